"""Reading the target artifact: its manifest (`target.json`), tokenizer, model, and the head
(embedding, lm_head, final norm) that drafter training reads alone.

Every stage after `target` reads the target through this module alone, so their code deps do
not include how the target was made (the toy's builder, the hub download's pinning).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.artifacts import read_manifest
from draftsmith.chat_format import FORMATS, ChatFormat
from draftsmith.config import TargetConfig
from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    import torch

MANIFEST = "target.json"
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True)
class TargetInfo:
    kind: str  # embedded | local | hub
    model: str  # what the user asked for
    path: str  # where the HF-layout files are (relative to the artifact dir when embedded)
    revision: str | None  # hub commit sha, or a content fingerprint for local/embedded
    chat_format: dict | str  # the resolved ChatFormat (a registry name in older artifacts)
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    trust_remote_code: bool
    dtype: str

    def model_dir(self, artifact_dir: Path) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else artifact_dir / p

    @property
    def format(self) -> ChatFormat:
        if isinstance(self.chat_format, str):
            return FORMATS[self.chat_format]
        return ChatFormat.from_dict(self.chat_format)


def download(cfg: TargetConfig) -> tuple[Path, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(cfg.model, revision=cfg.revision, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        raise DraftsmithError(
            f"target.model '{cfg.model}' is not in the local HF cache and the hub is unreachable "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')})",
            "connect to the hub once (or `hf download` it on a machine that can and copy the "
            "cache), or point target.model at a local directory",
        ) from None
    except HfHubHTTPError as exc:
        raise DraftsmithError(
            f"target.model '{cfg.model}' (revision {cfg.revision}) could not be fetched: {exc}",
            "check the model id and revision, and HF_TOKEN for gated models",
        ) from None
    return path, path.name  # snapshot folders are named by commit sha


def read_info(artifact_dir: Path) -> TargetInfo:
    return TargetInfo(**read_manifest(Path(artifact_dir) / MANIFEST, "target"))


def context_length(artifact_dir: Path) -> int | None:
    """The target's context window (max_position_embeddings of its text config), read from
    config.json without loading code; None where the config does not say."""
    info = read_info(artifact_dir)
    f = info.model_dir(Path(artifact_dir)) / "config.json"
    if not f.exists():
        return None
    config = json.loads(f.read_text())
    return config.get("text_config", config).get("max_position_embeddings")


def _local_model_dir(info: TargetInfo, artifact_dir: Path) -> Path:
    """Where the target's files are; a hub target whose HF cache was cleared is fetched again
    at its pinned commit."""
    model_dir = info.model_dir(Path(artifact_dir))
    if info.kind == "hub" and not model_dir.exists():
        model_dir, _ = download(TargetConfig(model=info.model, revision=info.revision))
    return model_dir


def load_tokenizer(artifact_dir: Path):
    from transformers import AutoTokenizer

    info = read_info(artifact_dir)
    return AutoTokenizer.from_pretrained(info.model_dir(Path(artifact_dir)),
                                         trust_remote_code=info.trust_remote_code)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_class(config, trust_remote_code: bool = False):
    """The transformers auto class for a target's config: AutoModelForCausalLM for a language
    model; AutoModelForImageTextToText for a multimodal wrapper around one (Kimi-K2.5 puts its
    DeepSeek-V3 text model inside Kimi_K25ForConditionalGeneration, with the text config nested
    as `text_config` and the weights under `language_model.`), which runs text alone the same
    way and whose get_decoder() is the text model's decoder."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    remote = (getattr(config, "auto_map", None) or {}) if trust_remote_code else {}
    if type(config) in AutoModelForCausalLM._model_mapping or "AutoModelForCausalLM" in remote:
        return AutoModelForCausalLM
    if type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    raise DraftsmithError(
        f"transformers has no causal-LM class for model_type '{config.model_type}'",
        "use a transformers version that knows this architecture, or (if you trust the repo's "
        "code) set target.trust_remote_code: true")


def load_model(artifact_dir: Path, device: str | None = None, device_map: str | None = None):
    """The target as a transformers causal LM, safetensors only, in the configured dtype.
    device_map="auto" spreads a target larger than one GPU over the visible GPUs (accelerate,
    as transformers does it) instead of moving it whole to `device`."""
    import torch
    from transformers import AutoConfig

    device = device or default_device()
    if device_map:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise DraftsmithError("hidden.device_map: auto needs the accelerate package",
                                  "pip install accelerate, or set hidden.device_map: null")
    info = read_info(artifact_dir)
    model_dir = _local_model_dir(info, artifact_dir)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=info.trust_remote_code)
    model = auto_class(config, info.trust_remote_code).from_pretrained(
        model_dir, config=config, dtype=getattr(torch, info.dtype), use_safetensors=True,
        trust_remote_code=info.trust_remote_code,
        **({"device_map": device_map} if device_map else {}),
    )
    return (model if device_map else model.to(device)).eval()


# ----------------------------------------------------------------------------- head


@dataclass
class TargetHead:
    """The only parts of the target that training reads (load_target_head)."""
    config: object  # its text config (shapes, rope, eps)
    embed: torch.Tensor  # (V, Ht) input embedding, shared with the drafter (frozen)
    lm_head: torch.Tensor  # (V, Ht)
    norm: torch.Tensor  # (Ht,) final norm weight


def load_target_head(target_dir: Path):
    """The three target tensors drafter training needs, read alone from the safetensors: the
    input embedding (V, H), the lm_head (V, H; the embedding when tied) and the final norm
    weight (H,). Returns (text config, embed, lm_head, norm). Nothing else is loaded: for a
    large target the full model would be tens or hundreds of GB of host memory."""
    config, model_dir, wanted = _head_names(target_dir)
    tensors = _read_tensors(model_dir, wanted)
    if tensors["lm_head"] is None:  # tied: the checkpoint stores the embedding only
        tensors["lm_head"] = tensors["embed"]
    return config, tensors["embed"], tensors["lm_head"], tensors["norm"]


def load_final_norm(target_dir: Path):
    """-> (the final norm's weight (H,), its text config): what turns the last layer's output
    into the final hidden state, read alone (the hidden stage's vLLM engine applies it)."""
    config, model_dir, wanted = _head_names(target_dir)
    return _read_tensors(model_dir, {"norm": wanted["norm"]})["norm"], config


def _head_names(target_dir: Path):
    """-> (text config, model dir, {embed, lm_head, norm: checkpoint name}), from a skeleton
    on the meta device (names only: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    info = read_info(target_dir)
    model_dir = _local_model_dir(info, target_dir)
    # A multimodal wrapper's names differ from its text model's (Kimi-K2.5:
    # `language_model.model.embed_tokens.weight`): _read_tensors matches them by suffix.
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=info.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config.get_text_config(),
                                                    trust_remote_code=info.trust_remote_code)
    names = {id(p): n for n, p in skeleton.named_parameters()}  # a tied weight: its first name
    return skeleton.config, model_dir, {
        "embed": names[id(skeleton.get_input_embeddings().weight)],
        "lm_head": names[id(skeleton.get_output_embeddings().weight)],
        "norm": names[id(skeleton.get_decoder().norm.weight)],
    }


def _read_tensors(model_dir: Path, wanted: dict[str, str]) -> dict:
    """{role: tensor} for checkpoint names `wanted` (matched exactly, else by suffix, since
    some checkpoints prefix the language model differently from the module tree)."""
    from safetensors import safe_open

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
