"""SpecForge's EAGLE-3 training step beside the train stage's, at the same drafter shape and
tokens a step: tokens a second and peak memory of both, each case a process of its own (its
own compile, its own peak).

    # here: SpecForge's wheel (pure Python; its step needs only torch, transformers, triton)
    python3 -m pip download --no-deps specforge==0.2.0 -d .whl
    # the GPU host: unpacked with no dependencies, beside the image's torch 2.11
    python3 -m pip install -q --no-index --no-deps --target /tmp/sf .whl/specforge-*.whl
    PYTHONPATH=/tmp/sf python3 benchmarks/specforge_step.py --lengths 2048 16384 --json out.json
    python benchmarks/specforge_step.py --preset toy --device cpu    # a CPU check, seconds

(On the CPU SpecForge's step runs up to its loss, a Triton kernel, and stops there; `benchmarks/
gpu/train.sh`'s `specforge` part runs this on the GPU.)

SpecForge's step as its trainer runs it (training/strategies/base.py, optimizer.py, 0.2.0):
its `LlamaForCausalLMEagle3` in bf16 with the embedding frozen, `OnlineEagle3Model` unrolled
over the preset's TTT steps on its default attention backend (flex_attention; sdpa on the
CPU), the losses weighted 0.8^i, `BF16Optimizer` (AdamW over fp32 masters, clipping at 0.5).
The target's distribution as its offline mode makes it: the stored final hidden state shifted
and put through the frozen target head to full-vocabulary logits inside the step
(`--compact`: its compact teacher, the head streamed in vocabulary chunks instead). Ours:
benchmarks/train_ttt.py's fast kind (the train stage's Trainer, `train.attention: auto`).
Both: rows of T tokens, max(T, tokens_per_step) tokens a step, random weights and inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _common.results import run_info, save_results, time_steps
from _common.shapes import TRAIN_PRESETS as PRESETS

HERE = Path(__file__).resolve().parent


def specforge_case(p, T: int, rows: int, device, iters: int, compact: bool) -> dict:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding
    from transformers import LlamaConfig

    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    config = LlamaConfig(hidden_size=p["H"], num_attention_heads=p["nh"],
                         num_key_value_heads=p["nkv"], head_dim=p["hd"],
                         intermediate_size=p["I"], vocab_size=p["V"], num_hidden_layers=1,
                         max_position_embeddings=max(T, 2048), tie_word_embeddings=False)
    config.draft_vocab_size, config.target_hidden_size = p["Vd"], p["H"]
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(config, attention_backend=backend)
    used = torch.randperm(p["V"])[:p["Vd"]].sort().values  # a draft vocab, as ours has
    draft.d2t.copy_(used - torch.arange(p["Vd"]))
    draft.t2d.zero_()
    draft.t2d[used] = True
    draft = draft.to(device=device, dtype=torch.bfloat16)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=p["steps"], attention_backend=backend)
    opt = BF16Optimizer(draft, lr=1e-5, max_grad_norm=0.5, total_steps=1000)
    g = torch.Generator().manual_seed(T)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, p["V"], (rows, T), generator=g).to(device)
    aux = torch.randn(rows, T, 3 * p["H"], generator=g).to(**bf16)
    final = torch.randn(rows, T, p["H"], generator=g).to(**bf16)
    head = (torch.randn(p["V"], p["H"], generator=g) * 0.02).to(**bf16)
    mask = torch.ones(rows, T, dtype=torch.long, device=device)

    def step():
        # TargetHead.preprocess and _prepare_eagle_target, as the strategy runs them
        input_ids, hidden, loss_mask = padding(ids, left=False), padding(final, left=False), \
            mask[..., None]
        teacher = (dict(target=None, target_hidden_for_compact=hidden, target_head_weight=head)
                   if compact else dict(target=hidden @ head.T))
        plosses = model(input_ids=input_ids, attention_mask=mask, loss_mask=loss_mask,
                        hidden_states=aux, **teacher)[0]
        sum(0.8 ** i * loss for i, loss in enumerate(plosses)).backward()
        opt.step()

    return time_steps(step, device, iters, rows * T)


def one(args) -> dict:
    """SpecForge's case in this process: --case IMPL T."""
    impl, T = args.case[0], int(args.case[1])
    p = dict(PRESETS[args.preset])
    device = torch.device(args.device)
    rows = max(1, p["tokens_per_step"] // T)
    return {"impl": impl, "T": T, "rows": rows, "status": "ok",
            **specforge_case(p, T, rows, device, args.iters or p["iters"],
                             compact=impl == "specforge-compact")}


def run(args, impl: str, T: int) -> dict:
    """One case in a process of its own, with an empty inductor cache of its own (so every
    case's first_step_s is a cold compile): ours is train_ttt.py's fast kind, SpecForge's this
    script's --case."""
    common = ["--preset", args.preset, "--device", args.device] + (
        ["--iters", str(args.iters)] if args.iters else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = ([sys.executable, str(HERE / "train_ttt.py"), *common, "--kinds", "fast",
                "--lengths", str(T), "--json", str(out)] if impl == "ours" else
               [sys.executable, str(Path(__file__).resolve()), *common, "--case", impl, str(T)])
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=env)
        if done.returncode != 0:
            return {"impl": impl, "T": T, "status": "failed", "error": done.stderr[-2000:]}
        if impl != "ours":
            return json.loads(done.stdout.strip().splitlines()[-1])
        r = json.loads(out.read_text())["results"][0]
    return {"impl": impl, **{k: r[k] for k in ("T", "rows", "status", "tokens_per_s", "step_ms",
                                              "first_step_s", "peak_memory_gb", "attention",
                                              "mfu") if k in r}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 16384])
    ap.add_argument("--impls", nargs="*", default=["ours", "specforge"],
                    choices=["ours", "specforge", "specforge-compact"])
    ap.add_argument("--iters", type=int)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--case", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:  # a child: one case, its result as the last line
        print(json.dumps(one(args)), flush=True)
        return None
    results = []
    for T in args.lengths:
        for impl in args.impls:
            results.append(run(args, impl, T))
            print(json.dumps(results[-1]), flush=True)
    for T in args.lengths:  # ours against each SpecForge mode at this length
        at = {r["impl"]: r for r in results if r["T"] == T and r["status"] == "ok"}
        for impl in ("specforge", "specforge-compact"):
            if "ours" in at and impl in at:
                at["ours"][f"speedup_over_{impl}"] = round(
                    at["ours"]["tokens_per_s"] / at[impl]["tokens_per_s"], 3)
                if "peak_memory_gb" in at[impl]:
                    at["ours"][f"memory_vs_{impl}"] = round(
                        at["ours"]["peak_memory_gb"] / at[impl]["peak_memory_gb"], 3)
    print(f"\n{'T':>6} {'impl':>18} {'tok/s':>10} {'peak GB':>8} {'first s':>7}")
    for r in results:
        print(f"{r['T']:>6} {r['impl']:>18} {r.get('tokens_per_s', r['status']):>10} "
              f"{r.get('peak_memory_gb', '-'):>8} {r.get('first_step_s', '-'):>7}")
    out = {**run_info(torch.device(args.device), None), "preset": args.preset,
           "results": results}
    save_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
