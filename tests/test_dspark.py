"""DSpark (drafters/dspark.py): its loss against a plain one-block-at-a-time reference in
float64, and its drafts against the sequential sampling vLLM's DSparkSpeculator does. Its
training on the toy, its reference-engine drafts and its export: test_methods.py, with the
other methods."""

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.config import TrainConfig
from draftsmith.drafters.dflash import joined_attention
from draftsmith.drafters.dspark import DSparkProposer
from draftsmith.drafters.layers import decode_attention
from draftsmith.drafters.registry import METHODS, DrafterConfig, build
from draftsmith.errors import DraftsmithError

from test_methods import MASK, packed_batch

RANK, BLOCK = 6, 3


def dspark_drafter(confidence=True, seed=0):
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, target_hidden_size=24, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=50,
                      aux_layers=(2, 4, 5), method="dspark", num_layers=2, block_size=BLOCK,
                      mask_token_id=MASK, markov_rank=RANK, confidence_head=confidence)
    m = build(c).double()
    for p in m.parameters():  # far from the init (W2 = 0 would hide the Markov head)
        torch.nn.init.normal_(p, std=0.3)
    return m


def block_states(m, aux, ids, a):
    """What an engine computes for anchor a of one sequence: the block [x_a, masks] over the
    context of the positions before a, no mask: the final states of its BLOCK slots."""
    kv = m.context_kv(m.context(aux[:, :a]), torch.arange(a))
    block = torch.cat([ids[0, a:a + 1], torch.full((BLOCK - 1,), MASK)])
    return m.blocks(block[None], a + torch.arange(BLOCK), kv,
                    lambda *qkv: joined_attention(decode_attention, *qkv))[0]


@pytest.mark.parametrize("confidence", [True, False])
def test_dspark_loss_matches_a_plain_reference(confidence):
    """The objective (every block in one forward under the block mask, the whole-vocab terms
    in checkpointed chunks) against one block at a time through the engine path: slot k
    drafts x_{a+k+1} with the Markov bias of x_{a+k}; 0.1 CE + 0.9 |q - p|_1 (p: the target's
    head on its final state at a + k) + BCE of the confidence against 1 - |q - p|_1 / 2, each
    slot weighted exp(-k / 4) while every label up to it is a response token of the sample,
    over the weights' sum. The same loss and gradients, in fp64."""
    m = dspark_drafter(confidence)
    batch = packed_batch()
    cfg = TrainConfig(method="dspark", dflash={"num_layers": 2, "block_size": BLOCK,
                                               "anchors": 12}, dspark={"markov_rank": RANK})
    objective = METHODS["dspark"].objective(cfg, m.config, None, None, None, device="cpu",
                                            dtype=torch.float64, attention="reference",
                                            compile=False)
    objective.chunk = 7  # several chunks, the last one short
    loss, stats = objective(m, batch, seed=3)
    loss.backward()
    fast = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad()

    from draftsmith.drafters.dflash import sample_anchors

    anchors, keep = sample_anchors(batch, 12, 3)
    head, w1, w2 = m.lm_head.weight, m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    total, weights, counted = 0.0, 0.0, [0] * BLOCK
    T = batch.ids.shape[1]
    for b, i in keep.nonzero().tolist():
        a = int(anchors[b, i])
        start = int((batch.doc[b] == batch.doc[b, a]).nonzero()[0, 0])
        h = block_states(m, batch.aux[b:b + 1, start:], batch.ids[b:b + 1, start:], a - start)
        for k in range(BLOCK):
            label = a + k + 1
            if not all(j < T and batch.doc[b, j] == batch.doc[b, a] and batch.loss_mask[b, j]
                       for j in range(a + 1, label + 1)):
                break  # supervision stops at the first label that is not a response token
            prev = w1[batch.ids[b, a + k]]
            logits = h[k] @ head.T + w2 @ prev
            q = torch.softmax(logits, -1)
            p = torch.softmax(batch.final[b, a + k] @ head.T, -1)
            l1 = (q - p).abs().sum()
            term = 0.1 * F.cross_entropy(logits, batch.ids[b, label]) + 0.9 * l1
            if confidence:
                c = m.confidence_head.proj(torch.cat([h[k], prev]))[0]
                term = term + F.binary_cross_entropy_with_logits(
                    c, (1 - l1.detach() / 2).clamp(0, 1))
            w = math.exp(-k / 4.0)
            total, weights = total + w * term, weights + w
            counted[k] += 1
    reference = total / weights
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-12)
    for name, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(fast[name], p.grad, rtol=0, atol=1e-12, msg=name)
    assert stats[:, 2].tolist() == counted and counted[-1] > 0
    assert m.lm_head.weight.grad is None and m.embed_tokens.weight.grad is None  # frozen


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dspark_drafts_each_slot_after_the_one_before(temperature):
    """The proposer drafts BLOCK tokens from one block [last token, BLOCK - 1 masks]; slot i's
    logits are the backbone's plus the Markov bias of the token drafted at slot i - 1 (of the
    last token for slot 0), sampled left to right as vLLM's DSparkSpeculator does: the drafts
    and their distributions."""
    m = dspark_drafter()
    aux = torch.randn(12, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (13,))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    drafts, qs = DSparkProposer(m).propose(aux, ids, BLOCK, temperature, g1)
    h = block_states(m, aux[None], ids[None], 12)
    prev, want = ids[-1], []
    for i in range(BLOCK):
        logits = m.lm_head(h[i]) + m.markov_head.markov_w2(m.markov_head.markov_w1(prev))
        if temperature == 0:
            token = logits.argmax()
        else:
            q = torch.softmax(logits / temperature, -1)
            token = torch.multinomial(q, 1, generator=g2)[0]
            torch.testing.assert_close(qs[i], q, rtol=0, atol=1e-12)
        want.append(token)
        prev = token
    assert drafts.tolist() == torch.stack(want).tolist()
    with pytest.raises(DraftsmithError, match="(?s)blocks of 3.*num_speculative_tokens: 3"):
        METHODS["dspark"].check_k(m.config, 2)
