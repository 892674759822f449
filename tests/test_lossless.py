"""The losslessness check: it passes the reference engine's sampled outputs and fails engines
whose outputs do not follow the target (always accepting drafts, a wrong temperature, noise)."""

from types import SimpleNamespace

import pytest
import torch

from draftsmith import speculative
from draftsmith.benchmark.lossless import check_greedy, check_sampled, ks_uniform, tie_tolerance
from draftsmith.drafters.eagle3 import Eagle3Proposer

from conftest import random_drafter, tiny_llama

V, PROMPTS, NEW = 48, 40, 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, hidden=32, sharpen=6, max_positions=128)


@pytest.fixture(scope="module")
def drafter(target):
    return random_drafter(target, draft_vocab=32)


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
    ref = [speculative.generate(target, Eagle3Proposer(random_drafter(target, V, seed=2)), x, k=2,
                                aux_layers=[1, 2, 3], max_new_tokens=8, eos_id=-1)[0] for x in p]
    assert check_greedy(target, p, ref, ref)["lossless"] is True
    wrong = [ref[0], ref[1], ref[2][:3] + [(ref[2][3] + 1) % V] + ref[2][4:]]
    v = check_greedy(target, p, ref, wrong)
    assert v["lossless"] is False and v["first_different_prompt"] == 2 and v["identical"] == 2


class FixedLogits(torch.nn.Module):
    """A target whose next-token logits are always `row`, in `row`'s dtype: the judge's tie
    rule on exact numbers."""

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.register_buffer("row", row)
        self.dtype, self.device = row.dtype, row.device

    def forward(self, ids):
        return SimpleNamespace(logits=self.row.expand(1, ids.shape[1], -1))


@pytest.mark.parametrize("runner_up, dtype, tie", [
    (20.25, torch.bfloat16, True),    # one bf16 step below 20.375: neighbours, a tie in bf16
    (20.125, torch.bfloat16, False),  # two steps: bf16 resolves it
    (20.25, torch.float32, False),    # the same gap in fp32 (relative 0.006 > 1e-3)
])
def test_greedy_ties_follow_the_targets_dtype(runner_up, dtype, tie):
    """vLLM serving a bf16 target picked the runner-up where the judge's bf16 logits were one
    bf16 step apart (relative gap 0.0061 on the H200): a tie at the precision the target runs
    in, not a speculation error; two steps are not."""
    assert tie_tolerance(torch.bfloat16) == 2 ** -7 and tie_tolerance(torch.float32) == 1e-3
    model = FixedLogits(torch.tensor([20.375, runner_up, 0.0], dtype=dtype))
    v = check_greedy(model, [[2]], reference=[[0, 0]], outputs=[[1, 0]])
    assert v["partings"][0]["position"] == 0
    assert v["lossless"] is tie and v["parted_at_a_tie"] == int(tie) and v["identical"] == 0
