"""Each stage's code deps in dvc.yaml are exactly its import closure inside the repository, so
editing any module reruns exactly the stages whose code imports it, and nothing else.

The closure follows every import statement, function-level ones included (they run too), from
the stage script through `draftsmith` and `draftsmith_kernels` (kernels/), and adds the
non-Python files a module names next to it (soft_ce.py compiles soft_ce.cu)."""

import ast
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PACKAGES = {"draftsmith": "src/draftsmith", "draftsmith_kernels": "kernels", "stages": "stages"}


def module_file(name: str) -> Path | None:
    top, *rest = name.split(".")
    if top not in PACKAGES:
        return None
    base = REPO / PACKAGES[top] / Path(*rest) if rest else REPO / PACKAGES[top]
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import mod`
    return names


def closure(script: Path) -> set[Path]:
    seen: set[Path] = set()
    todo = [script]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in imported_modules(f):
            parts = name.split(".")
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            for i in range(1, len(parts) + 1):
                m = module_file(".".join(parts[:i]))
                if m is not None:
                    todo.append(m)
        for const in ast.walk(ast.parse(f.read_text())):
            value = getattr(const, "value", None)
            if isinstance(const, ast.Constant) and isinstance(value, str) and len(value) < 64 \
                    and "/" not in value and "\n" not in value:
                sibling = f.parent / value
                if sibling.suffix and sibling.suffix != ".py" and sibling.is_file():
                    seen.add(sibling)  # a data file the module reads by name
    return {p for p in seen if p.name != "__init__.py" or p.stat().st_size}


def stages():
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def declared_code(deps: list) -> set[Path]:
    out = set()
    for d in deps:
        p = REPO / d
        if not d.startswith(tuple(PACKAGES.values())):
            continue  # data deps
        out |= {f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts} \
            if p.is_dir() else {p}
    return out


@pytest.mark.parametrize("name", list(stages()))
def test_stage_code_deps_are_its_import_closure(name):
    stage = stages()[name]
    script = REPO / "stages" / f"{name}.py"
    assert f"stages.{name}" in stage["cmd"], "stage scripts are stages/<stage name>.py"
    need = closure(script)
    have = declared_code(stage["deps"])
    rel = lambda s: sorted(str(p.relative_to(REPO)) for p in s)  # noqa: E731
    assert not need - have, (f"dvc.yaml stage '{name}' misses code it imports: {rel(need - have)}; "
                             "add them to its deps, or an edit there leaves it stale")
    assert not have - need, (f"dvc.yaml stage '{name}' lists code it never imports: "
                             f"{rel(have - need)}; remove them, or editing them reruns it for "
                             "nothing")


def test_closure_follows_lazy_imports_and_kernel_sources():
    train = {str(p.relative_to(REPO)) for p in closure(REPO / "stages" / "train.py")}
    assert {"src/draftsmith/ttt_flex.py", "kernels/soft_ce.py", "kernels/soft_ce.cu",
            "src/draftsmith/train/loop.py"} <= train
    assert "src/draftsmith/generate.py" not in train
