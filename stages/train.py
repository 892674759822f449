"""Stage `train`: the EAGLE-3 drafter, trained with training-time test on the hidden states."""

from draftsmith import train
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("train", lambda cfg, a: train.run(cfg.train, a.target, a.hidden, a.vocab, a.out,
                                                 a.checkpoints, a.curve, a.plot),
               paths=["target", "hidden", "vocab", "out", "checkpoints", "curve", "plot"])
