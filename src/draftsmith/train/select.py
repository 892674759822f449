"""`train.select: best_acceptance`: the checkpoint that serves best, not the last one.

Each checkpoint (every `train.save_every` steps) and the last step are scored by the
reference engine's acceptance length (speculative.py, greedy: tokens per target
forward, the bonus included) on the prompts of held-out samples, the ones the per-step accuracy
is measured on and never trained on. The best scoring weights are kept (on the CPU, and in the
resume checkpoint) and are what the stage saves; a tie goes to the later step. It needs the
whole target: on the toy a scoring takes a second or two, on a large target it runs the target
forward as the benchmark does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.checkpoint import attach_shared
from draftsmith.config import TrainConfig
from draftsmith.drafters.registry import METHODS, build
from draftsmith.errors import DraftsmithError


def end_of_turn_id(target_dir) -> int:
    """The token generation stops at, as the benchmark has it."""
    from draftsmith.target_info import load_tokenizer, read_info

    end_of_turn = read_info(target_dir).format.end_of_turn
    return load_tokenizer(target_dir).convert_tokens_to_ids(end_of_turn)


def prompt_ids(ids: torch.Tensor, loss_mask: torch.Tensor) -> list[int] | None:
    """A sample's prompt: its tokens before the first one trained on (None: none is)."""
    trained = loss_mask.nonzero()
    if len(trained) == 0 or int(trained[0]) == 0:
        return None
    return ids[: int(trained[0])].tolist()


class AcceptanceScorer:
    """The target and the held-out prompts, loaded once; `score` runs the reference engine."""

    def __init__(self, cfg: TrainConfig, load_target, eos_id: int):
        """load_target(device) -> the whole target model; eos_id: its end of turn."""
        self.cfg, self.load_target, self.eos_id = cfg, load_target, eos_id
        self.target, self.prompts = None, []

    def check(self, drafter_config) -> None:
        """Before training: the drafter can propose select_k tokens a step."""
        try:
            METHODS[drafter_config.method].check_k(drafter_config, self.cfg.select_k)
        except DraftsmithError as e:
            raise DraftsmithError(f"train.select_k: {e.problem}",
                                  f"set train.select_k to the k you serve with ({e.fix})"
                                  ) from None

    def start(self, device: torch.device, prompts: list[list[int]]) -> None:
        if not prompts:
            raise DraftsmithError("train.select: best_acceptance found no held-out sample with "
                                  "a prompt (every token of them is trained on)",
                                  "raise train.eval_samples, or set train.select: last")
        self.target = self.load_target(device)
        if self.target.device.type == "cpu":
            self.target = self.target.float()  # CPU kernels for bf16 are slow, or missing
        self.prompts = prompts[: self.cfg.select_samples]

    @torch.no_grad()
    def score(self, drafter_config, weights: dict, step: int) -> float:
        from draftsmith.speculative import measure

        model = build(drafter_config)
        model.load_state_dict(weights, strict=False)
        attach_shared(model, self.target)
        model = model.to(self.target.device, self.target.dtype).eval()
        summary, _ = measure(self.target, METHODS[drafter_config.method].proposer(model),
                             self.prompts, k=self.cfg.select_k,
                             aux_layers=list(drafter_config.aux_layers),
                             max_new_tokens=self.cfg.select_new_tokens, eos_id=self.eos_id,
                             temperature=0.0, seed=0, desc=f"select: step {step}")
        return summary["acceptance_length"]


@dataclass
class BestCheckpoint:
    """The scores so far ({step, acceptance_length}) and the best one's step and weights."""
    scores: list[dict] = field(default_factory=list)
    best_step: int | None = None
    best: dict | None = None

    def consider(self, step: int, trainer, scorer: AcceptanceScorer) -> None:
        """Score the trainer's weights now. Every process calls it (under FSDP2 the weights
        are gathered from all); the main one scores, and every process learns its score."""
        w = trainer.world
        weights = trainer.weights()
        score = torch.zeros((), dtype=torch.float64)
        if w.main:
            score += scorer.score(trainer.model.config, weights, step)
        if w.size > 1:
            score = w.sum_(score.to(trainer.rt.device)).cpu()
        score = round(float(score), 4)
        self.scores.append({"step": step, "acceptance_length": score})
        if self.best_step is None or score >= self.best_score():
            self.best_step, self.best = step, weights

    def best_score(self) -> float:
        return next(s["acceptance_length"] for s in self.scores if s["step"] == self.best_step)

    def state(self) -> dict:
        """What a resume checkpoint keeps of it (the weights apart)."""
        return {"scores": self.scores, "best_step": self.best_step}
