"""The fast training path (packed rows, flex attention, chunked target, fused loss) against the
plain reference, and the pieces it is built from. CPU tests run in float64 with the PyTorch
reference of the kernel; the GPU tests compare the real fast path (bf16, compiled, CUDA kernel)
with the reference on the same batch."""

import random

import pytest
import torch
import torch.nn.functional as F

from draftsmith.drafters.registry import DrafterConfig
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.batch import Batch
from draftsmith.train.data import pack
from draftsmith.drafters.losses import target_view, ttt_loss, ttt_loss_reference

V, VD, HT = 50, 20, 24
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def drafter(dtype=torch.float64, nh=4, nkv=2, seed=0, **shape):
    torch.manual_seed(seed)
    c = DrafterConfig(**{**dict(hidden_size=32, target_hidden_size=HT, num_heads=nh,
                                num_kv_heads=nkv, head_dim=8, intermediate_size=64,
                                vocab_size=V, draft_vocab_size=VD, aux_layers=(2, 4, 5)),
                         **shape})
    m = Eagle3Drafter(c).to(dtype)
    for p in m.parameters():  # far from the identity-ish init, so errors would show
        torch.nn.init.normal_(p, std=0.3)
    draft = torch.randperm(c.vocab_size)[:c.draft_vocab_size].sort().values
    m.d2t.copy_(draft - torch.arange(c.draft_vocab_size))
    m.t2d.zero_()
    m.t2d[draft] = True
    return m


def packed_batch(lengths, seq_len, dtype=torch.float64, rows=1, seed=1, ht=HT, vocab=V):
    """`rows` rows, each packing samples of `lengths` end to end, padding after."""
    g = torch.Generator().manual_seed(seed)
    B, T = rows, seq_len
    doc = torch.full((B, T), -1)
    pos = torch.zeros(B, T, dtype=torch.long)
    for r in range(B):
        at = 0
        for d, n in enumerate(lengths):
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at += n
    return Batch(aux=torch.randn(B, T, 3 * ht, generator=g, dtype=dtype),
                 final=torch.randn(B, T, ht, generator=g, dtype=dtype) * 3,
                 ids=torch.randint(0, vocab, (B, T), generator=g),
                 loss_mask=torch.rand(B, T, generator=g) < 0.8, doc=doc, pos=pos)


def one_sample(batch: Batch, r: int, d: int) -> Batch:
    keep = batch.doc[r] == d
    return Batch(batch.aux[r:r + 1, keep], batch.final[r:r + 1, keep], batch.ids[r:r + 1, keep],
                 batch.loss_mask[r:r + 1, keep], torch.zeros(1, int(keep.sum()), dtype=torch.long),
                 torch.arange(int(keep.sum()))[None])


def head_for(model, dtype=torch.float64, seed=2, ht=HT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(model.config.vocab_size, ht, generator=g, dtype=dtype)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_rows_train_each_sample_as_if_alone():
    """Document mask + per-document positions: a sample packed behind others gets exactly the
    per-step logits it gets alone."""
    m = drafter()
    batch = packed_batch([5, 9, 4], 20)
    steps = 3
    packed = m(batch.aux, F.pad(batch.ids[:, 1:], (0, steps + 1)), steps, doc=batch.doc,
               pos=batch.pos)
    for d in range(3):
        alone = one_sample(batch, 0, d)
        ref = m(alone.aux, F.pad(alone.ids[:, 1:], (0, steps + 1)), steps)
        at = (batch.doc[0] == d).nonzero()[:, 0]
        for j in range(steps):
            # chains whose inputs stay inside the sample (the rest are never counted)
            inside = len(at) - 1 - j
            torch.testing.assert_close(packed[j][0, at[:inside]], ref[j][0, :inside],
                                       rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["soft_ce", "kl"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("chunk", [7, 16])  # 7: a group per row; 16: two rows a group
def test_fused_loss_matches_reference(kind, rows, chunk):
    """Chunked target, fused linear + soft-CE (the kernel's PyTorch reference on the CPU)
    against full logits + autograd: loss, per-step stats and every gradient, in float64."""
    m = drafter()
    batch = packed_batch([7, 3, 12, 6], 31, rows=rows)
    head = head_for(m)
    draft_ids = m.d2t + torch.arange(VD)
    steps, weights = 4, [1.0, 0.8, 0.64, 0.512]
    ref_loss, ref_stats = ttt_loss_reference(m, batch, head, draft_ids, m.t2d, steps, weights,
                                             kind)
    ref_loss.backward()
    ref_grads = _grads(m)
    m.zero_grad()
    view = target_view(batch, head, draft_ids, m.t2d, chunk=5)  # several chunks
    loss, stats = ttt_loss(m, batch, view, steps, weights, kind, dtype=torch.float64,
                           chunk=chunk)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stats, ref_stats, rtol=1e-6, atol=0)  # fp32 metrics
    assert stats[:, 2].min() > 0  # every step counted positions: the test tests something
    for name, g in _grads(m).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)


MLA = dict(arch="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5)


@pytest.mark.parametrize("shape", [dict(nh=4, nkv=1), dict(nh=4, nkv=4, **MLA)],
                         ids=["gqa", "mla"])
def test_flex_attention_forward_matches_reference_on_cpu(shape):
    """The flex path's mask and log-sum-exp merge (forward; PyTorch has no flex backward on
    the CPU, the GPU test below covers gradients); MLA's values narrower than its keys."""
    from draftsmith.drafters.ttt_flex import document_block_mask, ttt_attention_flex
    from draftsmith.drafters.ttt_kernels import fixed_width

    m = drafter(**shape)
    batch = packed_batch([40, 17, 60], 130, rows=2)
    mask = document_block_mask(batch.doc)
    next_ids = F.pad(batch.ids[:, 1:], (0, 5))

    def flex(q, k0, v0, ks, vs, valid=None):
        return ttt_attention_flex(q, k0, v0, ks, vs, mask, valid)

    with torch.no_grad():
        ref = m.unroll(batch.aux, next_ids, 4, doc=batch.doc, pos=batch.pos)
        fast = m.unroll(batch.aux, next_ids, 4, doc=batch.doc, pos=batch.pos, attend=flex)
        fixed = m.unroll(batch.aux, next_ids, 4, doc=batch.doc, pos=batch.pos,
                         attend=fixed_width(flex, 4, "cpu"))
    real = batch.doc >= 0
    for a, b, c in zip(ref, fast, fixed):
        torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-10)
        assert torch.equal(b, c)  # the padded keys add exact zeros


def _diagonal_case(nh, nkv, hd, hd_v, j, doc, dtype=torch.float64, device="cpu"):
    """Random q, step-0 k/v and j diagonal k/v for a batch of documents `doc`, with grads."""
    g = torch.Generator(device=device).manual_seed(0)
    B, T = doc.shape

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype, device=device).requires_grad_()

    return (leaf(B, nh, T, hd), leaf(B, nkv, T, hd), leaf(B, nkv, T, hd_v),
            [leaf(B, nkv, T, hd) for _ in range(j)], [leaf(B, nkv, T, hd_v) for _ in range(j)])


@pytest.mark.parametrize("fixed", [False, True], ids=["", "fixed_width"])
@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("heads", [(4, 2, 8, 8), (4, 1, 8, 8), (4, 4, 10, 5)],
                         ids=["gqa", "mqa", "mla"])
def test_a_flash_style_kernel_gives_the_ttt_attention_and_its_gradients(heads, j, fixed):
    """ttt_kernels: step-0 keys through a kernel that takes no gradient of its log-sum-exp
    (the interface of torch's flash and cuDNN kernels, in PyTorch), its backward called with
    the merged output and log-sum-exp: the dense reference's output and the gradients of q and
    of every key and value, in float64, over packed rows with padding; also with the diagonal
    keys padded to a fixed number (fixed_width: what the compiled path sees)."""
    from draftsmith.drafters.eagle3 import ttt_attention
    from draftsmith.drafters.ttt_kernels import KernelAttention, fixed_width

    doc = packed_batch([5, 9, 3], 20, rows=2).doc
    doc[1] = 0  # a row that is one document
    q, k0, v0, ks, vs = _diagonal_case(*heads, j, doc)
    leaves = [q, k0, v0, *ks, *vs]
    want = ttt_attention(q, k0, v0, ks, vs, doc)
    attend = KernelAttention("reference").for_documents(doc)
    got = (fixed_width(attend, 5, "cpu") if fixed else attend)(q, k0, v0, ks, vs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    probe = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * probe).sum(), leaves),
                    torch.autograd.grad((want * probe).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class _CudnnOnTheCpu:
    """aten's two cuDNN attention ops as the CPU can run them (the PyTorch reference), with
    cuDNN's output layout (heads strided, the query axis outer); `grouped`: whether it takes
    fewer K/V heads than query heads ("yes", "no", "forward only"), raising where it does not,
    as a cuDNN without them would."""

    def __init__(self, grouped: str):
        self.grouped, self.calls = grouped, []

    def _check(self, q, k, backward=False):
        if k.shape[1] != q.shape[1] and self.grouped in ("no", "forward only" if backward else ""):
            raise RuntimeError("cuDNN: heads of q and k differ")
        self.calls.append(k.shape[1])

    def forward(self, q, k, v, bias, stats, p, causal, debug, scale):
        from draftsmith.drafters.ttt_kernels import ReferenceKernel, Segments

        self._check(q, k)
        doc = torch.zeros(q.shape[0], q.shape[2], dtype=torch.long)
        o, lse = ReferenceKernel().forward(q, k, v, Segments.of(doc))
        return o.transpose(1, 2).contiguous().transpose(1, 2), lse[..., None], None

    def backward(self, dout, q, k, v, out, lse, *rest, scale):
        from draftsmith.drafters.ttt_kernels import ReferenceKernel, Segments

        self._check(q, k, backward=True)
        doc = torch.zeros(q.shape[0], q.shape[2], dtype=torch.long)
        dq, dk, dv = ReferenceKernel().backward(dout, q, k, v, out, lse[..., 0], Segments.of(doc))
        return dq.transpose(1, 2).contiguous().transpose(1, 2), dk, dv


@pytest.mark.parametrize("grouped", ["yes", "no", "forward only"])
@pytest.mark.parametrize("whole_rows", [True, False], ids=["whole_rows", "packed"])
def test_the_cudnn_path_on_a_cpu_stand_in_for_its_kernel(monkeypatch, whole_rows, grouped):
    """CudnnKernel's own code (rows run at once or a document at a time, the kernel's tensors
    kept as they come, grouped K/V heads passed as they are or, where refused, repeated and
    their gradients summed) around aten's cuDNN ops replaced by the PyTorch reference: the
    dense TTT attention's output and gradients in float64. The GPU tests run the real kernel."""
    import torch.distributed.tensor  # noqa: F401  (reads the aten ops when first imported)

    from draftsmith.drafters.eagle3 import ttt_attention
    from draftsmith.drafters.ttt_kernels import KernelAttention

    fake = _CudnnOnTheCpu(grouped)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake.forward)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward",
                        fake.backward)
    doc = (torch.zeros(2, 16, dtype=torch.long) if whole_rows
           else packed_batch([6, 7], 16, rows=2).doc)
    attention = KernelAttention("cudnn")
    q, k0, v0, ks, vs = _diagonal_case(4, 2, 8, 6, 2, doc)
    got = attention.for_documents(doc)(q, k0, v0, ks, vs)
    want = ttt_attention(q, k0, v0, ks, vs, doc)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    probe, leaves = torch.randn_like(want), [q, k0, v0, *ks, *vs]
    for a, b in zip(torch.autograd.grad((got * probe).sum(), leaves),
                    torch.autograd.grad((want * probe).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert attention.kernel.gqa is (grouped == "yes")
    runs = 1 if whole_rows else 6  # 2 rows x (2 documents + padding)
    assert fake.calls[-runs:] == [2 if grouped == "yes" else 4] * runs


@pytest.mark.parametrize("shape", [dict(nh=4, nkv=2), dict(nh=4, nkv=4, **MLA)],
                         ids=["gqa", "mla"])
def test_the_kernel_path_trains_the_drafter_as_the_reference_does(shape):
    """The TTT objective with train.attention set to a kernel (here the kernels' PyTorch
    reference, the CPU stand-in for flash and cuDNN): the same loss and gradient for every
    weight as the dense reference, in float64 (MLA: rope keys shared by the heads)."""
    from draftsmith.config import TrainConfig
    from draftsmith.drafters.eagle3 import TTTObjective
    from draftsmith.drafters.ttt_kernels import ReferenceKernel

    m = drafter(**shape)
    batch = packed_batch([40, 17, 30], 90, rows=2)
    head, draft_ids = head_for(m), m.d2t + torch.arange(VD)
    cfg = TrainConfig(ttt_steps=4)
    grads = []
    for attention in ("reference", "flash"):
        objective = TTTObjective(cfg, head, draft_ids, m.t2d, dtype=torch.float64,
                                 attention=attention, compile=False)
        if attention == "flash":  # its path, the CUDA kernel swapped for the reference
            objective.attend.kernel = ReferenceKernel()
        loss, _ = objective(m, batch, seed=0)
        loss.backward()
        grads.append((loss.detach(), _grads(m)))
        m.zero_grad()
    (want, want_grads), (loss, got_grads) = grads
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert set(got_grads) == set(want_grads)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("attention", ["flex", "flash"])
def test_the_compiled_ttt_attention_compiles_as_often_as_it_should(monkeypatch, attention):
    """train.compile, counted with dynamo's own counter over two training steps (the second
    compiles nothing). flex: its graphs take minutes to compile, so it sees the same signature
    at every TTT step after the first (fixed_width): its forward (the CPU has no flex
    backward) compiles twice, one graph without diagonal keys and one with. A kernel (flash,
    its kernel swapped for the PyTorch reference): the element-wise merge and its backward,
    once per number of diagonal keys (steps - 1 each), no padded keys."""
    from torch._dynamo.testing import CompileCounter

    from draftsmith.config import TrainConfig
    from draftsmith.drafters.eagle3 import TTTObjective
    from draftsmith.drafters.ttt_kernels import ReferenceKernel

    counter, compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, backend=counter))
    m = drafter()
    batch = packed_batch([20, 15], 40)
    steps = 5
    objective = TTTObjective(TrainConfig(ttt_steps=steps), head_for(m), m.d2t + torch.arange(VD),
                             m.t2d, dtype=torch.float64, attention=attention, compile=True)
    if attention == "flash":
        objective.attend.kernel = ReferenceKernel()  # the CUDA kernel's stand-in on the CPU
    torch._dynamo.reset()
    for seed in range(2):  # a second step compiles nothing
        with torch.set_grad_enabled(attention != "flex"):
            loss, _ = objective(m, batch, seed=seed)
        if loss.requires_grad:
            loss.backward()
    assert counter.frame_count == (2 if attention == "flex" else 2 * (steps - 1)), \
        counter.frame_count


def test_target_view_never_needs_the_whole_vocab_at_once():
    m = drafter()
    batch = packed_batch([9, 9], 20, rows=2)
    head = head_for(m)
    draft_ids = m.d2t + torch.arange(VD)
    a = target_view(batch, head, draft_ids, m.t2d, chunk=3)
    b = target_view(batch, head, draft_ids, m.t2d, chunk=10_000)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-12, atol=1e-12)
    assert torch.equal(a.valid, b.valid)
    assert not a.valid[batch.doc < 0].any()


def test_pack_fits_every_sample_once_within_the_budget():
    rng = random.Random(0)
    lengths = {i: rng.randint(1, 100) for i in range(500)}
    rows = pack(lengths, 128, random.Random(1))
    assert sorted(i for r in rows for i in r) == sorted(lengths)
    assert all(sum(lengths[i] for i in r) <= 128 for r in rows)
    used = sum(lengths.values()) / (128 * len(rows))
    assert used > 0.9, used  # rows are nearly full: little compute on padding
    assert rows == pack(lengths, 128, random.Random(1))  # resumable: same seed, same rows


# ----------------------------------------------------------------------------- GPU


KIMI_MLA = dict(arch="mla", q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)  # Kimi-K2's head widths, a smaller q latent


def _gpu_case(T, nh=32, nkv=8, hd=128, H=4096, I=14336, Vd=32000, seed=0, **mla):
    """An 8B-shaped drafter (fp32 master weights) and one packed row on the GPU."""
    torch.manual_seed(seed)
    m = drafter(torch.float32, nh=nh, nkv=nkv, seed=seed, hidden_size=H,
                target_hidden_size=H, head_dim=hd, intermediate_size=I, vocab_size=2 * Vd,
                draft_vocab_size=Vd, **mla)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    lengths = [T // 2, T // 4, T // 4 - 3]
    batch = packed_batch(lengths, T, dtype=torch.bfloat16, ht=H, vocab=2 * Vd)
    return m.cuda(), batch.to("cuda"), head_for(m, torch.bfloat16, ht=H).cuda()


def _gpu_attend(attention: str, compile: bool, doc, steps: int = 7):
    """The train stage's TTT attention on the GPU for these documents: flex or a kernel,
    compiled as TTTObjective compiles it (flex with fixed_width) when asked."""
    from draftsmith.drafters.ttt_flex import FlexAttention
    from draftsmith.drafters.ttt_kernels import KernelAttention, fixed_width

    kind = FlexAttention(compile) if attention == "flex" else KernelAttention(attention, compile)
    attend = kind.for_documents(doc)
    return fixed_width(attend, steps, doc.device) if compile and kind.fixed_width else attend


GPU_ATTENTIONS = ["flex", "flash", "cudnn"]


@cuda
@pytest.mark.parametrize("attention", GPU_ATTENTIONS)
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_gpu_fast_path_matches_reference_in_bf16(compile, arch, attention):
    """Same batch, same weights: the TTT attention on flex (or torch's flash, or cuDNN) + CUDA
    soft-CE kernel under bf16 autocast vs the dense reference under bf16 autocast. Loss and
    gradients agree within bf16 rounding."""
    mla = KIMI_MLA if arch == "mla" else {}
    m, batch, head = _gpu_case(1024, H=1024, I=2048, nh=8, nkv=8 if mla else 2, Vd=4000, **mla)
    draft_ids = m.d2t + torch.arange(len(m.d2t), device="cuda")
    steps, weights = 7, [0.8 ** j for j in range(7)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss, ref_stats = ttt_loss_reference(m, batch, head, draft_ids, m.t2d, steps,
                                                 weights, "soft_ce")
    ref_loss.backward()
    ref = _grads(m)
    m.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        view = target_view(batch, head, draft_ids, m.t2d)
        loss, stats = ttt_loss(m, batch, view, steps, weights, "soft_ce",
                               attend=_gpu_attend(attention, compile, batch.doc),
                               dtype=torch.bfloat16)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert torch.equal(stats[:, 2], ref_stats[:, 2])  # the same positions counted
    for name, g in _grads(m).items():
        rel = (g - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, float(rel))


@cuda
@pytest.mark.parametrize("attention", GPU_ATTENTIONS)
@pytest.mark.parametrize("arch, method", [("llama", "eagle3"), ("mla", "eagle3"),
                                          ("llama", "eagle3.1"), ("mla", "eagle3.1")])
def test_gpu_bf16_layer_matches_the_fp64_reference(arch, method, attention):
    """The drafter layer, grouped-query or MLA, EAGLE-3 or 3.1 (normed aux states and carried
    states), as the train stage runs it on a GPU (bf16 autocast, the TTT attention compiled
    on flex or on torch's flash or cuDNN kernel, values narrower than keys for MLA) against
    the dense reference in float64, same weights and packed row: every TTT step's states and
    every gradient of a fixed random projection of them within bf16's error. (On the CPU, bf16 autocast with the reference attention lands at
    0.3-0.7% on the states, < 1% on gradients.)"""
    import copy

    mla = KIMI_MLA if arch == "mla" else {}
    v31 = dict(method=method, fc_norm=True, norm_output=True) if method == "eagle3.1" else {}
    m, batch, _ = _gpu_case(1024, H=1024, I=2048, nh=8, nkv=8 if mla else 2, Vd=4000, **mla,
                            **v31)
    steps, T = 7, batch.ids.shape[1]
    next_ids = F.pad(batch.ids[:, 1:], (0, steps + 1))
    g = torch.Generator(device="cuda").manual_seed(3)
    probe = [torch.randn(1, T, 1024, device="cuda", generator=g) for _ in range(steps)]
    real = batch.doc >= 0
    attend = _gpu_attend(attention, True, batch.doc)

    def run(model, aux, fast: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fast):
            states = model.unroll(aux, next_ids, steps, doc=batch.doc, pos=batch.pos,
                                  attend=attend if fast else None)
        sum((h[real].double() * r[real].double()).sum() for h, r in zip(states, probe)).backward()
        return [h.detach().double()[real] for h in states], _grads(model)

    exact = copy.deepcopy(m).double()
    want_states, want_grads = run(exact, batch.aux.double(), fast=False)
    states, grads = run(m, batch.aux, fast=True)
    for j, (h, ref) in enumerate(zip(states, want_states)):
        rel = (h - ref).norm() / ref.norm()
        assert rel < 2e-2, (j, float(rel))
    assert set(grads) == set(want_grads)
    for name, grad in grads.items():
        rel = (grad.double() - want_grads[name]).norm() / want_grads[name].norm()
        assert rel < 3e-2, (name, float(rel))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_bf16_working_copy_carries_autocast_gradients_to_fp32_master_weights(device):
    """bf16 (on the CPU with the reference attention; on a GPU the train stage's whole path,
    flex attention and compile included): the step computes with a bf16 copy, yet the fp32
    master weights get the gradients plain autocast over them gives (dense reference attention),
    within bf16 rounding; after the optimizer step the copy holds the new weights."""
    import copy

    from draftsmith.config import TrainConfig
    from draftsmith.target_info import TargetHead
    from draftsmith.train.loop import Runtime, Trainer

    m = drafter(torch.float32, head_dim=16)  # compiled flex attention needs >= 16
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.embed_tokens.to(torch.bfloat16)
    m = m.to(device)
    ref = copy.deepcopy(m)
    batch = packed_batch([9, 7], 20, dtype=torch.bfloat16).to(device)
    head = head_for(m, torch.bfloat16).to(device)
    cfg = TrainConfig(ttt_steps=3, seq_len=20, batch_size=1, device=device, bf16=True,
                      compile=device == "cuda")
    rt = Runtime.resolve(cfg)
    assert rt.dtype == torch.bfloat16
    draft_ids = ref.d2t + torch.arange(len(ref.d2t), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        view = target_view(batch, head, draft_ids, ref.t2d)
        ref_loss, _ = ttt_loss(ref, batch, view, 3, [1.0, 0.8, 0.64], "soft_ce",
                               dtype=torch.bfloat16)
    ref_loss.backward()

    trainer = Trainer(cfg, rt, m, TargetHead(None, None, head, None))
    work = trainer.compute
    assert work is not m and work.embed_tokens.weight is m.embed_tokens.weight  # shared
    loss, _ = trainer.loss(batch, seed=0)
    loss.backward()
    trainer.working.grads_to_master()
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    for (name, p), r in zip(m.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            continue
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert all(w.grad is None for w in work.parameters())
        rel = (p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, float(rel))
    before = [p.detach().clone() for p in m.trainable_parameters()]
    trainer.opt.step()
    trainer.working.weights_from_master()
    for b, p, w in zip(before, m.trainable_parameters(), work.trainable_parameters()):
        assert not torch.equal(b, p)  # the master moved ...
        assert torch.equal(w, p.to(torch.bfloat16))  # ... and the copy with it


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping, and a norm under the limit
def test_clipping_inside_the_optimizer_equals_clip_then_step(device, max_norm):
    """On a GPU the fused AdamW applies the clip factor as its grad_scale; the weights must be
    those of clip_grad_norm_ followed by the step (on the CPU it is that, literally)."""
    from draftsmith.train.precision import clip_in_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(37, 5), (11,), (3, 3)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = device == "cuda"
    opts = [torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
            for ps in (params, twins)]
    for step in range(3):
        grads = [torch.randn_like(p) * (step + 1) for p in params]
        for ps in (params, twins):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        clip_in_optimizer(opts[0], params, max_norm)
        torch.nn.utils.clip_grad_norm_(twins, max_norm)
        opts[1].step()
        assert not hasattr(opts[0], "grad_scale")  # never left behind for the next step
        for p, t in zip(params, twins):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_runtime_refuses_impossible_devices_before_any_work(monkeypatch):
    from draftsmith.config import TrainConfig
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.loop import Runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DraftsmithError, match="no GPU is visible"):
        Runtime.resolve(TrainConfig(device="cuda"))
    with pytest.raises(DraftsmithError, match="flex needs a GPU"):
        Runtime.resolve(TrainConfig(attention="flex"))
    with pytest.raises(DraftsmithError, match="cudnn needs a GPU.*CUDA kernel"):
        Runtime.resolve(TrainConfig(attention="cudnn"))
    rt = Runtime.resolve(TrainConfig())  # auto on a CPU machine: the embedded default's path
    assert (rt.device.type, rt.dtype, rt.attention, rt.compile) == \
        ("cpu", torch.float32, "reference", False)


@pytest.mark.parametrize("method, capability, cudnn, want", [
    ("eagle3", None, False, "reference"),  # the CPU
    ("eagle3", (9, 0), True, "cudnn"),  # Hopper: measured fastest for both layers
    ("eagle3.1", (9, 0), True, "cudnn"),
    ("dflash", (9, 0), True, "flex"),  # its anchors' mask: flex only
    ("eagle3", (9, 0), False, "flex"),  # a torch without cuDNN
    ("eagle3", (8, 0), True, "flex"),  # not measured off Hopper
    ("eagle3", (10, 0), True, "flex"),
])
def test_auto_attention_is_the_kernel_measured_fastest_where_it_was_measured(
        method, capability, cudnn, want):
    from draftsmith.train.loop import auto_attention

    assert auto_attention(method, capability, cudnn) == want


def test_the_gpu_benchmark_script_runs_at_toy_size(tmp_path):
    """benchmarks/train_ttt.py keeps working between GPU runs: its toy preset on the CPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_ttt.py"
    subprocess.run([sys.executable, str(script), "--preset", "toy", "--device", "cpu",
                    "--lengths", "64", "--iters", "1", "--json", str(tmp_path / "r.json"),
                    "--kinds", "naive", "naive_bf16", "reference", "fast",
                    "--archs", "llama", "mla", "--methods", "eagle3", "eagle3.1", "dflash",
                    "--docs", "2"],
                   check=True, capture_output=True, timeout=600)
    out = json.loads((tmp_path / "r.json").read_text())
    eagle3 = {("eagle3", a, k) for a in ("llama", "mla")
              for k in ("naive", "naive_bf16", "reference", "fast")}
    others = {("eagle3.1", "llama", "fast"), ("eagle3.1", "mla", "fast"),
              ("dflash", "llama", "fast")}  # DFlash: no MLA layer (no engine serves it)
    assert {(r["method"], r["arch"], r["kind"]) for r in out["results"]} == eagle3 | others
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["docs"] == 2
               for r in out["results"])


def test_the_specforge_comparison_script_runs_at_toy_size(tmp_path):
    """benchmarks/specforge_step.py keeps working between GPU runs: our side at toy size on the
    CPU, each case in a process of its own (SpecForge's side needs its wheel, which the suite
    does not install: run by hand, see the script's docstring)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "specforge_step.py"
    subprocess.run([sys.executable, str(script), "--preset", "toy", "--device", "cpu",
                    "--impls", "ours", "--lengths", "64", "128", "--iters", "1",
                    "--json", str(tmp_path / "r.json")],
                   check=True, capture_output=True, timeout=600)
    out = json.loads((tmp_path / "r.json").read_text())
    assert [(r["impl"], r["T"], r["status"]) for r in out["results"]] == \
        [("ours", 64, "ok"), ("ours", 128, "ok")]
    assert all(r["tokens_per_s"] > 0 and r["attention"] == "reference" for r in out["results"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_weight_gradient_adds_bf16_products_into_fp32(device):
    """loss.add_mm: acc += a @ b with bf16 a, b and an fp32 acc. On a GPU cuBLAS adds the fp32
    product itself: fp32-accurate (a bf16-rounded product, the fallback, is 100x off that);
    on the CPU the fallback's error stays within bf16 rounding of the product."""
    from draftsmith.drafters.losses import add_mm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 1000, generator=g).to(torch.bfloat16)
    b = torch.randn(1000, 200, generator=g).to(torch.bfloat16)
    acc0 = torch.randn(300, 200, generator=g)
    acc = acc0.clone().to(device)
    add_mm(acc, a.to(device), b.to(device))
    add_mm(acc, a.to(device), b.to(device))
    product = a.double() @ b.double()
    err = (acc.cpu().double() - (acc0.double() + 2 * product)).abs()
    if device == "cuda":
        assert err.max() < 2e-3, float(err.max())
    else:
        assert (err <= 2 * 2 ** -8 * product.abs() + 1e-4).all()
