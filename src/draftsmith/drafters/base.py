"""A drafter's shape (DrafterConfig, saved beside its weights) and the interface every method
implements (Method): what train, the reference engine, export and validate ask of it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from draftsmith.drafters.options import DEFAULT_METHOD

if TYPE_CHECKING:  # annotations only (tools/code_deps.py does not count these as deps)
    import torch
    from torch import nn

    from draftsmith.config import TrainConfig
    from draftsmith.serving.engines import Engine
    from draftsmith.drafters.batch import Batch


@dataclass
class DrafterConfig:
    hidden_size: int  # = the target's: the embedding table is shared
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocab
    draft_vocab_size: int  # = vocab_size when the drafter drafts over the target's vocab
    aux_layers: tuple[int, ...]  # vLLM convention: id k = hidden state entering target layer k
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    arch: str = "llama"  # llama: GQA (num_kv_heads, head_dim); mla: the fields below
    q_lora_rank: int | None = None  # MLA: None = one q_proj, no low-rank query
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    method: str = DEFAULT_METHOD  # train.method: which module of drafters/ builds and runs it
    # EAGLE-3.1 (vLLM's llama_eagle3.py / deepseek_eagle3.py flags of the same names)
    fc_norm: bool = False  # an RMSNorm per aux state before fc
    norm_output: bool = False  # the next draft step reads the final norm's output
    # DFlash and DSpark (and P-EAGLE's block_size)
    num_layers: int = 1  # decoder layers
    block_size: int = 0  # a block's tokens, the anchor included (DFlash drafts the k = block - 1
    # after it, DSpark k = block, the anchor's slot too); P-EAGLE: the depths trained, k at most
    mask_token_id: int | None = None  # the target token whose embedding fills masked slots
    # DSpark
    markov_rank: int = 0  # the Markov head's rank (W1 (V, r), W2 (V, r))
    confidence_head: bool = False  # a logit of each slot's acceptance from [h ; W1[prev]]

    def __post_init__(self):
        if self.arch not in ("llama", "mla"):
            raise ValueError(f"drafter arch {self.arch!r}: llama or mla")
        if self.arch == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim
                                       and self.v_head_dim):
            raise ValueError("an MLA drafter needs kv_lora_rank, qk_rope_head_dim, v_head_dim")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        """The inverse of to_dict; a drafter.json written before methods existed is EAGLE-3."""
        return cls(**{**d, "aux_layers": tuple(d["aux_layers"])})


def pick(logits, temperature: float, gen):
    """A token from logits (V,): the argmax at temperature 0, else a draw from
    softmax(logits / temperature) -> (token as a 0-d tensor on the logits' device, the
    distribution it was drawn from, or None at greedy)."""
    import torch

    if temperature <= 0:
        return logits.argmax(), None
    q = torch.softmax(logits.double() / temperature, -1)
    return torch.multinomial(q, 1, generator=gen)[0], q


class Proposer(ABC):
    """A method's drafts in the reference engine (speculative.py), for one sequence at a time."""

    @abstractmethod
    def propose(self, aux, ids, k: int, temperature: float, gen) -> tuple:
        """ids: the sequence so far (n tokens); aux: (m, n_aux * Ht) the target's aux states at
        the last m of its positions 0..n-2, those the proposer has not seen (m = n - 1: a new
        sequence). -> k target-vocab draft ids (k,) and, when sampling, the distribution each
        was drawn from over the target vocab (k, V); None at greedy."""


class Objective(ABC):
    """A method's training loss, set up once for a run (train.loop.Trainer calls it)."""

    positions: int  # rows of the per-position stats: TTT steps, or a block's drafted slots

    @abstractmethod
    def __call__(self, model: nn.Module, batch: Batch, seed: int, per_step_count=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (loss, per-position stats (positions, 3): [mean loss, correct, counted]), all
        on the device: nothing here may wait for the GPU. seed: the draw of any random choice
        the objective makes (the step, so a resumed run draws the same). per_step_count
        (counts, floor=1) -> what to divide by instead of this batch's own counts (data
        parallel: the global batch's, at least floor, over the world size; a sum of weights
        passes a smaller floor)."""


class Method(ABC):
    """One drafter method. A new method is a module that subclasses this, an entry in
    registry.METHODS and its name in options.py."""

    name: str  # train.method's value
    label: str  # for tables and messages
    # The drafter layers an engine loads this method with, and for each the architecture name
    # its config.json carries.
    architectures: dict[str, str]
    # engine name -> what that engine calls this method (vLLM's speculative_config.method,
    # SGLang's --speculative-algorithm); an engine missing here cannot serve it
    engine_names: dict[str, str]
    # engine name -> the engine's own speculative-config keys this method needs beside the
    # method's name (P-EAGLE: vLLM's parallel_drafting)
    speculative_config: dict[str, dict] = {}
    # where its exported config.json lists the target layers it reads (section, key)
    aux_ids_key: tuple[str, str]
    reference: str  # paper or engine file the implementation follows

    # --- the model
    @abstractmethod
    def config_fields(self, cfg: TrainConfig, target_config, mask_token_id: int | None) -> dict:
        """This method's DrafterConfig fields (method, flags, block size...) from train.* and
        the target's text config."""

    @abstractmethod
    def model(self, c: DrafterConfig) -> nn.Module:
        """A freshly initialised drafter of shape c. Its class's SHARED names the tensors taken
        from the target (frozen, never saved)."""

    @abstractmethod
    def init_from_target(self, model: nn.Module, head, d2t, t2d, copy: bool) -> None:
        """Set the vocab maps d2t/t2d (if the drafter has a draft vocab) and, with copy
        (train.init: copy), what the drafter takes from the target (head: TargetHead) besides
        the shared tensors."""

    def mask_token(self, target_dir, vocab_size: int) -> int | None:
        """The target token a drafter of this method drafts from where it has no token yet
        (DFlash's masked slots), from the target's tokenizer; None: it needs none."""
        return None

    def import_name(self, name: str) -> str:
        """A tensor name of an existing drafter of this method (train.init: models/init) in
        this code's naming."""
        return name

    # --- training
    @abstractmethod
    def objective(self, cfg: TrainConfig, c: DrafterConfig, head, d2t: torch.Tensor,
                  t2d: torch.Tensor, *, device, dtype, attention: str,
                  compile: bool) -> Objective:
        """The training loss for train.* (head: TargetHead; what the objective needs of it goes
        to `device` in `dtype`, the compute dtype). attention: the runtime's (reference, or a
        GPU kernel: flex, flash, cudnn); compile: torch.compile it."""

    def compile(self, model: nn.Module) -> None:
        """Compile the model's hot functions in place (train.compile)."""

    # --- inference
    @abstractmethod
    def proposer(self, model: nn.Module) -> Proposer:
        ...

    def check_k(self, c: DrafterConfig, k: int) -> None:
        """Raise DraftsmithError if this drafter cannot propose k tokens a step as trained."""

    @abstractmethod
    def draft_cost(self, c: dict, k: int, tau: float) -> dict:
        """What drafting k tokens costs per verification step at acceptance length tau (so tau
        new positions reach the drafter each step), from its drafter.json `c`: forwards, FLOPs
        (2 x the matmul weights each token passes through; attention left out, small at these
        lengths) and bytes (the bf16 weights a step reads: what bounds a forward at batch 1).
        benchmarks/methods.py turns it into the implied speed-up."""

    # --- export
    @abstractmethod
    def export_config(self, c: DrafterConfig, engine: Engine) -> dict:
        """config.json keys of this method for `engine` (the shared ones are export.py's)."""

    @abstractmethod
    def expected_shapes(self, config: dict) -> dict[str, tuple]:
        """Every tensor an export with this config.json must hold, and its shape."""

    @abstractmethod
    def check_export(self, config: dict, tensors: dict, engine: Engine,
                     target_num_layers: int) -> list[str]:
        """This method's own problems in an export (aux layer ids in the engine's convention,
        its flags); export.validate adds the shared ones (shapes, dtypes, vocab maps)."""
