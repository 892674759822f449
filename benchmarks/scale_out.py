"""Data-parallel scale-out under torchrun: drafter training and hidden-state extraction on one
and on N processes, the same global work, side by side in one run.

    python benchmarks/scale_out.py --nproc 1 2 --json benchmarks/results/scale_out_h200x2.json
    python benchmarks/scale_out.py --preset toy --nproc 1 2                 # CPU (gloo), seconds

Each case runs under `torchrun --standalone` (NCCL on GPUs, gloo on the CPU), one process per
GPU, with the stages' own code: `Trainer.step` with DDP (or FSDP2: `--parallel fsdp`) over
the same global batch (each
process takes rows[rank::world]; preset `8b`: 8 rows of 2048 tokens a step, the training
benchmark's 8B-shaped drafter, 7 TTT steps), and `hidden.write_hidden` with each process
writing every world-size-th shard (the extraction benchmark's 8B-shaped target and length mix,
four times the samples so every process gets several shards). Speed-up = tokens/s on N
processes over tokens/s on one, both measured here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common.results import run_info, save_results
from _common.shapes import (HIDDEN_PRESETS, TRAIN_PRESETS, length_mix, make_batch, make_drafter,
                            make_target, write_tokenized)

PRESETS = {
    "8b": dict(train=dict(TRAIN_PRESETS["8b"], T=2048, rows=8, iters=8),
               hidden=dict(HIDDEN_PRESETS["8b"], samples=128, shard_mb=256)),
    "toy": dict(train=dict(TRAIN_PRESETS["toy"], T=128, rows=4, iters=3),
                hidden=dict(HIDDEN_PRESETS["toy"], samples=48, shard_mb=0.02)),
}


def train_case(p, w, device, parallel: str) -> dict:
    from draftsmith.config import TrainConfig
    from draftsmith.dist import split
    from draftsmith.target_info import TargetHead
    from draftsmith.train.loop import Runtime, Trainer

    cfg = TrainConfig(ttt_steps=p["steps"], seq_len=p["T"], batch_size=p["rows"],
                      device=device.type, parallel=parallel)
    rows = split(list(range(p["rows"])), w)  # this process's share of the global batch
    batch = make_batch(p, p["T"], len(rows), device)
    head = torch.randn(p["V"], p["H"], device=device, dtype=torch.bfloat16)
    trainer = Trainer(cfg, Runtime.resolve(cfg, w), make_drafter(p, device),
                      TargetHead(None, None, head, None), w=w)
    for _ in range(2):  # warm-up: compile, autotune, NCCL buckets
        trainer.step(batch, 1e-5)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = _timed(lambda: [trainer.step(batch, 1e-5) for _ in range(p["iters"])], w, device)
    out = {"tokens": p["rows"] * p["T"] * p["iters"], "seconds": seconds, "parallel": parallel}
    if device.type == "cuda":  # per process: what FSDP2's sharding saves
        out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    return out


def hidden_case(p, w, device, work: Path) -> dict:
    from draftsmith.config import HiddenConfig
    from draftsmith.capture import set_attention
    from draftsmith.hidden import write_hidden

    model = make_target(p, device)
    set_attention(model, "auto")
    g = torch.Generator().manual_seed(0)
    lengths = length_mix(p)
    seqs = [torch.randint(0, p["config"]["vocab_size"], (n,), generator=g) for n in lengths]
    tok = write_tokenized(work / f"tok{w.rank}", seqs)
    cfg = HiddenConfig(dtype="bfloat16", shard_mb=p["shard_mb"], row_tokens=p["row_tokens"],
                       batch_rows=p["batch_rows"])
    run = lambda out: write_hidden(cfg, model, p["layers"], tok, work / out, "bench", 0, w)  # noqa: E731
    run("warm")  # compile, autotune, the pinned-memory pool
    w.barrier()
    if w.main:
        shutil.rmtree(work / "warm")  # the disk (or /dev/shm) holds one run at a time
    seconds = _timed(lambda: run("timed"), w, device)
    return {"tokens": sum(lengths), "seconds": seconds}


def _timed(fn, w, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    w.barrier()
    t0 = time.perf_counter()
    fn()
    sync()
    w.barrier()  # the world is done when its slowest process is
    return time.perf_counter() - t0


def worker(args) -> None:
    """One torchrun process: both cases, rank 0 writes the figures."""
    from draftsmith import dist
    from draftsmith.config import DistributedConfig

    w = dist.init(DistributedConfig())
    device = w.device(args.device)
    p = PRESETS[args.preset]
    out = {"processes": w.size}
    for case in args.cases:
        r = (train_case(p["train"], w, device, args.parallel) if case == "train"
             else hidden_case(p["hidden"], w, device, Path(args.shared)))
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1)
        out[case] = r
    if w.main:
        Path(args.shared, "result.json").write_text(json.dumps(out))
    dist.finish()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="+", default=["train", "hidden"],
                    choices=["train", "hidden"])
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                    help="train case with several processes: DDP or FSDP2 (train.parallel)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="where extraction writes its shards (default: a "
                    "temp dir; /dev/shm keeps the disk out of the figure)")
    ap.add_argument("--shared", help=argparse.SUPPRESS)  # set for the torchrun processes
    args = ap.parse_args(argv)
    if args.shared:
        return worker(args)
    results = []
    for n in args.nproc:
        with tempfile.TemporaryDirectory(dir=args.work) as shared:
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={n}", __file__, "--preset", args.preset,
                            "--device", args.device, "--cases", *args.cases, "--shared", shared,
                            "--parallel", args.parallel],
                           check=True)
            r = json.loads(Path(shared, "result.json").read_text())
        results.append(r)
        print(json.dumps(r), flush=True)
    one = next((r for r in results if r["processes"] == 1), None)
    for r in results:
        for case in args.cases:
            if one:
                r[case]["speedup"] = round(r[case]["tokens_per_s"] / one[case]["tokens_per_s"], 2)
    device = torch.device(args.device)
    out = {**run_info(device, None), "preset": args.preset, "parallel": args.parallel,
           "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
           "results": results}
    print(f"\n{'processes':>9} " + " ".join(f"{c + ' tok/s':>14} {'x':>5}" for c in args.cases))
    for r in results:
        print(f"{r['processes']:>9} " + " ".join(
            f"{r[c]['tokens_per_s']:>14} {r[c].get('speedup', '-'):>5}" for c in args.cases))
    save_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
