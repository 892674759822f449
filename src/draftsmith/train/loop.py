"""Train stage lifecycle: setup (device, data plan, drafter) -> train (checkpoint every
`save_every` steps, resume from the last one) -> evaluate (per-step accuracy of the initial and
the trained drafter on held-out samples) -> save.

One code path for the CPU (the embedded default: fp32, the dense reference attention) and the
GPU (bf16 autocast over fp32 master weights, cuDNN or flex attention, compiled). Inside a step nothing
waits for the GPU: metrics stay on the device and are read only at logging steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.atomic import atomic_path
from draftsmith.checkpoint import drafter_state, load_drafter_weights, save_drafter
from draftsmith.config import TrainConfig
from draftsmith.dist import World, check_divides, split, world
from draftsmith.drafters.options import train_problem
from draftsmith.drafters.registry import METHODS, DrafterConfig
from draftsmith.errors import DraftsmithError
from draftsmith.target_info import TargetHead
from draftsmith.train.data import HiddenStore, eval_steps, loader, schedule
from draftsmith.train.parallel import PREFIX, WholeLoss, data_parallel, renamed, shard_over_world
from draftsmith.train.precision import WorkingCopy, clip_in_optimizer
from draftsmith.train.resume import load_checkpoint, resume_key, save_checkpoint
from draftsmith.train.select import AcceptanceScorer, BestCheckpoint, prompt_ids
from draftsmith.train.sources import StoredStates
from draftsmith_kernels import soft_ce


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # compute dtype: bf16 under autocast, else fp32
    attention: str  # flex | flash | cudnn | reference
    compile: bool

    @classmethod
    def resolve(cls, cfg: TrainConfig, w: World = World()) -> Runtime:
        """w: this process's place in a torchrun world (its GPU is that of its local rank)."""
        cuda = torch.cuda.is_available()
        if cfg.device == "cuda" and not cuda:
            raise DraftsmithError("train.device is cuda but no GPU is visible to torch",
                                  "set train.device: auto (or cpu), or install a CUDA build "
                                  "of torch")
        device = w.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and cuda)
                          else "cpu")
        on_gpu = device.type == "cuda"
        attention = cfg.attention if cfg.attention != "auto" else auto_attention(
            cfg.method, torch.cuda.get_device_capability(device) if on_gpu else None,
            on_gpu and torch.backends.cudnn.is_available())
        if attention != "reference" and not on_gpu:
            why = ("PyTorch has no flex attention backward on the CPU" if attention == "flex"
                   else f"{attention} attention is a CUDA kernel")
            raise DraftsmithError(f"train.attention: {attention} needs a GPU ({why})",
                                  "set train.attention: auto or reference on the CPU")
        bf16 = on_gpu if cfg.bf16 == "auto" else cfg.bf16
        return cls(device, torch.bfloat16 if bf16 else torch.float32, attention,
                   on_gpu if cfg.compile == "auto" else cfg.compile)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.dtype == torch.bfloat16)


def auto_attention(method: str, capability: tuple[int, int] | None, cudnn: bool) -> str:
    """train.attention: auto. The CPU (capability None): the dense reference, PyTorch having no
    flex backward there. A GPU: cuDNN's kernel for EAGLE's TTT attention on Hopper (sm_90),
    where it trained both drafter layers fastest on one document a row, MLA as fast as flex on
    packed rows, and compiles in a fraction of flex's first step (flex is up to 4% faster on
    packed Llama rows: docs/performance.md has the tables); flex elsewhere (not measured) and
    for DFlash (its anchors' mask needs flex)."""
    if capability is None:
        return "reference"
    if cudnn and capability[0] == 9 and train_problem(method, "llama", "cudnn") is None:
        return "cudnn"
    return "flex"


def build_drafter(cfg: TrainConfig, head: TargetHead, d2t, t2d, aux_layers,
                  mask_token_id: int | None = None):
    """The drafter `train.method` trains, initialised as `train.init` says; mask_token_id:
    the target token of DFlash's masked slots (dflash.mask_token_id)."""
    method = METHODS[cfg.method]
    c = drafter_config(cfg, head.config, len(d2t), aux_layers, mask_token_id)
    torch.manual_seed(cfg.seed)
    model = method.model(c)
    shared = {"embed_tokens.weight": head.embed, "lm_head.weight": head.lm_head}
    for name in model.SHARED:
        model.get_parameter(name).data.copy_(shared[name].float())
    method.init_from_target(model, head, d2t, t2d, copy=cfg.init == "copy")
    if cfg.init not in ("copy", "scratch"):
        load_drafter_weights(model, Path(cfg.init))
    return model


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


def drafter_config(cfg: TrainConfig, tc, draft_vocab_size: int, aux_layers,
                   mask_token_id: int | None = None) -> DrafterConfig:
    """The drafter's shape from the target's text config `tc`: its attention heads, the
    attention kind `train.drafter_arch` (an MLA drafter takes the target's MLA widths, which
    the engine's MLA kernels are built for), the target's MLP width unless
    `train.intermediate_size` says otherwise, and what `train.method` adds."""
    mla = {}
    if cfg.drafter_arch == "mla":
        if not getattr(tc, "kv_lora_rank", None):
            raise DraftsmithError(
                f"train.drafter_arch: mla takes its latent widths from an MLA target, and this "
                f"target ({getattr(tc, 'model_type', '?')}) has no kv_lora_rank",
                "set train.drafter_arch: llama for a grouped-query target")
        mla = {k: getattr(tc, k, None) for k in MLA_FIELDS}
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    fields = dict(
        hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size,
        num_heads=tc.num_attention_heads,
        num_kv_heads=tc.num_attention_heads if mla else tc.num_key_value_heads,
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else head_dim,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size,
        aux_layers=tuple(aux_layers), rms_norm_eps=tc.rms_norm_eps, rope_theta=_rope_theta(tc),
        max_position_embeddings=tc.max_position_embeddings, arch=cfg.drafter_arch, **mla)
    return DrafterConfig(**{**fields, **METHODS[cfg.method].config_fields(cfg, tc,
                                                                         mask_token_id)})


def _rope_theta(tc) -> float:
    rp = getattr(tc, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * frac))


class Trainer:
    """The drafter (fp32 master weights), the module each step computes with (a bf16 working
    copy under bf16), its method's objective (the loss), the optimizer, and one step."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, model, head: TargetHead, target=None,
                 w: World = World(), vocab: tuple | None = None):
        """target: online mode's whole target model (on rt.device), run on every batch for
        its states; None when they are stored. w: a torchrun world of more than one process
        makes each step data parallel (DDP over the working copy, or FSDP2 over the fp32
        weights with train.parallel: fsdp). vocab: (d2t, t2d), the draft vocab's maps (None:
        the drafter's own)."""
        if rt.device.type == "cuda":  # nvcc's first build (seconds) beside the setup and compile
            soft_ce.prebuild()
        self.cfg, self.rt, self.target, self.world = cfg, rt, target, w
        self.method = METHODS[model.config.method]
        self.fsdp = w.size > 1 and cfg.parallel == "fsdp"
        self.model = model.to(rt.device)
        # The frozen tensors shared with the target (its embedding, DFlash's lm_head too) are
        # only read: keep them in the compute dtype (1 GB, not 2, for a 128K x 4096 table).
        # They are never saved with the drafter.
        for name in model.SHARED:
            self.model.get_parameter(name).data = self.model.get_parameter(name).data.to(rt.dtype)
        # FSDP2 casts to the compute dtype itself at each all-gather: no working copy then.
        self.working = WorkingCopy(self.model, torch.float32 if self.fsdp else rt.dtype)
        self.compute = self.working.compute
        d2t, t2d = vocab or (getattr(model, "d2t", None), getattr(model, "t2d", None))
        self.objective = self.method.objective(cfg, model.config, head, d2t, t2d,
                                               device=rt.device, dtype=rt.dtype,
                                               attention=rt.attention, compile=rt.compile)
        if rt.compile:
            self.method.compile(self.compute)
        self.parallel = None  # the whole loss under DDP or FSDP2, with several processes
        if w.size > 1:
            # Each process divides by the global batch's counts over the world size, so the
            # gradients DDP or FSDP average are exactly the global batch's.
            loss_fn = functools.partial(
                self.objective,
                per_step_count=lambda n, floor=1: w.sum_(n.clone()).clamp_min(floor) / w.size)
            whole = WholeLoss(self.compute, loss_fn)
            self.parallel = (shard_over_world(whole, rt.device, rt.dtype, w) if self.fsdp
                             else data_parallel(whole, rt.device))
        # After FSDP2 has turned the weights into shards. One fused kernel for all of AdamW's
        # updates on the GPU (the foreach path launches a dozen per step).
        self.opt = torch.optim.AdamW(self.model.trainable_parameters(), lr=cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=0.0,
                                     fused=rt.device.type == "cuda")

    def state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """-> (the drafter's tensors as saved, AdamW's state keyed by parameter name), whole
        and on the CPU: the same for any world size and either parallel mode, so a checkpoint
        resumes on any number of processes. Under FSDP2 every process must call it (it
        gathers the shards); only the main process gets the tensors."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        module = self.parallel if self.fsdp else self.model
        weights = get_model_state_dict(module, options=whole)
        optim = get_optimizer_state_dict(module, self.opt, options=whole) if optimizer else None
        if self.fsdp:
            weights, optim = renamed(weights, optim, lambda k: k.removeprefix(PREFIX))
        return {k: v.contiguous() for k, v in weights.items()
                if k not in self.model.SHARED}, optim

    def load_state(self, weights: dict, optim: dict) -> None:
        """The inverse of `state` (every process calls it with the whole state)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        module = self.parallel if self.fsdp else self.model
        if self.fsdp:
            weights, optim = renamed(weights, optim, lambda k: PREFIX + k)
        whole = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(module, weights, options=whole)  # all but the shared tensors
        set_optimizer_state_dict(module, self.opt, optim, options=whole)
        self.working.weights_from_master()

    def weights(self) -> dict:
        """The drafter's tensors as saved (all but the shared ones), whole, on the CPU, in
        every process (under FSDP2 gathered from the shards: every process must call it). A
        copy: training goes on changing the model's own tensors."""
        if not self.fsdp:
            return {k: v.clone() for k, v in drafter_state(self.model).items()}
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        whole = get_model_state_dict(self.parallel, options=StateDictOptions(
            full_state_dict=True))
        return {k.removeprefix(PREFIX): v.detach().cpu().clone() for k, v in whole.items()
                if k.removeprefix(PREFIX) not in self.model.SHARED}

    def set_weights(self, weights: dict) -> None:
        """The inverse of `weights` (every process, with the whole tensors)."""
        if not self.fsdp:
            self.model.load_state_dict(weights, strict=False)
        else:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_model_state_dict)

            set_model_state_dict(self.parallel, {PREFIX + k: v for k, v in weights.items()},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        self.working.weights_from_master()

    def saved_drafter(self):
        """The trained drafter whole, for save_drafter (under FSDP2 gathered from every
        process: all call it, the main process's copy is the one to save)."""
        if not self.fsdp:
            return self.model
        weights, _ = self.state(optimizer=False)
        model = self.method.model(self.model.config)
        model.load_state_dict(weights, strict=False)
        return model

    def full(self, rows: list) -> list:
        """A step's rows, padded with empty ones to batch_size when the step is compiled:
        every batch then has the training shape, so the last step of an epoch and the
        evaluation batches reuse the compiled graphs instead of recompiling (an empty row
        counts for nothing)."""
        if not self.rt.compile:
            return rows
        return rows + [[]] * (self.cfg.batch_size - len(rows))

    @torch.no_grad()
    def with_target_states(self, batch):
        """Online mode: the batch with the target's states computed here, on its packed rows."""
        from draftsmith.capture import capture_rows

        aux, final = capture_rows(self.target, batch.ids, batch.pos, self.model.config.aux_layers)
        return dataclasses.replace(batch, aux=aux, final=final)

    def loss(self, batch, seed: int, training: bool = False):
        """-> (loss, per-position stats (positions, 3) [mean loss, correct, counted]) on the
        device; seed: the draw of the objective's random choices (DFlash's anchors; the step,
        so a resumed run draws the same); training: through DDP (when data parallel), for a
        backward pass on every process."""
        if self.target is not None:
            batch = self.with_target_states(batch)
        with self.rt.autocast():
            # FSDP2 gathers the weights in its root's forward: evaluation goes through it too.
            if self.parallel is not None and (training or self.fsdp):
                return self.parallel(batch, seed)
            return self.objective(self.compute, batch, seed)

    def step(self, batch, lr: float, seed: int = 0):
        """One optimizer step on `batch`; -> (loss, stats) as for `loss`, still on the device."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, stats = self.loss(batch, seed, training=True)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.working.grads_to_master()
        clip_in_optimizer(self.opt, self.model.trainable_parameters(), self.cfg.grad_clip)
        self.working.weights_from_master()
        return loss, stats

    @torch.no_grad()
    def evaluate(self, store: HiddenStore, members: list[int]) -> dict:
        """Per-step top-1 agreement with the target (and loss) on held-out samples (data
        parallel: each process takes its share of the rows, and the sums are added up)."""
        self.compute.eval()
        total = torch.zeros(self.objective.positions, 3, device=self.rt.device)
        steps = [split(self.full(rows), self.world)
                 for rows in eval_steps(store, members, self.cfg.seq_len, self.cfg.batch_size)]
        if not self.fsdp:  # (FSDP2: every process takes part in every forward)
            steps = [s for s in steps if any(s)]
        batches = loader(store, steps, self.cfg.seq_len, device=self.rt.device, workers=0)
        for i, batch in enumerate(batches):  # the same draws for every evaluation
            _, stats = self.loss(batch.to(self.rt.device, non_blocking=True), EVAL_SEED + i)
            total[:, 0] += stats[:, 0] * stats[:, 2]  # mean loss -> summed over positions
            total[:, 1:] += stats[:, 1:]
        self.world.sum_(total)
        self.compute.train()
        loss_sum, correct, count = total.T.tolist()
        return {"accuracy": [round(c / max(1, n), 4) for c, n in zip(correct, count)],
                "loss": [round(s / max(1, n), 4) for s, n in zip(loss_sum, count)],
                "positions": [int(n) for n in count]}


EVAL_SEED = 1 << 40  # evaluation's draws, apart from every training step's


def step_seed(cfg: TrainConfig, step: int) -> int:
    """The draw of a training step's random choices: the same on a resumed run."""
    return cfg.seed * 1_000_003 + step


# ----------------------------------------------------------------------------- train


def train(cfg: TrainConfig, head: TargetHead, source: StoredStates, vocab_dir: Path,
          out_dir: Path, ckpt_dir: Path, curve_file: Path | None = None,
          plot_file: Path | None = None, mask_token_id: int | None = None,
          scorer: AcceptanceScorer | None = None) -> dict:
    """source: where the target's states come from (train/sources.py: stored, computed here,
    or from a serving engine). mask_token_id: the token of DFlash's masked slots
    (dflash.mask_token_id). scorer: with train.select: best_acceptance, what scores each
    checkpoint (train/select.py); the best one is saved."""
    from draftsmith.vocab import load as load_vocab

    w = world()
    check_divides(cfg.batch_size, w)
    rt = Runtime.resolve(cfg, w)
    d2t, t2d = load_vocab(vocab_dir)
    store = source.store
    store.check_fits(cfg.seq_len)
    train_ids, eval_ids = store.split(cfg.eval_samples)
    if not train_ids:
        raise DraftsmithError("no training samples", "lower train.eval_samples or add data")
    source.start(rt.device, eval_ids)
    trainer = Trainer(cfg, rt, build_drafter(cfg, head, d2t, t2d, store.aux_layers,
                                             mask_token_id), head, source.target, w,
                      vocab=(d2t, t2d))
    model = trainer.model
    selection = None
    if scorer is not None:
        scorer.check(model.config)
        scorer.start(rt.device, [p for p in (prompt_ids(*store.tokens(i)) for i in eval_ids)
                                 if p is not None])
        selection = BestCheckpoint()
    initial = trainer.evaluate(store, eval_ids)

    key = resume_key(cfg, store, vocab_dir)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    start, curve = load_checkpoint(Path(ckpt_dir), trainer, key, selection)
    trainer.working.weights_from_master()
    plan: list = []
    epoch = 0
    while len(plan) < cfg.steps:
        plan += schedule(store, train_ids, cfg.seq_len, cfg.batch_size, cfg.seed, epoch)
        epoch += 1
    # The same global steps whatever the world size; each process takes its share of the rows.
    steps = [split(trainer.full(rows), w) for rows in plan[start:cfg.steps]]
    batches = source.batches(steps, cfg.seq_len, rt.device, cfg.num_workers)
    tokens = torch.zeros((), dtype=torch.long, device=rt.device)
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    t0 = time.time()
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not w.main)
    trainer.compute.train()
    for step in range(start, cfg.steps):
        try:
            batch = next(batches)
        except Exception:
            source.close()
            if source.keeps_steps_on_failure() and step > start and w.main \
                    and not trainer.fsdp:  # kept for the rerun
                save_checkpoint(Path(ckpt_dir), *trainer.state(), step, key, curve,
                                selection)
            raise
        batch = batch.to(rt.device, non_blocking=True)
        loss, stats = trainer.step(batch, _lr(step, cfg), step_seed(cfg, step))
        tokens += batch.tokens
        if step % cfg.log_every == 0 or step == cfg.steps - 1:  # the only host sync
            loss = w.sum_(loss.detach().clone()) / w.size  # the global batch's, as one process
            per = w.sum_(stats).tolist()  # correct and counted positions of the global batch
            row = {"step": step, "loss": round(float(loss), 4)}
            for j, (_, c, n) in enumerate(per):
                row[f"acc_{j}"] = round(c / max(1, n), 4)
            curve.append(row)
            bar.set_postfix(loss=row["loss"], acc0=row["acc_0"], **source.rates(time.time() - t0))
        bar.update(1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            if selection is not None:  # every process: under FSDP2 all gather
                selection.consider(step + 1, trainer, scorer)
            if w.main or trainer.fsdp:  # FSDP2 gathers from every process; DDP needs one
                weights, optim = trainer.state()
                if w.main:
                    save_checkpoint(Path(ckpt_dir), weights, optim, step + 1, key, curve,
                                    selection)
    bar.close()
    seconds = time.time() - t0  # float(loss) above synchronised at the last step
    source.close()
    trained_tokens = int(w.sum_(tokens))
    if selection is not None:
        selection.consider(cfg.steps, trainer, scorer)
        if selection.best_step != cfg.steps:
            trainer.set_weights(selection.best)
    final = trainer.evaluate(store, eval_ids)
    drafter = trainer.saved_drafter()
    if not w.main:
        return {}

    save_drafter(drafter, out_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # done: nothing left to resume
    if curve_file:
        _write_curve(curve_file, curve)
    if plot_file:
        from draftsmith.plots import plot_training

        plot_training(curve, plot_file)
    metrics = {
        "method": model.config.method, "drafter_arch": model.config.arch,
        "steps": cfg.steps, "resumed_from_step": start,
        # what eval_accuracy's entries are: TTT steps, or a DFlash block's drafted slots
        "positions": trainer.objective.positions,
        "eval_accuracy": final["accuracy"], "eval_loss": final["loss"],
        "initial_eval_accuracy": initial["accuracy"],
        "eval_positions": final["positions"][0],
        "train_tokens_per_s": round(trained_tokens / seconds, 1) if seconds > 0 else None,
        "trainable_parameters": sum(p.numel() for p in model.trainable_parameters()),
        "device": rt.device.type, "compute_dtype": str(rt.dtype).removeprefix("torch."),
        "attention": rt.attention,
        "hidden_mode": source.mode, "processes": w.size,
        # train.select: the step saved, and with best_acceptance each checkpoint's score
        "select": cfg.select,
        "selected_step": selection.best_step if selection is not None else cfg.steps,
        **({"selection_scores": selection.scores} if selection is not None else {}),
        # with an engine, the pair's rates: the engine's alone, and the trainer's waiting
        **source.metrics(seconds),
    }
    if rt.device.type == "cuda":
        metrics["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(rt.device) / 1e9, 2)
    return metrics


def _write_curve(path: Path, curve: list[dict]) -> None:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(curve[0]))
    w.writeheader()
    w.writerows(curve)
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(buf.getvalue())
