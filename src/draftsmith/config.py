"""The one typed config: params.yaml parsed and validated before any work starts.

Each pipeline stage takes only its own section (``cfg.generate``, ``cfg.tokenize``...), so
dvc.yaml can declare exactly the params each stage depends on. Checks that need the resolved
target (its vocab size, its layer count) live in ``check_against_target``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from draftsmith.chat_format import FORMATS
from draftsmith.drafters.options import MethodOptions, engine_problem, k_problem, train_problem
from draftsmith.errors import ConfigError

EMBEDDED = "embedded"
EMBEDDED_MLA = "embedded-mla"  # the same toy as a DeepSeek-V3 model (MLA + MoE), like Kimi-K2.5

# The serving engines a user may name, and the benchmark's engines (the in-process reference
# and the served engines whose acceptance can be read). serving/engines.py says what each
# one means; the names are written here rather than imported from it because every stage
# imports this module, and a stage's code deps are its imports: editing the engine table must
# rerun only the stages that use it. tests/test_engines.py holds these equal to the table.
ENGINE_NAMES = ("vllm", "sglang")
BENCHMARK_ENGINES = ("reference", "vllm", "sglang")

class _Section(BaseModel):
    # Unknown keys are errors: a typo in params.yaml must never be silently ignored.
    # inf and nan pass `gt=0` bounds and then wreck a run hours in: refused like any bad value.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class EmbeddedTargetConfig(_Section):
    seed: int = 0
    vocab_size: int = Field(1024, ge=300, le=65536)
    hidden_size: int = Field(128, ge=16)
    num_layers: int = Field(8, ge=4)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    # null: hidden_size / num_heads. GPU vLLM's MLA kernels take only DeepSeek-like heads, so
    # an MLA toy served there needs 128 (q.k nope and v) in a narrow model
    head_dim: int | None = Field(None, ge=8)
    intermediate_size: int = Field(384, ge=16)
    max_seq_len: int = Field(256, ge=64)
    train_steps: int = Field(1700, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    train_examples: int = Field(20000, ge=10)
    eval_examples: int = Field(200, ge=1)
    # cpu by default: the embedded default's figures stay bit-reproducible on any machine; cuda
    # (bf16 autocast) for a GPU-sized toy (presets/h200.yaml)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    # fp32: fp32 master weights and AdamW state (16 bytes a parameter; on a GPU the forward and
    # backward autocast to bf16). bf16: weights, gradients and AdamW state in bf16 (8 bytes a
    # parameter), so an 8B-class body trains on one 80 GB GPU; an Adam update (about lr, 2.5e-4,
    # on weights of about 0.02: 1.25%) stays above bf16's rounding step (0.4%) while it matters
    weights: Literal["fp32", "bf16"] = "fp32"

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_heads and not self.head_dim:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads}), or head_dim set"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


class ChatFormatSpec(_Section):
    """A chat format declared in params.yaml, for templates the probe cannot read. The strings
    are exact: what the model emits, whitespace included (see draftsmith/chat_format.py)."""
    end_of_turn: str = Field(min_length=1)
    reasoning_open: str | None = None
    reasoning_close: str | None = None
    prompt_opens_reasoning: bool = False
    answer_open: str = ""
    template_answer_prefix: str | None = None

    @model_validator(mode="after")
    def _reasoning_markers(self):
        if (self.reasoning_open is None) != (self.reasoning_close is None):
            raise ValueError("reasoning_open and reasoning_close go together: set both, or "
                             "neither for a model without reasoning")
        if self.reasoning_close is not None and not self.reasoning_close.strip():
            raise ValueError("reasoning_close is only whitespace: reasoning and answer would be "
                             "joined without a marker (the seed story's bug)")
        return self


class TargetConfig(_Section):
    model: str = EMBEDDED
    revision: str = "main"
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # auto (probed from the template), a registered format's name, or one spelled out.
    chat_format: Literal[("auto", *FORMATS)] | ChatFormatSpec = "auto"
    embedded: EmbeddedTargetConfig = EmbeddedTargetConfig()

    @property
    def is_embedded(self) -> bool:
        return self.model in (EMBEDDED, EMBEDDED_MLA)


class GenerateConfig(_Section):
    source: str = "builtin"
    split: str = "train"
    format: Literal["auto", "messages", "sharegpt", "prompt"] = "auto"
    column: str | None = None
    num_samples: int = Field(1000, ge=1)
    seed: int = 0
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(160, ge=1)
    thinking: bool = True
    batch_size: int = Field(64, ge=1)
    backend: Literal["inprocess", "openai"] = "inprocess"
    on_bad_row: Literal["fail", "drop"] = "fail"

    @model_validator(mode="after")
    def _source_exists(self):
        if self.source in ("builtin",) or self.source.startswith("hf:"):
            return self
        if not Path(self.source).exists():
            raise ValueError(
                f"source file '{self.source}' does not exist; use 'builtin', an existing "
                ".jsonl/.parquet path, or 'hf:<dataset id>'"
            )
        if not self.source.endswith((".jsonl", ".json", ".parquet")):
            raise ValueError(f"source '{self.source}' must be a .jsonl, .json or .parquet file")
        return self


class ServerConfig(_Section):
    """An OpenAI-compatible server: the `openai` generate backend and the `vllm` benchmark
    engine use it. Not a dependency of any stage's output (where answers come from is not
    part of what they are), so changing it reruns nothing."""

    engine: Literal[ENGINE_NAMES] = "vllm"
    urls: list[str] = []
    launch: bool = False
    command: str | None = None
    extra_args: str = ""
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    startup_timeout_s: float = Field(900, gt=0)
    model: str | None = None
    api_key_env: str | None = "OPENAI_API_KEY"
    concurrency: int = Field(32, ge=1)
    request_timeout_s: float = Field(600, gt=0)
    max_retries: int = Field(5, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    # More keys for vLLM's --speculative-config when the benchmark serves a drafter, e.g.
    # {draft_sample_method: probabilistic}: vLLM drafts greedily by default, which at T > 0
    # accepts fewer drafts than exact speculative sampling (docs/gpu.md)
    speculative_config: dict[str, Any] = {}

    @model_validator(mode="after")
    def _speculative_keys(self):
        ours = sorted({"method", "model", "num_speculative_tokens"} & set(self.speculative_config))
        if ours:
            raise ValueError(
                f"speculative_config sets {ours}, which the benchmark sets from the export and "
                "benchmark.num_speculative_tokens: remove them there")
        if self.speculative_config and self.engine != "vllm":
            raise ValueError(
                f"speculative_config is vLLM's; with engine '{self.engine}' put the engine's "
                "own speculative flags in server.extra_args")
        return self

    @model_validator(mode="after")
    def _where(self):
        if self.command is not None and "{model}" not in self.command:
            raise ValueError(f"command '{self.command}' must contain {{model}} (the target's path)")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url '{url}' must start with http:// or https:// "
                                 "(e.g. http://127.0.0.1:8000/v1)")
        return self


class TokenizeConfig(_Section):
    truncated: Literal["drop", "keep"] = "drop"
    max_length: int = Field(512, ge=8)
    on_format_error: Literal["fail", "drop"] = "fail"
    max_malformed_share: float = Field(0.25, ge=0, le=1)
    check_template: bool = True
    shard_size: int = Field(4096, ge=1)


class VocabConfig(_Section):
    draft_vocab_size: int = Field(256, ge=1)


class HiddenConfig(_Section):
    engine: Literal["hf", "vllm"] = "hf"
    mode: Literal["offline", "online"] = "offline"
    aux_layers: list[int] | None = Field(None, min_length=1)
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = "bfloat16"
    row_tokens: int = Field(2048, ge=8)
    batch_rows: int = Field(8, ge=1)
    shard_mb: float = Field(1024, gt=0)
    attention: Literal["auto", "varlen", "sdpa", "flex_attention", "eager"] = "auto"
    device_map: Literal["auto"] | None = None
    online_ahead: int = Field(4, ge=1)
    online_keep: bool = False
    kept_from: str | None = None

    @model_validator(mode="after")
    def _kept_from_offline(self):
        if self.kept_from and self.mode != "offline":
            raise ValueError(
                "hidden.kept_from makes the states an online run kept into the offline "
                "artifact; with mode: online it would be ignored. Set hidden.mode: offline, "
                "or kept_from: null")
        return self


class TrainConfig(MethodOptions):
    """train.*: `method` and each method's own section (train.dflash) are the method wing's
    (drafters/options.py); the rest is every method's."""
    init: str = "copy"
    drafter_arch: Literal["llama", "mla"] = "llama"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ttt_steps: int = Field(3, ge=1)
    step_weight: float = Field(0.8, gt=0, le=1)
    loss: Literal["soft_ce", "kl"] = "soft_ce"
    steps: int = Field(1500, ge=1)
    seq_len: int = Field(256, ge=8)
    batch_size: int = Field(4, ge=1)
    lr: float = Field(2e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    bf16: bool | Literal["auto"] = "auto"
    attention: Literal["auto", "flex", "flash", "cudnn", "reference"] = "auto"
    compile: bool | Literal["auto"] = "auto"
    num_workers: int = Field(1, ge=0)
    seed: int = 0
    eval_samples: int = Field(64, ge=0)
    intermediate_size: int | None = Field(None, ge=1)
    save_every: int = Field(200, ge=0)
    log_every: int = Field(10, ge=1)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    select: Literal["last", "best_acceptance"] = "last"
    select_k: int = Field(3, ge=1)
    select_samples: int = Field(32, ge=1)
    select_new_tokens: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _selection_has_checkpoints(self):
        if self.select == "best_acceptance" and not (self.save_every and self.eval_samples):
            raise ValueError(
                "train.select: best_acceptance scores each checkpoint (every train.save_every "
                "steps) on held-out samples (train.eval_samples), and save_every is "
                f"{self.save_every}, eval_samples {self.eval_samples}: set both above 0, or "
                "train.select: last")
        return self

    @model_validator(mode="after")
    def _method_fits(self):
        problem = train_problem(self.method, self.drafter_arch, self.attention)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _init_exists(self):
        if self.init not in ("copy", "scratch") and not Path(self.init).is_dir():
            raise ValueError(
                f"init '{self.init}' is neither 'copy', 'scratch' nor an existing EAGLE-3 "
                "drafter directory"
            )
        return self


class BenchmarkConfig(_Section):
    source: str = "builtin"
    split: str = "test"
    num_prompts: int = Field(60, ge=1)
    num_speculative_tokens: int = Field(3, ge=1)
    temperatures: list[float] = Field([0.0, 0.6], min_length=1)
    max_new_tokens: int = Field(160, ge=1)
    thinking: bool = True
    seed: int = 0
    engines: list[Literal[BENCHMARK_ENGINES]] = Field(["reference"], min_length=1)

    @model_validator(mode="after")
    def _temps(self):
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures {self.temperatures} must be >= 0")
        return self


class DistributedConfig(_Section):
    """How the hidden and train stages are launched: more than one process means torchrun."""
    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str = ""
    rdzv_id: str = "draftsmith"
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    @model_validator(mode="after")
    def _multi_node(self):
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint: the head node's "
                             "host:port, the same on every node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        return self


class ExportConfig(_Section):
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class Config(_Section):
    target: TargetConfig = TargetConfig()
    generate: GenerateConfig = GenerateConfig()
    server: ServerConfig = ServerConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    vocab: VocabConfig = VocabConfig()
    hidden: HiddenConfig = HiddenConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    export: ExportConfig = ExportConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()


def _did_you_mean(name: str, section: type[BaseModel]) -> str:
    if name in Config.model_fields and section is not Config:
        return f"'{name}' is a top-level section: move it out to the file's top level"
    close = difflib.get_close_matches(name, list(section.model_fields), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(section.model_fields)}"


def _section_at(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            break
        if issubclass(field.annotation, BaseModel):
            model = field.annotation
    return model


def _explain(err: ValidationError, origin: str) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            hint = _did_you_mean(str(e["loc"][-1]), _section_at(e["loc"]))
            lines.append(f"{key}: unknown key ({hint})")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key or '<root>'}: {e['msg'].removeprefix('Value error, ')}{shown}")
    return ConfigError(
        f"{origin} is invalid:\n  " + "\n  ".join(lines),
        f"edit the key(s) above in {origin}; `draftsmith config show` prints the resolved config",
    )


def parse_override(text: str) -> tuple[list[str], Any]:
    """`generate.num_samples=10` -> (['generate', 'num_samples'], 10); values parse as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value", "write e.g. generate.seed=1")
    key, value = text.split("=", 1)
    try:
        return key.strip().split("."), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': the value is not YAML ({exc.problem})",
                          "quote it, e.g. generate.source='my file.jsonl'") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section", "check the key path")
        node[path[-1]] = value
    return raw


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Read, override and validate params.yaml. Raises ConfigError naming every bad key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} not found", "run from the repository root or pass --params")
    try:
        raw = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "save params.yaml as UTF-8") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of sections", "see the README for the layout")
    raw = apply_overrides(raw, overrides or [])
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        raise _explain(exc, str(path)) from None
    check_static(cfg)
    check_init_tracked(cfg.train, Path(path).parent)
    if cfg.target.is_embedded:
        emb = cfg.target.embedded
        check_against_target(cfg, vocab_size=emb.vocab_size, num_layers=emb.num_layers)
    return cfg


def check_static(cfg: Config) -> None:
    """Cross-section checks that need no artifact (the embedded target's shape is known)."""
    if cfg.generate.backend == "openai" and not (cfg.server.urls or cfg.server.launch):
        raise ConfigError(
            "generate.backend is 'openai' but no server is given",
            "set server.urls to running OpenAI-compatible servers (e.g. "
            "[http://127.0.0.1:8000/v1]), or server.launch: true to start one on the target")
    if cfg.hidden.engine != "hf" and cfg.server.engine != cfg.hidden.engine:
        raise ConfigError(
            f"hidden.engine is '{cfg.hidden.engine}' but server.engine is '{cfg.server.engine}'",
            f"set server.engine: {cfg.hidden.engine} (hidden states are captured in vLLM only)")
    for wrong in (k_problem(cfg.train, cfg.benchmark.num_speculative_tokens),
                  engine_problem(cfg.train.method, cfg.benchmark.engines)):
        if wrong:
            raise ConfigError(*wrong)
    launches_sglang = not cfg.server.urls and ("sglang" in cfg.benchmark.engines or (
        cfg.server.engine == "sglang" and cfg.server.launch))
    if cfg.target.dtype == "float32" and launches_sglang:
        raise ConfigError(
            "SGLang would be launched on the target in float32, which it cannot run: its RMSNorm "
            "kernel (sgl-kernel, SGLang 0.5.17) has no float32 path and the server dies at start "
            "(\"rmsnorm ... failed to dispatch data type Float\", seen on a GPU)",
            "set target.dtype: bfloat16 to serve through SGLang, or serve with vLLM "
            "(server.engine: vllm, benchmark.engines: [reference, vllm])")
    emb = cfg.target.embedded
    if cfg.target.is_embedded:
        needed = cfg.generate.max_new_tokens + 96
        if needed > emb.max_seq_len:
            raise ConfigError(
                f"generate.max_new_tokens={cfg.generate.max_new_tokens} leaves no room for the "
                f"prompt in the embedded target's {emb.max_seq_len} positions",
                f"lower generate.max_new_tokens to <= {emb.max_seq_len - 96} or raise "
                "target.embedded.max_seq_len",
            )


TRAIN_INIT_DIR = "models/init"  # the train stage's DVC dep for a drafter to fine-tune


def check_init_tracked(train: TrainConfig, workspace: Path) -> None:
    """A drafter to fine-tune must be where dvc.yaml tracks it, or a change to it would not
    rerun train."""
    if train.init in ("copy", "scratch"):
        return
    if (workspace / train.init).resolve() != (workspace / TRAIN_INIT_DIR).resolve():
        raise ConfigError(
            f"train.init: {train.init} is not tracked by DVC, so changing that drafter would "
            "not rerun train",
            f"put the drafter (or links to its files) in {TRAIN_INIT_DIR} and set "
            f"train.init: {TRAIN_INIT_DIR}")


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers: id k is the hidden state entering target layer k."""
    return [2, num_layers // 2, num_layers - 3]


def check_draft_vocab(vocab: VocabConfig, target_vocab_size: int) -> None:
    if vocab.draft_vocab_size > target_vocab_size:
        raise ConfigError(
            f"vocab.draft_vocab_size={vocab.draft_vocab_size} is larger than the target's "
            f"vocab ({target_vocab_size})",
            f"set vocab.draft_vocab_size <= {target_vocab_size} (typically 8-32K for a 128K+ vocab)",
        )


def check_aux_layers(hidden: HiddenConfig, num_layers: int) -> list[int]:
    """The aux layers to capture, checked against the target's depth."""
    layers = hidden.aux_layers or default_aux_layers(num_layers)
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(
            f"hidden.aux_layers {layers} has ids outside 0..{num_layers - 1} for a "
            f"{num_layers}-layer target (id k = the hidden state entering layer k)",
            f"use ids in 0..{num_layers - 1}, or null for vLLM's default "
            f"{default_aux_layers(num_layers)}",
        )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"hidden.aux_layers {layers} repeats a layer", "list distinct layer ids")
    return layers


def check_against_target(cfg: Config, *, vocab_size: int, num_layers: int) -> None:
    """Checks that need the target's shape. For the embedded target they run at load time;
    for a hub model each stage runs its own once the target is resolved, before its work."""
    check_draft_vocab(cfg.vocab, vocab_size)
    check_aux_layers(cfg.hidden, num_layers)
