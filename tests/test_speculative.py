"""The reference speculative engine: exact at greedy, distribution-preserving when sampling."""

import copy
import itertools
import math

import pytest
import torch

from draftsmith import speculative
from draftsmith.drafters.registry import DrafterConfig
from draftsmith.drafters.eagle3 import Eagle3Drafter, Eagle3Proposer
from draftsmith.drafters.layers import KVCache
from draftsmith.capture import capture
from draftsmith.speculative import SpecStats, TargetProposer

from conftest import random_drafter as tiny_drafter
from conftest import tiny_llama

V = 6  # tiny vocab: the sampling test enumerates every 3-token continuation


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, hidden=16, sharpen=8, max_positions=64)


def random_drafter(target, draft_vocab=V, seed=1):
    return tiny_drafter(target, draft_vocab, seed)


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


@torch.no_grad()
def uncached_generate(model, proposer, prompt_ids, *, k, aux_layers, max_new_tokens, eos_id,
                      temperature, gen):
    """The engine as it was before its caches, kept as their reference: every round the target
    re-reads the whole sequence and the drafter re-prefills all of it (aux of every position)."""
    def target_forward(ids):
        aux, final = capture(model, ids[None], torch.ones(1, len(ids), dtype=torch.long),
                             aux_layers)
        return aux[0], (final @ model.get_output_embeddings().weight.T)[0]

    stats = SpecStats(accepted_at=[0] * k, reached=[0] * k)
    ids = torch.tensor(prompt_ids)
    aux, logits = target_forward(ids)
    out = [int(speculative.pick(logits[-1], temperature, gen)[0])]
    while out[-1] != eos_id and len(out) < max_new_tokens:
        seq = torch.cat([ids, torch.tensor(out)])
        n = len(seq)
        drafts, q = proposer.propose(aux[: n - 1], seq, k, temperature, gen)
        drafts = drafts.tolist()
        aux, logits = target_forward(torch.cat([seq, torch.tensor(drafts)]))
        p_rows = logits[n - 1: n + k]  # row i: target's distribution for the token after i
        emitted = []
        stats.rounds += 1
        stats.drafted += k
        for i, d in enumerate(drafts):
            stats.reached[i] += 1
            if temperature <= 0:
                ok = d == int(p_rows[i].argmax())
            else:
                p = torch.softmax(p_rows[i].double() / temperature, -1)
                ok = bool(torch.rand(1, generator=gen, dtype=torch.double) < p[d] / q[i][d])
            if not ok:
                emitted.append(int(p_rows[i].argmax()) if temperature <= 0
                               else speculative._correction(p, q[i], gen))
                break
            stats.accepted += 1
            stats.accepted_at[i] += 1
            emitted.append(d)
            if d == eos_id:
                break
        else:
            emitted.append(int(speculative.pick(p_rows[k], temperature, gen)[0]))  # bonus
        stats.emitted += len(emitted)
        out += emitted
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out[:max_new_tokens], stats


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [1, 3])
def test_cached_engine_matches_the_uncached_one(target, temperature, k):
    d = random_drafter(target, draft_vocab=4)
    draws = 5 if temperature > 0 else 1
    for prompt, eos in [([1, 2, 3], -1), ([4, 0], 5), ([5, 5, 5, 1], -1)]:
        for seed in range(draws):
            runs = [engine(target, Eagle3Proposer(d), prompt, k=k, aux_layers=[1, 2, 3],
                           max_new_tokens=30, eos_id=eos, temperature=temperature,
                           gen=torch.Generator().manual_seed(seed))
                    for engine in (speculative.generate, uncached_generate)]
            assert runs[0] == runs[1]  # tokens and stats


def test_drafter_cache_across_rounds_matches_a_full_prefill():
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=32, target_hidden_size=24, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=20,
                      aux_layers=(2, 4, 5))
    d = Eagle3Drafter(c).double()
    for p in d.parameters():  # far from the identity-ish init, so errors would show
        torch.nn.init.normal_(p, std=0.3)
    # Positions verified per round (the prompt, then 1..k+1), past the cache's first capacity.
    rounds = [7] + [1, 4, 2, 5, 3] * 15
    aux = torch.randn(1, sum(rounds), 72, dtype=torch.double)
    tokens = torch.randint(0, 50, (1, sum(rounds)))
    cache, n, steps = KVCache(), 0, 4
    for m in rounds:
        chain_tokens = torch.randint(0, 50, (steps,))  # this round's drafts
        feed = lambda j, _: chain_tokens[j]  # noqa: E731
        cached = d.chain(aux[:, n: n + m], tokens[:, n: n + m], steps, feed, cache)
        n += m
        fresh = d.chain(aux[:, :n], tokens[:, :n], steps, feed)
        for a, b in zip(cached, fresh, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert cache.keys.shape[2] > 64  # the buffer grew


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_cuda_matches_the_cpu(target):
    d = random_drafter(target)
    gpu_target = copy.deepcopy(target).cuda()
    gpu_drafter = copy.deepcopy(d).to("cuda", torch.bfloat16)  # as a real drafter would run
    common = dict(k=3, aux_layers=[1, 2, 3], max_new_tokens=20, eos_id=-1)
    for prompt in ([1, 2, 3], [4, 0], [5, 5, 5, 1]):
        cpu, _ = speculative.generate(target, Eagle3Proposer(d), prompt, **common)
        gpu, stats = speculative.generate(gpu_target, Eagle3Proposer(gpu_drafter), prompt,
                                          **common)
        assert gpu == cpu
        assert stats.rounds > 0
    out, stats = speculative.generate(gpu_target, Eagle3Proposer(gpu_drafter), [1, 2],
                                      temperature=0.8, gen=torch.Generator("cuda").manual_seed(0),
                                      **common)
    assert len(out) == 20 and stats.rounds > 0


def test_ratio_standard_error_is_the_delta_method_over_units():
    se = speculative.ratio_standard_error
    assert se([(3, 1)]) is None and se([]) is None  # one unit: no spread to see
    assert se([(6, 2), (9, 3), (3, 1)]) == 0.0  # every unit at the same ratio
    # against a bootstrap over units, on skewed units (long prompts with low acceptance)
    g = torch.Generator().manual_seed(0)
    rounds = torch.randint(5, 60, (40,), generator=g).double()
    emitted = rounds * (1 + 3 * torch.rand(40, generator=g, dtype=torch.double))
    units = list(zip(emitted.tolist(), rounds.tolist()))
    picks = torch.randint(0, 40, (4000, 40), generator=g)
    boot = emitted[picks].sum(1) / rounds[picks].sum(1)
    assert se(units) == pytest.approx(float(boot.std()), rel=0.1)


def test_measure_reports_the_acceptance_lengths_standard_error_over_prompts(target):
    """None spread where every prompt gives the same figure (the target drafting for itself);
    one where prompts differ. That it predicts the spread over seeds at T > 0 is measured on the
    MLA toy (benchmarks/reference_seeds.py: benchmarks/results/reference_seeds_cpu_mla.json)."""
    prompts = [[i % V, (3 * i + 1) % V, (i * i) % V] for i in range(4)]
    run = lambda proposer: speculative.measure(  # noqa: E731
        target, proposer, prompts, k=3, aux_layers=[1, 2, 3], max_new_tokens=12, eos_id=-1,
        temperature=0.8, seed=0, desc="se")[0]
    itself = run(TargetProposer(target))
    assert itself["acceptance_length"] == 4 and itself["acceptance_length_se"] == 0.0
    assert run(Eagle3Proposer(random_drafter(target, draft_vocab=4)))["acceptance_length_se"] > 0
