"""The packed extraction's attention kernels side by side, on flat rows of causal documents:
how fast each runs as documents get long (a long-tailed length mix puts most attention FLOPs in
its longest samples).

    python benchmarks/varlen_attention.py --json benchmarks/results/varlen_attention_h200.json
    python benchmarks/varlen_attention.py --preset toy --device cpu          # CPU, seconds

Shape (preset `8b`): 32 query heads, 8 KV heads, head size 128 (Llama-3.1-8B, Qwen3-8B), bf16.
Rows: 32 documents of 512; 16 of 1,024; 8 of 2,048; 2 of 8,192; one of 16,384; one of 32,768; and a long-tailed row
(16,384 + 8,192 + 4 x 2,048). Kernels (those this machine has; the others report why not):
- flash: aten's flash forward with cumulative offsets, GQA native (the stage's kernel on CUDA
  before `split`);
- split: the stage's kernel on CUDA now: samples from packed_attention.LONG_TOKENS on through
  SDPA alone, the runs of shorter ones through flash;
- cudnn: aten's cuDNN attention forward with the same offsets (KV heads repeated if it wants);
- cudnn_dense: cuDNN SDPA once per document (batch 1, no offsets);
- sdpa: SDPA once per document, whatever backend torch picks (the stage's kernel on a CPU).
TFLOP/s counts the causal FLOPs (2 x heads x head size x n^2 per document of n tokens), and
`of_matmul` divides it by the bf16 matmul rate measured in the same run. Each output is
compared with flash's (or sdpa's on a CPU): max_abs_diff.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common.results import matmul_ceiling, run_info, save_results


PRESETS = {
    "8b": dict(hq=32, hkv=8, d=128, rows={"32x512": [512] * 32, "16x1k": [1024] * 16,
                                           "8x2k": [2048] * 8, "2x8k": [8192] * 2,
                                           "1x16k": [16384], "1x32k": [32768],
                                           "tail": [16384, 8192] + [2048] * 4}, iters=10),
    "toy": dict(hq=4, hkv=2, d=16, rows={"4x32": [32] * 4, "1x128": [128],
                                         "tail": [128, 32, 16]}, iters=2),
}


def flash(q, k, v, cu, longest, lengths):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True,
                                                   False)[0]


def cudnn(q, k, v, cu, longest, lengths):
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest,
                                                   False, 0.0, True)[0]


def split(q, k, v, cu, longest, lengths):
    """The stage's kernel on CUDA (packed_attention `split`), with its per-forward planning."""
    from draftsmith import packed_attention as pa

    with pa.documents(lengths, q.device):
        return pa._split(*(t.transpose(0, 1) for t in (q, k, v)), pa._CURRENT.get(), None,
                         None)


def per_document(backend):
    def run(q, k, v, cu, longest, lengths):
        out, at = torch.empty_like(q), 0
        for n in lengths:
            s = slice(at, at + n)
            qs, ks, vs = (t[s].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if backend is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                   enable_gqa=ks.shape[1] != qs.shape[1])
            else:
                from torch.nn.attention import sdpa_kernel
                if ks.shape[1] != qs.shape[1]:
                    ks, vs = (t.repeat_interleave(qs.shape[1] // t.shape[1], 1) for t in (ks, vs))
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out[s] = o[0].transpose(0, 1)
            at += n
        return out
    return run


def kernels(device) -> dict:
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return {"sdpa": per_document(None)}
    return {"flash": flash, "split": split, "sdpa": per_document(None),
            "cudnn_dense": per_document(SDPBackend.CUDNN_ATTENTION), "cudnn": cudnn}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    p, device = PRESETS[args.preset], torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ceiling = matmul_ceiling(device)
    results = []
    for name, lengths in p["rows"].items():
        g = torch.Generator(device).manual_seed(0)
        T = sum(lengths)
        q = torch.randn(T, p["hq"], p["d"], device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(T, p["hkv"], p["d"], device=device, dtype=dtype, generator=g)
                for _ in range(2))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
        flops = 2 * p["hq"] * p["d"] * sum(n * n for n in lengths)
        reference = None
        for kind, fn in kernels(device).items():
            r = {"row": name, "lengths": lengths, "kernel": kind}
            try:
                out = fn(q, k, v, cu, max(lengths), lengths)  # warm-up (and the output)
                sync()
                t0 = time.perf_counter()
                for _ in range(p["iters"]):
                    fn(q, k, v, cu, max(lengths), lengths)
                sync()
                seconds = (time.perf_counter() - t0) / p["iters"]
            except Exception as e:  # a kernel this machine lacks must not lose the others
                r["status"] = f"{type(e).__name__}: {str(e)[:200]}"
                results.append(r)
                print(json.dumps(r), flush=True)
                continue
            reference = out if reference is None else reference
            r.update(status="ok", ms=round(seconds * 1e3, 3),
                     tflops=round(flops / seconds / 1e12, 1),
                     max_abs_diff=float((out.float() - reference.float()).abs().max()))
            if ceiling:
                r["of_matmul"] = round(flops / seconds / ceiling, 3)
            results.append(r)
            print(json.dumps(r), flush=True)
    save_results(args.json, {**run_info(device, ceiling), "preset": args.preset,
                             "heads": [p["hq"], p["hkv"], p["d"]], "results": results})


if __name__ == "__main__":
    main()
