"""Stage `train`: the EAGLE-3 drafter, trained with training-time test on the hidden states
(stored, or in online mode computed here from the tokenized data)."""

from draftsmith import dist, train
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("train", lambda cfg, a: train.run(cfg.train, a.target, a.hidden, a.vocab, a.out,
                                                 a.checkpoints, a.curve, a.plot, a.tokenized,
                                                 cfg.hidden, cfg.server, a.work),
               paths=["target", "tokenized", "hidden", "vocab", "out", "checkpoints", "curve",
                      "plot", "work"], dist=dist,
               # online from a serving engine: one process sends requests (the engine spreads
               # the target itself)
               one_process=lambda cfg: cfg.hidden.mode == "online" and cfg.hidden.engine != "hf")
