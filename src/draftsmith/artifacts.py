"""What the data stages write and how to read it back: the one place for their file names and
readers, so every stage agrees on them (the target's: target_info.py; the hidden states':
hidden_format.py; the drafter's: checkpoint.py).

- raw samples (`generate`'s out): `samples.jsonl`;
- tokenized samples (`tokenize`'s out): `manifest.json` + safetensors shards of packed ids and
  loss masks;
- any stage's manifest, read with `read_manifest`: a missing one names the stage that writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError

SAMPLES_FILE = "samples.jsonl"
TOKENIZED_MANIFEST = "manifest.json"


def read_manifest(path: Path, stage: str) -> dict:
    """A stage's JSON manifest; when it is missing, an error that says which stage to run."""
    from draftsmith.readers import read_json_object

    f = Path(path)
    if not f.exists():
        raise DraftsmithError(f"{f} not found", f"run the {stage} stage first: `dvc repro {stage}`")
    return read_json_object(f, f"run the {stage} stage again: `dvc repro -f {stage}`")


def iter_samples(tokenized_dir: Path):
    """Yield (sample_id, input_ids, loss_mask) tensors from a tokenized artifact."""
    from safetensors.torch import load_file

    manifest = read_manifest(Path(tokenized_dir) / TOKENIZED_MANIFEST, "tokenize")
    for shard in manifest["shards"]:
        t = load_file(Path(tokenized_dir) / shard["file"])
        cu = t["cu_seqlens"].tolist()
        for k, sid in enumerate(shard["ids"]):
            yield sid, t["input_ids"][cu[k]:cu[k + 1]].long(), t["loss_mask"][cu[k]:cu[k + 1]].bool()


def sample_lengths(tokenized_dir: Path) -> dict[str, int]:
    """{sample_id: tokens} of a tokenized artifact, from its offsets alone (no ids read)."""
    from safetensors import safe_open

    manifest = read_manifest(Path(tokenized_dir) / TOKENIZED_MANIFEST, "tokenize")
    out = {}
    for shard in manifest["shards"]:
        with safe_open(Path(tokenized_dir) / shard["file"], "pt") as f:
            cu = f.get_tensor("cu_seqlens").tolist()
        out.update({sid: cu[k + 1] - cu[k] for k, sid in enumerate(shard["ids"])})
    return out
