"""Train stage: the EAGLE-3 drafter with training-time test, from stored hidden states.

data.py: packed rows read lazily from the hidden shards; loss.py: the target's view and the
fused draft-vocab loss; loop.py: device, steps, checkpoints, evaluation.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.config import TrainConfig
from draftsmith.train.loop import TargetHead, train


def run(cfg: TrainConfig, target_dir: Path, hidden_dir: Path, vocab_dir: Path, out_dir: Path,
        ckpt_dir: Path, curve_file: Path | None = None, plot_file: Path | None = None) -> dict:
    """The stage: reads only the target's embedding, lm_head and final norm."""
    from draftsmith.artifacts import load_target_head

    return train(cfg, TargetHead(*load_target_head(target_dir)), hidden_dir, vocab_dir, out_dir,
                 ckpt_dir, curve_file, plot_file)


__all__ = ["run", "train", "TargetHead"]
