"""The packed varlen attention: each sample of a flat row attends causally within itself only,
through per-sample SDPA (CPU) or torch's variable-length flash attention (CUDA: aten's flash
forward called directly, or the public varlen_attn)."""

import pytest
import torch

from draftsmith import packed_attention as pa
from draftsmith.errors import DraftsmithError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dense_reference(q, k, v, lengths, scale=None, window=None):
    """One (T x T) masked softmax over the whole row, in fp64: block-diagonal causal."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(len(doc))
    pos = i - torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])[doc]
    allowed = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]) < window
    q, k, v = (t[0].double() for t in (q, k, v))  # (H, T, D)
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)  # (T, Hq, Dv)


def inputs(lengths, hq=4, hkv=2, d=16, dv=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    return [torch.randn(1, h, T, dd, generator=g).to(device, dtype)
            for h, dd in [(hq, d), (hkv, d), (hkv, dv)]]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dv", [16, 8])  # MLA's narrower values
def test_per_sample_sdpa_equals_the_block_diagonal_mask(window, dv):
    lengths = [5, 1, 9, 4]
    q, k, v = inputs(lengths, dv=dv)
    with pa.documents(lengths, "cpu"):
        out, weights = pa.attention(None, q, k, v, None, scaling=0.3, sliding_window=window)
    assert weights is None and out.shape == (1, sum(lengths), 4, dv)
    torch.testing.assert_close(out[0].double(), dense_reference(q, k, v, lengths, 0.3, window),
                               atol=1e-5, rtol=1e-5)


def test_refuses_to_run_without_knowing_the_samples():
    q, k, v = inputs([4])
    with pytest.raises(RuntimeError, match="documents"):
        pa.attention(None, q, k, v, None)
    with pa.documents([3], "cpu"), pytest.raises(RuntimeError, match="one flat row of 3"):
        pa.attention(None, q, k, v, None)  # 4 tokens, but 3 announced


def test_softcapped_attention_is_refused_with_the_setting_that_works():
    q, k, v = inputs([4])
    with pa.documents([4], "cpu"), pytest.raises(DraftsmithError, match="flex_attention"):
        pa.attention(torch.nn.Identity(), q, k, v, None, softcap=50.0)


@pytest.mark.parametrize("lengths", [[9, 2, 3, 12, 1, 4, 8], [3, 1], [8, 9]])
def test_split_runs_long_samples_alone_and_the_rest_in_runs(lengths, monkeypatch):
    """`split` on the CPU, its flash calls standing in as per-sample SDPA: the row is cut right
    (long samples alone, each run of short ones with its own offsets) and put back in order."""
    monkeypatch.setattr(pa, "LONG_TOKENS", 8)
    calls = []

    def flash_stand_in(q, k, v, docs, scale, window):
        calls.append(docs.lengths)
        assert docs.cu.tolist() == [0, *torch.tensor(docs.lengths).cumsum(0).tolist()]
        return pa._sdpa_per_sample(q, k, v, docs, scale, window)

    monkeypatch.setattr(pa, "_flash", flash_stand_in)
    monkeypatch.setattr(pa, "KERNEL", "split")
    q, k, v = inputs(lengths, dv=8)
    with pa.documents(lengths, "cpu"):
        out = pa.attention(None, q, k, v, None, scaling=0.3)[0]
    torch.testing.assert_close(out[0].double(), dense_reference(q, k, v, lengths, 0.3),
                               atol=1e-5, rtol=1e-5)
    short_runs = {(9, 2, 3, 12, 1, 4, 8): [(2, 3), (1, 4)], (3, 1): [(3, 1)], (8, 9): []}
    assert calls == short_runs[tuple(lengths)]


@cuda
@pytest.mark.parametrize("lengths", [[2048], [700, 1, 33, 1290, 129], [64] * 40,
                                     [3000, 5, 700, 2048, 64, 64]])
@pytest.mark.parametrize("dv", [128, 64])
@pytest.mark.parametrize("kernel", ["flash", "varlen", "split"])
def test_gpu_varlen_kernel_equals_per_sample_sdpa(kernel, lengths, dv, monkeypatch):
    q, k, v = inputs(lengths, hq=32, hkv=8, d=128, dv=dv, dtype=torch.bfloat16, device="cuda")
    outs = {}
    for name in (kernel, "sdpa"):
        monkeypatch.setattr(pa, "KERNEL", name)
        with pa.documents(lengths, "cuda"):
            outs[name] = pa.attention(None, q, k, v, None)[0]
    ref = dense_reference(q, k, v, lengths).float() if sum(lengths) <= 2048 else None
    torch.testing.assert_close(outs[kernel], outs["sdpa"], atol=2e-2, rtol=2e-2)
    if ref is not None:
        torch.testing.assert_close(outs[kernel][0].float(), ref, atol=2e-2, rtol=2e-2)


@cuda
def test_gpu_flash_kernel_on_the_model_layout_with_a_window(monkeypatch):
    """The tensors as a model hands them over ((1, H, T, D) views of (T, H, D) memory, fewer KV
    heads), a sliding window and a scale, against the dense fp64 reference."""
    lengths = [700, 33, 1290]
    T = sum(lengths)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, h, 128, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
               for h in (32, 8, 8))
    monkeypatch.setattr(pa, "KERNEL", "flash")
    with pa.documents(lengths, "cuda"):
        out = pa.attention(None, q, k, v, None, scaling=0.07, sliding_window=256)[0]
    ref = dense_reference(q, k, v, lengths, 0.07, 256)
    torch.testing.assert_close(out[0].double(), ref, atol=2e-2, rtol=2e-2)


def _fake_varlen(q, k, v, cu, longest, causal, scale=None, window=(-1, -1), gqa=False):
    """What torch's varlen kernel computes, on the CPU: (T, H, D) inputs, one causal SDPA per
    sequence. Checks what it is handed the way the kernel would (head counts, head sizes)."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash wants one head size"
    assert gqa or q.shape[1] == k.shape[1], "this signature has no GQA"
    assert causal and window in ((-1, -1), (-1, 0))
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=gqa)
        out[a:b] = o.transpose(0, 1)
    return out


def old_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
               return_aux=None):  # torch 2.9-2.12
    return _fake_varlen(query, key, value, cu_seq_q, max_q, is_causal)


def new_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
               scale=None, window_size=(-1, -1), enable_gqa=False):  # torch >= 2.13
    return _fake_varlen(query, key, value, cu_seq_q, max_q, window_size == (-1, 0), scale,
                        window_size, enable_gqa)


@pytest.mark.parametrize("fake", [old_varlen, new_varlen])
@pytest.mark.parametrize("dv", [16, 8])
def test_the_varlen_call_fits_either_torch_signature(fake, dv, monkeypatch):
    """The CUDA path's argument handling (scale, GQA, MLA's narrower values) against both
    signatures torch's varlen_attn has had, run on the CPU through a stand-in kernel."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(pa, "KERNEL", "varlen")
    lengths = [5, 1, 9, 4]
    q, k, v = inputs(lengths, dv=dv)
    with pa.documents(lengths, "cpu"):
        out = pa.attention(None, q, k, v, None, scaling=0.3)[0]
    torch.testing.assert_close(out[0].double(), dense_reference(q, k, v, lengths, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_the_flash_call_takes_views_and_kv_heads_as_they_are(monkeypatch):
    """The default CUDA path's argument handling, on the CPU through a stand-in for aten's flash
    forward that checks what the real one requires: (T, H, D) with a contiguous last dim (any
    other strides), fewer KV heads than query heads, one head size, int32 offsets."""
    seen = {}

    def fake_flash(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                   window_size_right=None):
        assert all(t.stride(-1) == 1 for t in (query, key, value))
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash wants one head size"
        assert cum_seq_q.dtype == torch.int32 and is_causal and dropout_p == 0.0
        assert window_size_left is None and window_size_right is None
        seen["copied"] = not all(t._is_view() for t in (query, key))
        seen["kv_heads"] = key.shape[1]
        out = _fake_varlen(query, key, value, cum_seq_q, max_q, True, scale, gqa=True)
        return out, None, None, None, None

    monkeypatch.setattr(pa, "_aten_flash", lambda: fake_flash)
    monkeypatch.setattr(pa, "KERNEL", "flash")
    lengths = [5, 1, 9, 4]
    q, k, v = inputs(lengths, dv=8)  # MLA's narrower values: padded for the call
    with pa.documents(lengths, "cpu"):
        out = pa.attention(None, q, k, v, None, scaling=0.3)[0]
    torch.testing.assert_close(out[0].double(), dense_reference(q, k, v, lengths, 0.3),
                               atol=1e-5, rtol=1e-5)
    assert seen == {"copied": False, "kv_heads": 2}
