"""The reference engine's acceptance at one temperature over several seeds: how far a served
engine's figure at T > 0 may sit from the reference's by sampling alone.

At T > 0 each engine samples its own texts, so two correct engines differ by the spread of
acceptance over samples. With a weak drafter and 30 prompts that spread is wide: the MLA toy's
reference ranged 1.25-1.53 over 8 seeds (benchmarks/results/reference_seeds_cpu_mla.json),
while the GPU check compares one seed of it to one run of each engine.

    python benchmarks/reference_seeds.py --repo RUN/mla --seeds 0 1 2 3 4 5 6 7 \\
        --json benchmarks/results/reference_seeds_cpu_mla.json

REPO holds params.yaml (its benchmark section), models/target, models/drafter and data/raw,
as a pipeline checkout or `benchmarks/gpu/make_runs.py`'s toys do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def spread(repo: Path, seeds: list[int], temperature: float, device: str | None) -> dict:
    from draftsmith.benchmark import TargetJudge, held_out_prompts
    from draftsmith.config import load_config

    cfg = load_config(repo / "params.yaml").benchmark
    prompts, _ = held_out_prompts(cfg, repo / "data/raw")
    judge = TargetJudge(cfg, repo / "models/target", prompts, device)
    model, drafter = judge.model, judge.load_drafter(repo / "models/drafter")
    rows = []
    for seed in seeds:
        t0 = time.time()
        summary, outputs = judge.speculate(drafter, temperature, seed,
                                           f"reference T={temperature} seed {seed}")
        rows.append({"seed": seed, "acceptance_length": summary["acceptance_length"],
                     # what one run reports of its own spread (over prompts)
                     "acceptance_length_se": summary["acceptance_length_se"],
                     "acceptance_rate_per_position": summary["acceptance_rate_per_position"],
                     "tokens": sum(map(len, outputs)), "wall_s": round(time.time() - t0, 1)})
    lengths = [r["acceptance_length"] for r in rows]
    return {"temperature": temperature, "prompts": len(prompts), "k": cfg.num_speculative_tokens,
            "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "method": drafter.config.method, "rows": rows,
            "mean": round(statistics.fmean(lengths), 4),
            "sd": round(statistics.stdev(lengths), 4) if len(lengths) > 1 else None,
            "min": min(lengths), "max": max(lengths),
            # sd over seeds against the standard error each run reports: near 1 where a
            # single run's error is the spread the benchmark's gap warning assumes
            "mean_se": round(statistics.fmean(r["acceptance_length_se"] for r in rows), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default="cpu", help="the reference engine's (cpu, cuda)")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args(argv)
    if a.temperature <= 0:
        p.error("--temperature must be > 0: at T = 0 every seed gives the same figure")
    args = sys.argv[1:] if argv is None else argv
    out = {"command": "python benchmarks/reference_seeds.py " + " ".join(map(str, args)),
           **spread(a.repo, a.seeds, a.temperature, a.device)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"reference T={a.temperature} over seeds {a.seeds}: mean {out['mean']}, sd {out['sd']}, "
          f"range {out['min']}-{out['max']}; each run's standard error over prompts, mean "
          f"{out['mean_se']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
