"""Stage `target`: build the embedded toy target, or pin a hub/local model by revision."""

from draftsmith import target
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("target", lambda cfg, a: target.resolve(cfg.target, a.out), paths=["out"])
