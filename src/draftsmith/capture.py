"""The target's forward with its aux states captured: what drafter training reads of a target.

Per token: the aux hidden states (the residual stream ENTERING each of `aux_layers`, before any
norm: what vLLM's `aux_hidden_states` collects, `hidden_states + residual` before layer k) and
the final hidden state after the final norm (the target's logits are `final @ lm_head.T`, so
training gets the target's distribution without storing V floats a token).

Captured with forward pre-hooks on the decoder layers, so any decoder-only HF architecture
works (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA...). The hidden stage stores what this
returns (hidden/); online training (train/loop.py) and the reference speculative engine
(speculative.py) call it directly, so neither depends on how the hidden stage writes.

Packed rows put samples end to end with positions that restart per sample: transformers turns
such position ids into a block-diagonal causal mask (flex attention on a GPU skips the masked
blocks; SDPA masks them), so no compute goes to padding and no sample sees another.
"""

from __future__ import annotations

import torch

from draftsmith import packed_attention


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers")
    return layers


@torch.no_grad()
def capture(model, input_ids, attention_mask, aux_layers: list[int], **decoder_kwargs):
    """-> aux (B, T, len(aux_layers) * H) entering those layers, final (B, T, H) after the
    final norm. decoder_kwargs go to the decoder (position ids, a KV cache)."""
    layers = decoder_layers(model)
    seen: dict[int, torch.Tensor] = {}

    def hook(k):
        def pre(_module, args, kwargs):
            seen[k] = args[0] if args else kwargs["hidden_states"]
        return pre

    handles = [layers[k].register_forward_pre_hook(hook(k), with_kwargs=True) for k in aux_layers]
    try:
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  **{"use_cache": False, **decoder_kwargs})
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    # With a device map the layers sit on several GPUs: gather on the last one.
    return torch.cat([seen[k].to(final.device) for k in aux_layers], -1), final


def capture_rows(model, ids, pos, aux_layers: list[int]):
    """Packed rows: ids and pos (B, T), pos restarting at 0 for each sample (and for the
    padding at a row's end). -> aux, final as `capture`, each token seeing its own sample only."""
    if not is_varlen(model):
        return capture(model, ids, None, aux_layers, position_ids=pos)
    B, T = ids.shape
    starts = (pos.reshape(-1) == 0).nonzero()[:, 0].tolist()  # where samples start: one sync
    lengths = [b - a for a, b in zip(starts, [*starts[1:], B * T])]
    with packed_attention.documents(lengths, ids.device):
        aux, final = capture(model, ids.reshape(1, -1), None, aux_layers,
                             position_ids=pos.reshape(1, -1))
    return aux.view(B, T, -1), final.view(B, T, -1)


def capture_flat(model, seqs: list[torch.Tensor], aux_layers: list[int]):
    """Samples end to end in one row, no padding (a model set to packed_attention.NAME).
    -> aux (n, L*H), final (n, H) for their n tokens, in order."""
    device = model.device
    lengths = [len(s) for s in seqs]
    ids = torch.cat(seqs)[None].to(device, non_blocking=True)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device, non_blocking=True)
    with packed_attention.documents(lengths, device):
        aux, final = capture(model, ids, None, aux_layers, position_ids=pos)
    return aux[0], final[0]


def is_varlen(model) -> bool:
    return model.config._attn_implementation == packed_attention.NAME


def set_attention(model, attention: str) -> None:
    """auto: on a GPU the packed varlen attention (packed_attention: one flat row, flash
    attention per sample) for a bf16/fp16 target, flex attention (masked blocks skipped) for
    an fp32 one, or SDPA (masked blocks computed) where the model class takes no flex attention
    (transformers' Kimi-K2.5 wrapper: it refuses it when asked); SDPA on a CPU."""
    if attention == "auto":
        if model.device.type != "cuda":
            attention = "sdpa"
        elif packed_attention.varlen_available(model.device, model.dtype):
            attention = "varlen"
        else:
            attention = "flex_attention" if getattr(model, "_supports_flex_attn", False) \
                else "sdpa"
    if attention == "varlen":
        attention = packed_attention.register()
    model.set_attn_implementation(attention)
