"""What params.yaml says of the drafter methods: their names, the drafter layers an engine
serves each with, each method's own `train.<method>` section, and the rules those put on the
rest of the config. config.py builds TrainConfig over MethodOptions and calls the checks.

Torch-free and importing nothing of draftsmith, so that config.py (which every stage imports)
depends on this file alone of the method wing: editing a method's model, loss or export reruns
only the stages that import it. A new method adds its name here, its section if it has options,
and its rules; tests/test_methods.py holds the names equal to registry.METHODS.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

METHOD_NAMES = ("eagle3", "eagle3.1", "dflash", "p-eagle", "dspark")
DEFAULT_METHOD = "eagle3"  # also what a drafter saved without a method is
# The drafter layers the engines load each method with (vLLM: llama_eagle3.py and
# deepseek_eagle3.py take EAGLE-3 and 3.1; qwen3_dflash.py builds DFlash from Qwen3 layers only;
# parallel drafting, P-EAGLE's, reads mask_hidden in llama_eagle3.py alone).
METHOD_ARCHS = {"eagle3": ("llama", "mla"), "eagle3.1": ("llama", "mla"), "dflash": ("llama",),
                "p-eagle": ("llama",), "dspark": ("llama",)}
LLAMA_ONLY_WHY = {"dflash": "vLLM's DFlash drafter is built of Qwen3 grouped-query layers, "
                            "qwen3_dflash.py",
                  "p-eagle": "vLLM's parallel drafting loads mask_hidden in llama_eagle3.py "
                             "only",
                  "dspark": "vLLM's DSpark drafter is DFlash's Qwen3 layers, qwen3_dspark.py"}
# The served engines of each method (each drafters/<method>.py's engine_names say in which
# words), and why one is missing. A benchmark engine outside these is refused at load.
METHOD_ENGINES = {"eagle3": ("vllm", "sglang"), "eagle3.1": ("vllm", "sglang"),
                  "dflash": ("vllm", "sglang"), "p-eagle": ("vllm",), "dspark": ("vllm", "sglang")}
NOT_SERVED_WHY = {("p-eagle", "sglang"): "SGLang 0.5.17 has no parallel drafting (its EAGLE "
                                         "workers draft one depth a forward)"}
BLOCK_METHODS = ("dflash", "dspark")  # a block of masks after an anchor: train.dflash's backbone


class _Options(BaseModel):
    # config.py's sections are built the same way (unknown keys and inf/nan refused); repeated
    # here rather than imported, so that this file stays a leaf
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DFlashConfig(_Options):
    """train.dflash, read when train.method is dflash (drafters/dflash.py)."""
    num_layers: int = Field(1, ge=1, le=64)
    block_size: int = Field(4, ge=2, le=64)
    anchors: int = Field(512, ge=1)
    gamma: float = Field(4.0, gt=0)
    loss: Literal["ce", "soft_ce", "d-pace"] = "ce"
    dpace_alpha: float = Field(0.5, gt=0, le=1)  # read with loss: d-pace


class PEagleConfig(_Options):
    """train.peagle, read when train.method is p-eagle (drafters/peagle.py): COD's sampling of
    the depths trained (train.ttt_steps of them)."""
    down_sample_ratio: float = Field(0.7, gt=0, le=1)
    down_sample_ratio_min: float = Field(0.2, ge=0, le=1)


class DSparkConfig(_Options):
    """train.dspark, read when train.method is dspark (drafters/dspark.py); its backbone, block
    and anchors are train.dflash's (the block's every slot drafts: k = block_size)."""
    markov_rank: int = Field(256, ge=1)
    confidence_head: bool = True


class MethodOptions(_Options):
    """The method's name and each method's own section of `train`."""
    method: Literal[METHOD_NAMES] = DEFAULT_METHOD
    dflash: DFlashConfig = DFlashConfig()
    peagle: PEagleConfig = PEagleConfig()
    dspark: DSparkConfig = DSparkConfig()


def train_problem(method: str, drafter_arch: str, attention: str) -> str | None:
    """What makes train.method unusable with the rest of train.*, or None."""
    if drafter_arch not in METHOD_ARCHS[method]:
        layers = " or ".join(METHOD_ARCHS[method])
        return (f"method {method} with drafter_arch {drafter_arch}: no engine serves that "
                f"({LLAMA_ONLY_WHY[method]}). Set drafter_arch: {layers}, or method: eagle3 or "
                "eagle3.1 for an MLA drafter")
    if attention in ("flash", "cudnn") and method in BLOCK_METHODS:
        return (f"train.attention: {attention} runs EAGLE's TTT attention (causal within each "
                f"document); {'DFlash' if method == 'dflash' else 'DSpark'}'s blocks over "
                "sampled anchors need flex attention's mask. Set train.attention: auto or flex")
    return None


def engine_problem(method: str, engines: list[str]) -> tuple[str, str] | None:
    """(problem, fix) when benchmark.engines names an engine that cannot serve the method."""
    for engine in engines:
        if engine != "reference" and engine not in METHOD_ENGINES[method]:
            can = " or ".join(METHOD_ENGINES[method])
            return (f"benchmark.engines has {engine}, which cannot serve train.method {method} "
                    f"({NOT_SERVED_WHY[method, engine]})",
                    f"serve it with {can}: benchmark.engines: [reference, {can.split()[0]}]")
    return None


def k_problem(train: MethodOptions, k: int) -> tuple[str, str] | None:
    """(problem, fix) when the method cannot draft benchmark.num_speculative_tokens = k as
    trained, or None."""
    if train.method == "dflash" and train.dflash.block_size != k + 1:
        b = train.dflash.block_size
        return (f"train.dflash.block_size={b} drafts {b - 1} tokens a step (the anchor and "
                f"{b - 1} masks, seen at once), but benchmark.num_speculative_tokens={k}: an "
                "engine asked for another count changes every draft (vLLM never reads the "
                "block size)",
                f"set train.dflash.block_size: {k + 1}, or benchmark.num_speculative_tokens: "
                f"{b - 1}")
    if train.method == "dspark" and train.dflash.block_size != k:
        b = train.dflash.block_size
        return (f"train.dflash.block_size={b} makes DSpark draft {b} tokens a step (every slot "
                f"of the block, seen at once), but benchmark.num_speculative_tokens={k}: an "
                "engine asked for another count changes every draft",
                f"set train.dflash.block_size: {k}, or benchmark.num_speculative_tokens: {b}")
    if train.method == "p-eagle" and k > train.ttt_steps:
        return (f"train.ttt_steps={train.ttt_steps} trains P-EAGLE's first {train.ttt_steps} "
                f"depths, but benchmark.num_speculative_tokens={k}: the slots past them were "
                "never trained",
                f"set train.ttt_steps: {k}, or benchmark.num_speculative_tokens: "
                f"{train.ttt_steps}")
    return None
