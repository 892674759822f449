"""The security rules, checked on the code itself: no pickle loads outside weights_only, remote
code only when params say so, servers on loopback unless configured."""

import ast

import pytest

from conftest import REPO

CODE = [p for d in ("src/draftsmith", "src/draftsmith_kernels", "stages") for p in (REPO / d).rglob("*.py")]


def calls(name: str):
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == name:
                    yield path.relative_to(REPO), node


def keyword(node: ast.Call, name: str):
    return next((k.value for k in node.keywords if k.arg == name), None)


def test_no_pickle():
    for path in CODE:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names} | {n.module for n in ast.walk(tree)
                                      if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"pickle", "dill", "cloudpickle", "joblib"}, path


def test_torch_load_only_with_weights_only():
    found = list(calls("load"))
    torch_loads = [(p, n) for p, n in found
                   if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "torch"]
    assert torch_loads, "the checkpoint's optimizer state is read with torch.load"
    for path, node in torch_loads:
        v = keyword(node, "weights_only")
        assert isinstance(v, ast.Constant) and v.value is True, f"{path}:{node.lineno}"


@pytest.mark.parametrize("loader", ["from_pretrained", "from_config"])
def test_remote_code_only_from_params(loader):
    for path, node in calls(loader):
        v = keyword(node, "trust_remote_code")
        if v is None:
            continue  # transformers' default: off
        assert not (isinstance(v, ast.Constant) and v.value is True), f"{path}:{node.lineno}"
        assert "trust_remote_code" in ast.unparse(v), f"{path}:{node.lineno}: must come from params"


def test_defaults_are_safe():
    from draftsmith.config import Config

    cfg = Config()
    assert cfg.server.host == "127.0.0.1" and cfg.target.trust_remote_code is False
    assert not any("0.0.0.0" in p.read_text() for p in CODE)
