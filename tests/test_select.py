"""train.select: best_acceptance: each checkpoint scored by the reference engine on held-out
prompts, the best one saved; the scores in the metrics and across a resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import train
from draftsmith.checkpoint import DRAFTER_WEIGHTS, load_drafter
from draftsmith.config import TrainConfig
from draftsmith.errors import DraftsmithError
from draftsmith.target_info import load_model
from draftsmith.train.loop import Trainer
from draftsmith.train.select import AcceptanceScorer, end_of_turn_id

SELECT = TrainConfig(steps=60, seq_len=256, batch_size=2, lr=3e-3, ttt_steps=3, eval_samples=16,
                     save_every=20, log_every=5, warmup_steps=5, num_workers=0,
                     select="best_acceptance", select_samples=8, select_new_tokens=32)


def _run(cfg, toy_target, toy_data, out):
    return train.run(cfg, toy_target, toy_data / "hidden", toy_data / "vocab", out / "d",
                     out / "ckpt")


@pytest.fixture(scope="module")
def selected(toy_target, toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("select")
    return out, _run(SELECT, toy_target, toy_data, out)


def test_each_checkpoint_is_scored_and_the_best_is_saved(toy_target, toy_data, selected):
    out, m = selected
    scores = m["selection_scores"]
    assert [s["step"] for s in scores] == [20, 40, 60]
    best = max(s["acceptance_length"] for s in scores)
    assert m["selected_step"] == max(s["step"] for s in scores
                                     if s["acceptance_length"] == best)  # ties: the later
    assert best > 1.5  # trained: more than the one token a round every draft gets

    # The saved drafter is the one that scored best: scored again, it gets the same figure.
    scorer = AcceptanceScorer(SELECT, lambda device: load_model(toy_target, str(device)),
                              end_of_turn_id(toy_target))
    store_prompts = _held_out_prompts(toy_data)
    scorer.start(torch.device("cpu"), store_prompts)
    drafter = load_drafter(out / "d")
    weights = load_file(out / "d" / DRAFTER_WEIGHTS)
    assert scorer.score(drafter.config, weights, m["selected_step"]) == best


def _held_out_prompts(toy_data):
    from draftsmith.train.data import HiddenStore
    from draftsmith.train.select import prompt_ids

    store = HiddenStore(toy_data / "hidden")
    _, held = store.split(SELECT.eval_samples)
    return [p for p in (prompt_ids(*store.tokens(i)) for i in held) if p is not None]


def test_an_earlier_checkpoint_that_scores_higher_is_the_one_saved(toy_target, toy_data,
                                                                    tmp_path, monkeypatch):
    """The scores scripted (the weights each step scored are real): step 20 best."""
    seen = {}

    def scripted(self, config, weights, step):
        seen[step] = {k: v.clone() for k, v in weights.items()}
        return {20: 3.0, 40: 2.0, 60: 2.5}[step]

    monkeypatch.setattr(AcceptanceScorer, "score", scripted)
    m = _run(SELECT, toy_target, toy_data, tmp_path)
    assert m["selected_step"] == 20
    saved = load_file(tmp_path / "d" / DRAFTER_WEIGHTS)
    assert saved.keys() == seen[20].keys()
    for k in saved:
        torch.testing.assert_close(saved[k], seen[20][k], rtol=0, atol=0)
    assert any(not torch.equal(seen[20][k], seen[60][k]) for k in saved)  # not the last
    # The held-out accuracy reported is the saved drafter's, not the last step's.
    m_last = _run(SELECT.model_copy(update={"select": "last"}), toy_target, toy_data,
                  tmp_path / "last")
    assert m_last["selected_step"] == 60 and "selection_scores" not in m_last
    assert m["eval_accuracy"] != m_last["eval_accuracy"]


def test_a_resumed_run_keeps_the_scores_and_the_best(toy_target, toy_data, selected, tmp_path,
                                                     monkeypatch):
    _, whole = selected
    real, calls = Trainer.evaluate, []

    def interrupted(*args, **kwargs):  # the initial evaluation runs; the final one is Ctrl-C
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(SELECT, toy_target, toy_data, tmp_path)
    monkeypatch.undo()
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["step"] == 40 and [s["step"] for s in state["selection"]["scores"]] == [20, 40]
    assert "best.safetensors" in state["files"]
    m = _run(SELECT, toy_target, toy_data, tmp_path)
    assert m["resumed_from_step"] == 40
    assert m["selection_scores"] == whole["selection_scores"]
    assert m["selected_step"] == whole["selected_step"]


def test_a_select_k_the_drafter_cannot_propose_is_refused_before_training(toy_target,
                                                                          toy_data, tmp_path,
                                                                          monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("a step ran")

    monkeypatch.setattr(Trainer, "step", no_training)
    cfg = SELECT.model_copy(update={"method": "dflash", "select_k": 5})  # blocks of 4: k = 3
    with pytest.raises(DraftsmithError, match="(?s)train.select_k.*blocks of 4.*k you serve"):
        _run(cfg, toy_target, toy_data, tmp_path)
    assert not (tmp_path / "d").exists()
