"""Stage `generate`: answer the prompts with the target, keeping its reasoning."""

from draftsmith import generate
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("generate", lambda cfg, a: generate.run(cfg.generate, a.target, a.out, cfg.server,
                                                       a.work),
               paths=["target", "out", "work"])
