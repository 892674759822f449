"""How draftsmith installs: beside a serving engine (GPU vLLM 0.26 pins torch 2.11), with the
versions the committed figures were made with when `make install` does it, and without a
folder at the repo root that hides an installed package."""

import importlib.metadata as md
import tomllib

from packaging.requirements import Requirement

from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# What vLLM 0.26.0's wheel requires of the packages we share (its METADATA, read 2026-12-04
# with `pip install --dry-run --report`): it loads every export we make, and it is the last
# release on torch 2.11, the H200 image's torch.
VLLM_026 = ["torch==2.11.0", "transformers>=5.5.3", "pydantic>=2.12.0", "tokenizers>=0.21.1",
            "safetensors>=0.6.2", "pyyaml", "tqdm"]
# The H200 image's own (device README): what GPU vLLM is installed over.
GPU_IMAGE = {"torch": "2.11.0", "transformers": "5.17.0"}


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    reqs = PYPROJECT["dependencies"] if extra is None else PYPROJECT["optional-dependencies"][extra]
    return {r.name: r for r in map(Requirement, reqs)}


def test_draftsmith_installs_beside_gpu_vllm():
    """Each shared package has a version both we and vLLM 0.26 accept (one of the two
    ranges' own bounds), and the GPU image's torch and transformers fit ours as they are."""
    ours = requirements()
    for theirs in map(Requirement, VLLM_026):
        if theirs.name not in ours:
            continue
        bounds = [s.version for r in (theirs, ours[theirs.name]) for s in r.specifier]
        assert not bounds or any(theirs.specifier.contains(v) and
                                 ours[theirs.name].specifier.contains(v) for v in bounds), \
            (str(theirs), str(ours[theirs.name]))
    for name, version in GPU_IMAGE.items():
        assert ours[name].specifier.contains(version), (name, version)
    assert requirements("gpu")["vllm"].specifier.contains("0.26.0")


def test_make_install_pins_what_the_figures_were_made_with():
    """constraints.txt fits pyproject's ranges, and this environment (made by `make install`
    here and in CI) has exactly those versions: transformers >= 5.25 included."""
    ours = requirements()
    pins = [Requirement(line) for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} >= {"torch", "transformers"}
    for pin in pins:
        (version,) = [s.version for s in pin.specifier]
        assert ours[pin.name].specifier.contains(version), pin
        assert md.version(pin.name).split("+")[0] == version, (pin.name, md.version(pin.name))
    assert int(md.version("transformers").split(".")[1]) >= 25


def test_nothing_at_the_repo_root_shadows_an_installed_package():
    """`python -m` from the repo root (every stage, pytest) puts the root first on sys.path: a
    folder there named like an installed package hides it (kernels/ once hid Hugging Face's
    `kernels`, which transformers >= 5.25 imports at load). Importable code lives in src/."""
    installed = {top.lower() for d in md.distributions()
                 for top in (d.read_text("top_level.txt") or "").split()}
    installed |= {d.metadata["Name"].replace("-", "_").lower() for d in md.distributions()}
    at_root = {p.name.lower() for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert not at_root & installed, sorted(at_root & installed)
    import kernels  # Hugging Face's, as transformers finds it
    import transformers.modeling_utils  # noqa: F401

    assert "site-packages" in kernels.__file__


def test_the_gpu_wheelhouse_ships_what_each_engine_takes_from_the_image_apart():
    """tools/gpu_wheelhouse.py: vLLM runs on the image's packages (only what the image lacks
    ships); SGLang pins another transformers and tokenizers than the image's, so everything but
    the torch stack ships for it; neither ships the pieces no Hopper serving imports."""
    import gpu_wheelhouse as wh

    resolved = {"torch": "2.11.0", "triton": "3.6.0", "nvidia-cublas": "13.1.0.3",
                "cuda-bindings": "13.4.4", "transformers": "5.12.1", "tokenizers": "0.22.2",
                "numpy": "2.3.5", "pandas": "3.1.1", "tilelang": "0.1.11",
                "nvidia-cutlass-dsl-libs-cu12": "4.6.0", "nvidia-cuda-nvcc": "13.5.37"}
    report = {"install": [{"metadata": {"name": n.replace("-", "_"), "version": v}}
                          for n, v in resolved.items()]}

    def ships(engine: str, main: str) -> set[str]:
        r = {"install": [*report["install"], {"metadata": {"name": main, "version": "1"}}]}
        return {s.split("==")[0] for s in wh.to_ship(wh.ENGINES[engine], r)}

    assert ships("vllm", "vllm") == {"vllm", "pandas"}
    assert ships("sglang", "sglang") == {"sglang", "transformers", "tokenizers", "numpy",
                                         "pandas", "nvidia-cuda-nvcc"}
    for engine in wh.ENGINES.values():
        assert engine.requirement.split("==")[0] in engine.module
