"""Each stage's code deps in dvc.yaml are exactly its import closure inside the repository, so
editing any module reruns exactly the stages whose code imports it, and nothing else.

The closure follows every import statement, function-level ones included (they run too), from
the stage script through `draftsmith` and `draftsmith_kernels` (src/draftsmith_kernels/), and adds the
non-Python files a module names next to it (soft_ce.py compiles soft_ce.cu)."""

import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
from code_deps import closure, declared_code, rewrite, stages  # noqa: E402


@pytest.mark.parametrize("name", list(stages()))
def test_stage_code_deps_are_its_import_closure(name):
    stage = stages()[name]
    script = REPO / "stages" / f"{name}.py"
    assert f"stages.{name}" in stage["cmd"], "stage scripts are stages/<stage name>.py"
    need = closure(script)
    have = declared_code(stage["deps"])
    rel = lambda s: sorted(str(p.relative_to(REPO)) for p in s)  # noqa: E731
    assert not need - have, (f"dvc.yaml stage '{name}' misses code it imports: {rel(need - have)}; "
                             "run python tools/code_deps.py --write, or an edit there leaves it stale")
    assert not have - need, (f"dvc.yaml stage '{name}' lists code it never imports: "
                             f"{rel(have - need)}; run python tools/code_deps.py --write, or editing them "
                             "reruns it for nothing")


def test_closure_follows_lazy_imports_and_kernel_sources():
    train = {str(p.relative_to(REPO)) for p in closure(REPO / "stages" / "train.py")}
    assert {"src/draftsmith/drafters/ttt_flex.py", "src/draftsmith_kernels/soft_ce.py",
            "src/draftsmith_kernels/soft_ce.cu",
            "src/draftsmith/train/loop.py"} <= train
    assert "src/draftsmith/generate.py" not in train


def test_the_write_command_reproduces_dvc_yaml():
    """`python tools/code_deps.py --write` is how the deps above are kept: on the committed
    dvc.yaml it changes nothing, and it restores a dep deleted by hand."""
    text = (REPO / "dvc.yaml").read_text()
    assert rewrite(text) == text
    broken = text.replace("      - src/draftsmith/drafters/losses.py\n", "", 1)
    assert broken != text and rewrite(broken) == text


def test_readers_of_the_hidden_states_do_not_depend_on_their_writer():
    """train and benchmark read the hidden states through hidden_format.py alone: tuning the
    hidden stage's writer (its threads, safetensors_write.py, the fp8 kernel) reruns only it;
    and only the stages that relaunch under torchrun depend on dist.py."""
    writer = {"src/draftsmith/hidden/__init__.py", "src/draftsmith/hidden/safetensors_write.py",
              "src/draftsmith_kernels/fp8_rows.py", "src/draftsmith_kernels/fp8_rows.cu"}
    for name in ("train", "benchmark"):
        deps = {str(p.relative_to(REPO)) for p in closure(REPO / "stages" / f"{name}.py")}
        assert not deps & writer, (name, sorted(deps & writer))
    for name in ("export", "benchmark"):  # they run drafters, never the training loop
        deps = {str(p.relative_to(REPO)) for p in closure(REPO / "stages" / f"{name}.py")}
        assert not any(d.startswith("src/draftsmith/train/") for d in deps), (name, deps)
    for name in stages():
        deps = {str(p.relative_to(REPO)) for p in closure(REPO / "stages" / f"{name}.py")}
        assert ("src/draftsmith/dist.py" in deps) == (name in ("hidden", "train")), name


def test_every_dep_exists_or_is_made_by_a_stage():
    """A dep left behind by a move (kernels/ became src/draftsmith_kernels/) fails `dvc repro`
    with "No such file": the rewrite keeps deps it does not recognise as code, so check them."""
    outs = {o if isinstance(o, str) else next(iter(o))
            for s in stages().values() for o in s.get("outs", [])}
    for name, stage in stages().items():
        for dep in stage["deps"]:
            assert (REPO / dep).exists() or dep in outs, (name, dep)
