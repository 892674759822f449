"""Stage `export`: the trained drafter in the vLLM and SGLang layouts, validated."""

from draftsmith import export
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("export", lambda cfg, a: export.run(cfg.export, a.target, a.drafter, a.out),
               paths=["target", "drafter", "out"])
