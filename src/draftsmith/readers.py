"""Reading the files a user hands the pipeline (an exported drafter, a drafter to fine-tune, a
stage's manifest): a missing, truncated or foreign file becomes a DraftsmithError naming the
file and the fix, not a parser's traceback from several frames down."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in `path`; fix: what to do when it is missing or is not one."""
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} not found", fix)
    try:
        value = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DraftsmithError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                              fix) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f"line {exc.lineno} column {exc.colno}: {exc.msg}" \
            if isinstance(exc, json.JSONDecodeError) else "nested too deep"
        raise DraftsmithError(f"{path} is not valid JSON ({where})", fix) from None
    if not isinstance(value, dict):
        raise DraftsmithError(f"{path} holds a JSON {type(value).__name__}, not an object", fix)
    return value


def read_safetensors(path: Path, fix: str) -> dict:
    """Every tensor of a .safetensors file; a missing, truncated or foreign file -> a
    DraftsmithError (weights load from safetensors only: no pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} not found", fix)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise DraftsmithError(f"{path} is not a readable safetensors file ({exc})", fix) from None
