"""Stage `benchmark`: acceptance of the drafter on held-out prompts, per engine."""

from draftsmith import benchmark
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("benchmark", lambda cfg, a: benchmark.run(
        cfg.benchmark, a.target, a.drafter, a.raw, a.plot, export_dir=a.export,
        server=cfg.server, work_dir=a.work),
        paths=["target", "drafter", "export", "raw", "plot", "work"])
