"""The training-time-test attention matches the inference chain, step by step (EAGLE-3 and
EAGLE-3.1, Llama and MLA layers)."""

import pytest
import torch

from draftsmith.drafters.registry import DrafterConfig
from draftsmith.drafters.eagle3 import Eagle3Drafter, ttt_attention


MLA = dict(arch="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5)  # every width different, so a mixed-up split shows
V31 = dict(method="eagle3.1", fc_norm=True, norm_output=True)


def drafter(nh=4, nkv=2, seed=0, **kind):
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, target_hidden_size=24, num_heads=nh,
                      num_kv_heads=nh if kind.get("arch") == "mla" else nkv, head_dim=8,
                      intermediate_size=64, vocab_size=50, draft_vocab_size=20,
                      aux_layers=(2, 4, 5), **kind)
    m = Eagle3Drafter(c).double()
    for p in m.parameters():  # far from the identity-ish init, so errors would show
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("nh, nkv, mla", [(4, 2, {}), (4, 4, {}), (2, 1, {}), (4, 4, MLA),
                                          (3, 3, {**MLA, "q_lora_rank": None}), (4, 2, V31),
                                          (4, 4, {**MLA, **V31})])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_ttt_matches_inference_chain(nh, nkv, mla, steps):
    m = drafter(nh, nkv, **mla)
    T = 9
    aux = torch.randn(1, T, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (1, T + steps))
    train = m(aux, ids, steps)
    for t in range(T):
        chain = m.chain_logits(aux[:, : t + 1], ids, steps)
        for j in range(steps):
            torch.testing.assert_close(train[j][0, t], chain[j], rtol=0, atol=1e-10)


def slow_ttt_attention(q, k0, v0, ks, vs):
    """Reference: for every query position, list its keys explicitly and attend."""
    B, nh, T, hd = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        keys = torch.cat([k0[:, :, : t + 1], *[k[:, :, t: t + 1] for k in ks]], 2)
        vals = torch.cat([v0[:, :, : t + 1], *[v[:, :, t: t + 1] for v in vs]], 2)
        p = torch.softmax(q[:, :, t: t + 1] @ keys.transpose(-1, -2) / hd ** 0.5, -1)
        out[:, :, t: t + 1] = p @ vals
    return out


@pytest.mark.parametrize("j", [0, 1, 4])
def test_ttt_attention_pattern(j):
    torch.manual_seed(1)
    B, nh, T, hd = 2, 3, 6, 4
    q, k0, v0 = (torch.randn(B, nh, T, hd, dtype=torch.double) for _ in range(3))
    ks = [torch.randn(B, nh, T, hd, dtype=torch.double) for _ in range(j)]
    vs = [torch.randn(B, nh, T, hd, dtype=torch.double) for _ in range(j)]
    torch.testing.assert_close(ttt_attention(q, k0, v0, ks, vs),
                               slow_ttt_attention(q, k0, v0, ks, vs), rtol=0, atol=1e-12)


def test_padding_does_not_leak_into_real_positions():
    m = drafter()
    aux = torch.randn(2, 7, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (2, 10))
    doc = torch.zeros(2, 7, dtype=torch.long)
    doc[1, 4:] = -1  # padding
    padded = m(aux, ids, 3, doc=doc)
    alone = m(aux[1:, :4], ids[1:, :4 + 3], 3)
    for j in range(3):
        # Chain t attends to step-0 keys at s <= t only: padding after 4 cannot reach t < 4.
        for t in range(4):
            torch.testing.assert_close(padded[j][1, t], alone[j][0, t], rtol=0, atol=1e-10)


def test_mla_rotary_turns_adjacent_pairs():
    """DeepSeek's rope (vLLM: is_neox_style=False): pair i is (x[2i], x[2i+1]), turned by
    pos * theta^(-2i/d) as a complex number, unlike Llama's halves (x[i], x[i + d/2])."""
    from draftsmith.drafters.layers import rotate, rotate_pairs

    x = torch.randn(2, 3, 5, 8, dtype=torch.double)
    pos = torch.arange(5) + 7
    inv = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.double) / 8)
    turn = torch.polar(torch.ones(5, 4, dtype=torch.double), pos[:, None].double() * inv)
    want = torch.view_as_real(torch.view_as_complex(x.view(2, 3, 5, 4, 2)) * turn).flatten(-2)
    torch.testing.assert_close(rotate_pairs(x, pos, 10000.0), want, rtol=0, atol=1e-6)
    assert not torch.allclose(rotate(x, pos, 10000.0), want, atol=1e-3)
