"""The TTT attention on a flash-style kernel (torch's flash attention, cuDNN's), gradients
included, though such kernels take no gradient of their log-sum-exp.

ttt_flex.py splits chain t's softmax at step j into the step-0 keys (one attention call,
(o0, lse0)) and its own keys of steps 1..j (the "diagonal", a dot product each), merged
through the log-sum-exp. There, autograd differentiates the merge, so the step-0 kernel must
take a gradient of lse0: flex attention does; flash kernels do not.

Seen as one softmax over both key sets, no lse gradient is needed. With P the merged softmax,
out = P V, and LSE its log-sum-exp, attention's backward is dS = P * (dout . v - D) with
D = rowsum(dout * out). A flash kernel's backward computes exactly that for its own keys when
called with the merged `out` and `LSE` in place of its own (o0, lse0): it rebuilds
P = exp(s - LSE) and D from the `out` it is given. The diagonal keys' share is the same
formula, a few element-wise products (`_diagonal_backward`). So `KernelAttention` is
exact for any kernel with the usual interface (forward -> out, lse; backward(dout, q, k, v,
out, lse) -> dq, dk, dv), and `ReferenceKernel` (plain PyTorch, any device) is that interface
written out: the tests hold `KernelAttention` on it to `drafter.ttt_attention` in float64 on
the CPU, and on the GPU kernels to the same in bf16.

Why bother: MLA's query/key heads are 192 wide (128 + 64 rope). Flex attention rounds that up
to 256 and its H100/H200 defaults for it are 64 x 64 tiles on 4 warps (torch
_inductor/template_heuristics: no sm90 entry for 192), while cuDNN has kernels for 192/128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.drafters.layers import repeat_kv
from draftsmith.errors import DraftsmithError


def fixed_width(attend, steps: int, device):
    """attend(q, k0, v0, ks, vs, valid) -> attend(q, k0, v0, ks, vs) that passes steps - 1
    diagonal keys at every step j >= 1: its j keys, then the last of them again, masked out by
    `valid` ((steps - 1,) bool). A compiled attention then sees one signature at every step
    after the first and compiles twice in all (no diagonal keys; steps - 1 of them), not once
    per step. The padding adds exact zeros (the same result); its cost is a few element-wise
    products per padded key."""
    valid = [torch.arange(steps - 1, device=device) < j for j in range(steps)]

    def call(q, k0, v0, ks, vs):
        if not ks:
            return attend(q, k0, v0, ks, vs)
        # fresh views of a diagonal key (its strides): the same tensor twice would be another
        # aliasing pattern to dynamo, and k0's strides may differ (B = 1)
        pad = range(steps - 1 - len(ks))
        return attend(q, k0, v0, [*ks] + [ks[-1][...] for _ in pad],
                      [*vs] + [vs[-1][...] for _ in pad], valid=valid[len(ks)])

    return call


def allow_recompiles():
    """One compile per (shape, number of diagonal keys): more than dynamo's default limit of 8
    would fall back to eager silently (with flex: out of memory at long context)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 512)


def diagonal_merge(o0, lse0, q, ks: list, vs: list, valid=None):
    """Step-0 attention (o0 (B, nh, T, hd_v), lse0 (B, nh, T)) merged with the chain's own
    keys ks/vs (each (B, nkv, T, hd[_v]), one per step 1..j, attended at the same t only);
    valid: which of them count ((j,) bool; None: all, see `fixed_width`).
    -> (out (B, nh, T, hd_v) in q's dtype, LSE (B, nh, T) in >= fp32: the merged softmax's
    log-sum-exp). Grouped-query heads broadcast, never copied."""
    B, nh, T, hd = q.shape
    nkv = ks[0].shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax weights in >= fp32
    s = _diagonal_scores(q, ks, acc, valid)  # (B, nkv, rep, T, j)
    lse0 = lse0.reshape(B, nkv, nh // nkv, T).to(acc)
    m = torch.maximum(lse0, s.amax(-1))
    w0 = torch.exp(lse0 - m)
    wd = torch.exp(s - m[..., None])
    z = w0 + wd.sum(-1)
    hd_v = o0.shape[-1]  # MLA's values are narrower than its queries and keys
    out = o0.view(B, nkv, nh // nkv, T, hd_v) * (w0 / z)[..., None].to(q.dtype)
    wd = (wd / z[..., None]).to(q.dtype)
    for i, v in enumerate(vs):
        out = out + wd[..., i, None] * v[:, :, None]
    return out.view(B, nh, T, hd_v), (m + torch.log(z)).view(B, nh, T)


def _diagonal_scores(q, ks, acc, valid=None):
    """q . k_i / sqrt(hd) for each diagonal key: (B, nkv, rep, T, j) in `acc`, -inf where
    not `valid`."""
    B, nh, T, hd = q.shape
    qg = q.view(B, ks[0].shape[1], -1, T, hd)  # heads grouped by their KV head
    s = torch.stack([(qg * k[:, :, None]).sum(-1) for k in ks], -1).to(acc)
    s = s * (1.0 / math.sqrt(hd))
    return s if valid is None else s.masked_fill(~valid, float("-inf"))


def _diagonal_backward(dout, out, lse, q, ks, vs, valid=None):
    """The diagonal keys' share of the merged softmax's backward: -> (dq, [dk_i], [dv_i]),
    dq in >= fp32, the others in their input's dtype."""
    B, nh, T, hd = q.shape
    nkv = ks[0].shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    p = torch.exp(_diagonal_scores(q, ks, acc, valid)
                  - lse.view(B, nkv, nh // nkv, T, 1).to(acc))
    g = dout.view(B, nkv, nh // nkv, T, -1).to(acc)
    d = (g * out.view(g.shape).to(acc)).sum(-1)  # rowsum(dout * out): (B, nkv, rep, T)
    qg = q.view(B, nkv, nh // nkv, T, hd).to(acc)
    scale = 1.0 / math.sqrt(hd)
    dq = torch.zeros_like(qg)
    dks, dvs = [], []
    for i, (k, v) in enumerate(zip(ks, vs)):
        pi = p[..., i]
        ds = pi * ((g * v[:, :, None].to(acc)).sum(-1) - d) * scale  # dscore_i / scale
        dq = dq + ds[..., None] * k[:, :, None].to(acc)
        dks.append((ds[..., None] * qg).sum(2).to(k.dtype))
        dvs.append((pi[..., None] * g).sum(2).to(v.dtype))
    return dq.view(B, nh, T, hd), dks, dvs


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, plan, valid, j, q, k0, v0, *diag):
        ks, vs = list(diag[:j]), list(diag[j:])
        o0, lse0 = run.kernel.forward(q, k0, v0, plan)
        out, lse = run.merge(o0, lse0, q, ks, vs, valid) if ks else (o0, lse0)
        ctx.run, ctx.plan, ctx.valid, ctx.j = run, plan, valid, j
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        ks, vs = diag[:ctx.j], diag[ctx.j:]
        dout = dout.contiguous()
        # the kernel's own keys, under the merged softmax: its backward given (out, LSE)
        dq, dk0, dv0 = ctx.run.kernel.backward(dout, q, k0, v0, out, lse, ctx.plan)
        if not ks:
            return None, None, None, None, dq, dk0, dv0
        dq_d, dks, dvs = ctx.run.merge_backward(dout, out, lse, q, ks, vs, ctx.valid)
        return (None, None, None, None, (dq.to(dq_d.dtype) + dq_d).to(q.dtype), dk0, dv0,
                *dks, *dvs)


class KernelAttention:
    """train.attention flash or cudnn: the TTT attention on that kernel, its diagonal merge
    and the merge's backward compiled when asked.

    Compiled, the merge gets a graph per number of diagonal keys (steps - 1 forward and as many
    backward), not `fixed_width`'s one: these graphs are element-wise and compile in seconds,
    while padding to the widest step reads, differentiates and sums 15 padded keys and values
    over 7 TTT steps besides the 21 real ones (at T = 16,384 with MLA's 64 heads each is
    400 MB, and the sums alone took 10 ms of a 1.2 s step). `fixed_width = True` pads anyway
    (what flex attention, whose graphs compile in minutes, does)."""

    fixed_width = False

    def __init__(self, kernel: str | object, compile: bool = False):
        self.kernel = KERNELS[kernel]() if isinstance(kernel, str) else kernel
        self.merge, self.merge_backward = diagonal_merge, _diagonal_backward
        if compile:
            allow_recompiles()
            self.merge = torch.compile(diagonal_merge, dynamic=False)
            self.merge_backward = torch.compile(_diagonal_backward, dynamic=False)

    def for_documents(self, doc):
        """attend(q, k0, v0, ks, vs, valid=None) for a batch of these documents (doc: (B, T),
        -1 on padding), as ttt_flex.ttt_attention_flex computes it."""
        plan = self.kernel.plan(doc)
        return lambda q, k0, v0, ks, vs, valid=None: _TTTAttention.apply(  # noqa: E731
            self, plan, valid, len(ks), q, k0, v0, *ks, *vs)


# ----------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Segments:
    """A batch's rows cut into the runs the step-0 attention keeps apart: each document, and
    each row's padding (padding attends to padding, as in ttt_flex's block mask)."""
    rows: int
    length: int  # T
    spans: tuple[tuple[int, int, int], ...]  # (row, start, stop)
    cu: torch.Tensor | None = None  # (n + 1,) int32 on the device: starts in the flat B*T
    longest: int = 0

    @classmethod
    def of(cls, doc: torch.Tensor, with_offsets: bool = False) -> Segments:
        """doc: (B, T) document per token, -1 on padding, each document contiguous. Reads
        doc on the host: one wait for the device per batch, before its step is queued."""
        d = doc.cpu()
        B, T = d.shape
        change = torch.ones(B, T, dtype=torch.bool)
        change[:, 1:] = d[:, 1:] != d[:, :-1]
        starts = change.flatten().nonzero().flatten().tolist() + [B * T]
        spans = tuple((a // T, a % T, a % T + (b - a)) for a, b in zip(starts, starts[1:]))
        cu = torch.tensor(starts, dtype=torch.int32).to(doc.device) if with_offsets else None
        return cls(B, T, spans, cu, max(b - a for a, b in zip(starts, starts[1:])))

    def mask(self, device) -> torch.Tensor:
        """(B, T, T) bool: key s visible to query t (same run, s <= t)."""
        seg = torch.empty(self.rows, self.length, dtype=torch.long)
        for i, (r, a, b) in enumerate(self.spans):
            seg[r, a:b] = i
        seg = seg.to(device)
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=device).tril()
        return causal & (seg[:, :, None] == seg[:, None, :])


class ReferenceKernel:
    """The interface every step-0 kernel has, in plain PyTorch: causal attention within each
    run of `Segments`, (B, T, T) scores. q: (B, nh, T, hd); k: (B, nkv, T, hd); v: (B, nkv, T,
    hd_v); lse (B, nh, T) in >= fp32."""

    name = "reference"

    def plan(self, doc):
        return Segments.of(doc)

    def _probs(self, q, k, plan, lse=None):
        B, nh, T, hd = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        s = (q.view(B, k.shape[1], -1, T, hd).to(acc) @ k[:, :, None].transpose(-1, -2).to(acc))
        s = s.view(B, nh, T, T) / math.sqrt(hd)
        s = s.masked_fill(~plan.mask(q.device)[:, None], float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, -1)
        return torch.exp(s - lse[..., None]), lse

    def forward(self, q, k, v, plan):
        p, lse = self._probs(q, k, plan)
        return _group_sum_mm(p, v, q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, plan):
        B, nh, T, hd = q.shape
        nkv = k.shape[1]
        p, _ = self._probs(q, k, plan, lse.to(torch.promote_types(q.dtype, torch.float32)))
        acc = p.dtype
        g = dout.to(acc)
        dp = (g.view(B, nkv, -1, T, g.shape[-1]) @ v[:, :, None].transpose(-1, -2).to(acc))
        d = (g * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp.view(B, nh, T, T) - d) / math.sqrt(hd)
        dq = (ds.view(B, nkv, -1, T, T) @ k[:, :, None].to(acc)).view(B, nh, T, hd)
        dk = (ds.transpose(-1, -2).reshape(B, nkv, -1, T, T) @ q.view(B, nkv, -1, T, hd)
              .to(acc)).sum(2)
        dv = (p.transpose(-1, -2).reshape(B, nkv, -1, T, T) @ g.view(B, nkv, -1, T, g.shape[-1]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.sum(2).to(v.dtype)


def _group_sum_mm(p, v, dtype):
    """p (B, nh, T, S) @ v (B, nkv, S, hd_v), heads grouped by their KV head."""
    B, nh, T, S = p.shape
    nkv = v.shape[1]
    return (p.view(B, nkv, -1, T, S) @ v[:, :, None].to(p.dtype)).view(B, nh, T, -1).to(dtype)


class FlashKernel:
    """torch's flash attention (aten's varlen forward and backward, FlashAttention-2): the
    whole batch as one flat row, each run of `Segments` one sequence, grouped-query heads read
    as they are. One head size for q, k and v: MLA's narrower values are padded with zeros."""

    name = "flash"

    def plan(self, doc):
        return Segments.of(doc, with_offsets=True)

    @staticmethod
    def _flat(x):  # (B, h, T, d) -> (B*T, h, d), last dim contiguous
        B, h, T, d = x.shape
        return x.transpose(1, 2).reshape(B * T, h, d)

    def forward(self, q, k, v, plan):
        B, nh, T, hd = q.shape
        dv = v.shape[-1]
        qf, kf, vf = self._flat(q), self._flat(k), self._flat(F.pad(v, (0, hd - dv)))
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            qf, kf, vf, plan.cu, plan.cu, plan.longest, plan.longest, 0.0, True, False,
            scale=1.0 / math.sqrt(hd))
        return (out[..., :dv].reshape(B, T, nh, dv).transpose(1, 2),
                _lse_from_varlen(lse, B, nh, T))

    def backward(self, dout, q, k, v, out, lse, plan):
        B, nh, T, hd = q.shape
        dv = v.shape[-1]
        pad = (0, hd - dv)
        # rng state and the unused tensor: the forward's, irrelevant without dropout
        empty = torch.zeros(2, dtype=torch.uint64, device=q.device)
        dq, dk, dvv = torch.ops.aten._flash_attention_backward(
            self._flat(F.pad(dout, pad)), self._flat(q), self._flat(k),
            self._flat(F.pad(v, pad)), self._flat(F.pad(out, pad)),
            _lse_to_varlen(lse, B, nh, T), plan.cu, plan.cu, plan.longest, plan.longest, 0.0,
            True, empty, empty, scale=1.0 / math.sqrt(hd))
        unflat = lambda x, d: x[..., :d].reshape(B, T, -1, d).transpose(1, 2)  # noqa: E731
        return unflat(dq, hd), unflat(dk, hd), unflat(dvv, dv)


def _lse_from_varlen(lse, B, nh, T):
    """aten's varlen flash lse (nh, B*T) -> (B, nh, T) fp32."""
    if lse.shape != (nh, B * T):
        raise DraftsmithError(f"torch's varlen flash attention returned a log-sum-exp of shape "
                              f"{tuple(lse.shape)}, not (heads, tokens) = ({nh}, {B * T})",
                              "set train.attention: flex (this torch lays it out otherwise)")
    return lse.view(nh, B, T).transpose(0, 1)


def _lse_to_varlen(lse, B, nh, T):
    return lse.float().transpose(0, 1).reshape(nh, B * T).contiguous()


class CudnnKernel:
    """SDPA's cuDNN kernel (aten's cuDNN attention forward and backward), causal, one run of
    `Segments` at a time, all rows in one call when each row is one document. cuDNN takes
    MLA's 192-wide queries and keys with 128-wide values as they are, and grouped K/V heads
    (torch passes them through: no repeated copy, their gradients summed in the kernel); one
    that refuses them gets them repeated."""

    name = "cudnn"

    def plan(self, doc):
        return Segments.of(doc)

    @staticmethod
    def _whole_rows(plan):
        return len(plan.spans) == plan.rows and all(a == 0 and b == plan.length
                                                    for _, a, b in plan.spans)

    def _runs(self, plan):
        """(rows, start, stop) slices to run: all rows at once, or each span alone."""
        if self._whole_rows(plan):
            return [(slice(None), 0, plan.length)]
        return [(slice(r, r + 1), a, b) for r, a, b in plan.spans]

    gqa = True  # grouped K/V heads passed as they are (False: this cuDNN refused them)

    def forward(self, q, k, v, plan):
        return self._grouped_or_repeated(self._forward, q, k, v, plan)

    def backward(self, dout, q, k, v, out, lse, plan):
        return self._grouped_or_repeated(
            lambda q, k, v, plan: self._backward(dout, q, k, v, out, lse, plan), q, k, v, plan)

    def _grouped_or_repeated(self, call, q, k, v, plan):
        """call(q, k, v, plan), with grouped K/V heads as they are while cuDNN takes them."""
        try:
            return call(q, k, v, plan)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if not self.gqa or k.shape[1] == q.shape[1]:
                raise
            self.gqa = False  # repeat them from now on (a copy of K and V per call)
            return call(q, k, v, plan)

    def _kv(self, k, v, nh):
        return (k, v) if self.gqa else (_repeat_heads(k, nh), _repeat_heads(v, nh))

    def _forward(self, q, k, v, plan):
        B, nh, T, hd = q.shape
        k, v = self._kv(k, v, nh)
        runs = self._runs(plan)
        if len(runs) > 1:
            out = q.new_empty(B, nh, T, v.shape[-1])
            lse = q.new_empty(B, nh, T, dtype=torch.promote_types(q.dtype, torch.float32))
        for rows, a, b in runs:
            o, l, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q[rows, :, a:b], k[rows, :, a:b], v[rows, :, a:b], None, True, 0.0, True,
                False, scale=1.0 / math.sqrt(hd))
            self.lse_4d = l.dim() == 4  # (.., T, 1): backward takes it back so
            if len(runs) == 1:  # whole rows: the kernel's tensors as they are, no copy
                return o, l.reshape(o.shape[:-1])
            out[rows, :, a:b] = o
            lse[rows, :, a:b] = l.reshape(o.shape[:-1])
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, plan):
        B, nh, T, hd = q.shape
        nkv = k.shape[1]
        kr, vr = self._kv(k, v, nh)
        runs = self._runs(plan)
        if len(runs) > 1:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(kr), torch.empty_like(vr)
        lse = lse.to(torch.promote_types(lse.dtype, torch.float32))  # fp32 (fp64 in tests)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        for rows, a, b in runs:
            l = lse[rows, :, a:b]  # noqa: E741
            g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout[rows, :, a:b].contiguous(), q[rows, :, a:b], kr[rows, :, a:b],
                vr[rows, :, a:b], out[rows, :, a:b].contiguous(),
                (l.unsqueeze(-1) if self.lse_4d else l).contiguous(), seed, seed,
                None, None, None, b - a, b - a, 0.0, True, scale=1.0 / math.sqrt(hd))
            if len(runs) == 1:  # whole rows: no copy into the gradients
                dq, dk, dv = g[:3]
            else:
                dq[rows, :, a:b], dk[rows, :, a:b], dv[rows, :, a:b] = g
        if dk.shape[1] != nkv:  # repeated heads' gradients summed back onto their KV head
            dk = dk.view(B, nkv, nh // nkv, T, hd).sum(2)
            dv = dv.view(B, nkv, nh // nkv, T, -1).sum(2)
        return dq, dk, dv


def _repeat_heads(x, nh):
    """Grouped K/V heads repeated for cuDNN (MLA's, one per query head, left as they are)."""
    return x if x.shape[1] == nh else repeat_kv(x, nh)


KERNELS = {"flash": FlashKernel, "cudnn": CudnnKernel, "reference": ReferenceKernel}
