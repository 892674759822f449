"""Drafter training throughput and memory: today's reference path, the fast path, and a naive
baseline, side by side in one run.

    python benchmarks/train_ttt.py --json benchmarks/results/train_ttt_h200.json   # GPU, 8B shape
    python benchmarks/train_ttt.py --preset kimi-k2 --archs llama mla --kinds fast  # both layers
    python benchmarks/train_ttt.py --preset toy --device cpu                      # CPU, seconds
    python benchmarks/train_ttt.py --preset qwen3-8b --kinds fast --methods eagle3 eagle3.1 dflash
    python benchmarks/train_ttt.py --preset kimi-k2 --archs mla --kinds fast \
        --attentions flex flash cudnn                                 # MLA on three kernels

Shape (preset `8b`): Llama-3.1-8B (H 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128,256),
draft vocab 32,000, 7 TTT steps, random weights (speed does not depend on the values);
`kimi-k2`: Kimi-K2.5's text model (H 7168, vocab 163,840, MLP 18,432), the drafter layer as
the train stage builds it for that target, `--archs llama` (64 heads of 64) and/or `mla` (its
MLA: 64 heads, q latent 1,536, kv latent 512, q/k heads 128 + 64 rope, values 128). Each row
is one document of T tokens (full causal attention: no help from packing's block sparsity), or
with `--docs N` N documents end to end, as the train stage packs them; a step holds
max(T, 8192) tokens, as the naive baseline's 4 x 2048.

- reference: `ttt_loss_reference` + the dense TTT attention (T x T scores) + full-vocab logits:
  the algorithm the train stage ran before the fast path.
- fast: what the train stage runs on a GPU (`Trainer.step`: chunked target view, flex
  attention, fused lm_head + soft cross-entropy, torch.compile, a bf16 working copy of the fp32
  master weights, fused AdamW). `--attentions` runs it once per `train.attention` (flex, or
  the step-0 keys on torch's flash or cuDNN kernel: ttt_kernels.py), side by side.
- naive: fc + one Llama layer over [emb; h], 7 unrolled steps with plain causal attention (no
  TTT pattern), hard-label CE over the draft vocab, no compile: the field's usual baseline.
- naive_bf16 (only when asked for): the same with bf16 weights and optimizer state instead of
  fp32 master weights, to tell how much of a baseline figure is that choice.
All others: bf16 autocast, fp32 master weights, AdamW, gradient clipping.

`first_step_s`: a case's first step, compiling included (`graphs_compiled`: dynamo's new
graphs). Only a process's first case compiles cold (later ones reuse its caches, and
TORCHINDUCTOR_CACHE_DIR's from earlier runs: point it at an empty folder for a cold figure);
the soft-CE kernel's build (nvcc, on first use) is timed apart, `soft_ce_build_s`, unless
`--first-step-builds` leaves it to the first step as the train stage does (started in the
background when the trainer is made: with an empty DRAFTSMITH_KERNEL_CACHE, what a user's first
run on a machine pays).

`--methods` (fast path only): EAGLE-3 and EAGLE-3.1 (the same TTT, 3.1's norms added), and
DFlash as the preset's `dflash` entry has it (qwen3-8b: 5 layers, blocks of 16, 512 anchors a
row; its loss over the target's full vocab). DFlash's work grows with its anchors, not with T:
its tok/s counts the row's tokens, like the others', and its FLOPs count what it computes.

FLOPs per token (the `mfu` column): EAGLE: 6 x the drafter's matmul parameters per step x steps
(fc once) + 2 x the target head (forward only) + causal attention; DFlash: 6 x fc and each
layer's k/v projections per context token, 6 x its layers' matmul parameters and 4 x the frozen
head (forward and dx) per block token, attention over the mean context prefix; over the bf16
matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common.results import matmul_ceiling, run_info, save_results, time_steps
from _common.shapes import TRAIN_PRESETS as PRESETS, make_batch, make_drafter, train_config


def naive_loss(m, batch, steps):
    """No TTT attention: each step is an ordinary causal layer over its own keys."""
    B, T = batch.ids.shape
    next_ids = F.pad(batch.ids[:, 1:], (0, steps + 1))
    h = m.fc(batch.aux.to(m.fc.weight.dtype))
    total = 0.0
    for j in range(steps):
        x = m.midlayer.inputs(m.embed_tokens(next_ids[:, j:j + T]), h)
        q, k, v = m.midlayer.self_attn.qkv(x, batch.pos + j)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = m.midlayer.finish(a, h)
        logits = m.lm_head(m.norm(h))
        total = total + F.cross_entropy(logits.flatten(0, 1).float(),
                                        next_ids[:, j + 1:j + 1 + T].flatten() % logits.shape[-1])
    return total


def run_case(kind, p, T, device, iters, profile: Path | None = None, arch: str = "llama",
             method: str = "eagle3", attention: str = "auto", docs: int = 1):
    from draftsmith.target_info import TargetHead
    from draftsmith.train.loop import Runtime, Trainer
    from draftsmith.drafters.losses import ttt_loss_reference

    rows = max(1, p["tokens_per_step"] // T)
    m = make_drafter(p, device, arch, method)
    flops = flops_per_token(m, p, T // docs)  # attention: within each document
    if kind == "naive_bf16":
        m = m.to(torch.bfloat16)
    batch = make_batch(p, T, rows, device, docs)
    head = torch.randn(p["V"], p["H"], device=device, dtype=torch.bfloat16)
    cfg = train_config(p, arch, method, seq_len=T, batch_size=rows, attention=attention)
    rt = Runtime.resolve(cfg.model_copy(update={"device": device.type}))
    trainer = None
    if kind == "fast":  # the train stage's own step: bf16 working copy, fused AdamW
        trainer = Trainer(cfg, rt, m, TargetHead(None, None, head, None))
    elif kind == "reference":
        draft_ids = m.d2t + torch.arange(p["Vd"], device=device)
        weights = [0.8 ** j for j in range(p["steps"])]

        def step_loss():
            with rt.autocast():
                return ttt_loss_reference(m, batch, head, draft_ids, m.t2d, p["steps"],
                                          weights, "soft_ce")[0]
    else:
        def step_loss():
            with rt.autocast():
                return naive_loss(m, batch, p["steps"])
    opt = None if trainer else torch.optim.AdamW(m.trainable_parameters(), lr=1e-5)

    def step():
        if trainer:
            return trainer.step(batch, 1e-5, seed=0)
        loss = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.trainable_parameters(), 1.0)
        opt.step()

    case = {"kind": kind, "method": method, "arch": arch, "T": T, "rows": rows, "docs": docs,
            "attention": rt.attention if trainer else "dense" if kind == "reference" else "sdpa"}
    try:
        # the first step compiles (cold only in a process's first case)
        timed = time_steps(step, device, iters, rows * T)
        kernel = getattr(getattr(trainer and trainer.objective, "attend", None), "kernel", None)
        if getattr(kernel, "name", None) == "cudnn" and m.config.num_kv_heads < m.config.num_heads:
            timed["cudnn_grouped_heads"] = kernel.gqa  # False: cuDNN refused them, repeated
        if profile is not None:
            name = "_".join([kind] + [x for x in (arch, method, rt.attention)
                                      if x not in ("llama", "eagle3", "flex", "reference")])
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            write_profile(step, sync, device, profile / f"profile_{name}_T{T}.txt")
    except torch.OutOfMemoryError:
        return {**case, "status": "out of memory"}
    finally:
        del m, opt, trainer
    out = {**case, "status": "ok", **timed, "flops_per_token": flops}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def kernel_build_seconds(device) -> float | None:
    """The soft-CE CUDA kernel's build on first use (nvcc, kept as _build.build_directory says),
    timed apart so a case's first step is compiling only."""
    from draftsmith_kernels import soft_ce

    if device.type != "cuda":
        return None
    t0 = time.perf_counter()
    soft_ce.available()
    return round(time.perf_counter() - t0, 1)


def write_profile(step, sync, device, path: Path, steps: int = 2) -> None:
    """Where a step's time goes: the top operators by device time, over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def flops_per_token(m, p, T):
    """The drafter's own matmuls (its layer and lm_head every step, fc once), counted from its
    weights, so Llama's and MLA's layers are counted alike."""
    c = m.config
    if c.method == "dflash":
        return dflash_flops_per_token(m, T, p["dflash"]["anchors"])
    layer = sum(w.numel() for name, w in m.midlayer.named_parameters() if w.dim() == 2) \
        + m.lm_head.weight.numel()
    qk, v = ((c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim) if c.arch == "mla"
             else (c.head_dim, c.head_dim))
    attn = 2 * c.num_heads * (qk + v) * T / 2  # causal scores + weighted values, forward
    per_step = 6 * layer + 3 * attn
    return p["steps"] * per_step + 6 * m.fc.weight.numel() + 2 * p["H"] * p["V"]


def dflash_flops_per_token(m, T, anchors: int):
    """A row of T tokens: the context (fc, then each layer's k/v projections) at every token,
    trained (x6); N = min(anchors, T) blocks of B tokens through every layer (x6) and the frozen
    full-vocab head (forward and dx, x4) at the drafted slots; attention of each block over
    its context prefix (T/2 on average for uniform anchors) and itself, forward and backward."""
    c = m.config
    N, B = min(anchors, T), c.block_size
    layer = sum(w.numel() for w in m.layers.parameters() if w.dim() == 2)
    kv = sum(l.self_attn.k_proj.weight.numel() + l.self_attn.v_proj.weight.numel()
             for l in m.layers)
    attn = 2 * c.num_heads * 2 * c.head_dim * (T / 2 + B) * c.num_layers  # qk and pv
    context = 6 * (m.fc.weight.numel() + kv) * T
    blocks = N * B * (6 * layer + 3 * attn) + N * (B - 1) * 4 * m.lm_head.weight.numel()
    return (context + blocks) / T


def kernel_ratio(device, p):
    """The fused soft-CE kernel against its PyTorch reference, one step's logits."""
    from draftsmith_kernels import soft_ce as k

    if device.type != "cuda" or not k.available():
        return {"status": "no CUDA kernel here: " + k.status()}
    n, v = 8192, p["Vd"]
    sets = [(torch.randn(n, v, device=device, dtype=torch.bfloat16) * 4,
             torch.randn(n, v, device=device) * 4, torch.rand(n, device=device))
            for _ in range(3)]

    def time_it(fn):
        for x in sets:
            fn(*x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(30):
            fn(*sets[i % 3])
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 30 * 1e3

    kern, ref = time_it(k.soft_ce), time_it(k.soft_ce_ref)
    return {"n": n, "v": v, "kernel_ms": round(kern, 3), "reference_ms": round(ref, 3),
            "speedup": round(ref / kern, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="*", help="context lengths T to run")
    ap.add_argument("--kinds", nargs="*", default=["naive", "reference", "fast"])
    ap.add_argument("--archs", nargs="*", default=["llama"], choices=["llama", "mla"],
                    help="drafter layers to run side by side (mla: the preset's MLA widths)")
    ap.add_argument("--methods", nargs="*", default=["eagle3"],
                    choices=["eagle3", "eagle3.1", "dflash"],
                    help="drafter methods side by side (other than eagle3: the fast kind only)")
    ap.add_argument("--attentions", nargs="*", default=["auto"],
                    choices=["auto", "flex", "flash", "cudnn", "reference"],
                    help="train.attention of the fast kind, side by side (auto: as the train "
                         "stage picks)")
    ap.add_argument("--docs", type=int, default=1,
                    help="documents per row, of T / docs tokens each: packed rows as the train "
                         "stage feeds them (the step-0 attention kept within each)")
    ap.add_argument("--first-step-builds", action="store_true",
                    help="leave the soft-CE kernel's build to the fast kind's first step, as in "
                         "the train stage (in the background beside its compile), instead of "
                         "timing it apart")
    ap.add_argument("--iters", type=int)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--profile", type=Path, help="also write each case's operator profile here")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    device = torch.device(args.device)
    ceiling = matmul_ceiling(device)
    build_s = "in the first step" if args.first_step_builds else kernel_build_seconds(device)
    results = []
    cases = [(m, a, k, t) for m in args.methods for a in args.archs for k in args.kinds
             for t in (args.attentions if k == "fast" else ["auto"])
             if m == "eagle3" or k == "fast"]
    for T in args.lengths or p["lengths"]:
        for method, arch, kind, attention in cases:
            if method == "dflash" and (arch != "llama" or attention in ("flash", "cudnn")):
                continue  # no engine serves it (drafters/options.py: METHOD_ARCHS); flex only (train_problem there)
            r = run_case(kind, p, T, device, args.iters or p["iters"], args.profile, arch,
                         method, attention, args.docs)
            if r["status"] == "ok" and ceiling:
                r["mfu"] = round(r["tokens_per_s"] * r["flops_per_token"] / ceiling, 3)
            results.append(r)
            print(json.dumps(r), flush=True)
    out = {**run_info(device, ceiling), "preset": args.preset, "shape": p, "results": results,
           "soft_ce_kernel": kernel_ratio(device, p), "soft_ce_build_s": build_s}
    print(f"\n{'T':>6} {'method':>8} {'arch':>6} {'kind':>10} {'attention':>9} {'tok/s':>10} "
          f"{'peak GB':>8} {'mfu':>6} {'first s':>7}")
    for r in results:
        print(f"{r['T']:>6} {r['method']:>8} {r['arch']:>6} {r['kind']:>10} "
              f"{r['attention']:>9} {r.get('tokens_per_s', r['status']):>10} "
              f"{r.get('peak_memory_gb', '-'):>8} {r.get('mfu', '-'):>6} "
              f"{r.get('first_step_s', '-'):>7}")
    print("soft-CE kernel:", out["soft_ce_kernel"])
    save_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
