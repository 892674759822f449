"""P-EAGLE (arXiv 2602.01469, as SpecForge 0.2 and speculators port it): EAGLE-3 drafting all k
tokens of a step in one forward, served by vLLM's `parallel_drafting`.

At inference the drafter takes EAGLE-3's step 0 (the last verified token and its target
state) and k - 1 slots at the next positions, each fed the mask token's embedding and a learned
`mask_hidden` (a stand-in for the target's concatenated aux states, through the same fc). Slot
d attends to the verified keys and to slots 1..d: TTT's attention, with depth d's inputs fixed
instead of read from depth d - 1. So training is EAGLE-3's unroll (eagle3.py) with those
inputs, depth d at chain t (position t + d) judged against the target where TTT's step d is.

The loss is COD's (conditional drop-token sampling): depth 0 at every counted position; depth
d at a random subset of the chains drawn at depth d - 1 whose depth-d target counts,
int((N - d) * max(r^d, r_min)) of them per row (N: the row's counted positions, r:
`down_sample_ratio`); soft cross-entropy to the target's distribution over the draft vocab, one
mean over every drawn slot, whatever its depth. Every depth is computed at every position
(TTT's cost): the ports gather only the drawn slots, a saving not taken here. Evaluation counts
every slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.eagle3 import Eagle3, Eagle3Drafter, TTTObjective
from draftsmith.errors import DraftsmithError


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, c):
        super().__init__(c)
        # vLLM reads it as [1, n_aux * Ht] (view(1, -1)) and runs it through fc at load
        self.mask_hidden = nn.Parameter(
            torch.randn(1, 1, len(c.aux_layers) * c.target_hidden_size) * 0.02)

    def mask_state(self, like):
        """The state every mask slot starts from: fc(mask_hidden), (1, 1, H)."""
        return self.fused(self.mask_hidden.to(like.dtype))

    def later_inputs(self, emb_qkv, j, T, prenorm, w_emb):
        B = prenorm.shape[0]
        mask = self.embed_tokens.weight[self.config.mask_token_id].to(prenorm.dtype)
        e = F.linear(self.midlayer.input_layernorm(mask), w_emb)
        return e.expand(B, T, -1), self.mask_state(prenorm).expand(B, T, -1)

    def chain_inputs(self, token, prenorm):
        return torch.full_like(token, self.config.mask_token_id), self.mask_state(prenorm)


def cod_sample(counted: list, ratio: float, ratio_min: float, seed: int) -> list:
    """COD's drawn slots: counted[d] (B, T - 1 - d) bool, chain t's depth-d slot counts ->
    the same masks, depth d >= 1 thinned as the module docstring says. On the device, no host
    sync."""
    g = torch.Generator(counted[0].device).manual_seed(seed)
    n_valid = counted[0].sum(1)
    drawn = [counted[0]]
    for d in range(1, len(counted)):
        cand = drawn[-1][:, :counted[d].shape[1]] & counted[d]
        n = ((n_valid - d).clamp_min(0) * max(ratio ** d, ratio_min)).floor().long()
        score = torch.rand(cand.shape, generator=g, device=cand.device).masked_fill(~cand, -1.0)
        rank = score.argsort(1, descending=True).argsort(1)
        drawn.append(cand & (rank < n[:, None]))
    return drawn


class CODObjective(TTTObjective):
    """TTT's fused soft cross-entropy over COD's drawn slots, one mean over all of them."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.weights = [1.0] * cfg.ttt_steps
        self.ratio, self.ratio_min = cfg.peagle.down_sample_ratio, cfg.peagle.down_sample_ratio_min

    def __call__(self, model, batch, seed, per_step_count=None):
        from draftsmith.drafters.losses import target_view, ttt_loss

        # training draws (autograd on); evaluation (no_grad) counts every slot
        keep = (lambda counted: cod_sample(counted, self.ratio, self.ratio_min, seed)) \
            if torch.is_grad_enabled() else None
        view = target_view(batch, self.head, self.draft_ids, self.t2d)
        return ttt_loss(model, batch, view, self.positions, self.weights, self.kind,
                        attend=self.attention_for(batch.doc), dtype=self.dtype,
                        per_step_count=per_step_count, keep=keep, pooled=True)


class PEagle(Eagle3):
    """EAGLE-3 with a mask slot per depth; vLLM serves it as method eagle3 with
    parallel_drafting (llama_eagle3.py: `mask_hidden` required, the mask token from
    `mask_token_id` or `pard_token`)."""

    architectures = {"llama": "LlamaForCausalLMEagle3"}
    engine_names = {"vllm": "eagle3"}
    speculative_config = {"vllm": {"parallel_drafting": True}}

    def __init__(self):
        super().__init__(v31=False)
        self.name, self.label = "p-eagle", "P-EAGLE"
        self.reference = "arXiv 2602.01469; vLLM llama_eagle3.py parallel_drafting"

    def config_fields(self, cfg, target_config, mask_token_id) -> dict:
        return {**super().config_fields(cfg, target_config, mask_token_id),
                "method": self.name, "mask_token_id": mask_token_id,
                "block_size": cfg.ttt_steps}  # the depths trained

    def mask_token(self, target_dir, vocab_size):  # chosen as DFlash's is
        from draftsmith.drafters.dflash import mask_token_id
        from draftsmith.target_info import load_tokenizer

        return mask_token_id(load_tokenizer(target_dir), vocab_size)

    def model(self, c):
        return PEagleDrafter(c)

    def objective(self, cfg, c, head, d2t, t2d, *, device, dtype, attention, compile):
        from draftsmith.vocab import draft_ids_from_d2t

        return CODObjective(cfg, head.lm_head.to(device, dtype),
                            draft_ids_from_d2t(d2t).to(device), t2d.to(device), dtype=dtype,
                            attention=attention, compile=compile)

    def check_k(self, c, k):
        if k > c.block_size:
            raise DraftsmithError(
                f"this P-EAGLE drafter was trained on {c.block_size} depths and is asked for "
                f"{k} draft tokens a step: the slots past depth {c.block_size} were never "
                "trained", f"set benchmark.num_speculative_tokens <= {c.block_size}, or "
                f"train with train.ttt_steps: {k}")

    def draft_cost(self, c, k, tau) -> dict:
        # EAGLE-3's FLOPs, in one forward: the new positions and k - 1 mask slots at once
        fc, layer, head = self._weights(c)
        return {**super().draft_cost(c, k, tau), "forwards": 1,
                "bytes": 2 * (fc + layer + head)}

    def export_config(self, c, engine) -> dict:
        # vLLM's proposer reads the mask token from mask_token_id (or pard_token)
        return {**super().export_config(c, engine), "mask_token_id": c.mask_token_id,
                "pard_token": c.mask_token_id, "draftsmith": {"depths_trained": c.block_size}}

    def expected_shapes(self, config: dict) -> dict[str, tuple]:
        n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        return {**super().expected_shapes(config),
                "mask_hidden": (1, 1, n_aux * config["target_hidden_size"])}

    def check_export(self, c, tensors, engine, target_num_layers) -> list[str]:
        problems = super().check_export(c, tensors, engine, target_num_layers)
        if c.get("mask_token_id") is None and c.get("pard_token") is None:
            problems.append("no mask_token_id (or pard_token): vLLM's parallel drafting has "
                            "no token for its mask slots and refuses the drafter")
        return problems


PEAGLE = PEagle()
