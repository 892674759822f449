"""Bring a GPU serving engine (vLLM or SGLang) to an offline GPU host as a few chunks of at most
58 MiB, one transfer each, unpacked there into a folder the engine runs from.

    python tools/gpu_wheelhouse.py sglang     # -> .gpu-sglang/c1 .. cN (install.sh in the last)
    python tools/gpu_wheelhouse.py vllm       # -> .gpu-vllm/c1 .. cN

On the host, for each chunk k: copy .gpu-<engine>/c<k>/* into /tmp/<engine>-chunks; after the
last, `bash /tmp/<engine>-chunks/install.sh` unpacks into the engine's site folder (vLLM
/tmp/site, SGLang /tmp/sglang-site) and imports the engine there; then run it with that folder
first on PYTHONPATH (docs/gpu.md).

The host is the H200 image: Python 3.12, torch 2.11.0 (cu130), no network. vLLM 0.26.0 and
SGLang 0.5.17 are the last releases pinned to that torch. What ships: the engine's wheel and
every package of its resolution that the host lacks, unpacked into one folder, minus pieces no
Hopper serving imports, as tar | zstd split into parts. The image has no zstd binary, so the
`zstandard` wheel rides in the first chunk.

The two engines differ in what they take from the image:
- vLLM runs on the image's packages (its transformers 5.17 among them): only what the image
  lacks ships (../shared/tools/gpu-vllm-wheelhouse's 3 chunks served our drafters on the H200,
  2026-12-03). This script, 2026-12-04: 87 packages, 3 chunks (57.3, 52.0, 45.8 MiB) in 4
  minutes; on a CPU machine with the host's Python and torch, install.sh unpacked them and
  imported vllm 0.26.0 in 19 s.
- SGLang 0.5.17 pins transformers 5.12.1 and tokenizers < 0.23, and does not import under the
  image's transformers 5.17 ("'qwen3_asr' is already used by a Transformers config": SGLang
  registers a config that transformers now has). So everything ships except the torch stack
  (torch, triton, the CUDA libraries the image has, the same builds), and the SGLang server runs
  from its own PYTHONPATH, apart from the pipeline's. Measured 2026-12-04 on a 2-core machine:
  183 packages, 3.3 GB unpacked (sglang-kernel's one library is 1.1 GB of it), 12 chunks
  (585 MiB), 17 minutes to build; the chunks copied into /tmp/sglang-chunks and install.sh run
  there under Python 3.12 + torch 2.11.0 on that CPU machine: unpacked and imported
  `sglang.launch_server` in 87 s. Not yet run on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PYTHON = "3.12"
PART = "52M"  # the first chunk also carries the zstandard wheel (5.5 MB): <= 58 MiB each

# The H200 image's packages (its package list as read on 2026-11-17).
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs certifi charset-normalizer click cloudpickle cmake cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit einops filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub
idna jinja2 llvmlite markdown-it-py markupsafe mdurl ml-dtypes mpmath msgpack multidict networkx
ninja numba numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx opencv-python-headless packaging pillow prometheus-client propcache protobuf psutil
py-cpuinfo pygments pyyaml regex requests rich safetensors sentencepiece setuptools shellingham
six sympy tabulate tiktoken tokenizers torch torchaudio torchvision tqdm transformers triton
typer typing-extensions urllib3 uvloop yarl""".split())
# The image's torch and what it was built with: the engines pin the same releases.
TORCH_STACK = {n for n in IMAGE if n in {"torch", "torchaudio", "torchvision", "triton"}
               or n.startswith(("nvidia-", "cuda-"))}


@dataclass(frozen=True)
class Engine:
    requirement: str
    site: str  # where install.sh unpacks on the host
    module: str  # imported there to check the install
    take_from_image: frozenset  # packages not shipped
    skip: frozenset = frozenset()  # resolved but never imported by Hopper serving
    remove: tuple = ()  # files inside the site folder no Hopper serving loads
    why_skip: str = ""


ENGINES = {
    "vllm": Engine(
        "vllm==0.26.0", "/tmp/site", "vllm", frozenset(IMAGE),
        skip=frozenset("""pynvvideocodec torchcodec nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
        nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13
        quack-kernels humming-kernels tilelang z3-solver tokenspeed-mla tokenspeed-triton
        nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-nvdisasm nvidia-cuda-cccl cuda-tile
        supervisor sentry-sdk fastapi-cloud-cli rich-toolkit rignore agent-detector
        detect-installer""".split()),
        remove=("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
                "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
                "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so"),
        why_skip="video, other kernels' JIT toolchains, CLI/cloud extras; Ampere-only FA2"),
    "sglang": Engine(
        "sglang==0.5.17", "/tmp/sglang-site", "sglang.launch_server", frozenset(TORCH_STACK),
        # CUDA 12 builds (the image is CUDA 13); Blackwell-only MLA (tokenspeed); DeepSeek
        # V3.2's sparse-attention indexer (tilelang, and z3 for it). None of these is imported
        # by `import sglang.launch_server` nor by the model, worker and EAGLE-3/DFlash modules
        # (checked on a CPU: every other import of that chain resolved from the folder).
        skip=frozenset("""nvidia-cutlass-dsl-libs-cu12 tokenspeed-triton tilelang
        z3-solver""".split()),
        why_skip="CUDA 12 builds, Blackwell-only MLA, DeepSeek V3.2's indexer"),
}


def platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for n in range(17, 40):
        args += ["--platform", f"manylinux_2_{n}_x86_64"]
    return args + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], stderr=subprocess.PIPE,
                          text=True)
    # a machine's pip config may name local indexes that do not exist: one warning each
    said = [line for line in done.stderr.splitlines() if "is ignored: it is neither" not in line]
    if said:
        print("\n".join(said), file=sys.stderr)
    if done.returncode:
        raise SystemExit(f"pip {args[0]} failed (exit {done.returncode})")


def to_ship(engine: Engine, report: dict) -> list[str]:
    """name==version for each resolved package the host must receive."""
    out = []
    for item in report["install"]:
        meta = item["metadata"]
        name = meta["name"].lower().replace("_", "-")
        if name not in engine.take_from_image and name not in engine.skip:
            out.append(f"{name}=={meta['version']}")
    return out


INSTALL = """#!/usr/bin/env bash
# On the GPU host, after every chunk was copied to {chunks}: unpack into {site}.
set -euo pipefail
cd {chunks}
python3 -m pip install -q --no-index --no-deps --target /tmp/zst zstandard-*.whl
cat part.* > site.tar.zst
PYTHONPATH=/tmp/zst python3 - <<'PY'
import tarfile, zstandard
with open("site.tar.zst", "rb") as f, tarfile.open(
        fileobj=zstandard.ZstdDecompressor().stream_reader(f), mode="r|") as t:
    t.extractall("{site}", filter="fully_trusted")
PY
rm -f site.tar.zst
PYTHONPATH={site} python3 -c "import {module}; print('{name} ready in {site}')"
touch {site}/.ready  # what benchmarks/gpu/pipeline.sh waits for
"""


def build(name: str, out: Path, level: int) -> list[Path]:
    engine = ENGINES[name]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pip("install", "--dry-run", "--ignore-installed", "--report", str(work / "r.json"),
            *platform_args(), "--target", str(work / "t"), engine.requirement)
        need = to_ship(engine, json.loads((work / "r.json").read_text()))
        print(f"{name}: {len(need)} packages to ship ({engine.why_skip} left out)")
        (work / "need.txt").write_text("\n".join(need) + "\n")
        pip("download", "--no-deps", *platform_args(), "-d", str(work / "w"),
            "-r", str(work / "need.txt"))
        pip("download", "--no-deps", *platform_args(), "-d", str(work / "z"), "zstandard")
        site = work / "site"
        site.mkdir()
        for wheel in sorted((work / "w").glob("*.whl")):
            subprocess.run(["unzip", "-q", "-o", str(wheel), "-d", str(site)], check=True)
        for rel in engine.remove:
            target = site / rel
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        archive = work / "site.tar.zst"
        subprocess.run(f"tar -C {site} -cf - . | zstd -q -{level} --long=27 -T0 -o {archive}",
                       shell=True, check=True)
        # --long=27: a 128 MiB window finds repeats far apart in a fat library (one build per
        # GPU architecture); 2^27 is also the most a zstd decoder accepts by default
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        subprocess.run(["split", "-b", PART, "-d", str(archive), str(work / "part.")], check=True)
        chunks = []
        for i, part in enumerate(sorted(work.glob("part.*")), 1):
            chunk = out / f"c{i}"
            chunk.mkdir()
            shutil.move(part, chunk / part.name)
            chunks.append(chunk)
        for wheel in (work / "z").glob("*.whl"):
            shutil.copy(wheel, chunks[0])
        chunk_dir = f"/tmp/{name}-chunks"
        (chunks[-1] / "install.sh").write_text(INSTALL.format(
            chunks=chunk_dir, site=engine.site, module=engine.module, name=name))
    for c in chunks:
        mib = sum(f.stat().st_size for f in c.iterdir()) / 2**20
        print(f"  {c}: {mib:.1f} MiB")
    print(f"""
On the GPU host, one transfer per chunk, while its /tmp survives:
  chunk k = 1..{len(chunks)}: bring {out}/c<k>, then
      mkdir -p {chunk_dir} && cp {out}/c<k>/* {chunk_dir}/
  after chunk {len(chunks)}: bash {chunk_dir}/install.sh
  then run the engine with {engine.site} first on PYTHONPATH (docs/gpu.md)""")
    return chunks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", choices=sorted(ENGINES))
    p.add_argument("--out", type=Path, help="default .gpu-<engine>")
    p.add_argument("--level", type=int, default=19, help="zstd level (19: smallest, slowest)")
    a = p.parse_args(argv)
    build(a.engine, a.out or Path(f".gpu-{a.engine}"), a.level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
