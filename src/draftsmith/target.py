"""Resolve and load the target model.

The `target` artifact is a directory holding `target.json` (the manifest) and, for the embedded
default, the model itself. For a hub model the manifest pins the resolved commit, so a new
upstream revision is a visible change in `dvc.lock`; the weights stay in the HF cache and are
fetched again by that commit on another machine. Weights load from safetensors only, and model
code from the hub runs only with `target.trust_remote_code: true`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.atomic import atomic_path, write_json
from draftsmith.chat_format import ChatFormat, get_format
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
    chat_format: str
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
        return get_format(self.chat_format, None)


def _fingerprint(model_dir: Path) -> str:
    """Content hash of a local model: small files hashed whole, weight files by name and size
    (hashing hundreds of GB of shards on every run would cost more than the stage)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes() if f.stat().st_size < 1 << 24 else str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def _download(cfg: TargetConfig) -> tuple[Path, str]:
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


def _describe(model_dir: Path, cfg: TargetConfig) -> dict:
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise DraftsmithError(f"{model_dir} has no config.json",
                              "point target.model at an HF-layout model directory or hub id")
    if not list(model_dir.glob("*.safetensors")):
        raise DraftsmithError(
            f"{model_dir} has no .safetensors weights (only safetensors are loaded: pickled "
            "weights can run arbitrary code)",
            "convert the checkpoint to safetensors, or use a repo that ships them",
        )
    conf = json.loads(config_file.read_text())
    text = conf.get("text_config", conf)  # multimodal wrappers nest the language model's config
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    return dict(
        chat_format=get_format(cfg.chat_format, tok.chat_template).name,
        architecture=(conf.get("architectures") or ["?"])[0],
        num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
    )


def resolve(cfg: TargetConfig, out_dir: Path) -> dict:
    """Make the target artifact in out_dir (atomically). Returns the stage's metrics."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        return _resolve_into(cfg, tmp)


def _resolve_into(cfg: TargetConfig, out_dir: Path) -> dict:
    from draftsmith.toy import build

    metrics: dict = {}
    if cfg.is_embedded:
        metrics = build.build(cfg.embedded, out_dir / "model")
        model_dir, path, kind = out_dir / "model", "model", "embedded"
        revision = _fingerprint(model_dir)
    elif Path(cfg.model).is_dir():
        model_dir, kind = Path(cfg.model).resolve(), "local"
        path, revision = str(model_dir), _fingerprint(model_dir)
    else:
        model_dir, revision = _download(cfg)
        kind, path = "hub", str(model_dir)
    info = TargetInfo(kind=kind, model=cfg.model, path=path, revision=revision,
                      trust_remote_code=cfg.trust_remote_code, dtype=cfg.dtype,
                      **_describe(model_dir, cfg))
    write_json(out_dir / MANIFEST, asdict(info))
    metrics.update(kind=kind, revision=revision, num_layers=info.num_layers,
                   vocab_size=info.vocab_size, chat_format=info.chat_format)
    return metrics


def read_info(artifact_dir: Path) -> TargetInfo:
    f = Path(artifact_dir) / MANIFEST
    if not f.exists():
        raise DraftsmithError(f"{f} not found", "run the target stage first: `dvc repro target`")
    return TargetInfo(**json.loads(f.read_text()))


def load_tokenizer(artifact_dir: Path):
    from transformers import AutoTokenizer

    info = read_info(artifact_dir)
    return AutoTokenizer.from_pretrained(info.model_dir(Path(artifact_dir)),
                                         trust_remote_code=info.trust_remote_code)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(artifact_dir: Path, device: str | None = None):
    """The target as a transformers causal LM, safetensors only, in the configured dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    info = read_info(artifact_dir)
    model_dir = info.model_dir(Path(artifact_dir))
    if info.kind == "hub" and not model_dir.exists():
        model_dir, _ = _download(TargetConfig(model=info.model, revision=info.revision))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, info.dtype), use_safetensors=True,
        trust_remote_code=info.trust_remote_code,
    )
    return model.to(device).eval()
