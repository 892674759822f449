"""Each benchmark result file's header, where it is written, and the GPU's bf16 matmul ceiling
(the denominator of every MFU)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def run_info(device, ceiling) -> dict:
    """What every benchmark result file starts with: the command, the machine, the ceiling."""
    return {"command": "python " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "matmul_tflops": round(ceiling / 1e12, 1) if ceiling else None}


def save_results(path: Path | None, out: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")


def matmul_ceiling(device):
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - t0)


def time_steps(step, device, iters: int, tokens: int) -> dict:
    """A training step of `tokens` tokens timed as the benchmarks here time one: the first call
    (compiling; the graphs dynamo compiled in it counted), one more, then `iters` timed, the
    peak memory over those. -> tokens_per_s, step_ms, first_step_s, graphs_compiled,
    peak_memory_gb (CUDA only)."""
    from torch._dynamo.utils import counters

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    graphs = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    step()
    sync()
    out = {"first_step_s": round(time.perf_counter() - t0, 1),
           "graphs_compiled": counters["stats"]["unique_graphs"] - graphs}
    step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / iters
    out = {"tokens_per_s": round(tokens / seconds, 1), "step_ms": round(seconds * 1e3, 2), **out}
    if device.type == "cuda":
        out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return out
