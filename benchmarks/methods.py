"""The drafter methods side by side on the same target and data: one command for the README's
table and plot.

    python benchmarks/methods.py --server-command "<vllm python> src/draftsmith/serving/vllm_cpu.py serve {model}"
    python benchmarks/methods.py --methods eagle3 dflash --set train.steps=100   # quicker, no vLLM
    python benchmarks/methods.py --methods eagle3 dflash dflash:train.dflash.loss=soft_ce   # variants

In a scratch checkout of this repo that shares its DVC cache (the stages up to `hidden` come
back from DVC's run cache: the same target, data and hidden states for every method), `dvc
repro` runs once per method with only `train.method` changed, the benchmark stage measuring
acceptance in the reference engine and, given a server command, inside a live vLLM on the
same held-out prompts. The target alone is served too, for vLLM's time per output token
without a drafter. Writes metrics/methods.json, plots/methods.png and a markdown table
(--markdown), and prints the table.

Draft cost per verification step, counted from each drafter's config (k = drafts per step,
tau = accepted length, so tau new positions reach the drafter each step):
- forwards: EAGLE-3/3.1 run k chained forwards (step 0 over the tau new positions), DFlash one
  (its block of k + 1 tokens), P-EAGLE one (the tau new positions and k - 1 mask slots), DSpark
  one (its block of k tokens) and k Markov steps, each reading W2 (vocab x rank) once;
- FLOPs: 2 x the matmul weights each token passes through (fc, layers, head), attention left out
  (it is small at these lengths);
- weight bytes read: what bounds a forward at batch 1 (decode is memory-bound), the sum over
  the step's forwards; `cost` is that in units of one EAGLE-3 forward.
The speedup a method implies for a target whose forward reads X times the bytes of one
EAGLE-3 forward: tau / (1 + cost / X) (Leviathan et al.'s model with the draft's cost
measured in target forwards; verification assumed as cheap as one plain decode step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from draftsmith.drafters.options import METHOD_NAMES as METHODS  # noqa: E402
X_VALUES = (10, 30, 100)


def scratch_checkout(dest: Path, cache: Path) -> Path:
    """The working tree in a git repo of its own, its DVC cache `cache`."""
    sys.path.insert(0, str(REPO / "tools"))
    from checkout import copy_checkout

    copy_checkout(REPO, dest)
    dvc(dest, "config", "--local", "cache.dir", str(cache))
    return dest


def dvc(repo: Path, *args) -> str:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run([str(bin_dir / "dvc"), *args], cwd=repo, capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"dvc {' '.join(args)} failed in {repo}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def set_params(repo: Path, overrides: list[str]) -> None:
    from draftsmith.config import apply_overrides

    p = repo / "params.yaml"
    p.write_text(yaml.safe_dump(apply_overrides(yaml.safe_load(p.read_text()), overrides),
                                sort_keys=False))


# ----------------------------------------------------------------------------- costs


def drafter_costs(c: dict, k: int, tau: float) -> dict:
    """Per verification step: forwards, FLOPs and weight bytes (bf16) of the drafter `c` (its
    drafter.json), as its method counts them (Method.draft_cost)."""
    from draftsmith.drafters.registry import METHODS as REGISTRY

    try:
        return REGISTRY[c["method"]].draft_cost(c, k, tau)
    except ValueError as e:
        raise SystemExit(str(e))


def eagle3_forward_bytes(c: dict) -> int:
    """The cost unit: weight bytes (bf16) of one chained EAGLE-3 forward (its layer over 2H and
    its draft-vocab head) of the EAGLE-3 drafter `c`."""
    H, nh, nkv, hd = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * c["intermediate_size"]
    return 2 * (layer + c["draft_vocab_size"] * H)


# ----------------------------------------------------------------------------- serving


def target_alone(repo: Path, server_cmd: str, extra: str) -> dict:
    """vLLM serving the target without a drafter on the benchmark's prompts (greedy): its
    time per output token, beside the methods'."""
    from draftsmith.benchmark import held_out_prompts
    from draftsmith.config import load_config
    from draftsmith.serving.client import ChatClient, ChatRequest
    from draftsmith.serving.server import serve_target
    from draftsmith.target_info import read_info

    cfg = load_config(repo / "params.yaml", [f"server.command={server_cmd}",
                                             f"server.extra_args={extra}"])
    prompts, _ = held_out_prompts(cfg.benchmark, repo / "data/raw")
    fmt = read_info(repo / "models/target").format
    body = {"max_tokens": cfg.benchmark.max_new_tokens, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": cfg.benchmark.thinking}}
    with serve_target(cfg.server, repo / "models/target", repo / "data/alone.work",
                      seed=cfg.benchmark.seed, launch=True) as urls:
        client = ChatClient(cfg.server, urls, fmt)
        try:
            t0 = time.time()
            outs = list(client.stream([ChatRequest(p.id, p.messages, body) for p in prompts]))
            wall = time.time() - t0
        finally:
            client.close()
    tokens = sum(o.num_tokens for _, o in outs)
    return {"wall_s": round(wall, 1), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}


# ----------------------------------------------------------------------------- main


def run_method(repo: Path, spec: str, params: str, base: list[str]) -> dict:
    """spec: a method, or METHOD:KEY=VALUE[;KEY=VALUE...] (a variant: more params of its own);
    params: params.yaml as the checkout has it, each run's overrides applied to it afresh."""
    method, _, extra = spec.partition(":")
    (repo / "params.yaml").write_text(params)
    set_params(repo, base + [f"train.method={method}"] + [e for e in extra.split(";") if e])
    t0 = time.time()
    log = dvc(repo, "repro")
    wall = time.time() - t0
    read = lambda f: json.loads((repo / f).read_text())  # noqa: E731
    bench, train = read("metrics/benchmark.json"), read("metrics/train.json")
    drafter = read("models/drafter/drafter.json")
    stages = [line.split("'")[1] for line in log.splitlines()
              if line.startswith("Running stage") or "is cached - skipping run" in line]
    return {"method": method, "run": spec, "benchmark": bench, "train": train, "drafter": drafter,
            "stages_brought_up_to_date": stages, "repro_wall_s": round(wall, 1)}


def summarize(runs: list[dict], alone: dict | None) -> list[dict]:
    eagle = next((r["drafter"] for r in runs if r["drafter"]["method"] == "eagle3"), None)
    if eagle is None:
        raise SystemExit("the costs are counted in EAGLE-3 forwards: include eagle3 in --methods")
    unit = eagle3_forward_bytes(eagle)
    rows = []
    for r in runs:
        b, c = r["benchmark"], r["drafter"]
        ref = {x["temperature"]: x for x in b["results"]}
        served = {x["temperature"]: x for x in b.get("by_engine_results", {}).get("vllm", [])}
        tau = ref[0.0]["acceptance_length"]
        cost = drafter_costs(c, b["k"], tau)
        in_eagle3 = cost["bytes"] / unit
        rows.append({
            "method": c["method"], "run": r["run"], "k": b["k"],
            "acceptance_length_reference": {f"T{t}": x["acceptance_length"] for t, x in ref.items()},
            "acceptance_length_vllm": {f"T{t}": x["acceptance_length"] for t, x in served.items()},
            "acceptance_per_position_reference_T0": ref[0.0]["acceptance_rate_per_position"],
            "acceptance_per_position_reference": {f"T{t}": x["acceptance_rate_per_position"]
                                                   for t, x in ref.items()},
            "acceptance_per_position_vllm_T0": served.get(0.0, {}).get(
                "acceptance_rate_per_position"),
            "lossless_vllm_T0": served.get(0.0, {}).get("lossless", {}).get("lossless"),
            "vllm_ms_per_token_T0": round(1000 / served[0.0]["tokens_per_s"], 3)
            if 0.0 in served else None,
            "vllm_target_alone_ms_per_token": round(1000 / alone["tokens_per_s"], 3)
            if alone else None,
            "random_drafter_acceptance_length": b.get("random_drafter_acceptance_length"),
            "trainable_parameters": r["train"]["trainable_parameters"],
            "train_wall_s": r["train"].get("wall_s"), "eval_accuracy": r["train"]["eval_accuracy"],
            "draft_forwards_per_step": cost["forwards"],
            "draft_mflops_per_step": round(cost["flops"] / 1e6, 3),
            "draft_weight_bytes_per_step": cost["bytes"],
            "draft_cost_in_eagle3_forwards": round(in_eagle3, 3),
            "implied_speedup": {f"X={x}": round(tau / (1 + in_eagle3 / x), 3) for x in X_VALUES},
            "stages_brought_up_to_date": r["stages_brought_up_to_date"],
        })
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| run | AL ref T=0 | AL vLLM T=0 | AL ref T=0.6 | per position (vLLM, T=0) | "
            "vLLM lossless T=0 | forwards/step | MFLOP/step | cost (EAGLE-3 fwd) | "
            + " | ".join(f"speedup X={x}" for x in X_VALUES)
            + " | vLLM ms/token (target alone) | trainable params | train s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ref, served = r["acceptance_length_reference"], r["acceptance_length_vllm"]
        alone = r.get("vllm_target_alone_ms_per_token")
        lines.append(
            f"| {r['run']} | {ref.get('T0.0')} | {served.get('T0.0', 'not run')} | "
            f"{ref.get('T0.6', '-')} | {r['acceptance_per_position_vllm_T0'] or '-'} | "
            f"{r['lossless_vllm_T0'] if r['lossless_vllm_T0'] is not None else 'not run'} | "
            f"{r['draft_forwards_per_step']} | {r['draft_mflops_per_step']} | "
            f"{r['draft_cost_in_eagle3_forwards']} | "
            + " | ".join(str(v) for v in r["implied_speedup"].values())
            + f" | {r['vllm_ms_per_token_T0'] or 'not run'} ({alone or '-'}) | "
            f"{r['trainable_parameters']:,} | {r['train_wall_s']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="*", default=list(METHODS),
                    help="methods, or METHOD:KEY=VALUE[;KEY=VALUE] for a variant")
    ap.add_argument("--server-command", help="server.command for vLLM ({model}); without it "
                    "only the reference engine runs")
    ap.add_argument("--extra-args", default="--enforce-eager", help="server.extra_args")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="params for every method's run (e.g. train.steps=100)")
    ap.add_argument("--json", type=Path, default=REPO / "metrics/methods.json")
    ap.add_argument("--plot", type=Path, default=REPO / "plots/methods.png")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temp one")
    ap.add_argument("--cache", type=Path, default=REPO / ".dvc" / "cache",
                    help="the DVC cache to share (default: this repo's)")
    args = ap.parse_args(argv)

    work = args.keep or Path(tempfile.mkdtemp(prefix="methods-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = scratch_checkout(work, args.cache)
    served = [f"server.command={args.server_command}", f"server.extra_args={args.extra_args}",
              "benchmark.engines=[reference,vllm]"] if args.server_command else []
    base, params = [*args.set, *served], (repo / "params.yaml").read_text()
    runs = []
    for spec in args.methods:
        if spec.partition(":")[0] not in METHODS:
            raise SystemExit(f"{spec}: the method must be one of {', '.join(METHODS)}")
        runs.append(run_method(repo, spec, params, base))
        print(f"{spec}: acceptance length {runs[-1]['benchmark']['by_engine']}", flush=True)
    alone = target_alone(repo, args.server_command, args.extra_args) \
        if args.server_command else None
    rows = summarize(runs, alone)
    out = {"command": "python " + " ".join(sys.argv), "params": args.set, "k": rows[0]["k"],
           "x_values": list(X_VALUES), "vllm_target_alone": alone, "methods": rows}
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    from draftsmith.plots import plot_methods

    plot_methods(rows, args.plot)
    table = markdown(rows)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    print(table)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
