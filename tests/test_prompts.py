import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.prompts import builtin_prompts, load_prompts, prompt_id


def test_ids_are_stable_and_content_derived():
    a = [{"role": "user", "content": "hi"}]
    assert prompt_id(a) == prompt_id([{"role": "user", "content": "hi", "extra": 1}])
    assert prompt_id(a) != prompt_id([{"role": "user", "content": "hi!"}])
    assert prompt_id(a) != prompt_id([{"role": "system", "content": "hi"}])
    # Pinned: changing the id scheme would orphan resumed runs and the held-out check.
    assert prompt_id(a) == "675b797826f34c78"
    assert len(prompt_id(a)) == 16


def test_builtin_splits_are_deterministic_and_distinct():
    g1 = builtin_prompts(50, 0, "generate")
    assert [p.id for p in g1] == [p.id for p in builtin_prompts(50, 0, "generate")]
    b = builtin_prompts(50, 0, "benchmark")
    assert len({p.id for p in g1} & {p.id for p in b}) < 5  # independent streams


def _sharegpt_rows():
    # The layout of mlabonne/open-perfectblend: a `conversations` column of {from, value}.
    return [
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q2"},
                           {"from": "gpt", "value": "A2"}, {"from": "human", "value": "Q3"},
                           {"from": "gpt", "value": "A3"}]},
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "other"}]},
    ]


def test_sharegpt_jsonl_keeps_conversation_up_to_last_user_turn(tmp_path):
    f = tmp_path / "blend.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in _sharegpt_rows()))
    ps = load_prompts(str(f), split="train", fmt="auto", column=None, limit=10, seed=0)
    assert [p.messages[-1]["content"] for p in ps] == ["Q1", "Q3"]  # duplicate Q1 dropped
    assert [m["role"] for m in ps[1].messages] == ["system", "user", "assistant", "user"]
    assert ps[1].meta["source_index"] == 1


def test_parquet_messages_and_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["a?", "b?"], "n": [1, 2]}), f)
    ps = load_prompts(str(f), split="train", fmt="prompt", column="text", limit=5, seed=0)
    assert [p.messages for p in ps] == [[{"role": "user", "content": "a?"}],
                                        [{"role": "user", "content": "b?"}]]
    f2 = tmp_path / "msgs.jsonl"
    f2.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    assert load_prompts(str(f2), split="train", fmt="auto", column=None, limit=5, seed=0)[0] \
        .messages == [{"role": "user", "content": "x"}]


def test_wrong_column_and_format_name_the_fix(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DraftsmithError, match="generate.format"):
        load_prompts(str(f), split="train", fmt="auto", column=None, limit=5, seed=0)
    with pytest.raises(DraftsmithError, match="generate.column"):
        load_prompts(str(f), split="train", fmt="prompt", column="text", limit=5, seed=0)
    with pytest.raises(DraftsmithError, match="not in sharegpt format"):
        load_prompts(str(f), split="train", fmt="sharegpt", column="question", limit=5, seed=0)
