"""Fused soft cross-entropy: the CUDA kernel against its PyTorch reference, side by side in one
run on the same inputs (checked to agree first).

    python benchmarks/soft_ce.py                      # N=8192, V=32000, bf16 logits, fp32 targets
    python benchmarks/soft_ce.py --device cpu --n 256 --v 1000 --json /tmp/soft_ce.json

Times are medians over --reps calls, rotating through --sets input sets so that no call finds
its inputs in L2 from the previous one; CUDA events on the GPU. Bandwidth counts what the kernel
must move: logits and targets read twice (two passes) and grad written once, for both paths
(the reference moves more than that, so its GB/s is an effective rate). On CPU, or where
the kernel cannot be built, only the reference is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import draftsmith_kernels.soft_ce as K

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def median_ms(fn, inputs, reps: int, device: torch.device) -> float:
    for args in inputs:  # warm-up: lazy CUDA init, the allocator's pools
        fn(*args)
    times = []
    for i in range(reps):
        args = inputs[i % len(inputs)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=8192, help="rows (tokens)")
    ap.add_argument("--v", type=int, default=32000, help="draft vocab size")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--logits-dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--target-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated through")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    device = torch.device(args.device)
    ldtype, tdtype = DTYPES[args.logits_dtype], DTYPES[args.target_dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [(torch.randn(args.n, args.v, device=device, generator=gen).mul_(4).to(ldtype),
               torch.randn(args.n, args.v, device=device, generator=gen).mul_(4).to(tdtype),
               torch.rand(args.n, device=device, generator=gen))
              for _ in range(args.sets)]

    kernel = device.type == "cuda" and K.available()
    ref_ms = median_ms(K.soft_ce_ref, inputs, args.reps, device)
    kernel_ms = max_ce_diff = None
    if kernel:
        got, want = K.soft_ce(*inputs[0]), K.soft_ce_ref(*inputs[0])
        max_ce_diff = (got[0] - want[0]).abs().max().item()
        kernel_ms = median_ms(K.soft_ce, inputs, args.reps, device)

    elements = args.n * args.v
    bytes_moved = elements * (2 * (ldtype.itemsize + tdtype.itemsize) + ldtype.itemsize)
    result = {
        "n": args.n, "v": args.v, "device": str(device),
        "logits_dtype": args.logits_dtype, "target_dtype": args.target_dtype,
        "kernel": K.status() if device.type == "cuda" else "reference (cpu device)",
        "kernel_ms": kernel_ms, "ref_ms": ref_ms,
        "ratio": ref_ms / kernel_ms if kernel else None,  # reference time / kernel time
        "bytes_moved": bytes_moved,
        "bytes_counted": "logits and targets read twice, grad written once (per-row outputs "
                         "and row_scale left out)",
        "achieved_GBps": bytes_moved / kernel_ms / 1e6 if kernel else None,
        "max_ce_diff": max_ce_diff,
    }

    print(f"N={args.n} V={args.v} {args.logits_dtype} logits, {args.target_dtype} targets, "
          f"{device}: {result['kernel']}")
    print(f"{'path':10} {'median ms':>10} {'GB/s':>8} {'speed-up':>9}")
    print(f"{'reference':10} {ref_ms:10.3f} {bytes_moved / ref_ms / 1e6:8.2f} {1:8.2f}x")
    if kernel:
        print(f"{'kernel':10} {kernel_ms:10.3f} {result['achieved_GBps']:8.2f} "
              f"{result['ratio']:8.2f}x   (max |ce - ref| {max_ce_diff:.2e})")
    else:
        print(f"{'kernel':10} {'n/a':>10}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
