"""Stage `benchmark`: acceptance of the drafter on held-out prompts (reference engine)."""

from draftsmith import benchmark
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("benchmark", lambda cfg, a: benchmark.run(cfg.benchmark, a.target, a.drafter,
                                                         a.raw, a.plot),
               paths=["target", "drafter", "raw", "plot"])
