"""Train stage: the drafter of `train.method` (drafters/), from stored hidden states.

data.py: packed rows read lazily from the hidden shards; loop.py: device, steps, evaluation,
each step the method's objective (drafters/, over ../losses.py's fused losses); resume.py: the
checkpoints an interrupted run resumes from; parallel.py: DDP and FSDP2 under torchrun;
precision.py: the bf16 working copy over fp32 master weights.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.config import HiddenConfig, TrainConfig
from draftsmith.target_info import TargetHead, load_target_head
from draftsmith.train.loop import train


def run(cfg: TrainConfig, target_dir: Path, hidden_dir: Path, vocab_dir: Path, out_dir: Path,
        ckpt_dir: Path, curve_file: Path | None = None, plot_file: Path | None = None,
        tokenized_dir: Path | None = None, hidden: HiddenConfig | None = None) -> dict:
    """The stage: reads only the target's embedding, lm_head and final norm, unless the hidden
    artifact is online (hidden.mode: online): then the whole target runs here, on every batch."""

    def load_target(device):
        from draftsmith.capture import set_attention
        from draftsmith.target_info import load_model

        model = load_model(target_dir, str(device))
        set_attention(model, (hidden or HiddenConfig()).attention)
        return model

    head = TargetHead(*load_target_head(target_dir))
    mask = None
    if cfg.method == "dflash":
        from draftsmith.drafters.dflash import mask_token_id
        from draftsmith.target_info import load_tokenizer

        mask = mask_token_id(load_tokenizer(target_dir), head.config.vocab_size)
    return train(cfg, head, hidden_dir, vocab_dir, out_dir, ckpt_dir, curve_file, plot_file,
                 tokenized_dir, load_target, mask)


__all__ = ["run", "train", "TargetHead"]
