"""pytest-benchmark benchmarks of the training hot paths on the CPU, at the embedded default's
shape (H 128, 4 heads, 2 KV heads, draft vocab 256, 3 TTT steps, 4 rows x 256 tokens).

Not part of `make test` (tests/ is the test path): run `make bench`, or
`.venv/bin/python -m pytest benchmarks/ --benchmark-only`; compare two commits with
`--benchmark-autosave` then `--benchmark-compare`.
"""

import random

import pytest
import torch

from draftsmith.drafters.registry import DrafterConfig
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.batch import Batch
from draftsmith.train.data import pack
from draftsmith.drafters.losses import target_view, ttt_loss, ttt_loss_reference
from draftsmith_kernels.soft_ce import soft_ce_ref

H, V, VD, STEPS, ROWS, T = 128, 1024, 256, 3, 4, 256


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, target_hidden_size=H, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=384, vocab_size=V, draft_vocab_size=VD,
                      aux_layers=(2, 4, 5))
    m = Eagle3Drafter(c)
    draft = torch.randperm(V)[:VD].sort().values
    m.d2t.copy_(draft - torch.arange(VD))
    m.t2d[draft] = True
    rng = random.Random(0)
    doc, pos = torch.full((ROWS, T), -1), torch.zeros(ROWS, T, dtype=torch.long)
    for r in range(ROWS):  # samples of the toy's length mix, packed end to end
        at, d = 0, 0
        while at < T - 40:
            n = min(rng.randint(30, 90), T - at)
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at, d = at + n, d + 1
    batch = Batch(torch.randn(ROWS, T, 3 * H), torch.randn(ROWS, T, H),
                  torch.randint(0, V, (ROWS, T)), torch.rand(ROWS, T) < 0.7, doc, pos)
    head = torch.randn(V, H)
    return m, batch, head, m.d2t + torch.arange(VD)


def test_target_view(benchmark, case):
    m, batch, head, draft_ids = case
    benchmark(target_view, batch, head, draft_ids, m.t2d)


def test_ttt_step_fused_loss(benchmark, case):
    """Forward + backward of the training step as the CPU runs it (reference attention,
    fused lm_head + soft-CE on the kernel's PyTorch reference)."""
    m, batch, head, draft_ids = case
    view = target_view(batch, head, draft_ids, m.t2d)

    def step():
        loss, _ = ttt_loss(m, batch, view, STEPS, [1.0, 0.8, 0.64], "soft_ce")
        loss.backward()

    benchmark(step)


def test_ttt_step_reference_loss(benchmark, case):
    """The same step through the plain reference loss (full logits), for the ratio."""
    m, batch, head, draft_ids = case

    def step():
        loss, _ = ttt_loss_reference(m, batch, head, draft_ids, m.t2d, STEPS, [1.0, 0.8, 0.64],
                                     "soft_ce")
        loss.backward()

    benchmark(step)


def test_soft_ce_reference(benchmark):
    logits, target = torch.randn(4096, VD), torch.randn(4096, VD)
    benchmark(soft_ce_ref, logits, target, torch.rand(4096))


def test_pack_ten_thousand_samples(benchmark):
    rng = random.Random(0)
    lengths = {i: rng.randint(16, 256) for i in range(10_000)}
    rows = benchmark(pack, lengths, 2048, random.Random(1))
    assert sum(len(r) for r in rows) == len(lengths)


def test_rotary_and_projection(benchmark, case):
    m, batch, *_ = case
    x = batch.aux[..., :2 * H].contiguous()  # stands in for [norm(emb); norm(h)]
    benchmark(m.midlayer.self_attn.qkv, x, batch.pos)
