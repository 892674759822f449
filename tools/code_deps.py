"""Each DVC stage's code deps are its import closure inside the repository.

    python tools/code_deps.py           # exit 1 and name the stages whose deps have drifted
    python tools/code_deps.py --write   # rewrite dvc.yaml's code deps to the closures

The closure follows every import statement, function-level ones included (they run too), but
not those under `if TYPE_CHECKING:` (annotations only: they never run), from
the stage script through `draftsmith` and `draftsmith_kernels` (src/draftsmith_kernels/), and adds the
non-Python files a module names next to it (soft_ce.py compiles soft_ce.cu). Data deps (any
other path) are kept as written. tests/test_code_deps.py holds dvc.yaml to this.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"draftsmith": "src/draftsmith", "draftsmith_kernels": "src/draftsmith_kernels", "stages": "stages"}


def module_file(name: str) -> Path | None:
    top, *rest = name.split(".")
    if top not in PACKAGES:
        return None
    base = REPO / PACKAGES[top] / Path(*rest) if rest else REPO / PACKAGES[top]
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for annotations: never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in _runtime_nodes(tree):
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


def code_deps(name: str) -> list[str]:
    """dvc.yaml's code deps of stage `name`: its script first, then the rest sorted."""
    script = REPO / "stages" / f"{name}.py"
    rest = sorted(str(p.relative_to(REPO)) for p in closure(script) if p != script)
    return [str(script.relative_to(REPO)), *rest]


def rewrite(text: str) -> str:
    """dvc.yaml's text with each stage's code-dep lines replaced by its closure; comments,
    data deps and everything else untouched."""
    code = tuple(f"{d}/" for d in PACKAGES.values())
    out, stage, in_deps = [], None, False
    for line in text.splitlines(keepends=True):
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith(":"):
            stage = line.strip()[:-1]
        if line.strip() == "deps:":
            in_deps = True
            out.append(line)
            indent = line[: len(line) - len(line.lstrip())] + "  - "
            out += [f"{indent}{d}\n" for d in code_deps(stage)]
            continue
        if in_deps:
            item = line.strip()
            if item.startswith("- "):
                if item[2:].startswith(code):
                    continue  # replaced above
                out.append(line)
                continue
            in_deps = False
        out.append(line)
    return "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite dvc.yaml in place")
    args = ap.parse_args(argv)
    path = REPO / "dvc.yaml"
    old = path.read_text()
    new = rewrite(old)
    if args.write:
        path.write_text(new)
        return 0
    if new != old:
        drift = [n for n, s in yaml.safe_load(old)["stages"].items()
                 if s["deps"] != yaml.safe_load(new)["stages"][n]["deps"]]
        print(f"code deps drifted in stages {drift}: run python tools/code_deps.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
