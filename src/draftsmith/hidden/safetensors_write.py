"""Write a safetensors file straight from tensor memory, hashing it on the way.

`safetensors.torch.save_file` copies every tensor into a Python bytes object first, holding the
GIL for the copy (about 0.2 s a GB), and the manifest then needs a second pass over the file for
its sha256. For hidden-state shards (a GB each) written by a thread while the main thread
feeds the GPU, both cost GPU time. Here each tensor's memory goes to the file as it is
(`write` and `sha256.update` release the GIL on large buffers), once, hashed while written. The file is a standard
safetensors file: `safe_open` and `load_file` read it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


def save_hashed(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write `tensors` (on the CPU) to `path` as safetensors; -> {"bytes", "sha256"} of the file."""
    flat = {k: t.detach().contiguous().reshape(-1).view(torch.uint8) for k, t in tensors.items()}
    header, at = {}, 0
    for k, t in tensors.items():
        header[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [at, at + flat[k].numel()]}
        at += flat[k].numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    h = hashlib.sha256()
    # One thread hashes each block while this one writes it: a shard costs the slower of the
    # two, not their sum (the thread takes the blocks in order).
    with ThreadPoolExecutor(max_workers=1) as hasher, open(path, "wb") as f:
        for block in (struct.pack("<Q", len(text)), text, *(t.numpy() for t in flat.values())):
            mv = memoryview(block).cast("B")
            hashed = hasher.submit(h.update, mv)
            f.write(mv)
        hashed.result()
    return {"bytes": 8 + len(text) + at, "sha256": h.hexdigest()}
