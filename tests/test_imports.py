"""The library's import graph: no circle between modules, and none between wings (a subpackage
such as drafters/ or train/ counted as one unit beside each root module), so no import runs
back up, e.g. from the method wing into the training loop that uses it, or from a root module
into a wing that imports it. Annotation-only imports count for the wings: they couple the
design even when they never run. A leaf (a module importing nothing of the library, such as
drafters/options.py, which config.py reads) counts as a unit of its own: nothing runs through
it, so it closes no circle."""

import ast
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
from code_deps import imported_modules, module_file  # noqa: E402

SRC = REPO / "src"
FILES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def every_import(path: Path) -> set[str]:
    """imported_modules plus those under `if TYPE_CHECKING:`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def is_leaf(path: Path) -> bool:
    return not any(module_file(name) for name in every_import(path))


def unit(path: Path) -> str:
    """A wing (a subpackage of a package) or a root module; a leaf on its own."""
    parts = path.relative_to(SRC).parts
    return "/".join(parts[:2]) if len(parts) > 2 and not is_leaf(path) else "/".join(parts)


def graph(imports, key) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for f in FILES:
        for name in imports(f):
            m = module_file(name)
            if m is not None and key(m) != key(f):
                g.setdefault(key(f), set()).add(key(m))
    return g


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Each circle found by a depth-first walk, as the path that closes it."""
    found, done, path = [], set(), []

    def walk(v):
        path.append(v)
        for w in sorted(g.get(v, ())):
            if w in path:
                found.append(path[path.index(w):] + [w])
            elif w not in done:
                walk(w)
        path.pop()
        done.add(v)

    for v in sorted(g):
        if v not in done:
            walk(v)
    return found


def rel(p: Path) -> str:
    return str(p.relative_to(SRC))


def test_no_module_imports_itself_round_a_circle():
    assert circles(graph(imported_modules, rel)) == []


def test_no_wing_imports_back_up():
    assert circles(graph(every_import, unit)) == []


def test_a_leaf_is_one_and_a_wing_module_that_imports_is_its_wing():  # the check itself
    assert unit(SRC / "draftsmith/drafters/options.py") == "draftsmith/drafters/options.py"
    assert unit(SRC / "draftsmith/drafters/base.py") == "draftsmith/drafters"


def test_circles_are_found_where_there_are_some():  # the check itself
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []
