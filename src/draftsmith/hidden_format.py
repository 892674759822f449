"""The hidden stage's artifact: what its shards hold and how to read them back.

Training and anything else that reads the states import this module alone, not the stage
(hidden/): the writer (its threads, hidden/safetensors_write.py, the fp8 CUDA kernel) is then
not in their code deps, and tuning it reruns the hidden stage only.

The artifact is a folder of `hidden-NNNNN.safetensors` shards and a `manifest.json`:
- a shard's tensors, its n tokens' samples end to end: `aux` (n, L*H) the states entering the
  L aux layers, `final` (n, H) after the final norm, in the stored dtype; `input_ids` (n,)
  int32, `loss_mask` (n,) uint8, `cu_seqlens` (samples + 1,) int64; in fp8 shards also
  `aux_scale` (n, L) and `final_scale` (n, 1) fp32, one scale per token and layer;
- the manifest: `mode` (offline | online: no shards, training runs the target itself, or
  with `engine: vllm` fetches the states from a server as it goes),
  `aux_layers`, `hidden_size`, `dtype` (offline), and per shard its file, sample ids and
  lengths in stored order, bytes and sha256.

A stored dtype is defined here whole: its storage type, bytes per token, the host buffers a
shard is assembled in, its encoding (`encode`) and decoding (`hidden_states`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.artifacts import read_manifest
from draftsmith.errors import DraftsmithError

HIDDEN_MANIFEST = "manifest.json"
FP8 = "float8_e4m3fn"
STATE_KEYS = ("aux", "final", "aux_scale", "final_scale")  # the last two in fp8 shards only


def shard_file(index: int) -> str:
    return f"hidden-{index:05d}.safetensors"


def storage_dtype(dtype: str) -> torch.dtype:
    return torch.float8_e4m3fn if dtype == FP8 else getattr(torch, dtype)


def token_bytes(dtype: str, n_layers: int, hidden_size: int) -> int:
    """Stored bytes of one token's states, scales included."""
    if dtype == FP8:
        return (n_layers + 1) * (hidden_size + 4)  # fp8 values + one fp32 scale a row
    return (n_layers + 1) * hidden_size * torch.finfo(getattr(torch, dtype)).bits // 8


def empty_states(tokens: int, n_layers: int, hidden_size: int, dtype: str,
                 pin: bool) -> dict[str, torch.Tensor]:
    """Host buffers for a shard's states (pinned: filled by asynchronous device copies)."""
    store = storage_dtype(dtype)
    t = {"aux": torch.empty(tokens, n_layers * hidden_size, dtype=store, pin_memory=pin),
         "final": torch.empty(tokens, hidden_size, dtype=store, pin_memory=pin)}
    if dtype == FP8:
        t["aux_scale"] = torch.empty(tokens, n_layers, pin_memory=pin)
        t["final_scale"] = torch.empty(tokens, 1, pin_memory=pin)
    return t


def encode(aux: torch.Tensor, final: torch.Tensor, dtype: str, n_layers: int,
           quantize=None) -> dict[str, torch.Tensor]:
    """aux (n, L*H), final (n, H) -> their stored tensors, on their device. quantize: fp8's
    per-row quantizer (draftsmith_kernels.fp8_rows.quantize), given by the writer so that
    readers of the format do not import the CUDA kernel."""
    if dtype != FP8:
        store = storage_dtype(dtype)
        return {"aux": aux.to(store), "final": final.to(store)}
    n = len(aux)
    qa, sa = quantize(aux.reshape(n * n_layers, -1))
    qf, sf = quantize(final)
    return {"aux": qa.view(n, -1), "aux_scale": sa.view(n, -1), "final": qf,
            "final_scale": sf.view(n, 1)}


def hidden_states(t: dict, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden shard's tensors (or slices of them) -> aux (n, L*H), final (n, H); fp8 ones
    (one scale per token and layer) dequantized to dtype, others as stored."""
    if t["aux"].dtype != torch.float8_e4m3fn:
        return t["aux"], t["final"]
    n, layers = t["aux_scale"].shape
    aux = dequantize(t["aux"].reshape(n * layers, -1), t["aux_scale"].reshape(-1), dtype)
    return aux.view(n, -1), dequantize(t["final"], t["final_scale"].reshape(-1), dtype)


def sample_tensors(ordered: list) -> dict:
    """A shard's token ids, loss mask and sample bounds; ordered: its samples, in stored order,
    as (id, input_ids, loss_mask, ...)."""
    return {
        "input_ids": torch.cat([s[1] for s in ordered]).to(torch.int32),
        "loss_mask": torch.cat([s[2] for s in ordered]).to(torch.uint8),
        "cu_seqlens": torch.cumsum(torch.tensor([0] + [len(s[1]) for s in ordered]), 0),
    }


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """(N, C) fp8 and (N,) scales -> (N, C) in dtype: the inverse of fp8_rows.quantize."""
    return (q.float() * scale.float()[:, None]).to(dtype)


# ----------------------------------------------------------------------------- manifest


def shard_entry(index: int, ids: list, lengths: list[int], digest: dict) -> dict:
    """A shard's manifest entry: its samples in stored order, and its size and sha256."""
    return {"file": shard_file(index), "ids": ids, "lengths": lengths, **digest}


def offline_manifest(aux_layers: list[int], hidden_size: int, dtype: str,
                     shards: list[dict]) -> dict:
    return {"mode": "offline", "aux_layers": aux_layers, "hidden_size": hidden_size,
            "dtype": dtype, "shards": shards}


def kept_key(target_dir: Path, tokenized_dir: Path, layers: list[int], dtype: str) -> str:
    """What states kept by an online run (hidden.online_keep) are a function of: the samples,
    the target, the layers and the dtype asked for (the engine is always vLLM's). The kept
    folder's manifest carries it; hidden.kept_from takes the folder only when it matches."""
    import hashlib
    import json

    from draftsmith.artifacts import TOKENIZED_MANIFEST
    from draftsmith.target_info import read_info

    h = hashlib.sha256((Path(tokenized_dir) / TOKENIZED_MANIFEST).read_bytes())
    h.update(json.dumps([read_info(target_dir).revision, layers, dtype]).encode())
    return h.hexdigest()[:16]


def online_manifest(aux_layers: list[int], hidden_size: int, engine: str = "hf",
                    dtype: str = "bfloat16") -> dict:
    """engine: what runs the target for training (hf: the trainer itself; vllm: a server it
    fetches the states from, cast to dtype as offline shards store them)."""
    return {"mode": "online", "engine": engine, "aux_layers": aux_layers,
            "hidden_size": hidden_size, "dtype": dtype, "shards": []}


def fed_by_engine(manifest: dict) -> bool:
    """Online with a serving engine: training fetches the states from it as it goes."""
    return manifest.get("mode") == "online" and manifest.get("engine", "hf") != "hf"


def read_hidden_manifest(hidden_dir: Path) -> dict:
    return read_manifest(Path(hidden_dir) / HIDDEN_MANIFEST, "hidden")


def check_made_as_configured(manifest: dict, hidden_dir: Path, mode: str, engine: str) -> None:
    """Training follows the hidden artifact's mode, so an artifact made before hidden.mode (or,
    online, hidden.engine) changed would train the other way without a word: refuse it. `dvc
    repro` reruns the hidden stage first; a stage run by hand may not."""
    made, made_engine = manifest.get("mode", "offline"), manifest.get("engine", "hf")
    if made != mode or (mode == "online" and made_engine != engine):
        raise DraftsmithError(
            f"{hidden_dir} was made with hidden.mode: {made} (engine {made_engine}), but "
            f"params.yaml now says hidden.mode: {mode} (engine {engine})",
            "rerun the hidden stage before train (`dvc repro` does: it reruns what changed)")


def iter_hidden(hidden_dir: Path):
    """Yield (sample_id, aux, final, input_ids, loss_mask) per sample, states dequantized."""
    from safetensors.torch import load_file

    for shard in read_hidden_manifest(hidden_dir)["shards"]:
        t = load_file(Path(hidden_dir) / shard["file"])
        aux, final = hidden_states(t)
        cu = t["cu_seqlens"].tolist()
        for k, sid in enumerate(shard["ids"]):
            a, b = cu[k], cu[k + 1]
            yield (sid, aux[a:b], final[a:b], t["input_ids"][a:b].long(),
                   t["loss_mask"][a:b].bool())
