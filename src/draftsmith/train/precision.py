"""fp32 master weights with a bf16 working copy: each weight is cast once per optimizer step,
not once per use.

Under plain autocast every TTT step re-casts every fp32 weight to bf16 and casts its bf16
gradient back to fp32 before adding it to the others: 7 casts and 7 fp32 adds per weight per
step, 15% of a step's device time at the 8B shape on an H200
(benchmarks/results/profile_fast_T2048_h200.txt). Here the step computes with bf16 weights,
autograd sums a weight's 7 gradient contributions in bf16, and one cast carries the sum to the
fp32 master gradient that clipping and AdamW see. AdamW still updates fp32 weights, so small
updates are not lost to bf16 rounding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WorkingCopy:
    """`compute`: the module the step runs (the master itself when dtype is the master's).
    Call `grads_to_master()` after backward and `weights_from_master()` after the optimizer
    step (or after loading master weights)."""

    def __init__(self, master: nn.Module, dtype: torch.dtype):
        self.master = master
        self.active = any(p.dtype != dtype for p in master.parameters() if p.requires_grad)
        if not self.active:
            self.compute = master
            return
        # Frozen parameters (the target's embedding, already in the compute dtype) are shared,
        # not copied: at 128K x 4096 that is 1 GB.
        memo = {id(p): p for p in master.parameters() if not p.requires_grad}
        self.compute = copy.deepcopy(master, memo).to(dtype)
        self._pairs = [(m, w) for m, w in zip(master.parameters(), self.compute.parameters())
                       if m.requires_grad]

    def grads_to_master(self) -> None:
        if not self.active:
            return
        for m, w in self._pairs:
            m.grad = None if w.grad is None else w.grad.to(m.dtype)
            w.grad = None

    @torch.no_grad()
    def weights_from_master(self) -> None:
        if self.active:
            torch._foreach_copy_([w for _, w in self._pairs], [m for m, _ in self._pairs])


def clip_in_optimizer(opt: torch.optim.Optimizer, params, max_norm: float) -> None:
    """Gradient clipping to `max_norm`, then `opt.step()`. A fused AdamW (CUDA) applies the
    clip factor inside its own kernel, as its `grad_scale`: no extra pass over the gradients
    (1.7 GB of fp32 read and written a step at the 8B shape). Other optimizers: clip, then step."""
    params = [p for p in params if p.grad is not None]
    fused = (all(g.get("fused") for g in opt.param_groups) and params and params[0].is_cuda
             and type(params[0].grad) is torch.Tensor)  # FSDP2's sharded DTensors: plain clip
    if not fused:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)  # as clip_grad_norm_
    opt.grad_scale = 1.0 / coef  # the kernel divides each gradient by it
    try:
        opt.step()
    finally:
        del opt.grad_scale
