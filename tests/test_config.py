import torch
import pytest
import yaml
from pydantic import ValidationError

from draftsmith.config import Config, EmbeddedTargetConfig, default_aux_layers, load_config
from draftsmith.errors import ConfigError, DraftsmithError

from conftest import REPO


def write(tmp_path, data) -> str:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_shipped_params_are_valid_and_complete():
    cfg = load_config(REPO / "params.yaml")
    # Every knob is spelled out in params.yaml: nothing silently comes from a default.
    shipped = yaml.safe_load((REPO / "params.yaml").read_text())
    def keys(d, prefix=""):
        return {prefix + k for k in d} | {x for k, v in d.items() if isinstance(v, dict)
                                          for x in keys(v, prefix + k + ".")}
    def model_keys(m, prefix=""):
        out = set()
        for k, v in m.model_dump().items():
            out.add(prefix + k)
            if isinstance(v, dict) and hasattr(getattr(m, k), "model_dump"):  # a section
                out |= model_keys(getattr(m, k), prefix + k + ".")
        return out
    assert keys(shipped) == model_keys(cfg)


def test_code_defaults_are_the_shipped_params():
    """Tests that build configs from code defaults run what the pipeline runs."""
    assert Config().model_dump() == load_config(REPO / "params.yaml").model_dump()


def test_shipped_params_have_a_comment_per_key():
    for line in (REPO / "params.yaml").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"params.yaml line without a comment: {line!r}"


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"generate": {"temprature": 0.5}}))
    assert "generate.temprature: unknown key (did you mean 'temperature'?)" in str(e.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="generat: unknown key"):
        load_config(write(tmp_path, {"generat": {}}))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"generate": {"num_samples": "many"}}))
    assert "generate.num_samples" in str(e.value) and "'many'" in str(e.value)


@pytest.mark.parametrize("params, needle", [
    ({"generate": {"temperature": -1}}, "generate.temperature"),
    ({"generate": {"top_p": 0}}, "generate.top_p"),
    ({"vocab": {"draft_vocab_size": 5000}}, "larger than the target's vocab"),
    ({"hidden": {"aux_layers": [2, 4, 8]}}, "outside 0..7"),
    ({"hidden": {"aux_layers": [2, 2, 5]}}, "repeats a layer"),
    ({"target": {"embedded": {"hidden_size": 100, "num_heads": 3}}}, "multiple of num_heads"),
    ({"generate": {"source": "no/such/file.jsonl"}}, "does not exist"),
    ({"generate": {"max_new_tokens": 400}}, "leaves no room"),
    ({"benchmark": {"num_speculative_tokens": 0}}, "benchmark.num_speculative_tokens"),
    ({"train": {"init": "no/such/drafter"}}, "neither 'copy', 'scratch' nor an existing"),
    ({"hidden": {"online_ahead": 0}}, "hidden.online_ahead"),
    ({"hidden": {"engine": "vllm"}, "server": {"engine": "sglang"}},
     "server.engine is 'sglang'"),
    ({"server": {"speculative_config": {"num_speculative_tokens": 5}}},
     "benchmark.num_speculative_tokens"),
    ({"server": {"engine": "sglang", "speculative_config": {"draft_sample_method": "x"}}},
     "server.extra_args"),
    ({"benchmark": {"engines": ["reference", "sglang"]}}, "has no float32 path"),
    ({"server": {"engine": "sglang", "launch": True}}, "set target.dtype: bfloat16"),
])
def test_impossible_values_fail_before_work(tmp_path, params, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, params))
    assert needle in str(e.value)
    assert "fix:" in str(e.value)


def test_overrides_are_typed_and_validated(tmp_path):
    path = write(tmp_path, {})
    cfg = load_config(path, ["generate.num_samples=10", "target.embedded.lr=0.01"])
    assert cfg.generate.num_samples == 10 and cfg.target.embedded.lr == 0.01
    with pytest.raises(ConfigError, match="generate.num_samples"):
        load_config(path, ["generate.num_samples=0"])


def test_a_toy_head_width_apart_from_its_model_width(tmp_path):
    """GPU vLLM's MLA takes heads of 128 only: a narrow toy with wide heads is a valid config."""
    emb = load_config(write(tmp_path, {"target": {"embedded": {
        "hidden_size": 128, "num_heads": 4, "head_dim": 128}}})).target.embedded
    assert emb.head_width == 128
    assert load_config(write(tmp_path, {})).target.embedded.head_width == 128 // 4
    with pytest.raises(ConfigError, match="head_dim"):
        load_config(write(tmp_path, {"target": {"embedded": {"head_dim": 4}}}))


def test_default_aux_layers_follow_vllm():
    assert default_aux_layers(8) == [2, 4, 5]
    assert default_aux_layers(61) == [2, 30, 58]


def test_sections_are_independent_objects():
    cfg = Config()
    assert set(Config.model_fields) >= {"target", "generate", "tokenize", "vocab", "hidden"}
    with pytest.raises(ValidationError, match="frozen"):
        cfg.generate.seed = 3  # frozen: stages cannot mutate shared config


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, device cuda would train")
def test_embedded_target_on_cuda_without_a_gpu_is_refused_before_any_work(tmp_path):
    from draftsmith.toy import build

    cfg = EmbeddedTargetConfig(device="cuda")
    with pytest.raises(DraftsmithError, match="target.embedded.device"):
        build.build(cfg, tmp_path / "model")
    assert not (tmp_path / "model").exists()
