"""The losslessness check: it passes the reference engine's sampled outputs and fails engines
whose outputs do not follow the target (always accepting drafts, a wrong temperature, noise)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith import speculative
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.lossless import check_greedy, check_sampled, ks_uniform
from draftsmith.speculative import Eagle3Proposer

V, PROMPTS, NEW = 48, 40, 40


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked enough that drafts are sometimes right, like a real LM
        model.lm_head.weight.mul_(6)
    return model


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    c = DrafterConfig(hidden_size=32, target_hidden_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, vocab_size=V, draft_vocab_size=32,
                      aux_layers=(1, 2, 3))
    d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    d.t2d[:32] = True
    return d.eval()


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (5,), generator=g).tolist() for _ in range(PROMPTS)]


def sample(target, drafter, temperature):
    outs = []
    for i, p in enumerate(prompts()):
        gen = torch.Generator().manual_seed(i)
        out, _ = speculative.generate(target, Eagle3Proposer(drafter), p, k=3, aux_layers=[1, 2, 3],
                                      max_new_tokens=NEW, eos_id=-1, temperature=temperature,
                                      gen=gen)
        outs.append(out)
    return outs


def test_reference_engine_is_lossless_when_sampling(target, drafter):
    v = check_sampled(target, prompts(), sample(target, drafter, 0.8), 0.8)
    assert v["lossless"] is True and v["tokens"] == PROMPTS * NEW, v


def test_an_engine_that_accepts_every_draft_is_flagged(target, drafter, monkeypatch):
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: real_rand(*a, **kw) * 0)
    outs = sample(target, drafter, 0.8)
    monkeypatch.undo()
    v = check_sampled(target, prompts(), outs, 0.8)
    assert v["lossless"] is False and v["p_value"] < 1e-6, v


def test_a_wrong_temperature_is_flagged(target, drafter):
    """Outputs sampled at T=1.0 reported as T=0.8: a subtle change the test still sees."""
    v = check_sampled(target, prompts(), sample(target, drafter, 1.0), 0.8)
    assert v["lossless"] is False, v


def test_random_tokens_are_flagged(target):
    g = torch.Generator().manual_seed(5)
    noise = [torch.randint(0, V, (NEW,), generator=g).tolist() for _ in range(PROMPTS)]
    v = check_sampled(target, prompts(), noise, 0.8)
    assert v["lossless"] is False and v["share_in_target_tail_1pct"] > 0.05, v  # 0.01 expected


def test_ks_against_uniform():
    g = torch.Generator().manual_seed(0)
    u = torch.rand(5000, generator=g, dtype=torch.double)
    assert ks_uniform(u)[1] > 0.05
    assert ks_uniform(u ** 1.2)[1] < 1e-4  # a 3% tilt, found in 5,000 values


def test_greedy_check(target):
    p = prompts()[:3]
    ref = [speculative.generate(target, Eagle3Proposer(random_drafter_for(target)), x, k=2,
                                aux_layers=[1, 2, 3], max_new_tokens=8, eos_id=-1)[0] for x in p]
    assert check_greedy(target, p, ref, ref)["lossless"] is True
    wrong = [ref[0], ref[1], ref[2][:3] + [(ref[2][3] + 1) % V] + ref[2][4:]]
    v = check_greedy(target, p, ref, wrong)
    assert v["lossless"] is False and v["first_different_prompt"] == 2 and v["identical"] == 2


def random_drafter_for(target):
    torch.manual_seed(2)
    c = DrafterConfig(hidden_size=32, target_hidden_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, vocab_size=V, draft_vocab_size=V,
                      aux_layers=(1, 2, 3))
    d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    d.t2d[:] = True
    return d.eval()
