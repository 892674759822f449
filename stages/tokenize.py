"""Stage `tokenize`: chat-template the samples into ids + assistant-only loss masks, after
checking each against what the target itself emits."""

from draftsmith import tokenization
from draftsmith.stage import stage_main

if __name__ == "__main__":
    stage_main("tokenize", lambda cfg, a: tokenization.run(cfg.tokenize, a.target, a.raw, a.out),
               paths=["target", "raw", "out"])
