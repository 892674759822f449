"""Training's resume point: the checkpoint written every `train.save_every` steps to the
checkpoints folder (not a DVC out: DVC would delete it before the rerun that resumes from it).

- `drafter.safetensors` (the drafter's tensors, as checkpoint.py saves them) and
  `optimizer.pt` (AdamW's state keyed by parameter name), whole, whatever the world size;
- `state.json`: the step, the run's key, the curve so far and each file's size and sha256,
  checked before anything is read;
- with `train.select: best_acceptance`, `best.safetensors` (the best checkpoint's drafter so
  far) and its scores in `state.json`.

A checkpoint resumes only the run it was written by (`resume_key`); any other starts over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.atomic import atomic_path, check_digest, file_sha256, write_json
from draftsmith.checkpoint import DRAFTER_WEIGHTS
from draftsmith.config import TrainConfig

CHECKPOINT_FILES = (DRAFTER_WEIGHTS, "optimizer.pt")
BEST_WEIGHTS = "best.safetensors"


def resume_key(cfg: TrainConfig, store, vocab_dir: Path) -> str:
    """store: the train data (train.data.HiddenStore or TokenStore)."""
    # How the steps are spread over processes does not change them: a checkpoint of an
    # FSDP2 run resumes under DDP or on one process, and the other way round.
    h = hashlib.sha256(cfg.model_dump_json(exclude={"parallel"}).encode())
    h.update((store.dir / "manifest.json").read_bytes())  # the states', or online the tokens'
    h.update(json.dumps(store.aux_layers).encode())
    h.update((Path(vocab_dir) / "vocab.safetensors").read_bytes())
    return h.hexdigest()[:16]


def save_checkpoint(ckpt_dir: Path, weights: dict, optim: dict, step: int, key: str,
                    curve: list, selection=None) -> None:
    """selection: train.select.BestCheckpoint, with best_acceptance."""
    with atomic_path(ckpt_dir) as tmp:
        tmp.mkdir()
        save_file(weights, tmp / DRAFTER_WEIGHTS)
        torch.save(optim, tmp / "optimizer.pt")
        files = list(CHECKPOINT_FILES)
        state = {"step": step, "key": key, "curve": curve}
        if selection is not None:
            state["selection"] = selection.state()
            if selection.best is not None:
                save_file(selection.best, tmp / BEST_WEIGHTS)
                files.append(BEST_WEIGHTS)
        state["files"] = {f: {"bytes": (tmp / f).stat().st_size, "sha256": file_sha256(tmp / f)}
                          for f in files}
        write_json(tmp / "state.json", state)


def load_checkpoint(ckpt_dir: Path, trainer, key: str, selection=None) -> tuple[int, list]:
    """Load the checkpoint of run `key` into trainer (train.loop.Trainer), and its scores and
    best weights into `selection` (a BestCheckpoint, with best_acceptance); -> (the step to go
    on from, the curve so far), or (0, []) when there is none for this run."""
    state_file = ckpt_dir / "state.json"
    if not state_file.exists():
        return 0, []
    state = json.loads(state_file.read_text())
    if state["key"] != key:
        return 0, []  # a different run's checkpoint: start over
    for f, digest in state.get("files", {}).items():  # before reading any of it
        check_digest(ckpt_dir / f, digest, f"delete {ckpt_dir} to train from step 0 (the "
                     f"checkpoint of step {state['step']} cannot be resumed)")
    weights = load_file(ckpt_dir / DRAFTER_WEIGHTS)
    missing = set(trainer.model.state_dict()) - set(weights)
    assert missing == set(trainer.model.SHARED), missing
    trainer.load_state(weights, torch.load(ckpt_dir / "optimizer.pt", weights_only=True))
    if selection is not None and "selection" in state:
        selection.scores = state["selection"]["scores"]
        selection.best_step = state["selection"]["best_step"]
        if (ckpt_dir / BEST_WEIGHTS).exists():
            selection.best = load_file(ckpt_dir / BEST_WEIGHTS)
    return state["step"], state["curve"]
