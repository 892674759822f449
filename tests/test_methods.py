"""Every drafter method (drafters/): the table against the config, each new layer and loss
against a plain fp64 reference, the DFlash training path against the engine path, training on
the toy's data to acceptance in the reference engine, export and validate, and the bad-param
errors. (EAGLE-3.1's TTT against its inference chain: test_drafter.py; served by vLLM:
test_vllm_methods.py.)"""

import ast
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith import export, train
from draftsmith import speculative
from draftsmith.config import BenchmarkConfig, ConfigError, ExportConfig, TrainConfig, load_config
from draftsmith.drafters.registry import METHODS, DrafterConfig, build, method_of_export
from draftsmith.drafters.dflash import (DFlashProposer, block_attention, context_mask, flex_mask,
                                        joined_attention, mask_token_id, sample_anchors)
from draftsmith.drafters.layers import decode_attention
from draftsmith.drafters.options import METHOD_ARCHS, METHOD_ENGINES, METHOD_NAMES
from draftsmith.errors import DraftsmithError
from draftsmith.target_info import read_info
from draftsmith.drafters.batch import Batch
from draftsmith.drafters.losses import LinearCE

from conftest import REPO, tiny_llama

MASK = 7


def test_the_method_table_matches_the_config():
    assert tuple(METHODS) == METHOD_NAMES
    assert {n: tuple(m.architectures) for n, m in METHODS.items()} == METHOD_ARCHS
    assert {n: tuple(m.engine_names) for n, m in METHODS.items()} == METHOD_ENGINES


def test_a_method_lives_in_its_wing():
    """Adding a method touches its module, its entry in registry.METHODS and options.py: no
    code outside drafters/ names a method (as a string, or by its train.<method> section),
    and none imports a method's module; the rest asks the Method."""
    wing = REPO / "src/draftsmith/drafters"
    methods = {m: f"drafters.{mod}" for m, mod in
               (("eagle3", "eagle3"), ("eagle3.1", "eagle3"), ("dflash", "dflash"),
                ("p-eagle", "peagle"), ("dspark", "dspark"))}
    assert set(methods) == set(METHODS)
    named = []
    for f in [*(REPO / "src/draftsmith").rglob("*.py"), *(REPO / "stages").glob("*.py")]:
        if wing in f.parents:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in methods:
                named.append(f"{f.relative_to(REPO)}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in METHODS:
                named.append(f"{f.relative_to(REPO)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and any(
                    node.module.endswith(mod) or any(f"{node.module}.{a.name}".endswith(mod)
                                                     for a in node.names)
                    for mod in methods.values()):
                named.append(f"{f.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not named, named


def dflash_drafter(layers=2, block=4, nh=4, nkv=2, seed=0):
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, target_hidden_size=24, num_heads=nh, num_kv_heads=nkv,
                      head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=50,
                      aux_layers=(2, 4, 5), method="dflash", num_layers=layers,
                      block_size=block, mask_token_id=MASK)
    m = build(c).double()
    for p in m.parameters():  # far from the identity-ish init, so errors would show
        torch.nn.init.normal_(p, std=0.3)
    return m


def engine_logits(m, aux, ids, a, pos0=0):
    """What an engine computes for anchor a of one sequence: the context of positions < a
    (cached keys, any order of arrival), the block [x_a, masks] over all of it, no mask."""
    blk = m.config.block_size
    kv = m.context_kv(m.context(aux[:, :a]), pos0 + torch.arange(a))
    block = torch.cat([ids[0, a:a + 1], torch.full((blk - 1,), MASK)])
    h = m.blocks(block[None], pos0 + a + torch.arange(blk), kv,
                 lambda *qkv: joined_attention(decode_attention, *qkv))
    return m.lm_head(h[0, 1:])


@pytest.mark.parametrize("layers, nh, nkv", [(1, 4, 2), (2, 4, 4), (3, 2, 1)])
def test_dflash_training_path_matches_the_engine_path(layers, nh, nkv):
    """Two samples packed in one row: every anchor's block, drafted in one training forward
    under the block mask, equals the engine's block over that sample's context alone."""
    m = dflash_drafter(layers, nh=nh, nkv=nkv)
    blk, T = 4, 17
    aux = torch.randn(1, T, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (1, T))
    doc = torch.tensor([[0] * 8 + [1] * 9])
    pos = torch.cat([torch.arange(8), torch.arange(9)])[None]
    anchors = torch.tensor([[1, 2, 4, 5, 9, 12, 13]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    N = anchors.shape[1]
    at = anchors[..., None] + torch.arange(blk)
    block = torch.cat([ids[0, anchors[0]][:, None], torch.full((N, blk - 1), MASK)], -1)
    mask = context_mask(anchors, keep, doc, blk)
    h = m.blocks(block.view(1, -1), (pos[0, anchors[0]][:, None] + torch.arange(blk)).view(1, -1),
                 m.context_kv(m.context(aux), pos),
                 lambda q, kc, vc, kb, vb: block_attention(q, kc, vc, kb, vb, mask, blk))
    trained = m.lm_head(h.view(N, blk, -1)[:, 1:])
    for i, a in enumerate(anchors[0].tolist()):
        start = 0 if a < 8 else 8  # the sample's first position in the row
        want = engine_logits(m, aux[:, start:], ids[:, start:], a - start)
        torch.testing.assert_close(trained[i], want, rtol=0, atol=1e-10)
    assert at.max() < T


def test_dflash_proposer_caches_context_across_rounds():
    """The proposer appends each round's verified positions: drafts and their distributions
    equal a fresh proposer's over the whole sequence at once."""
    m = dflash_drafter(2)
    aux = torch.randn(20, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (21,))
    p = DFlashProposer(m)
    n = 6
    p.propose(aux[:n - 1], ids[:n], 3, 0.0, None)
    for n2 in (9, 10, 15):  # rounds that verified 3, 1 and 5 tokens
        g1, g2 = (torch.Generator().manual_seed(n2) for _ in range(2))
        drafts, q = p.propose(aux[n - 1:n2 - 1], ids[:n2], 3, 0.7, g1)
        fresh, q2 = DFlashProposer(m).propose(aux[:n2 - 1], ids[:n2], 3, 0.7, g2)
        assert torch.equal(drafts, fresh)
        torch.testing.assert_close(q, q2, rtol=0, atol=1e-12)
        n = n2


def packed_batch(seed=0, B=2, T=20):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 8 + [1] * 9 + [-1] * 3, [0] * T])
    pos = torch.stack([torch.cat([torch.arange(8), torch.arange(9), torch.zeros(3).long()]),
                       torch.arange(T)])
    mask = (torch.rand(B, T, generator=g) > 0.3) & (doc >= 0)
    return Batch(aux=torch.randn(B, T, 72, generator=g, dtype=torch.double),
                 final=torch.randn(B, T, 32, generator=g, dtype=torch.double),
                 ids=torch.randint(0, 50, (B, T), generator=g), loss_mask=mask, doc=doc, pos=pos)


def assert_same_loss_and_grads(m, loss, fast: dict, reference):
    """The objective's loss and gradients (`fast`, by parameter name) are the reference's,
    whose backward fills m's gradients, in fp64."""
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-12)
    for name, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(fast[name], p.grad, rtol=0, atol=1e-12)


def dpace_weights(ce, counted, alpha):
    """D-PACE's weights for one block's drafted slots, one slot at a time (ModelOpt's
    hf_dflash.py, speculators' losses/utils.py): q~_k = (1 - alpha) exp(-CE_k) + alpha where
    slot k counts (1 where not), C_k their running product, w_k the sum of the counted C_j from
    slot k on, for a counted k; no gradient through any of it."""
    n = len(ce)
    q = [(1 - alpha) * math.exp(-float(ce[k])) + alpha if counted[k] else 1.0 for k in range(n)]
    c = [math.prod(q[:k + 1]) for k in range(n)]
    return [sum(c[j] for j in range(k, n) if counted[j]) if counted[k] else 0.0
            for k in range(n)]


@pytest.mark.parametrize("kind", ["ce", "soft_ce", "d-pace"])
def test_dflash_loss_matches_a_plain_reference(kind):
    """The objective (anchors drawn at random, every block in one forward, the fused chunked
    cross-entropy) against one block at a time through the engine path and F.cross_entropy
    (to the data's token; soft_ce: to the target's distribution, its final state before the
    position through its head; d-pace: to the data's token, each slot weighted by D-PACE from
    the block's own cross-entropies instead of exp(-(k - 1) / gamma)): the same loss and
    gradients, in fp64."""
    m = dflash_drafter(2)
    batch = packed_batch()
    cfg = TrainConfig(method="dflash", dflash={"num_layers": 2, "block_size": 4, "anchors": 12,
                                               "loss": kind, "dpace_alpha": 0.3})
    objective = METHODS["dflash"].objective(cfg, m.config, None, None, None, device="cpu",
                                            dtype=torch.float64, attention="reference",
                                            compile=False)
    loss, stats = objective(m, batch, seed=3)
    loss.backward()
    fast = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad()

    anchors, keep = sample_anchors(batch, 12, 3)
    assert anchors.shape == (2, 12) and not keep[0].all()  # row 0 has too few: filler
    total, weights, counted = 0.0, 0.0, [0, 0, 0]
    for b, i in keep.nonzero().tolist():
        a = int(anchors[b, i])
        assert batch.loss_mask[b, a] and batch.loss_mask[b, a + 1]
        same = (batch.doc[b] == batch.doc[b, a]).nonzero()[:, 0]
        start = int(same[0])
        logits = engine_logits(m, batch.aux[b:b + 1, start:], batch.ids[b:b + 1, start:],
                               a - start)
        ces, counts_here = [], []
        for k in range(1, 4):
            p = a + k
            counts_here.append(bool(p < 20 and batch.doc[b, p] == batch.doc[b, a]
                                    and batch.loss_mask[b, p]))
            if kind == "soft_ce":
                target = torch.softmax(batch.final[b, min(p, 20) - 1] @ m.lm_head.weight.T, -1)
            else:
                target = batch.ids[b, min(p, 19)]
            ces.append(F.cross_entropy(logits[k - 1], target))
        w = (dpace_weights([c.detach() for c in ces], counts_here, 0.3) if kind == "d-pace"
             else [math.exp(-(k - 1) / 4.0) * counts_here[k - 1] for k in range(1, 4)])
        for k in range(3):
            if counts_here[k]:
                total = total + w[k] * ces[k]
                weights += w[k]
                counted[k] += 1
    assert_same_loss_and_grads(m, loss, fast, total / weights)
    assert stats[:, 2].tolist() == counted
    assert m.lm_head.weight.grad is None and m.embed_tokens.weight.grad is None  # frozen


def test_dpace_weights_follow_the_drafts_confidence():
    """D-PACE's point, on the library's weights: a slot after a likely miss weighs less than
    one after a likely hit, the first slot weighs the most (every later slot's continuation
    counts toward it), a slot that does not count weighs 0; and the same as one slot at a
    time on random blocks."""
    from draftsmith.drafters.dflash import dpace_weights as weights

    ce = torch.tensor([[0.1, 0.1, 0.1], [3.0, 0.1, 0.1], [0.1, 0.1, 0.1]], dtype=torch.double)
    counted = torch.tensor([[True] * 3, [True] * 3, [True, False, True]])
    w = weights(ce, counted, 0.5)
    assert w[0, 0] > w[0, 1] > w[0, 2] > 0
    assert w[1, 1] < w[0, 1] and w[1, 2] < w[0, 2] and w[2, 1] == 0
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(5, 7, 6, generator=g, dtype=torch.double) * 4
    counted = torch.rand(5, 7, 6, generator=g) > 0.3
    want = [dpace_weights(ce[i, j], counted[i, j].tolist(), 0.3) for i in range(5)
            for j in range(7)]
    torch.testing.assert_close(weights(ce, counted, 0.3).view(35, 6),
                               torch.tensor(want, dtype=torch.double), rtol=1e-12, atol=0)


def test_anchors_are_response_positions_and_reproducible():
    batch = packed_batch(1)
    a1, k1 = sample_anchors(batch, 8, 5)
    a2, k2 = sample_anchors(batch, 8, 5)
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    assert not torch.equal(sample_anchors(batch, 8, 6)[0], a1)
    for b, i in k1.nonzero().tolist():
        a = int(a1[b, i])
        assert batch.loss_mask[b, a] and batch.loss_mask[b, a + 1]
        assert batch.doc[b, a] == batch.doc[b, a + 1] >= 0
    assert (a1.diff(dim=1) > 0).all()  # ascending, distinct


def test_dflash_flex_mask_is_the_reference_attention():
    """The GPU's block mask over [context ; blocks] and the reference's context mask plus
    per-block attention are the same attention (flex runs unfused on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = packed_batch(2)
    anchors, keep = sample_anchors(batch, 7, 0)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7 * 4, 8)
    kc, vc, kb, vb = (torch.randn(2, 2, n, 8) for n in (20, 20, 28, 28))
    fast = joined_attention(flex_attention, q, kc, vc, kb, vb, enable_gqa=True,
                            block_mask=flex_mask(anchors, keep, batch.doc, 4))
    reference = block_attention(q, kc, vc, kb, vb, context_mask(anchors, keep, batch.doc, 4), 4)
    torch.testing.assert_close(fast, reference)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_linear_ce_matches_autograd(chunk):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=torch.double, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.double)
    labels = torch.randint(0, 40, (2, 9))
    scale = torch.rand(2, 9, dtype=torch.double) * (torch.rand(2, 9) > 0.2)
    loss, ce, agree = LinearCE.apply(x, w, labels, scale, torch.float64, chunk)
    logits = x @ w.T
    ref_ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 9)
    ref = (scale * ref_ce).sum()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ce, ref_ce, rtol=0, atol=1e-12)
    assert torch.equal(agree, logits.argmax(-1) == labels)
    (g,) = torch.autograd.grad(loss, x)
    (g_ref,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


def test_eagle31_switches_change_the_drafter():
    """fc_norm adds one norm per aux state before fc; norm_output carries the normed state
    into the next step: from step 1 on the drafts differ from EAGLE-3's with equal weights."""
    from test_drafter import drafter

    v3, v31 = drafter(), drafter(method="eagle3.1", fc_norm=True, norm_output=True)
    assert len(v31.fc_norm) == 3 and not hasattr(v3, "fc_norm")
    v31.load_state_dict(v3.state_dict(), strict=False)
    for norm in v31.fc_norm:
        norm.weight.data.fill_(1.0)
    aux, ids = torch.randn(1, 5, 72, dtype=torch.double), torch.randint(0, 50, (1, 8))
    # fc_norm: each aux state (24 wide) normed on its own before fc
    chunks = aux.view(1, 5, 3, 24)
    normed = (chunks * (chunks.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()).view(1, 5, 72)
    torch.testing.assert_close(v31.fused(aux), v3.fc(normed))
    # norm_output: with the fused inputs equal, step 0 agrees and step 1 reads norm(h)
    a, b = v3(normed, ids, 3), v31(aux, ids, 3)
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])
    v3.midlayer.hidden_norm.weight.data.fill_(1.0)  # then norm(norm(h)) = norm(h) up to eps...
    v31.midlayer.hidden_norm.weight.data.fill_(1.0)
    v3.norm.weight.data.fill_(1.0)
    v31.norm.weight.data.fill_(1.0)
    # ...and only the residual differs: h (EAGLE-3) against norm(h) (3.1)
    assert not torch.allclose(v3(normed, ids, 3)[1], v31(aux, ids, 3)[1])


def test_dflash_lossless_and_sampling_exact():
    """The reference engine with a DFlash proposer: greedy output is the target's own, and at
    T>0 the output follows the target's distribution (the proposal's q is what it drew from)."""
    import test_speculative as ts

    target = tiny_llama(ts.V, hidden=16, sharpen=8, max_positions=64)
    c = DrafterConfig(hidden_size=16, target_hidden_size=16, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=32, vocab_size=ts.V, draft_vocab_size=ts.V,
                      aux_layers=(1, 2, 3), method="dflash", num_layers=1, block_size=3,
                      mask_token_id=0)
    torch.manual_seed(1)
    d = build(c)
    d.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    d.lm_head.weight.data.copy_(target.get_output_embeddings().weight)
    d.eval()
    for prompt in ([1, 2, 3], [4, 0]):
        out, stats = speculative.generate(target, DFlashProposer(d), prompt, k=2,
                                          aux_layers=[1, 2, 3], max_new_tokens=20, eos_id=-1)
        assert out == ts.greedy_reference(target, prompt, 20) and stats.rounds > 0
    stat, df = ts.chi_square(target, lambda: DFlashProposer(d), 0.8, 3000, seed=0)  # k = 2
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_gpu_dflash_objective_matches_the_fp64_reference(name):
    """The DFlash (and DSpark) loss as the train stage runs it on a GPU (bf16 autocast, its
    layers compiled, compiled flex attention under the block mask, the chunked full-vocab
    terms) against the dense reference in float64, same weights, anchors and packed row: the
    loss and every gradient within bf16's error."""
    import copy

    from test_train_fast import packed_batch as eagle_rows

    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=1024, target_hidden_size=1024, num_heads=8, num_kv_heads=2,
                      head_dim=128, intermediate_size=2048, vocab_size=8000,
                      draft_vocab_size=8000, aux_layers=(2, 4, 5), method=name,
                      num_layers=2, block_size=8, mask_token_id=7, markov_rank=64,
                      confidence_head=name == "dspark")
    m = build(c)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    batch = eagle_rows([512, 300, 200], 1024, dtype=torch.bfloat16, rows=2, ht=1024,
                       vocab=8000).to("cuda")
    cfg = TrainConfig(method=name, dflash={"num_layers": 2, "block_size": 8, "anchors": 64},
                      dspark={"markov_rank": 64})
    method = METHODS[name]

    def run(model, dtype, fast):
        model.zero_grad()
        objective = method.objective(cfg, c, None, None, None, device="cuda", dtype=dtype,
                                     attention="flex" if fast else "reference", compile=fast)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fast):
            loss, stats = objective(model, batch, seed=11)
        loss.backward()
        return loss.double(), stats, {n: p.grad.double() for n, p in model.named_parameters()
                                      if p.grad is not None}

    exact = copy.deepcopy(m).double().cuda()
    want_loss, want_stats, want = run(exact, torch.float64, fast=False)
    fast = m.cuda()
    method.compile(fast)
    loss, stats, grads = run(fast, torch.bfloat16, fast=True)
    assert torch.equal(stats[:, 2], want_stats[:, 2].float())  # the same slots counted
    assert abs(float(loss - want_loss)) < 2e-2 * float(want_loss)
    assert set(grads) == set(want) and "lm_head.weight" not in grads
    for name, g in grads.items():
        rel = (g - want[name]).norm() / want[name].norm()
        assert rel < 3e-2, (name, float(rel))


def test_mask_token_choice(toy_tokenizer):
    class Tok:
        def __init__(self, n, mask=None, pad=None, eos=None):
            self.n, self.mask_token_id, self.pad_token_id, self.eos_token_id = n, mask, pad, eos

        def __len__(self):
            return self.n

    assert mask_token_id(Tok(10, mask=3, pad=1), 12) == 3
    assert mask_token_id(Tok(10, pad=1), 12) == 10  # the first row no token uses
    assert mask_token_id(Tok(12, pad=1, eos=2), 12) == 1
    with pytest.raises(DraftsmithError, match="no mask token"):
        mask_token_id(Tok(12), 12)
    assert mask_token_id(toy_tokenizer, len(toy_tokenizer)) == toy_tokenizer.pad_token_id


# ----------------------------------------------------------------------------- the params


def _params(tmp_path, **train):
    import yaml

    p = yaml.safe_load((REPO / "params.yaml").read_text())
    p["train"].update(train)
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(p))
    return f


def test_a_method_no_engine_serves_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="(?s)method dflash with drafter_arch mla.*"
                                          "drafter_arch: llama"):
        load_config(_params(tmp_path, method="dflash", drafter_arch="mla"))
    with pytest.raises(ConfigError, match="(?s)method p-eagle with drafter_arch mla.*"
                                          "parallel drafting.*drafter_arch: llama"):
        load_config(_params(tmp_path, method="p-eagle", drafter_arch="mla"))
    with pytest.raises(ConfigError, match="(?s)method dspark with drafter_arch mla.*"
                                          "qwen3_dspark.py.*drafter_arch: llama"):
        load_config(_params(tmp_path, method="dspark", drafter_arch="mla"))
    with pytest.raises(ConfigError, match="train.method.*'p-eagle' or 'dspark'"):
        load_config(_params(tmp_path, method="eagle4"))
    for method in ("eagle3", "eagle3.1"):  # both served on the MLA layer
        load_config(_params(tmp_path, method=method, drafter_arch="mla"))


def test_an_engine_that_cannot_serve_the_method_is_refused_at_load(tmp_path):
    f = _params(tmp_path, method="p-eagle")
    with pytest.raises(ConfigError, match="(?s)benchmark.engines has sglang, which cannot serve "
                                          "train.method p-eagle.*parallel drafting.*"
                                          r"benchmark.engines: \[reference, vllm\]"):
        load_config(f, ["benchmark.engines=[reference,sglang]"])
    load_config(f, ["benchmark.engines=[reference,vllm]"])
    load_config(_params(tmp_path, method="dspark", dflash={"block_size": 3}),
                ["benchmark.engines=[reference,sglang]", "target.dtype=bfloat16"])


def test_a_ttt_kernel_asked_for_dflash_is_refused_naming_the_fix(tmp_path):
    """train.attention flash and cudnn run EAGLE's TTT attention; DFlash's anchored blocks
    need flex attention's mask."""
    for kernel in ("flash", "cudnn"):
        with pytest.raises(ConfigError, match=f"(?s)train.attention: {kernel}.*DFlash.*"
                                              "train.attention: auto or flex"):
            load_config(_params(tmp_path, method="dflash", attention=kernel))
        with pytest.raises(ConfigError, match=f"(?s)train.attention: {kernel}.*DSpark.*"
                                              "train.attention: auto or flex"):
            load_config(_params(tmp_path, method="dspark", attention=kernel))
        load_config(_params(tmp_path, method="eagle3.1", attention=kernel))


def test_a_block_the_benchmark_cannot_ask_for_is_refused(tmp_path):
    f = _params(tmp_path, method="dflash", dflash={"block_size": 8})
    with pytest.raises(ConfigError, match="(?s)block_size=8 drafts 7.*num_speculative_tokens=3"
                                          ".*block_size: 4"):
        load_config(f)
    load_config(f, ["benchmark.num_speculative_tokens=7"])
    f = _params(tmp_path, method="dspark", dflash={"block_size": 4})  # every slot drafts
    with pytest.raises(ConfigError, match="(?s)block_size=4 makes DSpark draft 4.*"
                                          "num_speculative_tokens=3.*block_size: 3"):
        load_config(f)
    load_config(f, ["benchmark.num_speculative_tokens=4"])
    with pytest.raises(ConfigError, match="train.dflash.block_siz: unknown key.*block_size"):
        load_config(_params(tmp_path, method="dflash", dflash={"block_siz": 4}))


# ----------------------------------------------------------------------------- the toy's data

SHORT = TrainConfig(steps=60, seq_len=256, batch_size=2, lr=3e-3, ttt_steps=3, eval_samples=16,
                    log_every=5, warmup_steps=5, num_workers=0, save_every=0)
# DFlash starts further off (no head of its own to copy from the target: its states go
# through the target's head) and takes longer to pass the same bar.
STEPS = {"dflash": {"steps": 200},
         "dspark": {"steps": 200, "dflash": {"block_size": 3}, "dspark": {"markov_rank": 16}}}


@pytest.fixture(scope="module")
def trained(request, toy_target, toy_data, tmp_path_factory):
    """A drafter of the method given (indirect parametrization) trained on the toy's data;
    EAGLE-3 itself: test_train_export.py."""
    out = tmp_path_factory.mktemp(request.param)
    cfg = TrainConfig(**{**SHORT.model_dump(), "method": request.param,
                         **STEPS.get(request.param, {})})
    m = train.run(cfg, toy_target, toy_data / "hidden", toy_data / "vocab", out / "drafter",
                  out / "ckpt", out / "curve.csv")
    return request.param, out, m


METHODS_TRAINED = pytest.mark.parametrize("trained", ["eagle3.1", "dflash", "p-eagle", "dspark"],
                                          indirect=True)


@METHODS_TRAINED
def test_each_method_trains_on_the_toy(trained):
    method, out, m = trained
    acc, init = m["eval_accuracy"], m["initial_eval_accuracy"]
    assert m["method"] == method and len(acc) == m["positions"] == 3
    assert acc[0] > init[0] + 0.2 and acc[0] > 0.4, (acc, init)
    saved = set(load_file(out / "drafter" / "drafter.safetensors"))
    assert "embed_tokens.weight" not in saved
    # DFlash and DSpark draft with the target's head
    assert ("lm_head.weight" in saved) == (method not in ("dflash", "dspark"))
    assert json.loads((out / "drafter" / "drafter.json").read_text())["method"] == method


@METHODS_TRAINED
def test_each_method_drafts_in_the_reference_engine(trained, toy_target, toy_data):
    from draftsmith import benchmark

    method, out, _ = trained
    cfg = BenchmarkConfig(num_prompts=8, temperatures=[0.0], max_new_tokens=48)
    m = benchmark.run(cfg, toy_target, out / "drafter", toy_data / "raw")
    assert m["method"] == method
    assert m["results"][0]["lossless"]["lossless"] is True
    assert m["acceptance_length"] > 1.3 * m["random_drafter_acceptance_length"], m


@pytest.mark.parametrize("trained", ["dflash"], indirect=True)
def test_a_dflash_drafter_is_asked_for_its_block(trained, toy_target, toy_data):
    from draftsmith import benchmark

    _, out, _ = trained
    with pytest.raises(DraftsmithError, match="(?s)blocks of 4.*num_speculative_tokens: 3"):
        benchmark.run(BenchmarkConfig(num_speculative_tokens=5), toy_target, out / "drafter",
                      toy_data / "raw")


def _shape(toy_target):
    info = read_info(toy_target)
    return dict(target_num_layers=info.num_layers, target_hidden_size=info.hidden_size,
                target_vocab_size=info.vocab_size)


@METHODS_TRAINED
def test_each_method_exports_what_the_engines_load(trained, toy_target, tmp_path):
    method, out, _ = trained
    m = export.run(ExportConfig(), toy_target, out / "drafter", tmp_path / "export")
    c = json.loads((tmp_path / "export/vllm/config.json").read_text())
    t = load_file(tmp_path / "export/vllm/model.safetensors")
    assert method_of_export(c).name == method
    assert c["draftsmith"]["method"] == method
    if method == "dflash":
        assert c["architectures"] == ["DFlashDraftModel"]
        assert c["dflash_config"] == {"mask_token_id": read_tokenizer_pad(toy_target),
                                      "target_layer_ids": [1, 2, 3]}  # aux [2, 3, 4] - 1
        assert c["draftsmith"]["speculative_method"] == "dflash" and c["block_size"] == 4
        assert "eagle_aux_hidden_state_layer_ids" not in c  # it would override the ids
        assert not {"lm_head.weight", "embed_tokens.weight", "d2t"} & set(t)
        assert "layers.0.self_attn.k_norm.weight" in t
    elif method == "dspark":  # what vLLM's qwen3_dspark.py reads, at the top level
        assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
        assert c["dflash_config"]["mask_token_id"] == read_tokenizer_pad(toy_target)
        assert (c["block_size"], c["markov_rank"], c["markov_head_type"]) == (3, 16, "vanilla")
        assert c["enable_confidence_head"] is c["confidence_head_with_markov"] is True
        assert c["sample_from_anchor"] is True and c["draftsmith"]["num_speculative_tokens"] == 3
        assert t["markov_head.markov_w1.weight"].shape == (c["vocab_size"], 16)
        assert t["confidence_head.proj.weight"].shape == (1, c["hidden_size"] + 16)
        assert not {"lm_head.weight", "embed_tokens.weight", "d2t"} & set(t)
        args = export.speculative_args("vllm", tmp_path / "export/vllm", 3)
        assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "dspark"
        # SGLang 0.5.17's DSPARK: gamma = the block's k, the verify window k + 1
        args = export.speculative_args("sglang", tmp_path / "export/sglang", 3)
        assert args[args.index("--speculative-algorithm") + 1] == "DSPARK"
        assert args[args.index("--speculative-num-draft-tokens") + 1] == "4"
        assert "--speculative-num-steps" not in args
        sgl = json.loads((tmp_path / "export/sglang/config.json").read_text())
        assert m["sglang_aux_layer_ids"] == sgl["dflash_config"]["target_layer_ids"]
        # SGLang sizes the context from it (else from the draft's own layer count)
        assert sgl["num_target_layers"] == _shape(toy_target)["target_num_layers"]
        bad = shutil.copytree(tmp_path / "export/sglang", tmp_path / "no_head_type")
        sgl.pop("markov_head_type")
        (bad / "config.json").write_text(json.dumps(sgl))
        with pytest.raises(DraftsmithError, match="SGLang refuses a DSpark config without"):
            export.validate(bad, **_shape(toy_target))
    elif method == "p-eagle":
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
        assert c["mask_token_id"] == c["pard_token"] == read_tokenizer_pad(toy_target)
        assert t["mask_hidden"].shape == (1, 1, 3 * c["target_hidden_size"])
        assert c["draftsmith"]["depths_trained"] == 3
        args = export.speculative_args("vllm", tmp_path / "export/vllm", 3)
        spec = json.loads(args[args.index("--speculative-config") + 1])
        assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
        assert not (tmp_path / "export/sglang").exists() and m["sglang_aux_layer_ids"] is None
    else:
        assert c["fc_norm"] is True and c["norm_output"] is True
        assert c["draftsmith"]["speculative_method"] == "eagle3"
        assert {"fc_norm.0.weight", "fc_norm.2.weight", "lm_head.weight", "d2t"} <= set(t)
    assert m["vllm_aux_layer_ids"] in ([2, 3, 4], [1, 2, 3])
    for engine in ("vllm",) if method == "p-eagle" else ("vllm", "sglang"):
        export.validate(tmp_path / "export" / engine, **_shape(toy_target))


def read_tokenizer_pad(toy_target):
    from draftsmith.target_info import load_tokenizer

    return load_tokenizer(toy_target).pad_token_id


DFLASH_BREAKS = [  # (the method's export, a break, what validate says)
    ("causal", lambda c, t: c["dflash_config"].update(causal=True), "bidirectional blocks"),
    ("no_mask", lambda c, t: c["dflash_config"].pop("mask_token_id"), "mask_token_id is missing"),
    ("layers", lambda c, t: c["dflash_config"].update(target_layer_ids=[2, 3, 4]),
     "do not match the layers trained on"),
    ("order", lambda c, t: c["dflash_config"].update(target_layer_ids=[3, 2, 1]),
     "not ascending"),
    ("override", lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]),
     "overrides dflash_config.target_layer_ids"),
    ("k_norm", lambda c, t: t.pop("layers.0.self_attn.k_norm.weight"),
     "tensor layers.0.self_attn.k_norm.weight is missing"),
    ("target_layers", lambda c, t: c.update(num_target_layers=2),
     "num_target_layers=2 but the target has"),
    ("layers_count", lambda c, t: c.update(num_hidden_layers=2),
     "tensor layers.1.self_attn.q_proj.weight is missing"),
]
EAGLE31_BREAKS = [
    ("nested", lambda c, t: c["eagle_config"].update(fc_norm=c.pop("fc_norm")),
     "fc_norm is inside eagle_config"),
    ("no_fc_norm_weights", lambda c, t: t.pop("fc_norm.1.weight"),
     "tensor fc_norm.1.weight is missing"),
]


PEAGLE_BREAKS = [
    ("no_mask_hidden", lambda c, t: t.pop("mask_hidden"), "tensor mask_hidden is missing"),
    ("no_mask_token", lambda c, t: (c.pop("mask_token_id"), c.pop("pard_token")),
     "no mask_token_id (or pard_token)"),
]
DSPARK_BREAKS = [
    ("no_rank", lambda c, t: c.pop("markov_rank"), "no top-level markov_rank"),
    ("nested_rank", lambda c, t: c["dflash_config"].update(markov_rank=c.pop("markov_rank")),
     "markov_rank inside dflash_config"),
    ("gated", lambda c, t: c.update(markov_head_type="gated"), "has the vanilla head"),
    ("dflash_layout", lambda c, t: c.update(sample_from_anchor=False),
     "sample_from_anchor: false"),
    ("bonus_anchor", lambda c, t: c.update(dspark_bonus_anchor=True), "dspark_bonus_anchor"),
    ("no_w2", lambda c, t: t.pop("markov_head.markov_w2.weight"),
     "tensor markov_head.markov_w2.weight is missing"),
]
BREAKS = [("dflash", b) for b in DFLASH_BREAKS] + [("eagle3.1", b) for b in EAGLE31_BREAKS] \
    + [("p-eagle", b) for b in PEAGLE_BREAKS] + [("dspark", b) for b in DSPARK_BREAKS]


@pytest.mark.parametrize("trained, name, corrupt, needle", [(m, *b) for m, b in BREAKS],
                         ids=[f"{m}-{b[0]}" for m, b in BREAKS], indirect=["trained"])
def test_a_broken_export_of_each_method_fails_clearly(trained, toy_target, tmp_path, name,
                                                      corrupt, needle):
    _, out, _ = trained
    export.run(ExportConfig(), toy_target, out / "drafter", tmp_path / "export")
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "export/vllm", bad)
    c = json.loads((bad / "config.json").read_text())
    t = load_file(bad / "model.safetensors")
    corrupt(c, t)
    (bad / "config.json").write_text(json.dumps(c))
    save_file(t, bad / "model.safetensors")
    with pytest.raises(DraftsmithError) as e:
        export.validate(bad, **_shape(toy_target))
    assert needle in str(e.value)


@pytest.mark.e2e
def test_the_side_by_side_command_runs_at_toy_size(tmp_path):
    """benchmarks/methods.py (the README's methods table and plot) on the tests' toy, the
    reference engine only: every method's run brings only train, export and benchmark up to
    date after the first, and the table, JSON and plot come out."""
    import os
    import subprocess
    import sys

    from test_pipeline_dvc import SMALL

    sets = [f"{section}.{k}={json.dumps(v)}" for section, values in SMALL.items()
            for k, v in values.items() if not isinstance(v, dict)]
    sets += [f"target.embedded.{k}={v}" for k, v in SMALL["target"]["embedded"].items()]
    cache = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", Path.home() / ".cache/draftsmith"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/methods.py"), "--methods", "eagle3", "dflash",
         "dflash:train.dflash.loss=soft_ce", "--json", str(tmp_path / "m.json"),
         "--plot", str(tmp_path / "m.png"), "--markdown", str(tmp_path / "m.md"),
         "--cache", str(cache / "dvc-cache"), *[a for s in sets for a in ("--set", s)]],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "m.json").read_text())
    runs = {r["run"]: r for r in out["methods"]}
    assert list(runs) == ["eagle3", "dflash", "dflash:train.dflash.loss=soft_ce"]
    assert runs["dflash"]["stages_brought_up_to_date"] == ["train", "export", "benchmark"]
    assert runs["eagle3"]["draft_forwards_per_step"] == 3 == out["k"]
    assert runs["dflash"]["draft_forwards_per_step"] == 1
    assert runs["eagle3"]["draft_cost_in_eagle3_forwards"] > 3  # k forwards and fc
    assert (tmp_path / "m.png").stat().st_size > 1000
    assert (tmp_path / "m.md").read_text().count("\n") == 2 + 3


# ----------------------------------------------------------------------------- P-EAGLE


def peagle_drafter(depths=4, seed=0):
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, target_hidden_size=24, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=20,
                      aux_layers=(2, 4, 5), method="p-eagle", block_size=depths,
                      mask_token_id=MASK)
    m = build(c).double()
    for p in m.parameters():  # far from the identity-ish init, so errors would show
        torch.nn.init.normal_(p, std=0.3)
    return m


def parallel_logits(m, aux, next_ids, depths):
    """P-EAGLE laid out as its paper and vLLM's parallel drafting have it, apart from the TTT
    unroll: every position's depth-0 entry (its token and target state) and every anchor's
    depth 1..D-1 slots (the mask token, fc(mask_hidden)) in one sequence, one dense attention
    where slot (a, d) sees (a', d') iff d' = 0 and a' <= a, or a' = a and d' <= d."""
    T = aux.shape[1]
    entries = [(a, d) for d in range(depths) for a in range(T)]
    emb = m.embed_tokens.weight[[int(next_ids[0, a]) if d == 0 else MASK for a, d in entries]]
    fused, mask_state = m.fused(aux)[0], m.fc(m.mask_hidden.reshape(1, -1))[0]
    h = torch.stack([fused[a] if d == 0 else mask_state for a, d in entries])[None]
    attn = m.midlayer.self_attn
    q, k, v = attn.qkv(m.midlayer.inputs(emb[None], h),
                       torch.tensor([a + d for a, d in entries]))
    nh = q.shape[1]
    k, v = (x.repeat_interleave(nh // x.shape[1], 1) for x in (k, v))
    sees = torch.tensor([[(d2 == 0 and a2 <= a) or (a2 == a and d2 <= d) for a2, d2 in entries]
                         for a, d in entries])
    p = torch.softmax((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~sees, -math.inf),
                      -1)
    logits = m.logits(m.midlayer.finish(p @ v, h))[0]
    return {e: logits[i] for i, e in enumerate(entries)}


@pytest.mark.parametrize("depths", [1, 2, 4])
def test_peagle_training_path_is_the_parallel_forward_and_the_chain(depths):
    """The TTT unroll with P-EAGLE's inputs against the one-sequence parallel layout, and the
    inference chain (what the reference engine drafts with) against both, in fp64."""
    m = peagle_drafter(depths)
    T = 7
    aux = torch.randn(1, T, 72, dtype=torch.double)
    ids = torch.randint(0, 50, (1, T + depths))
    unrolled = m(aux, ids, depths)
    parallel = parallel_logits(m, aux, ids, depths)
    for a in range(T):
        chain = m.chain_logits(aux[:, :a + 1], ids, depths)
        for d in range(depths):
            torch.testing.assert_close(unrolled[d][0, a], parallel[(a, d)], rtol=0, atol=1e-10)
            torch.testing.assert_close(chain[d], parallel[(a, d)], rtol=0, atol=1e-10)
    # the drafts past depth 0 do not depend on the tokens fed: nothing is chained
    other = ids.clone()
    other[0, T:] = (other[0, T:] + 1) % 50
    again = m.chain_logits(aux, other, depths)
    for d in range(depths):
        torch.testing.assert_close(again[d], parallel[(T - 1, d)], rtol=0, atol=1e-10)


def test_cod_draws_chains_a_depth_at_a_time():
    from draftsmith.drafters.peagle import cod_sample

    g = torch.Generator().manual_seed(0)
    T, depths = 60, 5
    counted = [torch.rand(3, T - 1 - d, generator=g) > 0.2 for d in range(depths)]
    drawn = cod_sample(counted, 0.7, 0.2, seed=4)
    assert torch.equal(drawn[0], counted[0])  # depth 0: every counted position
    n = counted[0].sum(1)
    for d in range(1, depths):
        L = counted[d].shape[1]
        cand = drawn[d - 1][:, :L] & counted[d]
        assert not (drawn[d] & ~cand).any()  # a chain drawn at d was drawn at d - 1
        want = torch.minimum(((n - d) * max(0.7 ** d, 0.2)).floor().long(), cand.sum(1))
        assert torch.equal(drawn[d].sum(1), want)
    assert all(torch.equal(a, b) for a, b in zip(drawn, cod_sample(counted, 0.7, 0.2, seed=4)))
    assert not all(torch.equal(a, b) for a, b in zip(drawn, cod_sample(counted, 0.7, 0.2, 5)))


def test_peagle_loss_is_one_mean_over_the_drawn_slots():
    """The objective (COD's draw, the fused chunked soft cross-entropy, one mean over every
    drawn slot) against autograd over full logits on the same draw; evaluation (no gradient)
    counts every slot. fp64."""
    from types import SimpleNamespace

    from draftsmith.drafters.losses import target_view
    from draftsmith.drafters.peagle import cod_sample

    depths = 3
    m = peagle_drafter(depths)
    batch = packed_batch()
    head = torch.randn(50, 32, dtype=torch.double)
    d2t, t2d = torch.zeros(20, dtype=torch.long), torch.arange(50) < 20  # draft ids 0..19
    cfg = TrainConfig(method="p-eagle", ttt_steps=depths,
                      peagle={"down_sample_ratio": 0.6, "down_sample_ratio_min": 0.3})
    objective = METHODS["p-eagle"].objective(cfg, m.config, SimpleNamespace(lm_head=head), d2t,
                                             t2d, device="cpu", dtype=torch.float64,
                                             attention="reference", compile=False)
    loss, stats = objective(m, batch, seed=2)
    loss.backward()
    fast = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad()

    view = target_view(batch, head, torch.arange(20), t2d)
    T = batch.ids.shape[1]
    counted = [view.valid[:, 1 + d:] & (batch.doc[:, :T - 1 - d] == batch.doc[:, 1 + d:])
               for d in range(depths)]
    drawn = cod_sample(counted, 0.6, 0.3, seed=2)
    logits = m(batch.aux, F.pad(batch.ids[:, 1:], (0, depths + 1)), depths, doc=batch.doc,
               pos=batch.pos)
    total, n = 0.0, 0
    for d in range(depths):
        q = torch.softmax(view.logits[:, 1 + d:], -1)
        ce = -(q * torch.log_softmax(logits[d][:, :T - 1 - d], -1)).sum(-1)
        total = total + (ce * drawn[d]).sum()
        n += int(drawn[d].sum())
    assert_same_loss_and_grads(m, loss, fast, total / n)
    assert m.mask_hidden.grad.abs().sum() > 0  # the mask slots train it
    assert stats[:, 2].tolist() == [int(x.sum()) for x in drawn]
    assert stats[2, 2] < stats[0, 2]  # deeper depths drawn thinner
    with torch.no_grad():
        _, every = objective(m, batch, seed=2)
    assert every[:, 2].tolist() == [int(x.sum()) for x in counted]


def test_the_cost_model_counts_p_eagle_as_one_forward():
    """benchmarks/methods.py: P-EAGLE drafts k tokens in one forward (the same FLOPs as
    EAGLE-3's k chained forwards, a third of the weight bytes read at k = 3)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("methods_script", REPO / "benchmarks/methods.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    c = peagle_drafter().config.to_dict()
    pe = script.drafter_costs(c, 3, 2.5)
    e3 = script.drafter_costs({**c, "method": "eagle3"}, 3, 2.5)
    assert pe["forwards"] == 1 and e3["forwards"] == 3 and pe["flops"] == e3["flops"]
    assert pe["bytes"] < e3["bytes"] / 2


def test_the_cost_model_counts_dspark_as_dflash_plus_its_markov_steps():
    """benchmarks/methods.py: DSpark's block of k tokens drafts k (DFlash's k + 1 drafts k), and
    each of its k sequential Markov steps reads W2 (vocab x rank) once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("methods_script", REPO / "benchmarks/methods.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    c = {**dflash_drafter().config.to_dict(), "method": "dspark", "markov_rank": 4}
    ds = script.drafter_costs(c, 3, 2.5)
    df = script.drafter_costs({**c, "method": "dflash", "markov_rank": 0}, 3, 2.5)
    assert ds["forwards"] == df["forwards"] == 1
    assert ds["bytes"] - df["bytes"] == 2 * 3 * 50 * 4  # bf16 W2 (50 x 4), three times
