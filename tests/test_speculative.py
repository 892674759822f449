"""The reference speculative engine: exact at greedy, distribution-preserving when sampling."""

import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith import speculative
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.speculative import Eagle3Proposer, TargetProposer

V = 6  # tiny vocab: the sampling test enumerates every 3-token continuation


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the distribution a little so drafts are sometimes right
        model.lm_head.weight.mul_(8)
    return model


def random_drafter(target, draft_vocab=V, seed=1):
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=16, target_hidden_size=16, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=32, vocab_size=V, draft_vocab_size=draft_vocab,
                      aux_layers=(1, 2, 3))
    d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    ids = torch.arange(draft_vocab)  # draft vocab = the first tokens; d2t offsets are 0
    d.t2d[ids] = True
    return d.eval()


def greedy_reference(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_the_targets_own(target, k):
    d = random_drafter(target)
    for prompt in ([1, 2, 3], [4, 0], [5, 5, 5, 1]):
        out, stats = speculative.generate(target, Eagle3Proposer(d), prompt, k=k,
                                          aux_layers=[1, 2, 3], max_new_tokens=20, eos_id=-1)
        assert out == greedy_reference(target, prompt, 20)
        assert stats.rounds > 0


def test_target_as_its_own_drafter_reaches_k_plus_one(target):
    k = 4
    _, stats = speculative.generate(target, TargetProposer(target), [1, 2, 3], k=k,
                                    aux_layers=[1, 2, 3], max_new_tokens=30, eos_id=-1)
    s = stats.summary()
    assert s["acceptance_length"] == k + 1
    assert s["acceptance_rate_per_position"] == [1.0] * k


def exact_joint(model, prompt, n, temperature):
    """Probability of every n-token continuation under plain sampling from the target."""
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n):
            p, ctx = 1.0, list(prompt)
            for tok in seq:
                logits = model(input_ids=torch.tensor([ctx])).logits[0, -1]
                p *= float(torch.softmax(logits.double() / temperature, -1)[tok])
                ctx.append(tok)
            probs[seq] = p
    return probs


def chi_square(model, proposer_factory, temperature, n_samples, seed):
    prompt, n = [1, 2], 3
    exact = exact_joint(model, prompt, n, temperature)
    counts = dict.fromkeys(exact, 0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_samples):
        out, _ = speculative.generate(model, proposer_factory(), prompt, k=2, aux_layers=[1, 2, 3],
                                      max_new_tokens=n, eos_id=-1, temperature=temperature,
                                      gen=gen)
        counts[tuple(out)] += 1
    # Pool cells with small expectation into one, as a chi-square test requires.
    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        e = p * n_samples
        if e < 5:
            pooled_obs += counts[seq]
            pooled_exp += e
        else:
            stat += (counts[seq] - e) ** 2 / e
            df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return stat, df - 1


def test_sampling_preserves_the_target_distribution(target):
    d = random_drafter(target, draft_vocab=4)  # drafts can't even propose tokens 4 and 5
    stat, df = chi_square(target, lambda: Eagle3Proposer(d), 0.8, 3000, seed=0)
    # Chi-square with df degrees of freedom: mean df, sd sqrt(2 df); 5 sd is far in the tail.
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


def test_the_sampling_check_has_teeth(target, monkeypatch):
    """The same check fails an engine that accepts every draft (output follows the drafter)."""
    d = random_drafter(target, draft_vocab=4)
    monkeypatch.setattr(speculative, "_correction", lambda *a: 0)
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: real_rand(*a, **kw) * 0)  # always accept
    stat, df = chi_square(target, lambda: Eagle3Proposer(d), 0.8, 3000, seed=0)
    assert stat > df + 5 * math.sqrt(2 * df)
