"""Thin DVC stage scripts: each parses its paths and calls the draftsmith library.

Run as modules from the repository root (`python -m stages.tokenize ...`), so that a script
named like a standard-library module (tokenize) cannot shadow it.

dvc.yaml runs `python3`, whichever the shell finds first (a stock Debian or Ubuntu has no
`python` at all). `make repro` puts .venv/bin first; a fresh shell running `.venv/bin/dvc repro`
or `dvc exp run` does not, and its `python3` lacks the library. Then the stage moves itself into the checkout's .venv (made by `make install`) and
says so, or stops naming the fix, before any work: not a raw ModuleNotFoundError from inside
the script."""

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("draftsmith") is None:
    _venv = Path(__file__).resolve().parents[1] / ".venv"
    _venv_python = _venv / "bin" / "python"
    # a venv's python is a link to its base interpreter: tell them apart by sys.prefix
    if _venv_python.exists() and Path(sys.prefix).resolve() != _venv.resolve():
        print(f"stages: {sys.executable} has no draftsmith installed; running this stage with "
              f"{_venv_python} (`source .venv/bin/activate` makes it the shell's python)",
              file=sys.stderr, flush=True)
        os.execv(_venv_python, [str(_venv_python), *sys.orig_argv[1:]])
    sys.exit(f"stages: {sys.executable} has no draftsmith installed. Run `make install` (it "
             f"makes .venv with the library) and then `make repro` or `.venv/bin/dvc repro`; or "
             f"`pip install -e .` into the Python that runs dvc.")
