"""Data parallelism under torchrun: one process per GPU (NCCL), or per CPU slice (gloo).

A stage relaunches itself under torchrun when `distributed` in params asks for more than one
process (`torchrun_argv`), so dvc.yaml's commands never change. Inside torchrun each process
reads its rank from the environment torchrun sets; outside it, the world is one process and
every collective here is a no-op, so the library needs no torchrun anywhere.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from draftsmith.config import DistributedConfig
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, kind: str) -> torch.device:
        """This process's device of `kind` (cuda: the GPU of its local rank)."""
        return torch.device(f"cuda:{self.local_rank}") if kind == "cuda" else torch.device(kind)

    def barrier(self) -> None:
        if self.size > 1:
            tdist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over all processes (asynchronous on a GPU: no host sync)."""
        if self.size > 1:
            tdist.all_reduce(t)
        return t

    def gather(self, obj) -> list | None:
        """Every process's `obj` at the main process (in rank order), None elsewhere."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.main else None
        tdist.gather_object(obj, out, dst=0)
        return out


def world() -> World:
    """This process's place in the torchrun world (a world of one without torchrun)."""
    if not tdist.is_available() or not tdist.is_initialized():
        return World()
    return World(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def init(cfg: DistributedConfig) -> World:
    """Join the process group torchrun set up (NCCL with GPUs, gloo without); a no-op outside
    torchrun. A worker also asks the kernel to kill it when its torchrun agent dies, so a
    SIGKILLed stage leaves no process behind."""
    if not under_torchrun() or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return World()
    _die_with_parent()
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not tdist.is_initialized():
        tdist.init_process_group(backend)
    return world()


def finish() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def torchrun_argv(cfg: DistributedConfig, module: str, args: list[str]) -> list[str] | None:
    """The torchrun command that runs `python -m module args` as cfg asks, or None when the
    stage should run here as one process (one process asked for, or already under torchrun)."""
    if under_torchrun() or (cfg.nproc_per_node == 1 and cfg.nnodes == 1):
        return None
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}",
            f"--nnodes={cfg.nnodes}"]
    if cfg.nnodes == 1:
        argv.append("--standalone")  # a free local port; nothing to configure
    else:
        argv += [f"--node-rank={cfg.node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={cfg.rdzv_id}"]
    return [*argv, "-m", module, *args]


def split(rows: list, w: World) -> list:
    """This process's share of one step's rows (every process gets the same number of steps;
    a process left without a row gets an empty one, which counts for nothing)."""
    mine = rows[w.rank::w.size]
    return mine or [[]]


def check_divides(batch_size: int, w: World) -> None:
    if batch_size % w.size:
        raise DraftsmithError(
            f"train.batch_size={batch_size} rows per step cannot be split evenly over "
            f"{w.size} processes", "set train.batch_size to a multiple of the world size "
            "(distributed.nproc_per_node x distributed.nnodes): the global batch stays the "
            "same whatever the world size")


def _die_with_parent() -> None:
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
