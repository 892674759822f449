"""Reading the target artifact: its manifest (`target.json`), tokenizer and model.

Every stage after `target` reads the target through this module alone, so their code deps do
not include how the target was made (the toy's builder, the hub download's pinning).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftsmith.chat_format import FORMATS, ChatFormat
from draftsmith.config import TargetConfig
from draftsmith.errors import DraftsmithError

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
    f = Path(artifact_dir) / MANIFEST
    if not f.exists():
        raise DraftsmithError(f"{f} not found", "run the target stage first: `dvc repro target`")
    return TargetInfo(**json.loads(f.read_text()))


def context_length(artifact_dir: Path) -> int | None:
    """The target's context window (max_position_embeddings of its text config), read from
    config.json without loading code; None where the config does not say."""
    info = read_info(artifact_dir)
    f = info.model_dir(Path(artifact_dir)) / "config.json"
    if not f.exists():
        return None
    config = json.loads(f.read_text())
    return config.get("text_config", config).get("max_position_embeddings")


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
    model_dir = info.model_dir(Path(artifact_dir))
    if info.kind == "hub" and not model_dir.exists():
        model_dir, _ = download(TargetConfig(model=info.model, revision=info.revision))
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=info.trust_remote_code)
    model = auto_class(config, info.trust_remote_code).from_pretrained(
        model_dir, config=config, dtype=getattr(torch, info.dtype), use_safetensors=True,
        trust_remote_code=info.trust_remote_code,
        **({"device_map": device_map} if device_map else {}),
    )
    return (model if device_map else model.to(device)).eval()
