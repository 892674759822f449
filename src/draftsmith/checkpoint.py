"""The drafter's checkpoint: the one place for its file names, save and load.

- the drafter (`train`'s out): `drafter.safetensors` (every tensor but the shared, frozen
  embedding table) + `drafter.json` (its DrafterConfig);
- an existing EAGLE-3 drafter to finetune from (`train.init: <dir>`), in the vLLM/SpecForge
  `midlayer.*` or the speculators `layers.0.*` layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.artifacts import read_manifest
from draftsmith.atomic import atomic_path, write_json
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.errors import DraftsmithError

DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter.json"
SHARED = "embed_tokens.weight"  # the target's embedding table: never saved with the drafter


def drafter_state(model: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict:
    """The drafter's tensors to save: all but the shared embedding, floats cast to `dtype`."""
    out = {}
    for k, v in model.state_dict().items():
        if k == SHARED:
            continue
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.detach().contiguous().cpu()
    return out


def save_drafter(model: Eagle3Drafter, out_dir: Path) -> None:
    """Write the trained drafter (atomically: an interrupted save leaves the old one)."""
    with atomic_path(Path(out_dir)) as tmp:
        tmp.mkdir()
        save_file(drafter_state(model), tmp / DRAFTER_WEIGHTS)
        write_json(tmp / DRAFTER_CONFIG, model.config.to_dict())


def read_drafter_config(drafter_dir: Path) -> DrafterConfig:
    c = read_manifest(Path(drafter_dir) / DRAFTER_CONFIG, "train")
    c["aux_layers"] = tuple(c["aux_layers"])
    return DrafterConfig(**c)


def load_drafter(drafter_dir: Path, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """The saved drafter, in fp32, in eval mode. `embed` (the target's input embedding table)
    is put back when given; without it the table stays at its (meaningless) init, which is
    fine for exporting."""
    model = Eagle3Drafter(read_drafter_config(drafter_dir))
    state = load_file(Path(drafter_dir) / DRAFTER_WEIGHTS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing != [SHARED] or unexpected:
        raise DraftsmithError(
            f"{drafter_dir} does not hold a complete drafter (missing {missing}, "
            f"unexpected {unexpected})", "re-run the train stage")
    if embed is not None:
        model.embed_tokens.weight.data.copy_(embed.float())
    return model.eval()


def load_drafter_weights(model: Eagle3Drafter, path: Path) -> dict:
    """Initialise `model` from an existing EAGLE-3 drafter (vLLM/SpecForge `midlayer.*` layout
    or the speculators `layers.0.*` layout), reconciling its draft vocab with ours by target
    token id. Returns what was reconciled."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{path} has no .safetensors drafter weights",
                              "point train.init at an EAGLE-3 drafter directory")
    theirs: dict[str, torch.Tensor] = {}
    for f in files:
        theirs.update(load_file(f))
    renamed = {}
    for k, v in theirs.items():
        k = k.removeprefix("model.")
        renamed[k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k] = v
    mine = model.state_dict()
    if "t2d" in renamed and renamed["t2d"].shape != mine["t2d"].shape:
        raise DraftsmithError(
            f"{path} was trained for a target vocab of {renamed['t2d'].numel()} tokens, this "
            f"target has {mine['t2d'].numel()}", "init from a drafter of the same target")
    loaded = {}
    for k, v in renamed.items():
        if k in ("d2t", "t2d", "lm_head.weight", SHARED):
            continue
        if k not in mine or mine[k].shape != v.shape:
            raise DraftsmithError(
                f"{path}: tensor {k} {tuple(v.shape)} does not fit this drafter "
                f"({tuple(mine[k].shape) if k in mine else 'no such tensor'})",
                "init from a drafter of the same target and drafter kind (train.drafter_arch: "
                "llama or mla), or use init: copy")
        loaded[k] = v.to(mine[k].dtype)
    # lm_head rows follow target token ids: keep the rows of tokens both vocabs share.
    kept = 0
    if "lm_head.weight" in renamed and "d2t" in renamed:
        their_ids = (renamed["d2t"] + torch.arange(len(renamed["d2t"]))).tolist()
        row_of = {tid: r for r, tid in enumerate(their_ids)}
        our_ids = (model.d2t.cpu() + torch.arange(len(model.d2t))).tolist()
        head = mine["lm_head.weight"].clone()
        for r, tid in enumerate(our_ids):
            if tid in row_of:
                head[r] = renamed["lm_head.weight"][row_of[tid]]
                kept += 1
        loaded["lm_head.weight"] = head
    model.load_state_dict(loaded, strict=False)
    return {"tensors": len(loaded), "lm_head_rows_reused": kept,
            "lm_head_rows_fresh": len(model.d2t) - kept}
