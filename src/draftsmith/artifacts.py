"""What the data stages write and how to read it back: the one place for their file names and
readers, so every stage agrees on them (the target's: target_info.py; the drafter's:
checkpoint.py).

- raw samples (`generate`'s out): `samples.jsonl`;
- tokenized samples (`tokenize`'s out): `manifest.json` + safetensors shards of packed ids and
  loss masks;
- the hidden states (`hidden`'s out): `manifest.json` + safetensors shards;
- the target's embedding, lm_head and final norm, read alone from its safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError

SAMPLES_FILE = "samples.jsonl"
TOKENIZED_MANIFEST = "manifest.json"
HIDDEN_MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------- target


def load_target_head(target_dir: Path):
    """The three target tensors drafter training needs, read alone from the safetensors: the
    input embedding (V, H), the lm_head (V, H; the embedding when tied) and the final norm
    weight (H,). Returns (text config, embed, lm_head, norm). Nothing else is loaded: for a
    large target the full model would be tens or hundreds of GB of host memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.target_info import read_info

    info = read_info(target_dir)
    model_dir = info.model_dir(Path(target_dir))
    if info.kind == "hub" and not model_dir.exists():  # HF cache cleared: fetch the pinned commit
        from draftsmith.config import TargetConfig
        from draftsmith.target_info import download

        model_dir, _ = download(TargetConfig(model=info.model, revision=info.revision))
    # A multimodal wrapper's names differ from its text model's (Kimi-K2.5:
    # `language_model.model.embed_tokens.weight`): _read_tensors matches them by suffix.
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=info.trust_remote_code)
    with torch.device("meta"):  # names only: no memory
        skeleton = AutoModelForCausalLM.from_config(config.get_text_config(),
                                                    trust_remote_code=info.trust_remote_code)
    names = {id(p): n for n, p in skeleton.named_parameters()}  # a tied weight: its first name
    wanted = {
        "embed": names[id(skeleton.get_input_embeddings().weight)],
        "lm_head": names[id(skeleton.get_output_embeddings().weight)],
        "norm": names[id(skeleton.get_decoder().norm.weight)],
    }
    tensors = _read_tensors(model_dir, wanted)
    if tensors["lm_head"] is None:  # tied: the checkpoint stores the embedding only
        tensors["lm_head"] = tensors["embed"]
    return skeleton.config, tensors["embed"], tensors["lm_head"], tensors["norm"]


def _read_tensors(model_dir: Path, wanted: dict[str, str]) -> dict:
    """{role: tensor} for checkpoint names `wanted` (matched exactly, else by suffix, since
    some checkpoints prefix the language model differently from the module tree)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                where.update({k: f.name for k in st.keys()})
    out = {}
    for role, name in wanted.items():
        key = name if name in where else _closest_key(name, where)
        if key is None:
            if role == "lm_head":
                out[role] = None
                continue
            raise DraftsmithError(f"{model_dir}: no tensor {name} in the safetensors",
                                  "check that the target checkpoint is complete")
        with safe_open(model_dir / where[key], "pt") as st:
            out[role] = st.get_tensor(key)
    return out


def _closest_key(name: str, keys) -> str | None:
    """The checkpoint key ending like `name` (its last two parts, e.g. `norm.weight`, outside
    the decoder layers) that shares the longest suffix with it."""
    tail = ".".join(name.split(".")[-2:])
    found = [k for k in keys if (k == tail or k.endswith("." + tail)) and ".layers." not in k]

    def shared(k):
        a, b = k.split(".")[::-1], name.split(".")[::-1]
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return max(found, key=shared, default=None)


# ----------------------------------------------------------------------------- hidden states


def read_hidden_manifest(hidden_dir: Path) -> dict:
    f = Path(hidden_dir) / HIDDEN_MANIFEST
    if not f.exists():
        raise DraftsmithError(f"{f} not found", "run the hidden stage first: `dvc repro hidden`")
    return json.loads(f.read_text())


def iter_samples(tokenized_dir: Path):
    """Yield (sample_id, input_ids, loss_mask) tensors from a tokenized artifact."""
    manifest = json.loads((Path(tokenized_dir) / TOKENIZED_MANIFEST).read_text())
    for shard in manifest["shards"]:
        t = load_file(Path(tokenized_dir) / shard["file"])
        cu = t["cu_seqlens"].tolist()
        for k, sid in enumerate(shard["ids"]):
            yield sid, t["input_ids"][cu[k]:cu[k + 1]].long(), t["loss_mask"][cu[k]:cu[k + 1]].bool()
