"""Train stage: the EAGLE-3 drafter with training-time test, from stored hidden states.

Lifecycle: setup (data schedule, target head, drafter init) -> train (checkpoint every
`save_every` steps, resume from the last one) -> evaluate (per-step accuracy of the initial and
the trained drafter on held-out samples) -> save. Alignment, for a sample of length n:
chain t (t < n - 1) starts from the target's aux states at t and token x[t+1]; its step j
predicts x[t+2+j], supervised by the target's distribution at position p = t+1+j over the draft
vocab, counted where x[p+1] is a response token and the target's top token is in the vocab.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from draftsmith.atomic import atomic_path, write_json
from draftsmith.config import TrainConfig
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.errors import DraftsmithError
from draftsmith.hidden import read_manifest
from draftsmith.vocab import draft_ids_from_d2t

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter.json"


# ----------------------------------------------------------------------------- data


@dataclass
class Batch:
    aux: torch.Tensor  # (B, T, 3Ht)
    final: torch.Tensor  # (B, T, Ht) target's last hidden state, after its final norm
    ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T) response tokens
    key_mask: torch.Tensor  # (B, T) real (not padding) tokens


class HiddenData:
    """Samples of the hidden artifact, split into train and held-out eval by sample id, served
    as length-grouped batches one shard at a time (memory: one shard)."""

    def __init__(self, hidden_dir: Path, eval_samples: int):
        self.dir = Path(hidden_dir)
        m = read_manifest(hidden_dir)
        self.shards = m["shards"]
        ids = sorted(i for s in self.shards for i in s["ids"])
        self.eval_ids = set(ids[:eval_samples]) if eval_samples < len(ids) else set()
        self._cache: tuple[int, dict] | None = None

    def _load(self, s: int) -> dict:
        if self._cache is None or self._cache[0] != s:
            self._cache = (s, load_file(self.dir / self.shards[s]["file"]))
        return self._cache[1]

    def _sample(self, s: int, k: int):
        t = self._load(s)
        a, b = t["cu_seqlens"][k].item(), t["cu_seqlens"][k + 1].item()
        return (t["aux"][a:b], t["final"][a:b], t["input_ids"][a:b].long(),
                t["loss_mask"][a:b].bool())

    def members(self, held_out: bool) -> list[tuple[int, int]]:
        return [(s, k) for s, shard in enumerate(self.shards) for k, i in enumerate(shard["ids"])
                if (i in self.eval_ids) == held_out]

    def schedule(self, batch_size: int, seed: int, epoch: int) -> list[list[tuple[int, int]]]:
        """One epoch's batches: shards in random order, batches within a shard grouped by
        length then shuffled. A function of (seed, epoch) only, so resuming replays it."""
        rng = random.Random(seed * 100_003 + epoch)
        by_shard: dict[int, list[int]] = {}
        for s, k in self.members(False):
            by_shard.setdefault(s, []).append(k)
        out = []
        for s in rng.sample(sorted(by_shard), len(by_shard)):
            lens = self.shards[s].get("lengths")
            ks = rng.sample(by_shard[s], len(by_shard[s]))
            if lens:
                ks.sort(key=lambda k: lens[k])
            batches = [[(s, k) for k in ks[i:i + batch_size]] for i in range(0, len(ks), batch_size)]
            rng.shuffle(batches)
            out += batches
        return out

    def eval_batches(self, batch_size: int):
        members = self.members(True)
        return [members[i:i + batch_size] for i in range(0, len(members), batch_size)]

    def batch(self, members) -> Batch:
        samples = [self._sample(s, k) for s, k in members]
        T = max(len(x[2]) for x in samples)
        B = len(samples)
        aux = torch.zeros(B, T, samples[0][0].shape[-1])
        final = torch.zeros(B, T, samples[0][1].shape[-1])
        ids = torch.zeros(B, T, dtype=torch.long)
        lm = torch.zeros(B, T, dtype=torch.bool)
        km = torch.zeros(B, T, dtype=torch.bool)
        for r, (a, f, i, m) in enumerate(samples):
            n = len(i)
            aux[r, :n], final[r, :n], ids[r, :n], lm[r, :n], km[r, :n] = a, f, i, m, True
        return Batch(aux, final, ids, lm, km)


# ----------------------------------------------------------------------------- loss


def targets(batch: Batch, head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor):
    """Target's distribution over the draft vocab at every position, and where it counts:
    x[p+1] is a response token and the target's top token (full vocab) is in the draft vocab."""
    logits = batch.final @ head.T  # (B, T, V)
    in_draft = t2d[logits.argmax(-1)]
    probs = torch.softmax(logits[..., draft_ids].float(), -1)  # (B, T, Vd)
    nxt = torch.zeros_like(batch.loss_mask)
    nxt[:, :-1] = batch.loss_mask[:, 1:]
    return probs, nxt & in_draft


def ttt_loss(model: Eagle3Drafter, batch: Batch, head, draft_ids, t2d, steps: int,
             weights: list[float], kind: str):
    """-> (weighted loss, per-step [(loss, correct, counted)])."""
    probs, valid = targets(batch, head, draft_ids, t2d)
    B, T = batch.ids.shape
    next_ids = F.pad(batch.ids[:, 1:], (0, steps + 1))  # next_ids[t + j] = x[t + 1 + j]
    logits = model(batch.aux, next_ids, steps, key_mask=batch.key_mask)
    total, per_step = 0.0, []
    for j, lg in enumerate(logits):
        # Chain t, step j is judged against position p = t + 1 + j.
        q = F.pad(probs[:, 1 + j:], (0, 0, 0, 1 + j))
        m = F.pad(valid[:, 1 + j:], (0, 1 + j))
        logp = torch.log_softmax(lg.float(), -1)
        ce = -(q * logp).sum(-1)
        if kind == "kl":
            ce = ce + (q * torch.log(q.clamp_min(1e-20))).sum(-1)
        n = m.sum()
        loss = (ce * m).sum() / n.clamp_min(1)
        correct = ((lg.argmax(-1) == q.argmax(-1)) & m).sum()
        total = total + weights[j] * loss
        per_step.append((loss.detach(), int(correct), int(n)))
    return total, per_step


# ----------------------------------------------------------------------------- setup


def build_drafter(cfg: TrainConfig, target_model, d2t, t2d, aux_layers) -> Eagle3Drafter:
    tc = target_model.config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    c = DrafterConfig(
        hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size,
        num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
        head_dim=head_dim, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        vocab_size=tc.vocab_size, draft_vocab_size=len(d2t), aux_layers=tuple(aux_layers),
        rms_norm_eps=tc.rms_norm_eps, rope_theta=_rope_theta(tc),
        max_position_embeddings=tc.max_position_embeddings,
    )
    torch.manual_seed(cfg.seed)
    model = Eagle3Drafter(c)
    model.embed_tokens.weight.data.copy_(target_model.get_input_embeddings().weight.float())
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    if cfg.init == "copy":
        head = target_model.get_output_embeddings().weight.float()
        model.lm_head.weight.data.copy_(head[draft_ids_from_d2t(d2t)])
        model.norm.weight.data.copy_(target_model.get_decoder().norm.weight.float())
    elif cfg.init != "scratch":
        from draftsmith.export import load_drafter_weights

        load_drafter_weights(model, Path(cfg.init))
    return model


def _rope_theta(tc) -> float:
    rp = getattr(tc, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(model, data: HiddenData, head, draft_ids, t2d, steps: int, batch_size: int = 32):
    """Per-step top-1 agreement with the target (and loss) on the held-out samples."""
    model.eval()
    correct, count, loss = [0] * steps, [0] * steps, [0.0] * steps
    for members in data.eval_batches(batch_size):
        _, per = ttt_loss(model, data.batch(members), head, draft_ids, t2d, steps,
                          [1.0] * steps, "soft_ce")
        for j, (lv, c, n) in enumerate(per):
            correct[j] += c
            count[j] += n
            loss[j] += float(lv) * n
    return {"accuracy": [round(c / max(1, n), 4) for c, n in zip(correct, count)],
            "loss": [round(lv / max(1, n), 4) for lv, n in zip(loss, count)],
            "positions": count}


# ----------------------------------------------------------------------------- train


def _resume_key(cfg: TrainConfig, hidden_dir: Path, vocab_dir: Path) -> str:
    import hashlib

    h = hashlib.sha256(cfg.model_dump_json().encode())
    h.update((Path(hidden_dir) / "manifest.json").read_bytes())
    h.update((Path(vocab_dir) / "vocab.safetensors").read_bytes())
    return h.hexdigest()[:16]


def _save_checkpoint(ckpt_dir: Path, model, opt, step: int, key: str, curve: list) -> None:
    with atomic_path(ckpt_dir) as tmp:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / WEIGHTS)
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        write_json(tmp / "state.json", {"step": step, "key": key, "curve": curve})


def _load_checkpoint(ckpt_dir: Path, model, opt, key: str):
    state_file = ckpt_dir / "state.json"
    if not state_file.exists():
        return 0, []
    state = json.loads(state_file.read_text())
    if state["key"] != key:
        return 0, []  # a different run's checkpoint: start over
    model.load_state_dict(load_file(ckpt_dir / WEIGHTS))
    opt.load_state_dict(torch.load(ckpt_dir / "optimizer.pt", weights_only=True))
    return state["step"], state["curve"]


def run(cfg: TrainConfig, target_dir: Path, hidden_dir: Path, vocab_dir: Path, out_dir: Path,
        ckpt_dir: Path, curve_file: Path | None = None, plot_file: Path | None = None) -> dict:
    from draftsmith.target import load_model

    return train(cfg, load_model(target_dir, device="cpu").float(), hidden_dir, vocab_dir,
                 out_dir, ckpt_dir, curve_file, plot_file)


def train(cfg: TrainConfig, target_model, hidden_dir: Path, vocab_dir: Path, out_dir: Path,
          ckpt_dir: Path, curve_file: Path | None = None, plot_file: Path | None = None) -> dict:
    from draftsmith.vocab import load as load_vocab

    d2t, t2d = load_vocab(vocab_dir)
    aux_layers = read_manifest(hidden_dir)["aux_layers"]
    data = HiddenData(hidden_dir, cfg.eval_samples)
    if cfg.steps < 1 or not data.members(False):
        raise DraftsmithError("no training samples", "lower train.eval_samples or add data")
    head = target_model.get_output_embeddings().weight.detach().float()
    draft_ids = draft_ids_from_d2t(d2t)
    model = build_drafter(cfg, target_model, d2t, t2d, aux_layers)
    weights = [cfg.step_weight ** j for j in range(cfg.ttt_steps)]
    initial = evaluate(model, data, head, draft_ids, t2d, cfg.ttt_steps)

    opt = torch.optim.AdamW(model.trainable_parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    key = _resume_key(cfg, hidden_dir, vocab_dir)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    start, curve = _load_checkpoint(Path(ckpt_dir), model, opt, key)
    plan: list = []
    epoch = 0
    while len(plan) < cfg.steps:
        plan += data.schedule(cfg.batch_size, cfg.seed, epoch)
        epoch += 1
    t0, tokens = time.time(), 0
    bar = tqdm(range(start, cfg.steps), desc="train", unit="step", initial=start, total=cfg.steps)
    for step in bar:
        model.train()
        batch = data.batch(plan[step])
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, per = ttt_loss(model, batch, head, draft_ids, t2d, cfg.ttt_steps, weights,
                                 cfg.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), cfg.grad_clip)
        opt.step()
        tokens += int(batch.key_mask.sum())
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {"step": step, "loss": round(loss.item(), 4)}
            for j, (lv, c, n) in enumerate(per):
                row[f"acc_{j}"] = round(c / max(1, n), 4)
            curve.append(row)
            bar.set_postfix(loss=row["loss"], acc0=row["acc_0"])
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _save_checkpoint(Path(ckpt_dir), model, opt, step + 1, key, curve)
    seconds = time.time() - t0
    final = evaluate(model, data, head, draft_ids, t2d, cfg.ttt_steps)

    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if k != "embed_tokens.weight"}, tmp / WEIGHTS)
        write_json(tmp / CONFIG, model.config.to_dict())
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # done: nothing left to resume
    if curve_file:
        _write_curve(curve_file, curve)
    if plot_file:
        from draftsmith.plots import plot_training

        plot_training(curve, plot_file)
    return {
        "steps": cfg.steps, "resumed_from_step": start, "ttt_steps": cfg.ttt_steps,
        "eval_accuracy": final["accuracy"], "eval_loss": final["loss"],
        "initial_eval_accuracy": initial["accuracy"],
        "eval_positions": final["positions"][0],
        "train_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "trainable_parameters": sum(p.numel() for p in model.trainable_parameters()),
    }


def _write_curve(path: Path, curve: list[dict]) -> None:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(curve[0]))
    w.writeheader()
    w.writerows(curve)
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(buf.getvalue())


def load_trained(out_dir: Path, target_model) -> Eagle3Drafter:
    """The trained drafter with the target's (frozen) embeddings put back."""
    c = json.loads((Path(out_dir) / CONFIG).read_text())
    c["aux_layers"] = tuple(c["aux_layers"])
    model = Eagle3Drafter(DrafterConfig(**c))
    state = load_file(Path(out_dir) / WEIGHTS)
    state["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().float()
    model.load_state_dict(state)
    return model.eval()
