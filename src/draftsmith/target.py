"""The target stage: resolve the target model (build the toy, find a local dir, or pin a hub
revision) and record what later stages need in its manifest (readers: target_info.py).

The `target` artifact is a directory holding `target.json` (the manifest) and, for the embedded
default, the model itself. For a hub model the manifest pins the resolved commit, so a new
upstream revision is a visible change in `dvc.lock`; the weights stay in the HF cache and are
fetched again by that commit on another machine. Weights load from safetensors only, and model
code from the hub runs only with `target.trust_remote_code: true`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

from draftsmith.atomic import atomic_path, write_json
from draftsmith.chat_probe import resolve_format
from draftsmith.config import EMBEDDED_MLA, TargetConfig
from draftsmith.errors import DraftsmithError
from draftsmith.readers import read_json_object
from draftsmith.target_info import MANIFEST, TargetInfo, auto_class, download


def _fingerprint(model_dir: Path) -> str:
    """Content hash of a local model: small files hashed whole, weight files by name and size
    (hashing hundreds of GB of shards on every run would cost more than the stage)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes() if f.stat().st_size < 1 << 24 else str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


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
    conf = read_json_object(config_file, "point target.model at an HF-layout model directory "
                                         "whose config.json transformers wrote")
    text = conf.get("text_config", conf)  # multimodal wrappers nest the language model's config
    _check_weights(model_dir)
    from transformers import AutoConfig, AutoTokenizer

    # A model transformers cannot run as a causal LM is refused here, not at the first stage
    # that loads it (after generation, perhaps).
    config = _hf_read(
        lambda: AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code),
        f"transformers cannot read {config_file}",
        "fix the config (a model_type transformers knows, the fields it asks for), or set "
        "target.trust_remote_code: true for a model that ships its own code")
    auto_class(config, cfg.trust_remote_code)
    tok = _hf_read(
        lambda: AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code),
        f"cannot load the tokenizer of {model_dir}",
        "the tokenizer files (tokenizer.json, tokenizer_config.json) must be what transformers "
        "saved for this model")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise DraftsmithError(f"{config_file} has no {', '.join(missing)}",
                              "point target.model at a causal language model's directory")
    return dict(
        chat_format=resolve_format(cfg.chat_format, tok).to_dict(),
        architecture=(conf.get("architectures") or ["?"])[0],
        num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
    )


def _check_weights(model_dir: Path) -> None:
    """Every safetensors file's header reads (the tensors are not loaded): a truncated or
    foreign weight file is named here, before generation loads the model."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(f, "pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise DraftsmithError(f"{f} is not a readable safetensors file ({exc})",
                                  "download or convert the weights again") from None


def _hf_read(load, problem: str, fix: str):
    """load(), with whatever transformers or huggingface_hub raise for a file they cannot take
    (ValueError, KeyError, OSError, their own validation errors: a dozen types, each the
    user's file) turned into one error that names the file and the fix."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 (see above)
        raise DraftsmithError(f"{problem}: {type(exc).__name__}: {_first_line(exc)}",
                              fix) from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def resolve(cfg: TargetConfig, out_dir: Path) -> dict:
    """Make the target artifact in out_dir (atomically). Returns the stage's metrics."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        return _resolve_into(cfg, tmp)


def _resolve_into(cfg: TargetConfig, out_dir: Path) -> dict:
    from draftsmith.toy import build

    metrics: dict = {}
    if cfg.is_embedded:
        metrics = build.build(cfg.embedded, out_dir / "model", mla=cfg.model == EMBEDDED_MLA)
        model_dir, path, kind = out_dir / "model", "model", "embedded"
        revision = _fingerprint(model_dir)
    elif Path(cfg.model).is_dir():
        model_dir, kind = Path(cfg.model).resolve(), "local"
        path, revision = str(model_dir), _fingerprint(model_dir)
    else:
        model_dir, revision = download(cfg)
        kind, path = "hub", str(model_dir)
    info = TargetInfo(kind=kind, model=cfg.model, path=path, revision=revision,
                      trust_remote_code=cfg.trust_remote_code, dtype=cfg.dtype,
                      **_describe(model_dir, cfg))
    write_json(out_dir / MANIFEST, asdict(info))
    metrics.update(kind=kind, revision=revision, num_layers=info.num_layers,
                   vocab_size=info.vocab_size, chat_format=info.format.name,
                   chat_format_source=info.format.source)
    return metrics
