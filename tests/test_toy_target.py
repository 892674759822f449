"""The embedded target's trainer with bf16 weights (`target.embedded.weights: bf16`, what the
GPU preset's 8B-class body trains with): it learns, and saves bf16 weights. The fp32 path is
the embedded default's, held bit for bit by `make repro`'s committed figures."""

import json
import math

from safetensors import safe_open

from draftsmith.config import EmbeddedTargetConfig
from draftsmith.toy.recipes import TINY_TARGET


def test_bf16_weights_train_and_are_saved_as_bf16(tmp_path):
    from draftsmith.toy import build

    cfg = EmbeddedTargetConfig(**{**TINY_TARGET, "train_steps": 150, "eval_examples": 8},
                               weights="bf16")
    m = build.build(cfg, tmp_path / "model")
    # an untrained model scores about ln(vocab) = 6.2 nats; 150 steps get well under half that
    assert math.isfinite(m["heldout_loss"]) and m["heldout_loss"] < 3.0
    assert m["train_weights"] == "bf16" and m["train_loop_s"] > 0
    with safe_open(str(tmp_path / "model/model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((tmp_path / "model/config.json").read_text())["dtype"] == "bfloat16"
