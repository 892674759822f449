"""DFlash (arXiv 2602.06036; served by vLLM's qwen3_dflash.py): a block drafted in one forward.

    target aux states --fc--> hidden_norm --> context c (H), one per verified position
    block: [anchor token, MASK, ..., MASK]  (block_size tokens, the target's frozen embedding)
       -> num_layers Qwen3 decoder layers; each layer's attention reads the block's own keys
          (bidirectional) and the context's keys and values: that layer's k/v projections of
          c (no input norm), at the context's positions
       -> norm -> the target's lm_head (frozen, full vocab): slot k drafts the token at
          anchor + k, for k = 1 .. block_size - 1

The anchor is the token the target has just emitted, at position a; the context is every
position before it (the target has no state at a yet). One forward drafts block_size - 1
tokens, so an engine must ask for exactly that many (vLLM never reads the block size: its
num_speculative_tokens decides how many masks follow the anchor, and with bidirectional
attention a different count changes every draft).

Training (the paper's objective, as SpecForge implements it): up to `anchors` random anchors
per row among response positions whose next token is a response token too; each block sees
the context strictly before its anchor (same document) and itself; hard cross-entropy to the
data's tokens at anchor + k, weighted exp(-(k - 1) / gamma), over the sum of weights.
`loss: d-pace` (ModelOpt 0.46's default, speculators' since 2026-08) weights each slot instead
by how likely the draft is to get there and what follows it is worth (`dpace_weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.base import DrafterConfig, Method, Objective, Proposer, pick
from draftsmith.drafters.layers import (MLP, Attention, KVCache, RMSNorm, accum,
                                        decode_attention, repeat_kv)
from draftsmith.errors import DraftsmithError


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer (per-head q/k norms) whose attention also reads the context."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, c.hidden_size, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def pre(self, x, pos):
        """The block's stream (B, Q, H) -> its q (B, nh, Q, hd), k and v (B, nkv, Q, hd)."""
        return self.self_attn.qkv(self.input_layernorm(x), pos)

    def post(self, x, attn):
        """Residual stream + attention output (B, nh, Q, hd) -> the layer's output (B, Q, H)."""
        B, nh, Q, hd = attn.shape
        x = x + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, Q, nh * hd))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen, never saved

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for shared in (self.embed_tokens, self.lm_head):
            shared.weight.requires_grad_(False)

    def context(self, aux):
        """The target's aux states (B, S, n * Ht) -> the context states (B, S, H)."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, ctx, pos) -> list:
        """Each layer's keys and values of the context (B, S, H) at positions pos."""
        return [layer.self_attn.kv(ctx, pos) for layer in self.layers]

    def blocks(self, ids, pos, ctx_kv: list, attend):
        """Block tokens ids (B, Q) at positions pos -> final states (B, Q, H).
        attend(q, kc, vc, kb, vb): attention of the block's queries over the context's keys
        and values (kc, vc) and the blocks' own (kb, vb)."""
        x = self.embed_tokens(ids)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            q, k, v = layer.pre(x, pos)
            x = layer.post(x, attend(q, kc, vc, k, v))
        return self.norm(x)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- training


def sample_anchors(batch, n: int, seed: int):
    """Up to n anchors per row, drawn uniformly among positions a where x[a] and x[a + 1] are
    response tokens of the same sample. -> (anchors (B, n) ascending, keep (B, n): a real
    anchor, not filler). On the batch's device, no host sync: the shapes never change."""
    m, doc = batch.loss_mask, batch.doc
    valid = m & F.pad(m[:, 1:] & (doc[:, 1:] == doc[:, :-1]), (0, 1)) & (doc >= 0)
    g = torch.Generator(valid.device).manual_seed(seed)
    score = torch.rand(valid.shape, generator=g, device=valid.device).masked_fill(~valid, -1.0)
    top = score.topk(n, dim=1)
    anchors, order = top.indices.sort(dim=1)
    return anchors, top.values.gather(1, order) >= 0


def context_mask(anchors, keep, doc, block: int):
    """(B, Q, S) bool, Q = n anchors x block: block j's queries see the context before its
    anchor, in its sample, when it is a real anchor (and always every slot of their own
    block, which `block_attention` adds)."""
    S = doc.shape[1]
    j = torch.arange(anchors.shape[1] * block, device=doc.device) // block
    a = anchors[:, j]  # (B, Q)
    return (torch.arange(S, device=doc.device) < a[..., None]) \
        & (doc[:, None, :] == doc.gather(1, a)[..., None]) & keep[:, j, None]


def block_attention(q, kc, vc, kb, vb, ctx_allowed, block: int):
    """The reference attention (dense over the context, per block over the blocks: no Q x Q
    scores): q (B, nh, Q, hd); kc, vc (B, nkv, S, hd); kb, vb (B, nkv, Q, hd); ctx_allowed
    (B, Q, S). Each query attends to the context it is allowed and its own block's B slots."""
    B, nh, Q, hd = q.shape
    N = Q // block
    kc, vc, kb, vb = (repeat_kv(t, nh) for t in (kc, vc, kb, vb))
    s_ctx = (q @ kc.transpose(-1, -2)).masked_fill(~ctx_allowed[:, None], float("-inf"))
    qb = q.view(B, nh, N, block, hd)
    s_blk = (qb @ kb.view(B, nh, N, block, hd).transpose(-1, -2)).view(B, nh, Q, block)
    p = torch.softmax((torch.cat([s_ctx, s_blk], -1) / math.sqrt(hd)).to(accum(q.dtype)), -1) \
        .to(q.dtype)
    S = kc.shape[2]
    own = p[..., S:].reshape(B, nh, N, block, block) @ vb.view(B, nh, N, block, hd)
    return p[..., :S] @ vc + own.view(B, nh, Q, hd)


def joined_attention(attn, q, kc, vc, kb, vb, **kw):
    """`attn` (decode or flex attention) over the context's and the block's keys, joined."""
    return attn(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), **kw)


def flex_mask(anchors, keep, doc, block: int):
    """`context_mask` and the own-block slots as one flex-attention block mask over the keys
    [context ; blocks] (blocks of 128 x 128 that it rules out are
    never computed: a block sees its own slots and a prefix of its sample)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors.shape
    S = doc.shape[1]
    anchor_doc = doc.gather(1, anchors)

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block
        in_ctx = kv_idx < S
        ctx = in_ctx & (kv_idx < anchors[b, j]) & keep[b, j] \
            & (doc[b, torch.clamp(kv_idx, max=S - 1)] == anchor_doc[b, j])
        return ctx | (~in_ctx & ((kv_idx - S) // block == j))

    return create_block_mask(mask_mod, B, None, N * block, S + N * block, device=doc.device,
                             _compile=doc.is_cuda)


def dpace_weights(ce: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's slot weights (arXiv 2605.18810, as ModelOpt's hf_dflash.py and speculators'
    losses/utils.py compute them; docs/research/dspark-peagle-dpace.md section 3), for
    (..., slots) cross-entropies of one block's drafted slots and whether each counts:
    q_k = (1 - alpha) exp(-CE_k) + alpha (1 where slot k does not count), the draft's smoothed
    chance of its label; C_k = q_1 ... q_k, of reaching slot k and getting it; w_k = the sum of
    C_j over the counted slots j >= k, for a counted k (0 otherwise). Without gradient."""
    ce, m = ce.detach(), counted.to(ce.dtype)
    q = torch.where(counted, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
    c = torch.cumprod(q, -1)
    return m * (m * c).flip(-1).cumsum(-1).flip(-1)


class BlockObjective(Objective):
    """DFlash's loss (module docstring): cross-entropy at each block slot k >= 1, weighted
    exp(-(k - 1) / gamma), over the sum of the counted slots' weights. To the data's token
    (loss: ce, the paper's), or to the target's whole distribution for that position, its
    final state at a + k - 1 through its head (loss: soft_ce, ModelOpt's distillation; the
    teacher's logits for every drafted slot of a batch exist at once: rows x vocab), or to the
    data's token weighted by D-PACE (loss: d-pace, gamma unused; over the sum of the weights,
    as ModelOpt normalises, so the loss stays on the cross-entropy's scale)."""

    def __init__(self, cfg, c: DrafterConfig, *, dtype, flex: bool, compile: bool):
        """flex: the GPU's block-sparse attention (else the dense reference)."""
        self.block, self.anchors, self.mask_id = c.block_size, cfg.dflash.anchors, c.mask_token_id
        self.positions = c.block_size - 1
        self.weights = [math.exp(-k / cfg.dflash.gamma) for k in range(self.positions)]
        self.soft = cfg.dflash.loss == "soft_ce"
        self.dpace = cfg.dflash.dpace_alpha if cfg.dflash.loss == "d-pace" else None
        self.dtype, self.flex = dtype, flex
        if flex:
            from draftsmith.drafters.ttt_flex import _flex

            self.attn = _flex() if compile else None

    def __call__(self, model, batch, seed, per_step_count=None):
        B, T = batch.ids.shape
        s = block_states(self, model, batch, seed, span=self.block)
        ids, at = s.ids, s.at
        counted = (s.keep[..., None] & (at < T) & (s.doc == s.doc[..., :1])
                   & s.mask)[..., 1:]  # (B, N, blk - 1)
        h = s.h[:, :, 1:]  # the drafted slots
        counts = counted.sum((0, 1))  # per slot
        divide_by = counts.clamp_min(1) if per_step_count is None else per_step_count(counts)
        acc = accum(self.dtype)
        w = torch.tensor(self.weights, dtype=acc, device=h.device)
        scale = counted.to(acc) * w / (w * divide_by.to(acc)).sum()
        from draftsmith.drafters.losses import CHUNK_ROWS, LinearCE, LinearSoftCE, SharedGrad, ce_chunk_rows

        x, head = h.reshape(B, -1, h.shape[-1]), model.lm_head.weight
        if self.soft:  # the target's own distribution for the token at a + k
            with torch.no_grad():
                before = (at[..., 1:] - 1).clamp(max=T - 1).view(B, -1)
                final = batch.final.gather(1, before[..., None].expand(-1, -1, x.shape[-1]))
                teacher = final.to(head.dtype) @ head.T
            loss, ce, agree = LinearSoftCE.apply(x, head, teacher, scale.view(B, -1), self.dtype,
                                                 False, CHUNK_ROWS, SharedGrad())
        else:
            row_scale = (scale.view(B, -1) if self.dpace is None  # else from LinearCE's CEs
                         else lambda ce: self.dpace_scale(ce, counted, per_step_count))
            loss, ce, agree = LinearCE.apply(x, head, ids[..., 1:].reshape(B, -1), row_scale,
                                             self.dtype, ce_chunk_rows(model.config.vocab_size))
        ce, agree = ce.view_as(counted), agree.view_as(counted)
        stats = torch.stack([(ce * counted).sum((0, 1)) / counts.clamp_min(1),
                             (agree & counted).sum((0, 1)).to(acc), counts.to(acc)], -1)
        return loss, stats.float()


    def dpace_scale(self, ce, counted, per_step_count):
        """Each drafted row's share of the loss under D-PACE: its weight over the weights'
        sum (the global batch's under data parallel)."""
        w = dpace_weights(ce.view_as(counted), counted, self.dpace)
        total = w.sum().view(1)
        z = (total.clamp_min(1e-12) if per_step_count is None
             else per_step_count(total, floor=1e-12))
        return (w / z).view(ce.shape)


@dataclass
class BlockStates:
    """A batch's blocks through the backbone (`block_states`): h (B, N, blk, H) the final
    states of each anchor's block; over the `span` positions a .. a + span - 1 of each anchor:
    ids, doc, mask (loss mask), at (the positions, unclamped: past T where a block runs off
    the row); anchors (B, N) and keep (B, N) as `sample_anchors` gives them."""
    h: torch.Tensor
    ids: torch.Tensor
    doc: torch.Tensor
    mask: torch.Tensor
    at: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor


def block_states(objective: BlockObjective, model, batch, seed: int, span: int) -> BlockStates:
    """Draw the anchors and run every block [anchor, masks] of the batch through the backbone
    in one forward, under the objective's attention (flex's block mask, or the dense
    reference); gather `span` positions from each anchor on (DFlash's labels lie inside the
    block, DSpark's one past it)."""
    B, T = batch.ids.shape
    blk = objective.block
    anchors, keep = sample_anchors(batch, min(objective.anchors, T), seed)
    N = anchors.shape[1]
    at = anchors[..., None] + torch.arange(span, device=anchors.device)  # (B, N, span)

    def gather(t):
        return t.gather(1, at.clamp(max=T - 1).view(B, -1)).view(B, N, span)

    ids = gather(batch.ids)
    block_ids = torch.cat([ids[..., :1], torch.full_like(ids[..., 1:blk], objective.mask_id)],
                          -1)
    block_pos = gather(batch.pos)[..., :1] + torch.arange(blk, device=at.device)
    if objective.flex:
        from torch.nn.attention.flex_attention import flex_attention

        mask = flex_mask(anchors, keep, batch.doc, blk)
        attn = objective.attn or flex_attention
        attend = lambda q, kc, vc, kb, vb: joined_attention(  # noqa: E731
            attn, q, kc, vc, kb, vb, block_mask=mask, enable_gqa=kc.shape[1] != q.shape[1])
    else:
        mask = context_mask(anchors, keep, batch.doc, blk)
        attend = lambda q, kc, vc, kb, vb: block_attention(  # noqa: E731
            q, kc, vc, kb, vb, mask, blk)
    ctx = model.context(batch.aux.to(model.fc.weight.dtype))
    h = model.blocks(block_ids.view(B, -1), block_pos.view(B, -1),
                     model.context_kv(ctx, batch.pos), attend)
    return BlockStates(h.view(B, N, blk, -1), ids, gather(batch.doc), gather(batch.loss_mask),
                       at, anchors, keep)


# ----------------------------------------------------------------------------- inference


class DFlashProposer(Proposer):
    """The reference engine's DFlash drafts: the context's keys and values are cached per
    layer as positions are verified; each round runs one block [last token, k masks]."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter.eval()
        self.caches = [KVCache() for _ in drafter.layers]

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen):
        logits = self.drafter.lm_head(self.block_states(aux, ids, k)[1:])  # (k, V)
        drafts, qs = zip(*(pick(row, temperature, gen) for row in logits))
        return torch.stack(drafts), (None if qs[0] is None else torch.stack(qs))

    def block_states(self, aux, ids, masks: int):
        """Cache the context's new positions, then run the block [ids[-1], `masks` masks]:
        -> its final states (1 + masks, H)."""
        d = self.drafter
        n, m = len(ids), len(aux)
        if m == n - 1:
            self.caches = [KVCache() for _ in d.layers]
        start = self.caches[0].length
        assert start + m == n - 1, "aux must cover the positions the drafter lacks"
        device = ids.device
        ctx = d.context(aux[None].to(d.fc.weight.dtype))
        ctx_kv = []
        for cache, (kc, vc) in zip(self.caches, d.context_kv(ctx, torch.arange(start, n - 1,
                                                                                device=device))):
            ctx_kv.append(cache.write(start, kc, vc))
            cache.length = n - 1
        block = torch.cat([ids[-1:], torch.full((masks,), d.config.mask_token_id,
                                                device=device)])
        return d.blocks(block[None], torch.arange(n - 1, n + masks, device=device), ctx_kv,
                        lambda *qkv: joined_attention(decode_attention, *qkv))[0]  # no mask


# ----------------------------------------------------------------------------- the method


class DFlash(Method):
    name, label = "dflash", "DFlash"
    architectures = {"llama": "DFlashDraftModel"}  # vLLM's qwen3_dflash.py (Qwen3 layers)
    engine_names = {"vllm": "dflash", "sglang": "DFLASH"}
    aux_ids_key = ("dflash_config", "target_layer_ids")
    reference = "arXiv 2602.06036; vLLM qwen3_dflash.py, v1/spec_decode/dflash.py"
    CONVENTION = ("dflash_config.target_layer_ids: id i = output of target layer i (the state "
                  "entering layer i + 1; vLLM adds the one)")

    def config_fields(self, cfg, target_config, mask_token_id) -> dict:
        return {"method": self.name, "num_layers": cfg.dflash.num_layers,
                "block_size": cfg.dflash.block_size, "mask_token_id": mask_token_id,
                "draft_vocab_size": target_config.vocab_size}  # the target's head

    def model(self, c):
        if not c.block_size or c.mask_token_id is None:
            raise ValueError("a DFlash drafter needs block_size and mask_token_id")
        return DFlashDrafter(c)

    def mask_token(self, target_dir, vocab_size):
        from draftsmith.target_info import load_tokenizer

        return mask_token_id(load_tokenizer(target_dir), vocab_size)

    def init_from_target(self, model, head, d2t, t2d, copy):
        if copy:  # its states go through the target's own head: the target's final norm
            model.norm.weight.data.copy_(head.norm.float())

    def objective(self, cfg, c, head, d2t, t2d, *, device, dtype, attention, compile):
        # train.attention: flash or cudnn is refused for DFlash (config.py): flex on a GPU
        return BlockObjective(cfg, c, dtype=dtype, flex=attention != "reference",
                              compile=compile)

    def compile(self, model):
        for layer in model.layers:
            layer.pre = torch.compile(layer.pre, dynamic=False)
            layer.post = torch.compile(layer.post, dynamic=False)
            layer.self_attn.kv = torch.compile(layer.self_attn.kv, dynamic=False)
        model.norm.forward = torch.compile(model.norm.forward, dynamic=False)

    def proposer(self, model):
        return DFlashProposer(model)

    def check_k(self, c, k):
        if k != c.block_size - 1:
            raise DraftsmithError(
                f"this DFlash drafter was trained on blocks of {c.block_size} (the anchor and "
                f"{c.block_size - 1} masks) and is asked for {k} draft tokens a step: with "
                "bidirectional attention in the block every draft would change",
                f"set benchmark.num_speculative_tokens: {c.block_size - 1}, or train with "
                f"train.dflash.block_size: {k + 1}")

    def draft_cost(self, c, k, tau) -> dict:
        return self._block_cost(c, k, tau, slots=k + 1, markov=0)  # the anchor and k masks

    @staticmethod
    def _block_cost(c: dict, k: int, tau: float, slots: int, markov: int) -> dict:
        """One forward over a block of `slots` (the context's K/V for the tau new positions),
        k drafts through the target's head, each also reading `markov` weights."""
        H, V, L = c["hidden_size"], c["vocab_size"], c["num_layers"]
        nh, nkv, hd = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        fc = len(c["aux_layers"]) * c["target_hidden_size"] * H
        layer = H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * c["intermediate_size"]
        kv, head = H * 2 * nkv * hd, V * H  # the target's own lm_head, full vocab
        flops = 2 * (tau * (fc + L * kv) + slots * L * layer + k * (head + markov))
        return {"forwards": 1, "flops": flops, "bytes": 2 * (fc + L * layer + head + k * markov)}

    def export_config(self, c, engine) -> dict:
        return {
            "model_type": "qwen3", "num_hidden_layers": c.num_layers,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            # qwen3_dflash.py's own default theta is 1e6, not the target's: always written
            "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "use_sliding_window": False,  # every layer full attention: bidirectional blocks
            "draft_vocab_size": c.vocab_size,  # the target's head and vocab: no d2t
            "block_size": c.block_size,  # read by SGLang; vLLM: num_speculative_tokens = this - 1
            "dflash_config": {"mask_token_id": c.mask_token_id,
                              "target_layer_ids": [k - 1 for k in c.aux_layers]},
            "draftsmith": {"aux_layer_convention": self.CONVENTION,
                           "num_speculative_tokens": c.block_size - 1},
        }

    def expected_shapes(self, config: dict) -> dict[str, tuple]:
        c = config
        H, Ht, I = c["hidden_size"], c["target_hidden_size"], c["intermediate_size"]
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        n_aux = len(c["dflash_config"]["target_layer_ids"])
        shapes = {"fc.weight": (H, n_aux * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nh * hd, H),
                p + "self_attn.k_proj.weight": (nkv * hd, H),
                p + "self_attn.v_proj.weight": (nkv * hd, H),
                p + "self_attn.o_proj.weight": (H, nh * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I)})
        return shapes

    def check_export(self, c: dict, tensors: dict, engine, target_num_layers: int) -> list[str]:
        problems = []
        dc = c.get("dflash_config") or {}
        ids = dc.get("target_layer_ids")
        if not ids:
            return ["dflash_config.target_layer_ids is missing (the engine would read no "
                    "context states)"]
        if any(not -1 <= i < target_num_layers for i in ids):
            problems.append(f"dflash_config.target_layer_ids {ids} out of range for a "
                            f"{target_num_layers}-layer target (id i = output of layer i)")
        trained = c.get("draftsmith", {}).get("aux_layers_vllm_convention")
        if trained is not None and ids != [k - 1 for k in trained]:
            problems.append(f"dflash_config.target_layer_ids {ids} do not match the layers "
                            f"trained on ({[k - 1 for k in trained]}: {self.CONVENTION})")
        if ids != sorted(ids):
            problems.append(f"dflash_config.target_layer_ids {ids} are not ascending: vLLM "
                            "concatenates the states in layer order whatever the list's order")
        top = c.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and top != [i + 1 for i in ids]:
            problems.append(f"top-level eagle_aux_hidden_state_layer_ids {top} overrides "
                            f"dflash_config.target_layer_ids {ids} in vLLM (read without the "
                            "+1): remove it")
        mask = dc.get("mask_token_id", c.get("mask_token_id"))
        if mask is None:
            problems.append("dflash_config.mask_token_id is missing (vLLM refuses to start)")
        elif not 0 <= mask < c.get("vocab_size", 0):
            problems.append(f"mask_token_id {mask} is outside the target's vocab")
        if c.get("is_causal") or dc.get("causal"):
            problems.append("the block is causal in this config, but the drafter was trained "
                            "with bidirectional blocks: remove is_causal / dflash_config.causal")
        if "lm_head.weight" in tensors and c.get("draft_vocab_size", c.get("vocab_size")) \
                != c.get("vocab_size") and "d2t" not in tensors:
            problems.append("a draft vocab smaller than the target's without d2t")
        return problems


DFLASH = DFlash()


def mask_token_id(tokenizer, vocab_size: int) -> int:
    """The target token whose (frozen) embedding fills a block's masked slots, chosen as
    SpecForge chooses it: the tokenizer's mask token, else the first embedding row no token
    uses, else the pad token, else the end-of-sequence token."""
    unused = len(tokenizer) if len(tokenizer) < vocab_size else None
    for candidate in (tokenizer.mask_token_id, unused, tokenizer.pad_token_id,
                      tokenizer.eos_token_id):
        if candidate is not None and 0 <= candidate < vocab_size:
            return candidate
    raise DraftsmithError("the target's tokenizer has no mask, pad or end-of-sequence token "
                          "and its embedding no unused row, so DFlash has no mask token",
                          "add a mask token to the target's tokenizer (and an embedding row)")
