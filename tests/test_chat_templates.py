"""Reference tests per template family, none of them in the format registry: the format is read
from the template (chat_probe), recorded by the target stage, and every synthetic sample passes
the tokenize stage with the per-sample format check on. The templates in tests/templates/ are
written here in each family's style."""

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith import artifacts, target, tokenization
from draftsmith.target_info import read_info
from draftsmith.chat_probe import probe_format
from draftsmith.config import TargetConfig, TokenizeConfig
from draftsmith.errors import DraftsmithError
from draftsmith.render import render_sample
from draftsmith.toy.tokenizer import train_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
QUESTION, REASONING, ANSWER = "What is 12 + 30?", "2 + 0 = 2\n1 + 3 = 4", "42"

# template -> (its special tokens, what the probe must read: open, close, end, prompt opens)
FAMILIES = {
    "kimi_k2_5": (["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
                  ("<think>", "</think>", "<|im_end|>", False)),
    "glm4_5": (["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>"],
               ("\n<think>", "</think>\n", "<|user|>", False)),
    "magistral": (["<s>", "</s>", "[INST]", "[/INST]", "[THINK]", "[/THINK]"],
                  ("[THINK]", "[/THINK]", "</s>", False)),
    "gpt_oss": (["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"],
                ("<|channel|>analysis<|message|>",
                 "<|end|><|start|>assistant<|channel|>final<|message|>", "<|return|>", False)),
    "deepseek_v3_1": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                       "<｜Assistant｜>"], ("<think>", "</think>", "<｜end▁of▁sentence｜>", True)),
    "seed_oss": (["<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>"],
                 ("<seed:think>", "</seed:think>", "<seed:eos>", False)),
    "gemma": (["<bos>", "<start_of_turn>", "<end_of_turn>"], (None, None, "<end_of_turn>", False)),
}


def family_tokenizer(name):
    tok = train_tokenizer([f"{QUESTION} {REASONING} answer {ANSWER} And 1 + 1?"] * 10,
                          vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": FAMILIES[name][0]})
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def record(fmt, i, *, thinking, messages, reasoning=REASONING, content=ANSWER, completion=None):
    rec = dict(id=f"s{i}", messages=messages, thinking=thinking,
               reasoning=reasoning if thinking else None, content=content, finish_reason="stop",
               think_closed=True, well_formed=True)
    # The raw completion the target emitted, as the in-process backend keeps it.
    rec["completion"] = completion or fmt.emission(rec["reasoning"], content, thinking=thinking)
    return rec


def samples(fmt) -> list[dict]:
    one = [{"role": "user", "content": QUESTION}]
    two = [*one, {"role": "assistant", "content": ANSWER, "reasoning_content": "old"},
           {"role": "user", "content": "And 1 + 1?"}]
    modes = [True, False] if fmt.supports_reasoning else [False]
    return [record(fmt, i, thinking=t, messages=m, content="2" if m is two else ANSWER)
            for i, (t, m) in enumerate((t, m) for t in modes for m in (one, two))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The family's target stage output: a tiny HF-layout model with the family's tokenizer."""
    name = request.param
    tok = family_tokenizer(name)
    root = tmp_path_factory.mktemp(name)
    model_dir = root / "hf"
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    target.resolve(TargetConfig(model=str(model_dir)), root / "target")
    return name, tok, root


def test_probe_reads_the_family_format(family):
    name, tok, root = family
    fmt = read_info(root / "target").format
    assert fmt.source == "template"
    assert (fmt.reasoning_open, fmt.reasoning_close, fmt.end_of_turn,
            fmt.prompt_opens_reasoning) == FAMILIES[name][1]


def test_tokenize_passes_the_format_check(family, tmp_path):
    name, tok, root = family
    fmt = read_info(root / "target").format
    recs = samples(fmt)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = tokenization.run(TokenizeConfig(), root / "target", raw, tmp_path / "tok")
    assert m["format_check_pass_rate"] == 1.0 and m["samples_kept"] == len(recs)
    assert m["chat_format"]["source"] == "template"
    # Loss masks cover exactly the emission: the prompt is the template's generation prompt.
    for (sid, ids, mask), rec in zip(artifacts.iter_samples(tmp_path / "tok"), recs):
        r = render_sample(tok, fmt, rec)
        assert tok.decode(ids[mask], skip_special_tokens=False) == r.response
        assert tok.decode(ids[~mask], skip_special_tokens=False) == r.prompt
        if rec["thinking"]:
            assert REASONING in r.response and r.response.endswith(rec["content"] + fmt.end_of_turn)


def test_seed_story_bug_fails_the_check(family, tmp_path):
    """A generator that stored reasoning and answer joined as the content, wrapper dropped,
    while the target itself emitted the wrapper. A family without reasoning refuses any."""
    name, tok, root = family
    fmt = read_info(root / "target").format
    user = [{"role": "user", "content": QUESTION}]
    if fmt.supports_reasoning:
        good = fmt.emission(REASONING, ANSWER, thinking=True)
        rec = record(fmt, 0, thinking=True, messages=user, reasoning=None,
                     content=REASONING + ANSWER, completion=good)
        match = "emission_mismatch"
    else:
        rec = record(fmt, 0, thinking=False, messages=user, completion="-")
        rec.update(thinking=True, reasoning=REASONING)
        match = "has no reasoning support"
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "samples.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(DraftsmithError, match=match):
        tokenization.run(TokenizeConfig(), root / "target", raw, tmp_path / "tok")


@pytest.mark.parametrize("name, match", [
    ("reasoning_after_answer", "before the answer"),
    ("seed_story_bug", "joins reasoning and answer with no marker"),
])
def test_template_whose_reasoning_cannot_be_placed_is_refused(name, match):
    tok = train_tokenizer([QUESTION] * 10, vocab_size=300)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    with pytest.raises(DraftsmithError, match=match) as err:
        probe_format(tok)
    assert "target.chat_format" in str(err.value)
