"""The drafter's checkpoint: the one place for its file names, save and load.

- the drafter (`train`'s out): `drafter.safetensors` (every tensor but those shared with the
  target, frozen: its embedding table, and DFlash's lm_head) + `drafter.json` (its
  DrafterConfig, `method` included);
- an existing drafter of the same method to finetune from (`train.init: <dir>`); EAGLE-3 in
  the vLLM/SpecForge `midlayer.*` or the speculators `layers.0.*` layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.artifacts import read_manifest
from draftsmith.atomic import atomic_path, write_json
from draftsmith.drafters.options import DEFAULT_METHOD
from draftsmith.drafters.registry import METHODS, DrafterConfig, build
from draftsmith.errors import DraftsmithError
from draftsmith.readers import read_safetensors

DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter.json"


def drafter_state(model, dtype: torch.dtype | None = None) -> dict:
    """The drafter's tensors to save: all but those shared with the target (model.SHARED),
    floats cast to `dtype`."""
    out = {}
    for k, v in model.state_dict().items():
        if k in model.SHARED:
            continue
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.detach().contiguous().cpu()
    return out


def save_drafter(model, out_dir: Path) -> None:
    """Write the trained drafter (atomically: an interrupted save leaves the old one)."""
    with atomic_path(Path(out_dir)) as tmp:
        tmp.mkdir()
        save_file(drafter_state(model), tmp / DRAFTER_WEIGHTS)
        write_json(tmp / DRAFTER_CONFIG, model.config.to_dict())


def read_drafter_config(drafter_dir: Path) -> DrafterConfig:
    c = read_manifest(Path(drafter_dir) / DRAFTER_CONFIG, "train")
    if c.get("method", DEFAULT_METHOD) not in METHODS:
        raise DraftsmithError(f"{drafter_dir} holds a drafter of method {c['method']!r}, which "
                              f"this version does not know ({', '.join(METHODS)})",
                              "re-run the train stage with this version")
    try:
        return DrafterConfig.from_dict(c)
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftsmithError(f"{drafter_dir}/{DRAFTER_CONFIG} is not a drafter's config "
                              f"({type(exc).__name__}: {exc})",
                              "re-run the train stage (`dvc repro -f train`)") from None


def load_drafter(drafter_dir: Path, target=None):
    """The saved drafter, in fp32, in eval mode. `target` (the target model) gives back the
    tensors shared with it (its input embedding; DFlash's lm_head); without it they stay at
    their (meaningless) init, which is fine for exporting."""
    model = build(read_drafter_config(drafter_dir))
    state = read_safetensors(Path(drafter_dir) / DRAFTER_WEIGHTS,
                             "re-run the train stage (`dvc repro -f train`)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != set(model.SHARED) or unexpected:
        raise DraftsmithError(
            f"{drafter_dir} does not hold a complete drafter (missing "
            f"{sorted(set(missing) - set(model.SHARED))}, unexpected {unexpected})",
            "re-run the train stage")
    if target is not None:
        attach_shared(model, target)
    return model.eval()


def attach_shared(model, target) -> None:
    """Give the drafter the tensors it shares with the target model (its input embedding;
    DFlash's lm_head too), which are never saved with it."""
    shared = {"embed_tokens.weight": target.get_input_embeddings().weight,
              "lm_head.weight": target.get_output_embeddings().weight}
    for name in model.SHARED:
        model.get_parameter(name).data.copy_(shared[name].float())


def load_drafter_weights(model, path: Path) -> dict:
    """Initialise `model` from an existing drafter of its method (EAGLE-3: vLLM/SpecForge
    `midlayer.*` layout or the speculators `layers.0.*` layout), reconciling a draft vocab
    with ours by target token id. Returns what was reconciled."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{path} has no .safetensors drafter weights",
                              "point train.init at a drafter directory of train.method")
    theirs: dict[str, torch.Tensor] = {}
    for f in files:
        theirs.update(read_safetensors(f, "put a drafter's safetensors weights in train.init"))
    method = METHODS[model.config.method]
    renamed = {method.import_name(k.removeprefix("model.")): v for k, v in theirs.items()}
    mine = model.state_dict()
    if "t2d" in renamed and "t2d" in mine and renamed["t2d"].shape != mine["t2d"].shape:
        raise DraftsmithError(
            f"{path} was trained for a target vocab of {renamed['t2d'].numel()} tokens, this "
            f"target has {mine['t2d'].numel()}", "init from a drafter of the same target")
    loaded = {}
    for k, v in renamed.items():
        if k in ("d2t", "t2d", "lm_head.weight", *model.SHARED):
            continue
        if k not in mine or mine[k].shape != v.shape:
            raise DraftsmithError(
                f"{path}: tensor {k} {tuple(v.shape)} does not fit this drafter "
                f"({tuple(mine[k].shape) if k in mine else 'no such tensor'})",
                f"init from a drafter of the same target, method ({model.config.method}) and "
                "drafter kind (train.drafter_arch: llama or mla), or use init: copy")
        loaded[k] = v.to(mine[k].dtype)
    # lm_head rows follow target token ids: keep the rows of tokens both vocabs share.
    kept = 0
    if "lm_head.weight" in renamed and "d2t" in renamed and "d2t" in mine:
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
            "lm_head_rows_fresh": len(model.d2t) - kept if "d2t" in mine else 0}
