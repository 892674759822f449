"""Data parallel training over a torchrun world: DDP over the working copy, or FSDP2 over the
fp32 weights (train.parallel: fsdp). Both wrap the whole loss (WholeLoss), not the
drafter, since a step calls the drafter's methods rather than its forward.
"""

from __future__ import annotations

import inspect

import torch

from draftsmith.dist import World


class WholeLoss(torch.nn.Module):
    """DistributedDataParallel reduces the gradients of what its module's forward computes, and
    FSDP2 gathers its weights around that forward, so this module's forward is a step's whole
    loss (the method's objective, which calls the drafter's methods, not its forward)."""

    def __init__(self, compute: torch.nn.Module, loss_fn):
        super().__init__()
        self.compute, self.loss_fn = compute, loss_fn

    def forward(self, batch, seed):
        return self.loss_fn(self.compute, batch, seed)


PREFIX = "compute."  # the drafter's names inside WholeLoss


def data_parallel(whole: WholeLoss, device: torch.device):
    from torch.nn.parallel import DistributedDataParallel

    # The frozen embedding and the constant vocab maps are sent once, at construction: only
    # gradients cross the wire on each step.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                      inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})  # torch < 2.13
    return DistributedDataParallel(whole, **no_buffer_sync,
                                   device_ids=[device.index] if device.type == "cuda"
                                   else None)


def shard_over_world(whole: WholeLoss, device: torch.device, dtype: torch.dtype, w: World):
    """FSDP2 over all processes: each holds 1/world of the fp32 weights, gradients and AdamW
    state; a step gathers the weights in the compute dtype and reduce-scatters fp32 gradients.
    The frozen embedding (already in the compute dtype) is a group of its own, since a group
    holds one dtype; sharded too, so no process keeps the whole table (so is DFlash's frozen
    lm_head, the target's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (w.size,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for name in whole.compute.SHARED:  # "embed_tokens.weight" -> its module
        fully_shard(whole.compute.get_submodule(name.rsplit(".", 1)[0]), mesh=mesh, mp_policy=mp)
    return fully_shard(whole, mesh=mesh, mp_policy=mp)


def renamed(weights: dict, optim: dict | None, rename) -> tuple[dict, dict | None]:
    """Weights and AdamW state with every parameter name passed through rename (FSDP2 names
    them inside WholeLoss; checkpoints name them as the drafter does)."""
    if not optim:  # not asked for, or not the main process (it gets the gathered state)
        return {rename(k): v for k, v in weights.items()}, optim
    groups = [{**g, "params": [rename(k) for k in g["params"]]} for g in optim["param_groups"]]
    return ({rename(k): v for k, v in weights.items()},
            {"state": {rename(k): v for k, v in optim["state"].items()}, "param_groups": groups})
