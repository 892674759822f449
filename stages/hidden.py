"""Stage `hidden`: the target's aux hidden states (and final hidden state) for every token."""

from draftsmith import dist, hidden
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("hidden", lambda cfg, a: hidden.run(cfg.hidden, a.target, a.tokenized, a.out,
                                                   cfg.server, a.work),
               paths=["target", "tokenized", "out", "work"], dist=dist,
               one_process=lambda cfg: cfg.hidden.engine != "hf")
