"""DSpark (deepseek-ai/DeepSpec; served by vLLM's qwen3_dspark.py): DFlash's block drafter in
which every slot drafts, with a Markov head that shows each draft the one before it and a
confidence head that predicts its acceptance.

    block: [anchor x_a, MASK, ..., MASK] (B tokens) -> DFlash's backbone and norm (dflash.py)
       -> h_k, k = 0 .. B-1: slot k drafts x_{a+k+1}
    logits_k = lm_head(h_k) + W2 W1[prev_k]       Markov head of rank r: W1 (V, r), W2 (V, r);
       prev_0 = x_a, prev_k = the token drafted at slot k - 1 (in training the data's token)
    c_k = proj([h_k ; W1[prev_k]])                 confidence: a logit of slot k's acceptance

One forward and B cheap sequential steps (a row of W1, a rank-r product) draft B tokens: vLLM
asks for num_speculative_tokens = B (its `sample_from_anchor`, true by default).

Training (DeepSpec's loss.py; docs/research/dspark-peagle-dpace.md section 1.2): DFlash's
anchors; slot k counts while x_{a+1} .. x_{a+k+1} are all response tokens of the anchor's
sample (supervision stops at the first that is not), weighted w_k = exp(-k / gamma):

    L = sum_k w_k (0.1 CE(q_k, x_{a+k+1}) + 0.9 |q_k - p_k|_1 + 1.0 BCE(c_k, a_k)) / sum_k w_k

q_k: the Markov-corrected draft distribution; p_k: the target's, its head on its final state at
a + k; a_k = clamp(1 - |q_k - p_k|_1 / 2, 0, 1), the chance a token sampled from q_k is accepted
against p_k (a target, not differentiated). W2 starts at zero (our choice: the drafter starts
as its backbone alone, and W1 learns once W2 has moved).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftsmith.drafters.base import Objective, pick
from draftsmith.drafters.dflash import (BlockObjective, DFlash, DFlashDrafter, DFlashProposer,
                                        block_states)
from draftsmith.drafters.layers import accum
from draftsmith.errors import DraftsmithError


class MarkovHead(nn.Module):
    """vLLM's DSparkMarkovHead: the previous token's rank-r row of W1, projected by W2 to a
    bias over the vocab."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """vLLM's DSparkConfidenceHead with_markov: a logit from [h_k ; W1[prev_k]]."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)

    def forward(self, h, prev_embed):
        return self.proj(torch.cat([h, prev_embed], -1)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, c):
        super().__init__(c)
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank)
        if c.confidence_head:
            self.confidence_head = ConfidenceHead(c.hidden_size + c.markov_rank)


def _slot_terms(x, prev_embed, teacher, labels, head, w2):
    """Rows of final states x (n, H), their previous tokens' W1 rows (n, r), the target's final
    states (n, Ht) and the labels (n,) -> (CE, |q - p|_1, agree) per row, in x's accumulation
    dtype. The whole-vocab rows live inside this call only (checkpointed by the caller)."""
    acc = accum(x.dtype)
    logits = (x @ head.T + prev_embed @ w2.T).to(acc)
    logq = logits.log_softmax(-1)
    p = (teacher.to(head.dtype) @ head.T).to(acc).softmax(-1)
    l1 = (logq.exp() - p).abs().sum(-1)
    ce = -logq.gather(-1, labels[:, None])[:, 0]
    return ce, l1, logits.argmax(-1) == labels


class DSparkObjective(Objective):
    """The loss above, over row chunks of `chunk` slots (each chunk's whole-vocab logits are
    recomputed in backward rather than kept: slots x vocab never exists at once)."""

    WEIGHTS = (0.1, 0.9, 1.0)  # CE, L1, confidence: DeepSpec's released configs

    def __init__(self, cfg, c, *, dtype, flex: bool, compile: bool, chunk: int = 1024):
        self.blocks = BlockObjective(cfg, c, dtype=dtype, flex=flex, compile=compile)
        self.positions, self.dtype, self.chunk = c.block_size, dtype, chunk  # every slot drafts
        self.weights = [math.exp(-k / cfg.dflash.gamma) for k in range(self.positions)]

    def __call__(self, model, batch, seed, per_step_count=None):
        B, T = batch.ids.shape
        s = block_states(self.blocks, model, batch, seed, span=self.positions + 1)
        labels = s.ids[..., 1:]  # (B, N, blk): slot k's label x_{a+k+1}
        counted = (s.keep[..., None] & (s.at[..., 1:] < T) & (s.doc[..., 1:] == s.doc[..., :1])
                   & s.mask[..., 1:]).cumprod(-1).bool()
        prev = s.ids[..., :-1]  # the data's previous token (teacher forcing)
        acc = accum(self.dtype)
        w = counted.to(acc) * torch.tensor(self.weights, dtype=acc, device=s.h.device)
        total = w.sum()
        z = (total.clamp_min(1e-12) if per_step_count is None  # the global batch's sum
             else per_step_count(total.view(1), floor=1e-12).reshape(()))

        x = s.h.reshape(-1, s.h.shape[-1])
        heads = model.markov_head
        prev_embed = heads.markov_w1(prev.reshape(-1)).to(x.dtype)
        before = s.at[..., :-1].clamp(max=T - 1).reshape(B, -1)  # the target's state at a + k
        teacher = batch.final.gather(1, before[..., None].expand(-1, -1, batch.final.shape[-1]))
        teacher, flat_labels = teacher.reshape(x.shape[0], -1), labels.reshape(-1)
        head, w2 = model.lm_head.weight, heads.markov_w2.weight
        parts = [checkpoint(_slot_terms, x[i:i + self.chunk], prev_embed[i:i + self.chunk],
                            teacher[i:i + self.chunk], flat_labels[i:i + self.chunk], head, w2,
                            use_reentrant=False)
                 for i in range(0, x.shape[0], self.chunk)]
        ce, l1, agree = (torch.cat(t).view_as(counted) for t in zip(*parts))
        per_row = self.WEIGHTS[0] * ce + self.WEIGHTS[1] * l1
        if getattr(model, "confidence_head", None) is not None:
            target = (1 - l1.detach() / 2).clamp(0, 1)
            c = model.confidence_head(x, prev_embed).view_as(counted).to(acc)
            per_row = per_row + self.WEIGHTS[2] * F.binary_cross_entropy_with_logits(
                c, target, reduction="none")
        loss = (per_row * w).sum() / z
        counts = counted.sum((0, 1))
        stats = torch.stack([(ce.detach() * counted).sum((0, 1)) / counts.clamp_min(1),
                             (agree & counted).sum((0, 1)).to(acc), counts.to(acc)], -1)
        return loss, stats.float()


class DSparkProposer(DFlashProposer):
    """The reference engine's DSpark drafts: DFlash's cached context, one block [last token,
    k - 1 masks], then the k drafts sampled left to right, each with the Markov bias of the
    one before it (as vLLM's DSparkSpeculator samples)."""

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen):
        d = self.drafter
        h = self.block_states(aux, ids, k - 1)  # (k, H): every slot drafts
        base = d.lm_head(h)
        heads, prev = d.markov_head, ids[-1]
        drafts, qs = [], []
        for i in range(k):
            logits = base[i] + heads.markov_w2(heads.markov_w1(prev))
            token, q = pick(logits, temperature, gen)
            drafts.append(token)
            qs.append(q)
            prev = token
        return torch.stack(drafts), (None if qs[0] is None else torch.stack(qs))


class DSpark(DFlash):
    name, label = "dspark", "DSpark"
    architectures = {"llama": "Qwen3DSparkModel"}  # vLLM's qwen3_dspark.py (Qwen3 layers)
    # SGLang 0.5.17: models/dspark.py (the same class name and tensors; its confidence head is
    # built only outside the default SGLANG_RAGGED_VERIFY_MODE=static, else its weights skipped)
    engine_names = {"vllm": "dspark", "sglang": "DSPARK"}
    reference = "deepseek-ai/DeepSpec; vLLM qwen3_dspark.py, v1/worker/gpu/spec_decode/dspark"

    def config_fields(self, cfg, target_config, mask_token_id) -> dict:
        return {**super().config_fields(cfg, target_config, mask_token_id),
                "method": self.name, "markov_rank": cfg.dspark.markov_rank,
                "confidence_head": cfg.dspark.confidence_head}

    def model(self, c):
        if not c.block_size or c.mask_token_id is None or not c.markov_rank:
            raise ValueError("a DSpark drafter needs block_size, mask_token_id and markov_rank")
        return DSparkDrafter(c)

    def objective(self, cfg, c, head, d2t, t2d, *, device, dtype, attention, compile):
        return DSparkObjective(cfg, c, dtype=dtype, flex=attention != "reference",
                               compile=compile)

    def proposer(self, model):
        return DSparkProposer(model)

    def check_k(self, c, k):
        if k != c.block_size:
            raise DraftsmithError(
                f"this DSpark drafter was trained on blocks of {c.block_size} slots, each "
                f"drafting a token, and is asked for {k} draft tokens a step: with "
                "bidirectional attention in the block every draft would change",
                f"set benchmark.num_speculative_tokens: {c.block_size}, or train with "
                f"train.dflash.block_size: {k}")

    def draft_cost(self, c, k, tau) -> dict:
        # every slot of its block of k drafts (the anchor's too), and each of the k sequential
        # Markov steps reads W2 (vocab x rank)
        return self._block_cost(c, k, tau, slots=k, markov=c["vocab_size"] * c["markov_rank"])

    def export_config(self, c, engine) -> dict:
        out = super().export_config(c, engine)
        # vLLM's qwen3_dspark.py reads these at the top level (a trainer that writes them
        # inside dflash_config, as SpecForge does, leaves vLLM without markov_rank); SGLang
        # reads them there too (dspark_config.py: dspark_* keys, then dspark_config, then the
        # top level), its gamma is the top-level block_size and it refuses a config without
        # markov_head_type
        return {**out, "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": c.confidence_head,
                "confidence_head_with_markov": c.confidence_head, "sample_from_anchor": True,
                "draftsmith": {**out["draftsmith"], "num_speculative_tokens": c.block_size}}

    def expected_shapes(self, config: dict) -> dict[str, tuple]:
        V, H, r = config["vocab_size"], config["hidden_size"], config["markov_rank"]
        shapes = {**super().expected_shapes(config), "markov_head.markov_w1.weight": (V, r),
                  "markov_head.markov_w2.weight": (config.get("draft_vocab_size") or V, r)}
        if config.get("enable_confidence_head"):
            width = H + (r if config.get("confidence_head_with_markov") else 0)
            shapes.update({"confidence_head.proj.weight": (1, width),
                           "confidence_head.proj.bias": (1,)})
        return shapes

    def check_export(self, c, tensors, engine, target_num_layers) -> list[str]:
        problems = super().check_export(c, tensors, engine, target_num_layers)
        if not c.get("markov_rank"):
            problems.append("no top-level markov_rank: vLLM builds DSpark's Markov head from "
                            "it and fails to load without it")
        if (c.get("dflash_config") or {}).get("markov_rank") is not None:
            problems.append("markov_rank inside dflash_config: vLLM reads it at the top level "
                            "only")
        head = c.get("markov_head_type")
        if head is None and engine.name == "sglang":
            problems.append("no markov_head_type: SGLang refuses a DSpark config without it "
                            "(write markov_head_type: vanilla)")
        elif head not in (None, "vanilla"):
            problems.append(f"markov_head_type {head!r}: this drafter has the vanilla head "
                            "(vLLM implements it alone; SGLang would look for the other head's "
                            "weights)")
        if c.get("sample_from_anchor") is False or c.get("dspark_bonus_anchor"):
            problems.append("sample_from_anchor: false (vLLM 0.32; dspark_bonus_anchor: true "
                            "in vLLM 0.26) makes vLLM run DFlash's layout (the anchor not "
                            "drafting), not the one this drafter was trained on")
        has_head = any(n.startswith("confidence_head.") for n in tensors)
        if has_head and not c.get("enable_confidence_head"):
            problems.append("confidence_head tensors without enable_confidence_head: vLLM "
                            "drops the head")
        return problems


DSPARK = DSpark()
