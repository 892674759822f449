"""The drafters' losses without whole-vocabulary logits: EAGLE-3's TTT loss (`ttt_loss` over
`LinearSoftCE`), and `LinearCE`, the hard-label cross-entropy over a frozen head that DFlash
drafts through (drafters/ set them up; the training loop never calls them itself).

TTT alignment, for a sample x: chain t at step j predicts x[t+2+j], supervised by the target's
distribution at position p = t+1+j over the draft vocab, counted where x[p+1] is a response
token of the same sample and the target's top token (full vocab) is in the draft vocab.

Memory: the target's logits over the full vocab exist only a chunk of rows at a time (for its
argmax); over the draft vocab once per batch. The drafter's logits exist only a group of rows
at a time too (at most 4 chunks): `LinearSoftCE` computes lm_head, the soft cross-entropy and
its gradient group by group in the forward pass (the fused kernel in
`draftsmith_kernels.soft_ce`, or its PyTorch reference), keeping only the gradients, (T, H)
and (Vd, H), for the backward pass.

`ttt_loss_reference` is the plain version (full logits, autograd) the tests hold this to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from draftsmith_kernels.soft_ce import soft_ce

if TYPE_CHECKING:
    from draftsmith.drafters.batch import Batch

CHUNK_ROWS = 4096  # rows of logits alive at once: the target's 4096 x 128K x 2 bytes = 1 GB


@dataclass
class TargetView:
    """What the target says at every position of a batch."""
    logits: torch.Tensor  # (B, T, Vd) in the head's dtype: its logits over the draft vocab
    valid: torch.Tensor  # (B, T) bool: position p counts (see the module docstring)


@torch.no_grad()
def target_view(batch: Batch, head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                chunk: int = CHUNK_ROWS) -> TargetView:
    """head: the target's lm_head (V, Ht) in the compute dtype."""
    B, T, Ht = batch.final.shape
    final = batch.final.reshape(B * T, Ht).to(head.dtype)
    # Kept in the head's dtype: the GEMM rounds to it anyway, so a wider copy adds no
    # precision, only bytes (the soft-CE kernel reads these once per TTT step).
    keep = head.dtype if head.dtype in (torch.bfloat16, torch.float32, torch.float64) \
        else torch.float32
    logits = torch.empty(B * T, len(draft_ids), dtype=keep, device=final.device)
    top = torch.empty(B * T, dtype=torch.long, device=final.device)
    for a in range(0, B * T, chunk):
        full = final[a:a + chunk] @ head.T  # (rows, V): only a chunk of it ever exists
        top[a:a + chunk] = full.argmax(-1)
        logits[a:a + chunk] = full[:, draft_ids]
    same_doc_next = F.pad(batch.doc[:, 1:] == batch.doc[:, :-1], (0, 1))
    next_is_response = F.pad(batch.loss_mask[:, 1:], (0, 1)) & same_doc_next
    valid = next_is_response & t2d[top].view(B, T) & (batch.doc >= 0)
    return TargetView(logits.view(B, T, -1), valid)


class LinearSoftCE(torch.autograd.Function):
    """sum over rows of scale * softCE(x @ weight.T, target), with the gradient computed in the
    forward pass, a group of rows at a time.

    x: (B, L, H); weight: (Vd, H); target: (B, L, Vd) target logits (may be a strided view);
    scale: (B, L) fp32 (0 where a row does not count); shared: the lm_head gradient buffer of
    the losses summed with this one (SharedGrad). Returns (loss, ce, agree): the scalar
    loss (differentiable), and per row the cross-entropy and whether the draft's argmax equals
    the target's (for metrics). With kl=True the loss is KL(target || draft) instead: the same
    gradient, the target's entropy subtracted.

    Per group of whole rows b (up to GROUP_CHUNKS x chunk positions, at least one row): one
    GEMM for the group's logits, the soft cross-entropy turning them into their gradient in
    place (`chunk` rows a call), then one GEMM each for dx and for the lm_head gradient, which
    cuBLAS adds straight into the fp32 buffer. At the 8B shape and T=2048 that is 3 GEMMs per
    TTT step instead of 12, and no bf16 product cast and added to 0.5 GB of fp32 (20 ms a step
    on an H200: benchmarks/results/profile_fast_T2048_working_copy_h200.txt)."""

    @staticmethod
    def forward(ctx, x, weight, target, scale, dtype, kl, chunk, shared: SharedGrad):
        B, L, H = x.shape
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        xs = x.to(dtype).reshape(B * L, H)
        dx = torch.empty(B * L, H, dtype=dtype, device=x.device) if need_dx else None
        dw = shared.buffer(weight) if need_dw else None
        acc = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 in exact tests
        ce = torch.empty(B, L, dtype=acc, device=x.device)
        agree = torch.empty(B, L, dtype=torch.bool, device=x.device)
        loss = torch.zeros((), dtype=acc, device=x.device)
        per_group = max(1, GROUP_CHUNKS * chunk // max(1, L))
        with torch.autocast(x.device.type, enabled=False):
            for b0 in range(0, B, per_group):
                rows = slice(b0 * L, min(B, b0 + per_group) * L)
                g = xs[rows] @ w.T  # (rows, Vd) logits, turned into their gradient in place
                for b in range(b0, min(B, b0 + per_group)):
                    for a in range(0, L, chunk):
                        r = (b - b0) * L + a
                        s = scale[b, a:a + chunk]
                        c, neg_ent, pred, tpred, _ = soft_ce(g[r:r + len(s)],
                                                             target[b, a:a + chunk], s,
                                                             inplace=True)
                        loss += (s * (c + neg_ent if kl else c)).sum()
                        ce[b, a:a + chunk], agree[b, a:a + chunk] = c, pred == tpred
                if need_dx:
                    torch.mm(g, w, out=dx[rows])
                if need_dw:
                    add_mm(dw, g.T, xs[rows])  # accumulated in >= fp32
        ctx.save_for_backward(None if dx is None else dx.view(B, L, H))
        ctx.x_dtype, ctx.shared = x.dtype, shared
        ctx.mark_non_differentiable(ce, agree)
        return loss, ce, agree

    @staticmethod
    def backward(ctx, grad_loss, _ce, _agree):
        (dx,) = ctx.saved_tensors
        gx = None if dx is None else (dx * grad_loss).to(ctx.x_dtype)
        return gx, ctx.shared.take(grad_loss), None, None, None, None, None, None


GROUP_CHUNKS = 4  # LinearSoftCE's logits group: 4 x 4096 rows x 32K x 2 bytes = 1 GB at most
_FUSED_ADD_MM: bool | None = None  # whether this torch adds a bf16 product into fp32 itself


def add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in a wider dtype than a and b (fp32 vs bf16): on CUDA cuBLAS adds the
    fp32-accumulated product into acc itself (addmm's out_dtype), instead of rounding it to bf16,
    casting it and adding it (3x the bytes)."""
    global _FUSED_ADD_MM
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _FUSED_ADD_MM is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _FUSED_ADD_MM = True
            return
        except (RuntimeError, TypeError):  # an older torch: no mixed-dtype addmm
            _FUSED_ADD_MM = False
    acc += (a @ b).to(acc.dtype)


class SharedGrad:
    """One lm_head gradient for all TTT steps: each step adds its (Vd, H) fp32 gradient into
    the same buffer in the forward pass, and the first step reached by backward returns the
    sum (the others return None). Right because the steps' losses are summed with weight one
    (their weights are folded into the row scales), so every step gets the same grad_loss;
    a buffer per step would cost 7 x 0.5 GB at an 8B shape."""

    def __init__(self):
        self.dw = None

    def buffer(self, weight):
        if self.dw is None:
            self.dw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype,
                                                                         torch.float32))
        return self.dw

    def take(self, grad_loss):
        dw, self.dw = self.dw, None
        return None if dw is None else dw * grad_loss


class LinearCE(torch.autograd.Function):
    """sum over rows of scale * CE(x @ weight.T, labels): hard-label cross-entropy over a frozen
    head (DFlash drafts through the target's own lm_head over its whole vocab), its gradient to
    x computed in the forward pass `chunk` rows at a time, so only one chunk's logits exist.

    x: (B, L, H); weight: (V, H), frozen; labels: (B, L) int64 (any id where scale is 0);
    scale: (B, L) fp32, or a function of the rows' cross-entropies (B, L) -> that scale (D-PACE's
    weights: each row's dx is then computed unscaled and scaled once all are known, an
    elementwise pass instead of a second GEMM). Returns (loss, ce, agree) as LinearSoftCE. Per
    chunk: one GEMM for the logits, softmax minus one-hot in place in >= fp32, one GEMM for dx."""

    @staticmethod
    def forward(ctx, x, weight, labels, scale, dtype, chunk):
        assert not ctx.needs_input_grad[1], "LinearCE's head is frozen"
        B, L, H = x.shape
        w = weight.to(dtype)
        xs, lab = x.to(dtype).reshape(B * L, H), labels.reshape(-1)
        sc = scale.reshape(-1) if torch.is_tensor(scale) else None  # None: known after the CE
        acc = torch.promote_types(dtype, torch.float32)
        need_dx = ctx.needs_input_grad[0]
        dx = torch.empty(B * L, H, dtype=dtype, device=x.device) if need_dx else None
        ce = torch.empty(B * L, dtype=acc, device=x.device)
        agree = torch.empty(B * L, dtype=torch.bool, device=x.device)
        loss = torch.zeros((), dtype=acc, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for a in range(0, B * L, chunk):
                rows = slice(a, min(B * L, a + chunk))
                g = (xs[rows] @ w.T).to(acc)  # (rows, V) logits, turned into their gradient
                y = lab[rows, None]
                lse = torch.logsumexp(g, -1)
                c = lse - g.gather(1, y)[:, 0]
                ce[rows], agree[rows] = c, g.argmax(-1) == y[:, 0]
                if sc is not None:
                    loss += (sc[rows] * c).sum()
                if need_dx:
                    g.sub_(lse[:, None]).exp_()  # softmax
                    g.scatter_add_(1, y, torch.full_like(y, -1, dtype=g.dtype))
                    if sc is not None:
                        g.mul_(sc[rows, None])
                    torch.mm(g.to(dtype), w, out=dx[rows])
            if sc is None:
                sc = scale(ce.view(B, L)).reshape(-1).to(acc)
                loss = (sc * ce).sum()
                if need_dx:
                    dx.mul_(sc[:, None])
        ctx.save_for_backward(None if dx is None else dx.view(B, L, H))
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(ce, agree)
        return loss, ce.view(B, L), agree.view(B, L)

    @staticmethod
    def backward(ctx, grad_loss, _ce, _agree):
        (dx,) = ctx.saved_tensors
        gx = None if dx is None else (dx * grad_loss).to(ctx.x_dtype)
        return gx, None, None, None, None, None


def ce_chunk_rows(vocab: int) -> int:
    """LinearCE's rows per chunk: about 2^28 fp32 logits (1 GB) alive at once."""
    return max(1, (1 << 28) // vocab)


def ttt_loss(model, batch: Batch, view: TargetView, steps: int, weights: list[float], kind: str,
             attend=None, dtype: torch.dtype = torch.float32, chunk: int = CHUNK_ROWS,
             per_step_count=None, keep=None, pooled: bool = False):
    """-> (weighted loss, per-step stats (steps, 3): [mean loss, correct, counted]), all on the
    device: nothing here waits for the GPU.

    Step j's loss is a mean over its counted positions. per_step_count(counts) -> what to
    divide by instead of this batch's own counts (at least 1); data parallel passes the global
    batch's counts over the world size, so the averaged gradients are the global batch's.
    keep(counted) -> the positions of each step to count, of those that could (P-EAGLE's
    sampled slots); pooled: one mean over every counted position of every step instead."""
    B, T = batch.ids.shape
    # chain t is judged at p = t + 1 + j, inside the row
    counted = [view.valid[:, 1 + j:] & (batch.doc[:, :T - 1 - j] == batch.doc[:, 1 + j:])
               for j in range(steps)]
    if keep is not None:
        counted = keep(counted)
    counts = torch.stack([c.sum() for c in counted])
    if pooled:
        every = counts.sum().reshape(1)
        divide_by = (every.clamp_min(1) if per_step_count is None
                     else per_step_count(every)).expand(steps)
    else:
        divide_by = counts.clamp_min(1) if per_step_count is None else per_step_count(counts)
    next_ids = F.pad(batch.ids[:, 1:], (0, steps + 1))  # next_ids[t + j] = x[t + 1 + j]
    hs = model.unroll(batch.aux.to(model.fc.weight.dtype), next_ids, steps, doc=batch.doc, pos=batch.pos, attend=attend)
    acc = torch.promote_types(view.logits.dtype, torch.float32)
    total, stats, shared = 0.0, [], SharedGrad()
    for j, h in enumerate(hs):
        L = T - 1 - j
        n = counts[j]
        # step weight folded in
        scale = counted[j].to(acc) * weights[j] / divide_by[j].to(acc)
        # The norm over the whole row, then the slice: one shape for every step, so a compiled
        # norm (the train stage on a GPU) compiles once.
        loss, _, agree = LinearSoftCE.apply(model.norm(h)[:, :L], model.lm_head.weight,
                                            view.logits[:, 1 + j:], scale, dtype,
                                            kind == "kl", chunk, shared)
        total = total + loss  # weight one: see SharedGrad
        mean = loss.detach() * divide_by[j] / n.clamp_min(1) if pooled \
            else loss.detach() / weights[j]
        stats.append(torch.stack([mean.float(), (agree & counted[j]).sum().float(), n.float()]))
    return total, torch.stack(stats)


def ttt_loss_reference(model, batch: Batch, head, draft_ids, t2d, steps: int,
                       weights: list[float], kind: str):
    """The plain TTT loss: full-vocab target logits and full draft logits, autograd through
    everything, the dense reference attention. Same contract as ttt_loss."""
    logits = batch.final.to(head.dtype) @ head.T  # (B, T, V)
    in_draft = t2d[logits.argmax(-1)]
    probs = torch.softmax(logits[..., draft_ids].to(torch.promote_types(head.dtype, torch.float32)), -1)
    same_doc_next = F.pad(batch.doc[:, 1:] == batch.doc[:, :-1], (0, 1))
    valid = F.pad(batch.loss_mask[:, 1:], (0, 1)) & same_doc_next & in_draft & (batch.doc >= 0)
    B, T = batch.ids.shape
    next_ids = F.pad(batch.ids[:, 1:], (0, steps + 1))
    out = model(batch.aux.to(model.fc.weight.dtype), next_ids, steps, doc=batch.doc,
                pos=batch.pos)
    total, stats = 0.0, []
    for j, lg in enumerate(out):
        L = T - 1 - j
        m = valid[:, 1 + j:] & (batch.doc[:, :L] == batch.doc[:, 1 + j:])
        q = probs[:, 1 + j:]
        logp = torch.log_softmax(lg[:, :L].to(q.dtype), -1)
        ce = -(q * logp).sum(-1)
        if kind == "kl":
            ce = ce + (q * torch.log(q.clamp_min(1e-20))).sum(-1)
        n = m.sum()
        loss = (ce * m).sum() / n.clamp_min(1)
        correct = ((lg[:, :L].argmax(-1) == q.argmax(-1)) & m).sum()
        total = total + weights[j] * loss
        stats.append(torch.stack([loss.detach().float(), correct.float(), n.float()]))
    return total, torch.stack(stats)
