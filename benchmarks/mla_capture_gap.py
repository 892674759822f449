"""Is the MLA + MoE toy's capture gap between two bf16 engines MoE routing flips? Measured with
transformers alone: the target's states captured as the pipeline captures them (capture.capture:
entering the pipeline's default aux layers, vLLM's, and entering layer 1, which the dense first
layer alone precedes; the last after the final norm), in pairs of runs that differ only in
numerics, compared per token by hidden_engines.py's metric (max |x - y| / max |x|, counted over
--tol = 1/16 as in the H200 run):

- `bf16_vs_fp32`: the target in bf16 (SDPA) against itself in fp32 (the reference);
- `eager_vs_sdpa`: bf16 with eager attention against bf16 with SDPA (two bf16 kernels);
- `eager_vs_sdpa_fp32`: the same two kernels in fp32 (does the kernels' difference need bf16?).

Each MoE layer's router choice (its top-k expert set per token) is recorded in both runs; a
flip is a token whose set differs. The causal test reruns the second run of each pair with its
routing pinned to the first's choice (the top-k indices substituted, their weights taken from
the run's own scores at those indices, as the router would): if the tokens over --tol vanish,
routing flips are the cause. Near-ties: the router's relative gap between its k-th and
(k+1)-th choice score, in the first run, at the flips against all tokens. --dense-target: the
same pairs on a dense target (the Qwen3 toy), the control.

    python benchmarks/mla_capture_gap.py --target tiny-mla --dense-target tiny --samples 400 \
        --threads 1 --json benchmarks/results/mla_capture_gap_cpu.json

--target, --dense-target: a target artifact (the target stage's out dir), or the name of a toy
in src/draftsmith/toy/recipes.py, built here by the target stage's code (`tiny-mla`: `target.model:
embedded-mla`, the size the tests use; about 80 s on one core). Samples: the toy's held-out
task chats (prompt and reference answer, rendered by the target's template as the toy trained
on them), or --tokenized: a tokenized artifact's samples. On a GPU: --device cuda (the pairs
stay transformers' own: SDPA, eager).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from _common.results import run_info, save_results
from draftsmith.artifacts import iter_samples
from draftsmith.capture import capture, decoder_layers, set_attention
from draftsmith.config import HiddenConfig, check_aux_layers
from draftsmith.target_info import (MANIFEST, context_length, load_model, load_tokenizer,
                                    read_info)
from hidden_engines import layer_summary, token_diff


def build_toy(name: str, out: Path) -> dict:
    """A toy of draftsmith/toy/recipes.py (`tiny-mla`, `tiny`) built by the target stage, as the
    tests do; -> the stage's metrics."""
    from draftsmith.toy.recipes import TOYS

    from draftsmith import target
    from draftsmith.config import EMBEDDED, EMBEDDED_MLA, EmbeddedTargetConfig, TargetConfig

    toy = TOYS[name]
    return target.resolve(TargetConfig(model=EMBEDDED_MLA if toy["mla"] else EMBEDDED,
                                       embedded=EmbeddedTargetConfig(**toy["embedded"])), out)


def toy_samples(target: Path, n: int, seed: int) -> list[torch.Tensor]:
    """n held-out task chats of the toy, tokenized as its training rendered them."""
    from draftsmith.toy import tasks
    from draftsmith.toy.build import _encode

    rows = _encode(load_tokenizer(target), tasks.examples(n, seed, "eval"), seed,
                   context_length(target) or 256)
    return [torch.tensor(ids) for ids, _ in rows]


def load_as(target: Path, dtype: str, attention: str, device: str, tmp: Path):
    """The target through load_model in `dtype` (a copy of its manifest saying so, as the H200
    run set its target.json's dtype to bfloat16): transformers keeps the router in fp32."""
    info = json.loads((target / MANIFEST).read_text())
    info.update(dtype=dtype, path=str(read_info(target).model_dir(target).resolve()))
    d = tmp / f"{dtype}-{attention}"
    d.mkdir()
    (d / MANIFEST).write_text(json.dumps(info))
    model = load_model(d, device)
    set_attention(model, attention)
    return model


def routers(model) -> dict[int, torch.nn.Module]:
    """{layer: its MoE router} (transformers' DeepseekV3TopkRouter: `mlp.gate` with top_k)."""
    return {i: layer.mlp.gate for i, layer in enumerate(decoder_layers(model))
            if hasattr(getattr(layer.mlp, "gate", None), "top_k")}


@contextmanager
def routing(model, seen: dict, pin: dict | None = None):
    """Records each router's choice (top-k indices) and choice scores into `seen`; with `pin`
    ({layer: indices}) the router's indices are replaced by those, weighted as it would."""
    def hook(i):
        def fn(gate, _args, out):
            logits, weights, idx = out
            scores = logits.sigmoid()
            if pin is not None:
                idx = pin[i].to(idx.device)
                weights = scores.gather(1, idx)
                if gate.norm_topk_prob:
                    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
                weights = weights * gate.routed_scaling_factor
            seen[i] = (idx.cpu(), (scores + gate.e_score_correction_bias).cpu())
            return logits, weights, idx
        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in routers(model).items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run(model, samples, layers, pins=None) -> dict:
    """One pass over the samples (one forward each): states (tokens, len(layers) + 1, H),
    per MoE layer the top-k indices (tokens, k) and choice scores (tokens, E)."""
    states, routed = [], []
    t0 = time.perf_counter()
    for n, ids in enumerate(samples):
        seen = {}
        with routing(model, seen, pins[n] if pins else None):
            aux, final = capture(model, ids[None].to(model.device), None, layers)
        H = final.shape[-1]
        states.append(torch.cat([aux[0].view(len(ids), -1, H), final[0][:, None]], 1).float().cpu())
        routed.append(seen)
    moe = sorted(routed[0])
    return {"states": torch.cat(states), "moe": moe, "lengths": [len(x) for x in samples],
            "idx": {i: torch.cat([r[i][0] for r in routed]) for i in moe},
            "scores": {i: torch.cat([r[i][1] for r in routed]) for i in moe},
            "pins": [{i: r[i][0] for i in moe} for r in routed],
            "s": round(time.perf_counter() - t0, 1)}


def flips(ref: dict, other: dict) -> torch.Tensor:
    """(tokens, MoE layers): True where the two runs' top-k expert sets differ."""
    return torch.stack([(ref["idx"][i].sort(-1)[0] != other["idx"][i].sort(-1)[0]).any(-1)
                        for i in ref["moe"]] or [torch.zeros(len(ref["states"]), dtype=bool)], -1)


def compare(ref: dict, other: dict, names: list[str], ends: list[int], tol: float) -> dict:
    """Per captured layer: hidden_engines' figures, and how many of the tokens over tol had a
    routing flip before that point (at a MoE layer < the layer it enters; any, for the last)
    against how many tokens had one at all; and how many had one in their context (the token
    or an earlier one of its sample: attention carries a flip's difference forward)."""
    r = token_diff(ref["states"], other["states"])  # (tokens, layers)
    f = flips(ref, other)
    out = {"flips_per_moe_layer": {str(i): int(f[:, j].sum()) for j, i in enumerate(ref["moe"])},
           "tokens_with_a_flip": int(f.any(-1).sum()), "per_layer": {}}
    for k, (name, end) in enumerate(zip(names, ends)):
        earlier = f[:, [j for j, i in enumerate(ref["moe"]) if i < end]].any(-1)
        over = r[:, k] > tol
        context = torch.cat([e.cumsum(0) > 0 for e in earlier.split(ref["lengths"])])
        out["per_layer"][name] = {**layer_summary(r[:, k], tol),
                                  "over_tol_with_earlier_flip": int((over & earlier).sum()),
                                  "tokens_with_earlier_flip": int(earlier.sum()),
                                  "over_tol_with_flip_in_context": int((over & context).sum()),
                                  "tokens_with_flip_in_context": int(context.sum())}
    return out


def near_ties(ref: dict, other: dict) -> dict:
    """The first run's relative gap (s_k - s_k+1) / s_k between its k-th and (k+1)-th choice
    scores, at every (token, MoE layer), at the flips, and at each flipped token's first flip
    (later ones may follow from it rather than from a tie)."""
    if not ref["moe"]:
        return {}
    gaps = []
    for i in ref["moe"]:
        k = ref["idx"][i].shape[-1]
        s = ref["scores"][i].topk(k + 1, -1)[0]
        gaps.append((s[:, k - 1] - s[:, k]) / s[:, k - 1].abs().clamp_min(1e-12))
    gaps, flip = torch.stack(gaps, -1), flips(ref, other)  # (tokens, MoE layers)
    first = flip & (flip.cumsum(-1) == 1)

    def q(x):
        if not len(x):
            return None
        p = torch.quantile(x.double(), torch.tensor([0, 0.1, 0.5, 0.9, 1], dtype=torch.double))
        return {"n": len(x), **dict(zip(("min", "p10", "median", "p90", "max"), p.tolist()))}

    out = {"all": q(gaps.flatten()), "at_flips": q(gaps[flip]), "at_first_flips": q(gaps[first])}
    if first.any():  # how rare a gap as small as a typical first flip's is
        out["share_of_all_within_first_flips_median"] = float(
            (gaps <= out["at_first_flips"]["median"]).double().mean())
    return out


def pair(target, a, b, samples, layers, names, ends, tol, device, tmp) -> dict:
    """Runs a = (dtype, attention), then b, then b with its routing pinned to a's. `scale`: the
    first run's state scale per captured layer (the median over tokens of max |x|)."""
    ref = run(load_as(target, *a, device, tmp), samples, layers)
    model = load_as(target, *b, device, tmp)
    other = run(model, samples, layers)
    scale = ref["states"].abs().amax(-1).median(0).values
    out = {"first": "/".join(a), "second": "/".join(b), "s": [ref["s"], other["s"]],
           "scale": dict(zip(names, scale.tolist())),
           "unpinned": compare(ref, other, names, ends, tol), "near_ties": near_ties(ref, other)}
    if ref["moe"]:
        pinned = run(model, samples, layers, pins=ref["pins"])
        out["pinned"] = compare(ref, pinned, names, ends, tol)
        out["s"].append(pinned["s"])
    return out


PAIRS = {"bf16_vs_fp32": (("float32", "sdpa"), ("bfloat16", "sdpa")),
         "eager_vs_sdpa": (("bfloat16", "sdpa"), ("bfloat16", "eager")),
         "eager_vs_sdpa_fp32": (("float32", "sdpa"), ("float32", "eager"))}


def measure(target: str, args, tmp: Path) -> dict:
    """Every pair of --pairs on one target (an artifact, or a toy's name: built), over its
    samples."""
    name, target, built = target, Path(target), {}
    if not target.exists():
        target = tmp / "target"
        built = build_toy(name, target)
    info = read_info(target)
    layers = args.aux_layers or [1, *check_aux_layers(HiddenConfig(), info.num_layers)]
    names, ends = [f"layer {k}" for k in layers] + ["last"], [*layers, info.num_layers]
    if args.tokenized:
        samples = [ids for _, ids, _ in iter_samples(args.tokenized)][:args.samples]
    else:
        samples = toy_samples(target, args.samples, args.seed)
    res = {"target": name, "revision": info.revision, "architecture": info.architecture,
           "hidden_size": info.hidden_size, "heldout_loss": built.get("heldout_loss"),
           "samples": len(samples), "tokens": sum(len(s) for s in samples)}
    for p in args.pairs:
        (tmp / p).mkdir()
        res[p] = pair(target, *PAIRS[p], samples, layers, names, ends, args.tol, args.device,
                      tmp / p)
        for kind in ("unpinned", "pinned"):
            if kind in res[p]:
                c = res[p][kind]
                print(f"{info.architecture} {p} {kind}: {c['tokens_with_a_flip']} tokens flipped; "
                      "over tol (with an earlier flip): " + ", ".join(
                          f"{n} {v['tokens_over_tol']} ({v['over_tol_with_earlier_flip']})"
                          for n, v in c["per_layer"].items()), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True,
                    help="an MLA + MoE target artifact, or a toy of src/draftsmith/toy/recipes.py (tiny-mla)")
    ap.add_argument("--dense-target", help="the control: a dense target artifact or toy (tiny)")
    ap.add_argument("--tokenized", type=Path, help="samples from a tokenized artifact instead")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    ap.add_argument("--aux-layers", type=int, nargs="+",
                    help="default: 1 (after the dense first layer alone: no routing reaches it) "
                         "and the pipeline's default, vLLM's (2, L/2, L-3)")
    ap.add_argument("--tol", type=float, default=1 / 16)
    ap.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {**run_info(torch.device(args.device), None), "torch_threads": torch.get_num_threads(),
           "tol": args.tol, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for key, target in (("mla", args.target), ("dense", args.dense_target)):
            if target:
                (Path(tmp) / key).mkdir()
                out["results"][key] = measure(target, args, Path(tmp) / key)
    save_results(args.json, out)


if __name__ == "__main__":
    main()
