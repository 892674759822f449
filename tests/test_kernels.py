"""draftsmith_kernels.soft_ce: the reference against a float64 formula (CPU), the dispatcher, the
benchmark script, and (on a GPU) the CUDA kernel against the reference."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import draftsmith_kernels.soft_ce as K
from draftsmith_kernels import _build
from draftsmith.errors import DraftsmithError

REPO = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Output tolerance (rtol) by grad dtype: rounding to it dominates the fp32 arithmetic.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.fixture(autouse=True)
def default_mode(monkeypatch):
    monkeypatch.delenv(K.ENV, raising=False)
    yield
    K.use(None)


def make_inputs(n, v, ldtype, tdtype, device="cpu", scale=4.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n, v, device=device, generator=g) * scale).to(ldtype)
    target = (torch.randn(n, v, device=device, generator=g) * scale).to(tdtype)
    row_scale = torch.rand(n, device=device, generator=g)
    row_scale[1::3] = 0  # masked rows (not row 0, so N=1 keeps a gradient): grad exactly zero
    return logits, target, row_scale


def float64_expected(logits, target, row_scale):
    """(ce, neg_entropy, pred, target_pred, grad) from the formulas, grad by autograd."""
    l = logits.double().requires_grad_()
    t = target.double()
    p = torch.softmax(t, -1)
    ce = torch.logsumexp(l, -1) - (p * l).sum(-1)
    (row_scale.double() * ce).sum().backward()
    neg_entropy = (p * torch.log_softmax(t, -1)).sum(-1)
    return ce.detach(), neg_entropy, logits.argmax(-1), target.argmax(-1), l.grad


def assert_matches(out, want, grad_dtype, atol=1e-4):
    ce, neg_entropy, pred, target_pred, grad = out
    assert ce.dtype == neg_entropy.dtype == torch.float32
    assert pred.dtype == target_pred.dtype == torch.int64 and grad.dtype == grad_dtype
    torch.testing.assert_close(ce.double(), want[0], rtol=1e-5, atol=atol)
    torch.testing.assert_close(neg_entropy.double(), want[1], rtol=1e-5, atol=atol)
    assert torch.equal(pred, want[2]) and torch.equal(target_pred, want[3])
    torch.testing.assert_close(grad.double(), want[4].to(grad.dtype).double(),
                               rtol=GRAD_RTOL[grad_dtype], atol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("ldtype,tdtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("v", [1, 2, 31, 1000])
@pytest.mark.parametrize("n", [1, 5, 300])
def test_ref_matches_float64_formula(n, v, ldtype, tdtype, inplace):
    logits, target, row_scale = make_inputs(n, v, ldtype, tdtype, seed=n * 1000 + v)
    want = float64_expected(logits, target, row_scale)
    out = K.soft_ce_ref(logits, target, row_scale, inplace=inplace)
    assert_matches(out, want, ldtype)
    assert (out[4] is logits) == inplace
    assert not out[4][1::3].any(), "rows with row_scale 0 have zero grad"


@pytest.mark.parametrize("chunk_rows", [1, 7])
def test_ref_chunks_cover_every_row(monkeypatch, chunk_rows):
    v = 31
    monkeypatch.setattr(K, "REF_CHUNK_ELEMENTS", chunk_rows * v + v // 2)
    logits, target, row_scale = make_inputs(300, v, torch.float32, torch.float32)
    assert_matches(K.soft_ce_ref(logits, target, row_scale),
                   float64_expected(logits, target, row_scale), torch.float32)


def test_argmax_ties_take_first_index():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    target = torch.tensor([[3.0, 0.0, 3.0, 3.0], [0.0, 1.0, 0.0, 1.0]])
    _, _, pred, target_pred, _ = K.soft_ce_ref(logits, target, torch.ones(2))
    assert pred.tolist() == [1, 0] and target_pred.tolist() == [0, 1]


def test_contract_errors():
    logits, target, row_scale = make_inputs(4, 8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="shape of logits"):
        K.soft_ce(logits, target[:, :7], row_scale)
    with pytest.raises(ValueError, match=r"row_scale must be \(N,\)"):
        K.soft_ce(logits, target, row_scale[:3])
    with pytest.raises(TypeError, match="target_logits must be"):
        K.soft_ce(logits, target.half(), row_scale)
    with pytest.raises(ValueError, match="contiguous"):
        K.soft_ce(logits.t(), target.t(), torch.ones(8), inplace=True)


def test_cpu_tensors_use_the_reference_silently(monkeypatch, recwarn):
    def no_build():
        raise AssertionError("CPU tensors must not build the kernel")

    monkeypatch.setattr(K, "_extension", no_build)
    logits, target, row_scale = make_inputs(5, 31, torch.bfloat16, torch.float32)
    got, want = K.soft_ce(logits, target, row_scale), K.soft_ce_ref(logits, target, row_scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not [w for w in recwarn if "draftsmith_kernels" in str(w.message)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("how", ["use", "env"])
def test_forcing_cuda_without_a_gpu_raises(monkeypatch, how):
    if how == "use":
        K.use("cuda")
    else:
        monkeypatch.setenv(K.ENV, "cuda")
    logits, target, row_scale = make_inputs(2, 3, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="CUDA kernel is unavailable: no CUDA device"):
        K.soft_ce(logits, target, row_scale)
    assert not K.available() and K.status() == "reference (no CUDA device)"


def test_mode_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="one of"):
        K.use("fast")
    monkeypatch.setenv(K.ENV, "fast")
    with pytest.raises(DraftsmithError, match=f"(?s){K.ENV} is 'fast'.*one of auto, ref, cuda"):
        K.status()
    K.use("ref")  # the override wins over the environment
    assert K.status().startswith("reference (forced")


def test_a_built_kernel_is_kept_by_its_source_compiler_and_archs(tmp_path, monkeypatch):
    """A changed source or another toolkit must build anew, never load a stale binary; the
    same build finds its folder again (a second run loads, not nvcc)."""
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}")
    first = _build.build_directory("k", src, ["90"], "V13.0")
    assert first.is_dir() and first.parent == tmp_path / "cache"
    assert _build.build_directory("k", src, ["90"], "V13.0") == first
    assert _build.build_directory("k", src, ["90", "100"], "V13.0") != first
    assert _build.build_directory("k", src, ["90"], "V13.1") != first
    src.write_text("__global__ void k() { }")
    assert _build.build_directory("k", src, ["90"], "V13.0") != first


needs_nvcc = pytest.mark.skipif(_build.find_nvcc() is None,
                                reason="needs nvcc (the CUDA toolkit); no GPU needed")
# Each kernel's C function with no rows (returns before any CUDA call) and with an unknown
# dtype code (refused before any CUDA call): what its ctypes declaration must carry through.
C_CALLS = {"soft_ce": lambda f, rows, dtype: f(None, dtype, None, 0, *[None] * 6, rows, 8, None),
           "fp8_rows": lambda f, rows, dtype: f(None, dtype, None, None, rows, 8, None)}


@needs_nvcc
@pytest.mark.parametrize("kernel", ["soft_ce", "fp8_rows"])
def test_each_kernel_builds_with_nvcc_alone_and_loads(tmp_path, monkeypatch, kernel):
    """No GPU needed to build and load: the .cu compiles with CUDA's headers only, the library
    exports the C functions its shim declares, and a second build loads the kept file."""
    import importlib

    shim = importlib.import_module(f"draftsmith_kernels.{kernel}")
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path))
    lib, reason, error = _build.build(f"draftsmith_{kernel}", f"{kernel}.cu", archs=["90"])
    assert lib is not None, (reason, getattr(error, "stderr", None))
    shim.bind(lib)
    errors, run = getattr(lib, f"draftsmith_{kernel}_error"), getattr(lib, f"draftsmith_{kernel}")
    assert errors(1) == b"invalid argument"  # cudaErrorInvalidValue, no device needed
    assert C_CALLS[kernel](run, 0, 2) == 0 and C_CALLS[kernel](run, 3, 7) == 1
    (built,) = tmp_path.glob(f"draftsmith_{kernel}-*/draftsmith_{kernel}.so")
    assert not list(tmp_path.glob("*/*.tmp"))  # written beside it, then renamed
    stamp = built.stat().st_mtime_ns
    assert _build.build(f"draftsmith_{kernel}", f"{kernel}.cu", archs=["90"])[0] is not None
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt


@needs_nvcc
def test_a_kernel_that_does_not_compile_gives_the_compilers_error(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k() { undeclared(); }\n")
    monkeypatch.setattr(_build, "__file__", str(tmp_path / "_build.py"))
    lib, reason, error = _build.build("bad", "bad.cu", archs=["90"])
    assert lib is None and "undeclared" in reason and "error" in reason
    assert not list((tmp_path / "cache").glob("*/*"))  # nothing half-written kept


def test_prebuild_does_nothing_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(K, "_built", False)
    K.prebuild()
    assert not K._built
    assert not any(t.name == "soft_ce build" for t in threading.enumerate())


def test_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "benchmarks/soft_ce.py", "--device", "cpu", "--n", "64",
                    "--v", "100", "--json", str(out)], cwd=REPO, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert {"n", "v", "kernel_ms", "ref_ms", "ratio", "bytes_moved", "achieved_GBps",
            "bytes_counted"} <= result.keys()
    assert result["n"] == 64 and result["ref_ms"] > 0 and result["kernel_ms"] is None


# --- GPU: the kernel against the reference ------------------------------------------------

def poison_allocator(*nbytes):
    """Leave all-ones bytes (NaN as floats, -1 as int64) in freed blocks of these sizes, which the
    kernel's outputs are then carved from: an element it never writes cannot pass."""
    for size in nbytes:
        torch.full((size,), 255, dtype=torch.uint8, device="cuda")


def run_kernel(logits, target, row_scale, inplace):
    if not inplace:  # inplace output is the logits buffer: unwritten elements stay logits
        n = logits.shape[0]
        poison_allocator(4 * n, 4 * n, 8 * n, 8 * n, logits.numel() * logits.element_size())
    return K.soft_ce(logits, target, row_scale, inplace=inplace)


def assert_kernel_matches_ref(logits, target, row_scale, inplace):
    want = K.soft_ce_ref(logits, target, row_scale)  # not inplace: logits stay for the kernel
    K.use("cuda")
    got = run_kernel(logits, target, row_scale, inplace)
    assert got[4].dtype == logits.dtype and (got[4] is logits) == inplace
    for name, g in zip(["ce", "target_neg_entropy", "grad"], [got[0], got[1], got[4]]):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[4].float(), want[4].float(),
                               rtol=GRAD_RTOL[logits.dtype], atol=1e-6)


@gpu
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ldtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("v", [1, 31, 32000, 32001, 128256])
@pytest.mark.parametrize("n", [1, 3, 1000, 4099])
def test_kernel_matches_ref(n, v, ldtype, tdtype, inplace):
    inputs = make_inputs(n, v, ldtype, tdtype, device="cuda", seed=n * 1000 + v)
    assert_kernel_matches_ref(*inputs, inplace)


def misaligned(x):
    """A contiguous copy of x one element past an aligned base: the kernel's scalar path."""
    out = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    assert out.data_ptr() % 16
    return out.copy_(x)


@gpu
@pytest.mark.parametrize("ldtype,tdtype", [(torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16)])
def test_kernel_rows_not_16_byte_aligned(ldtype, tdtype):
    logits, target, row_scale = make_inputs(7, 32000, ldtype, tdtype, device="cuda")
    logits, target = misaligned(logits), misaligned(target)
    assert_kernel_matches_ref(logits, target, row_scale, inplace=False)
    assert_kernel_matches_ref(logits, target, row_scale, inplace=True)


@gpu
@pytest.mark.parametrize("ldtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_large_logits_stay_finite(ldtype):
    logits, target, row_scale = make_inputs(64, 32000, ldtype, torch.float32, device="cuda",
                                            scale=120.0)  # randn * 30 * 4
    assert_kernel_matches_ref(logits, target, row_scale, inplace=False)


@gpu
def test_kernel_argmax_ties_take_first_index():
    # fp32: 4 columns a vector, 2048 a sweep of 512 threads. Tied maxima in other threads,
    # in later sweeps of the same thread, and within one vector.
    logits = torch.zeros(3, 32000, device="cuda")
    target = torch.zeros(3, 32000, device="cuda")
    for row, cols in enumerate([[5000, 2053, 31000, 5], [4101, 4100], [9, 8, 31999]]):
        logits[row, cols] = 3.0
        target[row, cols[::-1]] = 2.0
    K.use("cuda")
    _, _, pred, target_pred, _ = K.soft_ce(logits, target, torch.ones(3, device="cuda"))
    assert pred.tolist() == [5, 4100, 8] and target_pred.tolist() == [5, 4100, 8]


@gpu
def test_cuda_tensors_use_the_kernel():
    assert K.available() and K.status() == "cuda kernel"


# ----------------------------------------------------------------------------- fp8_rows


def test_fp8_reference_scales_each_row_to_the_format_range():
    from draftsmith.hidden_format import dequantize
    from draftsmith_kernels import fp8_rows as F8

    x = torch.randn(6, 50, dtype=torch.bfloat16) * torch.logspace(-3, 3, 6)[:, None]
    x[3] = 0
    q, scale = F8.quantize_ref(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale[3] == 1 and torch.all(q[3].float() == 0)  # an all-zero row
    rows = [r for r in range(6) if r != 3]
    amax = x.float().abs().amax(-1)
    assert torch.allclose(scale[rows], amax[rows] / 448)
    assert torch.all(q[rows].float().abs().amax(-1) == 448)  # each row's largest maps to the max
    y = dequantize(q, scale, torch.float32)
    rel = (y - x.float()).norm(dim=-1)[rows] / x.float().norm(dim=-1)[rows]
    assert rel.max() < 0.05  # e4m3 keeps ~3 significant bits at every magnitude


@gpu
@pytest.mark.parametrize("shape", [(1, 1), (7, 4096), (33, 12288), (5, 1000), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_kernel_matches_reference(shape, dtype):
    from draftsmith_kernels import fp8_rows as F8

    K.use("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=g) * 30).to(dtype)
    if shape[0] > 2:
        x[1] = 0
    q, s = F8.quantize(x)
    rq, rs = F8.quantize_ref(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # Same scale; the kernel multiplies by 1/scale, the reference divides: at most one fp8
    # step apart, in a few elements (0.96% at most on an H200, bf16 5 x 1000). One e4m3 step
    # is 2^-3 of the value's power of two, and 2^-9 below the smallest normal (2^-6): e4m3's
    # subnormals are evenly spaced, so the floor is on the value, at 2^-6.
    diff = (q.float() - rq.float()).abs()
    step = rq.float().abs().clamp_min(2 ** -6) * 2 ** -3
    assert torch.all(diff <= step), float((diff / step).max()) if diff.numel() else 0.0
    if diff.numel():  # (0, 64): an empty batch goes through, and there is nothing to compare
        assert (diff > 0).float().mean() < 0.02
