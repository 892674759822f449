"""Hidden-state extraction throughput: the hidden stage's packed path against the implementation
before it and two plain HF baselines, side by side in one run.

    python benchmarks/hidden_extract.py --json benchmarks/results/hidden_extract_h200.json  # GPU, 8B
    python benchmarks/hidden_extract.py --preset qwen3-8b --mix 2000,1.0,16384,160,0 \
        --row-tokens 16384 --batch-rows 1                          # your own mix: a tail to 16K
    python benchmarks/hidden_extract.py --preset toy --device cpu                        # CPU, seconds

Target (preset `8b`): Llama-3.1-8B shape, random bf16 weights; `qwen3-8b`: Qwen3-8B's shape
(36 layers, MLP 12,288, vocab 151,936, q/k norms). Data: the length mix of
shared/notes/gpu-baseline.md, 64 samples of max(64, min(8192, lognormal(log 1700, 0.7))) tokens,
or `--mix MEDIAN,SIGMA,CAP,SAMPLES,SEED`. Aux layers as vLLM's default (2, L//2, L-3).

- padded_hf: HF forward, random order, batch 8 padded to its longest, output_hidden_states;
  states copied to the host per sample (the usual script).
- before: the stage before packing (length-sorted batches of 16 padded to their longest,
  forward pre-hooks, per-sample device-to-host copies), states kept in host memory.
- packed / packed_fp8: `hidden.write_hidden` itself (`hidden.attention: auto`: on a GPU the
  varlen attention, each forward's samples in one flat row with nothing padded; side-stream
  copies into pinned memory, shards written by threads to a temp dir); packed_flex: the same
  on padded rows of row_tokens with flex attention (the stage before varlen); packed_sdpa:
  rows with SDPA (masked blocks computed, not skipped); packed_varlen_sdpa: the flat row with
  one SDPA call per sample instead of the flash kernel; packed_flash: the flat row with the
  flash kernel for every sample (the stage's kernel before `split`); packed_varlen_api: the flat row
  through torch's public `varlen_attn` (on torch 2.11: KV heads repeated, made contiguous)
  instead of aten's flash forward called directly.
- On request (diagnostics): packed_nowrite and packed_flex_nowrite, without writing shards
  (the extraction alone); packed_save_file, the same with `safetensors.torch.save_file` and a second pass for
  the sha256 (the stage's writer before `safetensors_write`).
- writes: the stage's shard writer alone, no GPU: shards of the packed run's sizes from pinned
  memory, `hidden.WRITERS` threads, into --work. The host's ceiling for the stage: its tok/s is
  the packed run's tokens over the time to write their states.
- Each kind runs once to warm up, then is timed; the shards a run wrote are removed between
  runs, off the clock (the stage removes nothing), and that removal is timed apart
  (removed_s: the last run's). drain_s: the end of a packed run's time, spent waiting for its
  writers after the last shard's states were in host memory.
- equal: 8 x 2048 equal-length rows, one document each, no hooks, no copies, the norms, MLPs and
  rotary fused as in the stage (fused_forward): the ceiling an extraction can reach on this
  model, measured here. equal_hf: the same as transformers runs it (nothing fused).
- The packed kinds run the stage's forward, fused as the stage fuses it; padded_hf and before
  run transformers' forward as the scripts they stand for did.

MFU: (2 x non-embedding parameters + causal attention within each sample) per token over the
bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.hidden.fused_forward import fused

from _common.results import matmul_ceiling, run_info, save_results
from _common.shapes import HIDDEN_PRESETS as PRESETS, length_mix, make_target, write_tokenized


def flops_per_token(model, lengths) -> float:
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters()
                 if "embed_tokens" not in n and "lm_head" not in n)
    width = c.num_attention_heads * (getattr(c, "head_dim", None)
                                     or c.hidden_size // c.num_attention_heads)
    # causal: QK^T and PV over the n(n+1)/2 ~ n^2/2 pairs of each sample, 2 FLOPs a MAC
    attn = 4 * c.num_hidden_layers * width * sum(n * n / 2 for n in lengths)
    return 2 * params + attn / sum(lengths)


def padded_batch(seqs: list[torch.Tensor]):
    """Right-padded ids and attention mask of a batch, as the usual scripts build them."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)], att[r, :len(s)] = s, 1
    return ids, att


@torch.no_grad()
def padded_hf(model, seqs, layers, batch=8):
    order = list(range(len(seqs)))
    random.Random(1).shuffle(order)
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        ids, att = padded_batch([seqs[i] for i in idx])
        out = model.model(input_ids=ids.to(model.device), attention_mask=att.to(model.device),
                          output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[k] for k in layers], -1)
        for r, i in enumerate(idx):
            aux[r, :len(seqs[i])].cpu(), out.last_hidden_state[r, :len(seqs[i])].cpu()


@torch.no_grad()
def before(model, seqs, layers, batch=16):
    """The hidden stage before this work (its `_shard`), states kept in host memory."""
    from draftsmith.capture import capture

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        ids, att = padded_batch([seqs[i] for i in idx])
        aux, fin = capture(model, ids.to(model.device), att.to(model.device), layers)
        for r, i in enumerate(idx):
            n = len(seqs[i])
            aux[r, :n].to("cpu", torch.bfloat16), fin[r, :n].to("cpu", torch.bfloat16)


# Output folders written by the last run of a kind. They are removed between runs, off the clock:
# deleting 20 GB from a tmpfs takes seconds, and the stage deletes nothing.
WRITTEN: list[Path] = []


def remove_written() -> None:
    import shutil

    while WRITTEN:
        shutil.rmtree(WRITTEN.pop(), ignore_errors=True)


def packed(model, p, tok_dir, dtype, attention, work: Path, writer: str = "stage",
           kernel: str = "auto"):
    """writer: the stage's own (stage), none (shards not written: the extraction alone), or
    safetensors.torch.save_file plus a second pass for the sha256 (what the stage did before).
    kernel: the varlen attention's kernel (packed_attention.KERNEL)."""
    from unittest import mock

    from draftsmith import capture, hidden, packed_attention
    from draftsmith.config import HiddenConfig

    capture.set_attention(model, attention)
    out = work / f"h-{dtype}-{attention}-{writer}"
    save = {"stage": hidden._save, "none": lambda t, path: {"bytes": 0, "sha256": ""},
            "save_file": _save_file_then_hash}[writer]
    copied = []  # when each shard's device-to-host copies had landed

    def write_shard(tensors, ready, path, write=hidden._write_shard):
        if ready is not None:
            ready.synchronize()
        copied.append(time.perf_counter())
        return write(tensors, None, path)

    try:
        cfg = HiddenConfig(dtype=dtype, shard_mb=p.get("shard_mb", 1024),
                           row_tokens=p["row_tokens"], batch_rows=p["batch_rows"],
                           attention=attention)
        with mock.patch.object(hidden, "_save", save), \
                mock.patch.object(hidden, "_write_shard", write_shard), \
                mock.patch.object(packed_attention, "KERNEL", kernel), fused(model):
            result = hidden.write_hidden(cfg, model, p["layers"], tok_dir, out, "bench", 0)
        return {**result, "gpu_done_at": max(copied)}
    finally:
        model.set_attn_implementation("sdpa")
        WRITTEN.append(out)


def writes(p, lengths, hidden_size: int, work: Path) -> int:
    """-> bytes written: the packed run's shards, from pinned memory, by the stage's writer."""
    from concurrent.futures import ThreadPoolExecutor

    from draftsmith import hidden

    per_token = (len(p["layers"]) + 1) * hidden_size * 2
    plan = hidden.plan_shards(lengths, per_token, int(p.get("shard_mb", 1024) * 2**20))
    sizes = [sum(lengths[i] for i in s) for s in plan]
    pin = torch.cuda.is_available()
    aux = torch.ones(max(sizes), len(p["layers"]) * hidden_size, dtype=torch.bfloat16,
                     pin_memory=pin)
    final = torch.ones(max(sizes), hidden_size, dtype=torch.bfloat16, pin_memory=pin)
    out = work / "writes"
    out.mkdir(exist_ok=True)
    WRITTEN.append(out)
    with ThreadPoolExecutor(hidden.WRITERS) as pool:
        jobs = [pool.submit(hidden._save, {"aux": aux[:n], "final": final[:n]},
                            out / f"w-{k:05d}.safetensors") for k, n in enumerate(sizes)]
        return sum(j.result()["bytes"] for j in jobs)


def _save_file_then_hash(tensors, path):
    from safetensors.torch import save_file

    from draftsmith.atomic import file_sha256

    save_file(tensors, path)
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


@torch.no_grad()
def equal(model, p, rows=8, T=2048, fuse=True):
    T = min(T, p["cap"])
    ids = torch.randint(0, model.config.vocab_size, (rows, T), device=model.device)
    with fused(model) if fuse else contextlib.nullcontext():
        model.model(input_ids=ids, use_cache=False)
    return rows * T, [T] * rows


# First match wins: attention first, since flash kernels' template names mention cutlass.
KERNEL_GROUPS = (("attention", ("flash", "fmha", "attention", "varlen", "sdpa")),
                 ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                 ("copy", ("memcpy", "memset", "copy")))


def time_breakdown(fn, sync, path: Path) -> dict:
    """One more run of fn under the profiler: its wall time, the time the GPU ran anything
    (the union of kernel and copy intervals, all streams), and kernel time by group. What the
    MFU misses is either the GPU idle (wall - busy) or slow kernels (by group)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    trace.unlink()
    busy = _union([e for e in events])
    compute = _union([e for e in events if e["cat"] == "kernel"])
    groups = {g: 0.0 for g, _ in KERNEL_GROUPS} | {"other": 0.0}
    for e in events:
        name = e["name"].lower()
        g = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")
        groups[g] += e["dur"]
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                              max_name_column_width=70))
    return {"profiled_wall_s": round(wall, 3), "gpu_busy_s": round(busy / 1e6, 3),
            "kernels_busy_s": round(compute / 1e6, 3),
            **{f"{g}_s": round(t / 1e6, 3) for g, t in groups.items()}}


def _union(events) -> float:
    """Microseconds covered by at least one of the events' intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _mix(text: str) -> dict:
    try:
        median, sigma, cap, samples, seed = text.split(",")
        return dict(median=int(median), sigma=float(sigma), cap=int(cap), samples=int(samples),
                    seed=int(seed))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mix {text!r}: want MEDIAN,SIGMA,CAP,SAMPLES,SEED, e.g. 2000,1.0,16384,160,0")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kinds", nargs="*",
                    default=["padded_hf", "before", "packed", "packed_fp8", "packed_flex",
                             "equal", "equal_hf"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="where the packed runs write their shards "
                    "(default: a temp dir; /dev/shm keeps the disk out of the figure)")
    ap.add_argument("--shard-mb", type=float, help="hidden.shard_mb of the packed runs (1024)")
    ap.add_argument("--samples", type=int, help="samples in the length mix (preset's)")
    ap.add_argument("--mix", type=_mix, metavar="MEDIAN,SIGMA,CAP,SAMPLES,SEED",
                    help="your own length mix: lognormal around MEDIAN tokens with spread "
                    "SIGMA (the preset's: 0.7), clipped to CAP, SAMPLES of them drawn with SEED; "
                    "e.g. 2000,1.0,16384,160,0 for a reasoning-trace tail to 16K")
    ap.add_argument("--row-tokens", type=int, help="hidden.row_tokens of the packed runs")
    ap.add_argument("--batch-rows", type=int, help="hidden.batch_rows of the packed runs")
    ap.add_argument("--profile", type=Path, help="also profile each kind once (a GPU): "
                    "operator tables here, GPU busy time and kernel groups in the results")
    return ap.parse_args(argv)


def preset(args) -> dict:
    """The preset with the command line's overrides."""
    p = dict(PRESETS[args.preset])
    if args.shard_mb:
        p["shard_mb"] = args.shard_mb
    if args.mix:
        p.update(args.mix)
    for key in ("samples", "row_tokens", "batch_rows"):
        if getattr(args, key):
            p[key] = getattr(args, key)
    return p


def kinds(model, p, seqs, lengths, tok: Path, tmp: Path) -> dict:
    """Each kind's run: -> (tokens or None, the packed run's figures or None)."""
    return {
        "padded_hf": lambda: (padded_hf(model, seqs, p["layers"]), None),
        "before": lambda: (before(model, seqs, p["layers"]), None),
        "packed": lambda: (None, packed(model, p, tok, "bfloat16", "auto", tmp)),
        "packed_fp8": lambda: (None, packed(model, p, tok, "float8_e4m3fn", "auto", tmp)),
        "packed_sdpa": lambda: (None, packed(model, p, tok, "bfloat16", "sdpa", tmp)),
        "packed_flex": lambda: (None, packed(model, p, tok, "bfloat16", "flex_attention", tmp)),
        "packed_varlen_sdpa": lambda: (None, packed(model, p, tok, "bfloat16", "varlen",
                                                    tmp, kernel="sdpa")),
        "packed_flash": lambda: (None, packed(model, p, tok, "bfloat16", "varlen",
                                              tmp, kernel="flash")),
        "packed_varlen_api": lambda: (None, packed(model, p, tok, "bfloat16", "varlen",
                                                   tmp, kernel="varlen")),
        "writes": lambda: (None, {"bytes": writes(p, lengths, model.config.hidden_size,
                                                  tmp)}),
        "packed_flex_nowrite": lambda: (None, packed(model, p, tok, "bfloat16",
                                                     "flex_attention", tmp, "none")),
        # diagnostics, on request: the extraction without writing, and the earlier writer
        "packed_nowrite": lambda: (None, packed(model, p, tok, "bfloat16", "auto",
                                                tmp, "none")),
        "packed_save_file": lambda: (None, packed(model, p, tok, "bfloat16", "auto",
                                                  tmp, "save_file")),
    }


def timed(fn, sync, repeats: int, device) -> tuple:
    """fn warmed up once, then timed over `repeats` runs (written shards removed after each):
    -> (its last output, mean seconds, when the last run ended, seconds its removal took)."""
    fn()  # warm-up: compile, autotune, allocator, pinned pool
    sync()
    remove_written()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync()
        end = time.perf_counter()
        seconds += end - t0
        remove_written()
        removed = time.perf_counter() - end
    return out, seconds / repeats, end, removed


def result(kind, out, seconds, end, removed, lengths, model, ceiling, device) -> dict:
    """One kind's figures: tokens per second, MFU, and for packed runs the stage's split into
    extraction and the drain of its last writes."""
    mix = out[1] if kind.startswith("equal") else lengths
    n = out[0] if kind.startswith("equal") else sum(lengths)
    r = {"kind": kind, "status": "ok", "tokens": n, "tokens_per_s": round(n / seconds, 1)}
    if kind.startswith("packed"):
        r["bytes_per_token"] = out[1]["bytes_per_token"]
        # the stage's time split: until its last shard's states were in host memory
        # (extraction, with the earlier shards' writes running beside it), then the
        # wait for the last writes (drain: a one-off per stage run, whatever its size)
        drain = end - out[1]["gpu_done_at"]
        extraction = seconds - drain
        r["drain_s"] = round(drain, 3)
        r["extraction_tokens_per_s"] = round(n / extraction, 1)
        if ceiling:
            r["extraction_mfu"] = round(r["extraction_tokens_per_s"]
                                        * flops_per_token(model, mix) / ceiling, 3)
    if kind.startswith("packed") or kind == "writes":
        r["removed_s"] = round(removed, 3)
    if kind == "writes":
        r["gb_per_s"] = round(out[1]["bytes"] / seconds / 1e9, 2)
    elif ceiling:
        r["mfu"] = round(r["tokens_per_s"] * flops_per_token(model, mix) / ceiling, 3)
    if device.type == "cuda":
        r["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return r


def main(argv=None):
    args = parse_args(argv)
    p = preset(args)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ceiling = matmul_ceiling(device)
    model = make_target(p, device)
    lengths = length_mix(p)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, p["config"]["vocab_size"], (n,), generator=g) for n in lengths]
    results = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        tok = write_tokenized(Path(tmp) / "tok", seqs)
        runs = kinds(model, p, seqs, lengths, tok, Path(tmp))
        for kind in args.kinds:
            if kind.startswith("equal"):
                fn = functools.partial(equal, model, p, fuse=kind == "equal")
            else:
                fn = runs[kind]
            try:
                out, seconds, end, removed = timed(fn, sync, p["repeats"], device)
            except Exception as e:  # one failing kind must not lose the others' figures
                remove_written()
                r = {"kind": kind, "status": f"{type(e).__name__}: {str(e)[:300]}"}
                results.append(r)
                print(json.dumps(r), flush=True)
                continue
            r = result(kind, out, seconds, end, removed, lengths, model, ceiling, device)
            if args.profile and device.type == "cuda":
                r["breakdown"] = time_breakdown(fn, sync, args.profile / f"profile_{kind}.txt")
                remove_written()
            results.append(r)
            print(json.dumps(r), flush=True)
    base = next((r["tokens_per_s"] for r in results if r["kind"] == "padded_hf"
                 and r["status"] == "ok"), None)
    for r in results:
        if base and r["status"] == "ok":
            r["vs_padded_hf"] = round(r["tokens_per_s"] / base, 2)
    with fused(model) as swapped:  # what the stage's forward swaps on this device
        pass
    out = {**run_info(device, ceiling), "preset": args.preset, "fused": swapped,
           "mix": {k: p.get(k) for k in ("median", "sigma", "cap", "samples", "seed")},
           "row_tokens": p["row_tokens"], "batch_rows": p["batch_rows"],
           "work_dir": str(args.work or tempfile.gettempdir()), "lengths": lengths,
           "results": results}
    print(f"\n{'kind':>12} {'tok/s':>10} {'mfu':>6} {'x padded':>9}")
    for r in results:
        print(f"{r['kind']:>12} {r.get('tokens_per_s', r['status'][:40]):>10} {r.get('mfu', '-'):>6} "
              f"{r.get('vs_padded_hf', '-'):>9}")
    save_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
