"""smla.flash_mla against FlashMLA's conventions, on numpy arrays (CPU).

The cases follow FlashMLA's own tests (test_flash_mla_sparse_decoding.py,
the sparse prefill test and tests/ref.py): NaN in every cache slot that no
valid index reads, invalid indices -1 / -2^31 / s_kv / 2^31-1 and friends,
attention sinks of +-inf, topk_length, blocks padded the way its quantiser
pads them, lse of a query with nothing to attend = +inf.
"""

from __future__ import annotations

import numpy as np
import pytest

import smla
from reference import (FP8_ROW, INVALID_INDICES, LATENT, MODEL1_NOPE, MODEL1_ROW, MODEL1_VALUE, QK, ROPE, V, attention,
                       dequantize_ds_mla, dequantize_model1, model1_block_bytes, model1_view, quantize_ds_mla,
                       quantize_model1)
from smla.flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata

ml_dtypes = pytest.importorskip("ml_dtypes")
bf16 = ml_dtypes.bfloat16


def flashmla_lse(lse: np.ndarray) -> np.ndarray:
    return np.where(np.isneginf(lse), np.inf, lse)


def check(name, ans, ref, atol, rtol):
    ans = np.asarray(ans, np.float64)
    assert ans.shape == ref.shape, f"{name}: {ans.shape} vs {ref.shape}"
    np.testing.assert_array_equal(np.isposinf(ans), np.isposinf(ref), err_msg=name)
    np.testing.assert_array_equal(np.isneginf(ans), np.isneginf(ref), err_msg=name)
    assert not np.isnan(ans).any()
    f = np.isfinite(ref)
    np.testing.assert_allclose(ans[f], ref[f], atol=atol, rtol=rtol, err_msg=name)


def sparse_decode_case(rng, b, s_q, h_q, topk, block_size, num_blocks, have_topk_length, all_invalid=False):
    """FlashMLA-style sparse decode inputs with an FP8 cache (num_blocks, block_size, 1, 656)."""
    q = np.clip(rng.standard_normal((b, s_q, h_q, QK)), -1, 1).astype(bf16)
    # Blocks padded by one row, as FlashMLA's quantize_k_cache allocates them.
    buf = np.zeros((num_blocks, block_size + 1, FP8_ROW), np.uint8)
    kv = buf[:, :block_size, :]
    num_slots = num_blocks * block_size
    lat = np.clip(rng.standard_normal((num_slots, LATENT)) * 0.1, -1, 1).astype(np.float32)
    pe = np.clip(rng.standard_normal((num_slots, ROPE)) * 0.1, -1, 1).astype(np.float32)
    kv[:] = quantize_ds_mla(lat, pe).reshape(num_blocks, block_size, FP8_ROW)
    indices = np.stack([rng.choice(num_slots, size=topk, replace=False) for _ in range(b * s_q)])
    indices = indices.reshape(b, s_q, topk).astype(np.int32)
    indices[rng.random(indices.shape) < 0.2] = -1
    if all_invalid:
        indices[0] = -1
    topk_length = rng.integers(0, topk + 1, size=b).astype(np.int32) if have_topk_length else None
    # Every slot that no counted index reads becomes NaN.
    counted = indices.copy()
    if topk_length is not None:
        counted[np.broadcast_to(np.arange(topk)[None, None, :] >= topk_length[:, None, None], counted.shape)] = -1
    used = np.zeros(num_slots, bool)
    used[counted[counted >= 0]] = True
    for s in np.flatnonzero(~used):
        kv[s // block_size, s % block_size, :LATENT] = 0x7F  # e4m3 NaN
    sink = rng.standard_normal(h_q).astype(np.float32)
    mask = rng.standard_normal(h_q)
    sink[mask > 0.5], sink[mask < -0.5] = np.inf, -np.inf
    return q, kv[:, :, None, :], indices, topk_length, sink


@pytest.mark.parametrize("b,s_q,h_q,topk,block_size,have_topk_length", [
    (4, 1, 64, 64, 2, False),
    (3, 3, 16, 64, 61, True),
    (2, 2, 128, 96, 64, True),
])
def test_sparse_decode(rng, b, s_q, h_q, topk, block_size, have_topk_length):
    num_blocks = -(-512 // block_size)
    q, k_cache, indices, topk_length, sink = sparse_decode_case(rng, b, s_q, h_q, topk, block_size, num_blocks,
                                                                have_topk_length, all_invalid=True)
    sched, splits = get_mla_metadata()
    assert isinstance(sched, FlashMLASchedMeta) and splits is None
    scale = QK**-0.55
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, None, softmax_scale=scale, causal=False,
                                      is_fp8_kvcache=True, indices=indices, attn_sink=sink, topk_length=topk_length)
    assert out.shape == (b, s_q, h_q, V) and out.dtype == bf16
    assert lse.shape == (b, h_q, s_q) and lse.dtype == np.float32 and lse.flags.c_contiguous
    rows = dequantize_ds_mla(k_cache[:, :, 0, :]).reshape(-1, QK)
    tl = None if topk_length is None else np.repeat(topk_length, s_q)
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(b * s_q, h_q, QK), rows,
                                 indices.reshape(b * s_q, topk), scale, tl, sink)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)
    assert np.all(np.isposinf(lse[0])) and np.all(out[0] == 0)  # the all-invalid request
    assert sched.have_initialized and sched.config.topk == topk and sched.config.is_fp8_kvcache


def test_sched_meta_must_match_its_first_use(rng):
    q, k_cache, indices, _, _ = sparse_decode_case(rng, 2, 1, 16, 64, 16, 32, False)
    sched, _ = get_mla_metadata()
    flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, is_fp8_kvcache=True, indices=indices)
    with pytest.raises(smla.InvalidArgumentError, match="topk"):
        flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, is_fp8_kvcache=True, indices=indices[..., :32])
    with pytest.raises(smla.InvalidArgumentError, match="num_splits"):
        flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], np.zeros(3, np.int32),
                               is_fp8_kvcache=True, indices=indices)


def dense_paged_cache(rng, seqlens, block_size, width, dtype):
    """FlashMLA's 4-D paged cache, blocks shuffled: random rows of `width` where the requests' contexts lie, NaN
    elsewhere. Returns (block_table, k_cache)."""
    b, max_blocks = len(seqlens), -(-int(seqlens.max()) // block_size)
    block_table = rng.permutation(b * max_blocks).reshape(b, max_blocks).astype(np.int32)
    k_cache = np.full((b * max_blocks, block_size, 1, width), np.nan, dtype)
    for i in range(b):
        for p in range(seqlens[i]):
            k_cache[block_table[i, p // block_size], p % block_size, 0] = rng.standard_normal(width) * 0.1
    return block_table, k_cache


def dense_slots(block_table, seqlens, s_q, block_size, causal):
    """(b, s_q, positions) the cache slots each new token attends, -1 padded: its request's whole context, or with
    `causal` the context up to the token itself (the j-th of s_q new tokens sits at seqlens - s_q + j)."""
    b = len(seqlens)
    slots = np.full((b, s_q, block_table.shape[1] * block_size), -1, np.int64)
    for i in range(b):
        for j in range(s_q):
            p = np.arange(seqlens[i] - s_q + j + 1 if causal else seqlens[i])
            slots[i, j, :len(p)] = block_table[i, p // block_size] * block_size + p % block_size
    return slots


@pytest.mark.parametrize("dtype", [bf16, np.float16])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_dense_decode(rng, dtype, s_q, causal):
    b, h_q, block_size = 3, 16, 64
    seqlens = np.array([1 + s_q, 200, 130], np.int32)
    block_table, k_cache = dense_paged_cache(rng, seqlens, block_size, QK, dtype)
    q = rng.standard_normal((b, s_q, h_q, QK)).astype(dtype)
    # The older metadata form: FlashMLA's shapes and dtypes, accepted and ignored.
    tile_md, num_splits = get_mla_metadata(seqlens, s_q * h_q, 1, h_q, False, None)
    assert tile_md.shape == (1, 8) and tile_md.dtype == np.int32 and num_splits.shape == (b + 1,)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tile_md, num_splits, causal=causal)
    rows = np.asarray(k_cache[:, :, 0, :], np.float64).reshape(-1, QK)
    slots = dense_slots(block_table, seqlens, s_q, block_size, causal)
    scale = QK**-0.5  # FlashMLA's default softmax_scale
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(b * s_q, h_q, QK), rows,
                                 slots.reshape(b * s_q, -1), scale)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, ref_lse.reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)


def test_dense_decode_empty_context_gives_inf_lse():
    q = np.ones((2, 1, 4, QK), np.float16)
    k_cache = np.full((2, 16, 1, QK), np.nan, np.float16)
    out, lse = flash_mla_with_kvcache(q, k_cache, np.array([[0], [1]], np.int32), np.array([0, 0], np.int32), 512,
                                      get_mla_metadata()[0])
    assert np.all(np.isposinf(lse)) and np.all(out == 0)


@pytest.mark.parametrize("s_q,s_kv,topk,h_q,have_sink,have_topk_length", [
    (5, 128, 128, 64, False, False),
    (7, 95, 128, 16, True, True),  # topk > s_kv: out-of-bounds indices
    (3, 592, 64, 128, True, False),
])
def test_sparse_prefill(rng, s_q, s_kv, topk, h_q, have_sink, have_topk_length):
    q = (rng.standard_normal((s_q, h_q, QK)) / 10 + (rng.random() - 0.5) / 10).astype(bf16)
    kv_buf = (rng.standard_normal((s_kv, 2, QK)) / 10).astype(bf16)
    kv = kv_buf[:, :1, :]  # non-contiguous (s_kv, 1, d_qk)
    idx_buf = np.zeros((s_q, 1, topk + 3), np.int32)
    indices = idx_buf[:, :, :topk]
    invalid = list(INVALID_INDICES) + [s_kv, 114514, 1919810]
    for t in range(s_q):
        perm = rng.permutation(max(s_kv, topk))[:topk]
        perm[perm >= s_kv] = rng.choice(invalid, size=int((perm >= s_kv).sum()))
        indices[t, 0] = perm
    indices[s_q - 1, 0] = rng.choice(invalid)  # a query with nothing to attend
    sink = None
    if have_sink:
        sink = rng.standard_normal(h_q).astype(np.float32)
        m = rng.standard_normal(h_q)
        sink[m < -0.5], sink[m > 0.5] = -np.inf, np.inf
    topk_length = None
    if have_topk_length:
        topk_length = np.minimum(rng.integers(0, max(topk + 1, 64), size=s_q), topk).astype(np.int32)
    sm_scale = 0.5
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, sm_scale, 512, sink, topk_length)
    assert out.shape == (s_q, h_q, V) and max_logits.shape == (s_q, h_q) and lse.shape == (s_q, h_q)
    rows = np.asarray(kv[:, 0, :], np.float64)
    idx = indices[:, 0, :]
    ref_out, ref_lse = attention(np.asarray(q, np.float64), rows, idx, sm_scale, topk_length, sink)
    check("out", out, ref_out, 8e-4 + 2**-8 * 0.5, 3.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse), 1e-6, 2.01 / 65536)
    # max_logits: the largest valid scaled score, -inf where there is none; no sink.
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= np.arange(topk)[None, :] < topk_length[:, None]
    scores = sm_scale * np.einsum("thd,tkd->thk", np.asarray(q, np.float64), rows[np.where(valid, idx, 0)])
    ref_max = np.where(valid[:, None, :], scores, -np.inf).max(axis=-1)
    check("max_logits", max_logits, ref_max, 1e-6, 2.01 / 65536)
    assert np.all(np.isneginf(max_logits[-1])) and np.all(np.isposinf(lse[-1])) and np.all(out[-1] == 0)

    out2, none, lse2 = flash_mla_sparse_fwd(q, kv, indices, sm_scale, 512, sink, topk_length,
                                            return_max_logits=False)
    assert none is None and np.array_equal(lse2, lse)


def test_flash_mla_argument_errors(rng):
    q, k_cache, indices, _, _ = sparse_decode_case(rng, 2, 1, 16, 64, 16, 32, False)
    sched = get_mla_metadata()[0]
    with pytest.raises(smla.InvalidArgumentError, match="head_dim_v"):
        flash_mla_with_kvcache(q, k_cache, None, None, 128, sched, is_fp8_kvcache=True, indices=indices)
    with pytest.raises(smla.InvalidArgumentError, match="causal"):
        flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, causal=True, is_fp8_kvcache=True, indices=indices)
    with pytest.raises(smla.InvalidArgumentError, match="is_fp8_kvcache"):
        flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], indices=indices)
    with pytest.raises(smla.InvalidArgumentError, match="block_table"):
        flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], is_fp8_kvcache=True)
    with pytest.raises(smla.InvalidArgumentError, match="h_kv"):
        flash_mla_sparse_fwd(q[0], np.zeros((8, 2, QK), bf16), np.zeros((1, 2, 64), np.int32), 0.1)


# --- d_qk 512: heads with no rope part (GLM-5.3-Flash) ---------------------------------------------------------

FP8_NOPE_ROW = LATENT + 16  # fp8_ds_mla_nope: 512 e4m3 + 4 fp32 scales


def no_rope_fp8_cache(rng, num_blocks, block_size, form):
    """An FP8 cache of random latents for 512-wide heads, (num_blocks, block_size, 1, 656 | 528): the envelope's rope
    part is bf16 NaN (never read). Returns (cache, rows [num_slots, 512] float64 as the kernels see them)."""
    num_slots = num_blocks * block_size
    lat = np.clip(rng.standard_normal((num_slots, LATENT)) * 0.1, -1, 1).astype(np.float32)
    rows = quantize_ds_mla(lat, np.full((num_slots, ROPE), np.nan, np.float32))
    values = dequantize_ds_mla(rows)[:, :LATENT]
    if form == "fp8_ds_mla_nope":
        rows = rows[:, :FP8_NOPE_ROW]
    return rows.reshape(num_blocks, block_size, 1, -1), values


@pytest.mark.parametrize("form", ["fp8_ds_mla", "fp8_ds_mla_nope"])
@pytest.mark.parametrize("h_q,topk,block_size", [(8, 64, 64), (16, 100, 1), (128, 2048, 16)])
def test_sparse_decode_without_rope_part(rng, form, h_q, topk, block_size):
    b, s_q = 2, 2
    num_blocks = -(-max(2 * topk, 256) // block_size)
    k_cache, rows = no_rope_fp8_cache(rng, num_blocks, block_size, form)
    assert k_cache.shape[-1] == (FP8_ROW if form == "fp8_ds_mla" else FP8_NOPE_ROW)
    num_slots = num_blocks * block_size
    q = np.clip(rng.standard_normal((b, s_q, h_q, LATENT)), -1, 1).astype(bf16)
    indices = np.stack([rng.choice(num_slots, size=topk, replace=False) for _ in range(b * s_q)])
    indices = indices.reshape(b, s_q, topk).astype(np.int32)
    indices[rng.random(indices.shape) < 0.2] = rng.choice(INVALID_INDICES)
    topk_length = rng.integers(0, topk + 1, size=b).astype(np.int32)
    sink = rng.standard_normal(h_q).astype(np.float32)
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], is_fp8_kvcache=True,
                                      indices=indices, attn_sink=sink, topk_length=topk_length)
    assert out.shape == (b, s_q, h_q, V) and lse.shape == (b, h_q, s_q)
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(b * s_q, h_q, LATENT), rows,
                                 indices.reshape(b * s_q, topk), LATENT**-0.5, np.repeat(topk_length, s_q), sink)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)


@pytest.mark.parametrize("dtype", [bf16, np.float16])
def test_dense_decode_without_rope_part(rng, dtype):
    b, s_q, h_q, block_size = 3, 2, 16, 16
    seqlens = np.array([2, 70, 45], np.int32)
    block_table, k_cache = dense_paged_cache(rng, seqlens, block_size, LATENT, dtype)
    q = rng.standard_normal((b, s_q, h_q, LATENT)).astype(dtype)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, get_mla_metadata()[0], causal=True)
    rows = np.asarray(k_cache[:, :, 0, :], np.float64).reshape(-1, LATENT)
    slots = dense_slots(block_table, seqlens, s_q, block_size, causal=True)
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(b * s_q, h_q, LATENT), rows,
                                 slots.reshape(b * s_q, -1), LATENT**-0.5)  # the default scale is d_qk^-0.5
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, ref_lse.reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)


def test_sparse_prefill_without_rope_part(rng):
    s_q, s_kv, topk, h_q = 4, 300, 128, 64
    q = (rng.standard_normal((s_q, h_q, LATENT)) / 10).astype(bf16)
    kv = (rng.standard_normal((s_kv, 1, LATENT)) / 10).astype(bf16)
    indices = np.stack([rng.permutation(s_kv)[:topk] for _ in range(s_q)]).astype(np.int32)[:, None, :]
    indices[0, 0, :5] = list(INVALID_INDICES)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, 0.3)
    rows = np.asarray(kv[:, 0, :], np.float64)
    ref_out, ref_lse = attention(np.asarray(q, np.float64), rows, indices[:, 0, :], 0.3)
    check("out", out, ref_out, 8e-4 + 2**-8 * 0.5, 3.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse), 1e-6, 2.01 / 65536)
    valid = (indices[:, 0, :] >= 0) & (indices[:, 0, :] < s_kv)
    scores = 0.3 * np.einsum("thd,tkd->thk", np.asarray(q, np.float64), rows[np.where(valid, indices[:, 0, :], 0)])
    check("max_logits", max_logits, np.where(valid[:, None, :], scores, -np.inf).max(axis=-1), 1e-6, 2.01 / 65536)


@pytest.mark.parametrize("form", ["bfloat16", "fp8_ds_mla", "fp8_ds_mla_nope"])
def test_write_mla_cache_without_rope_part(rng, form):
    """k_pe=None writes the latent only; the envelope's rope bytes (and every unwritten slot) stay as they were."""
    n, num_blocks, block_size = 20, 4, 8
    latent = (rng.standard_normal((n, LATENT)) * 0.3).astype(np.float32)
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[3] = -1
    width = {"bfloat16": LATENT, "fp8_ds_mla": FP8_ROW, "fp8_ds_mla_nope": FP8_NOPE_ROW}[form]
    if form == "bfloat16":
        cache = np.full((num_blocks, block_size, width), np.nan, bf16)
    else:
        cache = np.full((num_blocks, block_size, width), 0x7F, np.uint8)
    before = cache.copy()
    smla.write_mla_cache(latent, None, slots, cache)
    flat, old = cache.reshape(-1, width), before.reshape(-1, width)
    written = slots[slots >= 0]
    if form == "bfloat16":
        want = latent[slots >= 0].astype(bf16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(flat[written], np.float32), want)
    else:
        want = quantize_ds_mla(latent[slots >= 0], np.zeros((len(written), ROPE), np.float32))[:, :FP8_NOPE_ROW]
        np.testing.assert_array_equal(flat[written, :FP8_NOPE_ROW], want)
        np.testing.assert_array_equal(flat[written, FP8_NOPE_ROW:], old[written, FP8_NOPE_ROW:])  # rope bytes kept
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    np.testing.assert_array_equal(flat[untouched].view(np.uint8), old[untouched].view(np.uint8))


def test_without_rope_part_mismatched_cache_names_it(rng):
    q = np.zeros((2, 1, 8, LATENT), bf16)
    indices = np.zeros((2, 1, 4), np.int32)
    wide = np.zeros((4, 16, 1, QK), bf16)  # a 576-wide cache under 512-wide queries
    with pytest.raises(smla.InvalidArgumentError, match="kv_cache: dimension 2 .* must be 512"):
        flash_mla_with_kvcache(q, wide, None, None, 512, get_mla_metadata()[0], indices=indices)
    compact = np.zeros((4, 16, 1, FP8_NOPE_ROW), np.uint8)  # the rope-free fp8 form under 576-wide queries
    with pytest.raises(smla.InvalidArgumentError, match="fp8_ds_mla_nope has no rope part"):
        flash_mla_with_kvcache(np.zeros((2, 1, 8, QK), bf16), compact, None, None, 512, get_mla_metadata()[0],
                               is_fp8_kvcache=True, indices=indices)


# --- MODEL1 (DeepSeek-V4): 512-wide heads whose value is the whole row, a second cache under one softmax ----------


def model1_cache(rng, num_blocks, block_size, used):
    """A bf16 cache (num_blocks, block_size, 1, 512) of random rows, NaN in every slot no counted index reads."""
    rows = np.clip(rng.standard_normal((num_blocks * block_size, LATENT)) * 0.3, -1, 1).astype(bf16)
    rows[~used] = np.nan
    return rows.reshape(num_blocks, block_size, 1, LATENT), np.asarray(rows, np.float64)


def model1_indices(rng, b, s_q, topk, num_slots, other_slots):
    """(b, s_q, topk) int32 slots, a fifth invalid (INVALID_INDICES, num_slots, or the other cache's slot count)."""
    indices = rng.integers(0, num_slots, size=(b, s_q, topk)).astype(np.int32)
    invalid = rng.random(indices.shape) < 0.2
    indices[invalid] = rng.choice(list(INVALID_INDICES) + [num_slots, max(num_slots, other_slots)], size=invalid.sum())
    return indices


def counted(indices, lengths, num_slots):
    """Indices with the uncounted (beyond the request's length) and invalid ones set to -1."""
    idx = indices.astype(np.int64)
    if lengths is not None:
        lengths = lengths if lengths.ndim == 2 else np.broadcast_to(lengths[:, None], idx.shape[:2])
        idx[np.arange(idx.shape[2])[None, None, :] >= lengths[:, :, None]] = -1
    idx[(idx < 0) | (idx >= num_slots)] = -1
    return idx


@pytest.mark.parametrize("b,s_q,h_q,topk,extra_topk,block_size,extra_block_size,per_token", [
    (4, 1, 64, 64, 128, 64, 2, False),
    (3, 3, 128, 128, 64, 61, 576, True),
    (2, 2, 16, 576, 576, 1, 69, False),
    (74, 3, 16, 64, 576, 64, 69, True),
    (321, 1, 8, 64, 64, 2, 64, False),
])
def test_model1_sparse_decode_two_caches(rng, b, s_q, h_q, topk, extra_topk, block_size, extra_block_size, per_token):
    num_blocks, extra_blocks = -(-1024 // block_size), -(-700 // extra_block_size)
    num_slots, extra_slots = num_blocks * block_size, extra_blocks * extra_block_size
    indices = model1_indices(rng, b, s_q, topk, num_slots, extra_slots)
    extra_indices = model1_indices(rng, b, s_q, extra_topk, extra_slots, num_slots)
    extra_indices[1] = -1  # request 1 attends the main cache only
    indices[-1, -1] = extra_indices[-1, -1] = -1  # the last token: every index of both lists -1, nothing to attend
    length_shape = (b, s_q) if per_token else (b,)
    topk_length = rng.integers(0, topk + 1, size=length_shape).astype(np.int32)
    topk_length[0] = 0  # request 0 attends the extra cache only
    extra_topk_length = rng.integers(0, extra_topk + 1, size=length_shape).astype(np.int32)
    main_idx, extra_idx = counted(indices, topk_length, num_slots), counted(extra_indices, extra_topk_length, extra_slots)
    used = np.zeros(num_slots, bool)
    used[main_idx[main_idx >= 0]] = True
    extra_used = np.zeros(extra_slots, bool)
    extra_used[extra_idx[extra_idx >= 0]] = True
    k_cache, rows = model1_cache(rng, num_blocks, block_size, used)
    extra_k_cache, extra_rows = model1_cache(rng, extra_blocks, extra_block_size, extra_used)
    q = np.clip(rng.standard_normal((b, s_q, h_q, LATENT)), -1, 1).astype(bf16)
    sink = rng.standard_normal(h_q).astype(np.float32)
    sink[:2] = np.inf, -np.inf
    sched = get_mla_metadata()[0]
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, None, indices=indices, attn_sink=sink,
                                      topk_length=topk_length, extra_k_cache=extra_k_cache,
                                      extra_indices_in_kvcache=extra_indices, extra_topk_length=extra_topk_length)
    assert out.shape == (b, s_q, h_q, V) and lse.shape == (b, h_q, s_q)
    assert sched.config.extra_page_block_size == extra_block_size and sched.config.extra_topk == extra_topk
    # One softmax over both lists: the union of rows, the extra cache's slots after the main cache's.
    both = np.concatenate([main_idx, np.where(extra_idx >= 0, extra_idx + num_slots, -1)], axis=2)
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(b * s_q, h_q, LATENT),
                                 np.concatenate([rows, extra_rows]), both.reshape(b * s_q, -1),
                                 LATENT**-0.5, None, sink)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)
    assert np.all(np.isposinf(lse[-1, :, -1])) and np.all(np.asarray(out[-1, -1], np.float64) == 0)  # the empty token
    # The value is the whole row: its last 64 (rope) dims reach out like the others.
    assert np.abs(np.asarray(out[..., LATENT - 64:], np.float64)).max() > 0.01


def test_model1_sparse_prefill_value_is_the_whole_row(rng):
    """flash_mla_sparse_fwd with d_qk 512 (MODEL1's prefill): out = softmax(q.k) @ k over all 512 dims."""
    s_q, s_kv, topk, h_q = 3, 200, 64, 128
    q = (rng.standard_normal((s_q, h_q, LATENT)) / 10).astype(bf16)
    kv = (rng.standard_normal((s_kv, 1, LATENT)) / 3).astype(bf16)
    indices = np.stack([rng.permutation(s_kv)[:topk] for _ in range(s_q)]).astype(np.int32)[:, None, :]
    topk_length = np.array([topk, 10, 0], np.int32)
    out, _, lse = flash_mla_sparse_fwd(q, kv, indices, LATENT**-0.5, topk_length=topk_length)
    ref_out, ref_lse = attention(np.asarray(q, np.float64), np.asarray(kv[:, 0, :], np.float64), indices[:, 0, :],
                                 LATENT**-0.5, topk_length)
    check("out", out, ref_out, 8e-4 + 2**-8 * 0.5, 3.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse), 1e-6, 2.01 / 65536)
    assert np.all(np.isposinf(lse[2])) and np.all(np.asarray(out[2], np.float64) == 0)


def test_model1_argument_errors(rng):
    b, s_q, h_q = 2, 1, 16
    used = np.ones(64, bool)
    k_cache, _ = model1_cache(rng, 4, 16, used)
    extra_k_cache, _ = model1_cache(rng, 8, 8, used)
    q = np.clip(rng.standard_normal((b, s_q, h_q, LATENT)), -1, 1).astype(bf16)
    indices = rng.integers(0, 64, size=(b, s_q, 32)).astype(np.int32)
    extra_indices = rng.integers(0, 64, size=(b, s_q, 16)).astype(np.int32)

    def call(**kwargs):
        args = dict(indices=indices, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices)
        args.update(kwargs)
        return flash_mla_with_kvcache(q, args.pop("k_cache", k_cache), None, None, 512, get_mla_metadata()[0],
                                      **args)

    call()  # the good call works
    with pytest.raises(smla.InvalidArgumentError, match="give both or neither"):
        call(extra_indices_in_kvcache=None)
    with pytest.raises(smla.InvalidArgumentError, match="give both or neither"):
        call(extra_k_cache=None)
    with pytest.raises(smla.InvalidArgumentError, match="only valid with indices"):
        flash_mla_with_kvcache(q, k_cache, np.zeros((b, 4), np.int32), np.full(b, 3, np.int32), 512,
                               get_mla_metadata()[0], extra_k_cache=extra_k_cache,
                               extra_indices_in_kvcache=extra_indices)
    with pytest.raises(smla.InvalidArgumentError, match="extra_indices_in_kvcache: expected"):
        call(extra_indices_in_kvcache=extra_indices[:1])
    with pytest.raises(smla.InvalidArgumentError, match="extra_topk_length: expected"):
        call(extra_topk_length=np.zeros(3, np.int32))
    with pytest.raises(smla.InvalidArgumentError, match="extra_topk_length: row 0 is 17"):
        call(extra_topk_length=np.array([17, 0], np.int32))
    with pytest.raises(smla.InvalidArgumentError, match="extra_kv_cache"):
        call(extra_k_cache=extra_k_cache.astype(np.float16))
    with pytest.raises(smla.InvalidArgumentError, match="num_heads_k must be 1"):
        call(extra_k_cache=np.repeat(extra_k_cache, 2, axis=2))
    fp8_model1 = np.zeros((4, 16, 1, MODEL1_ROW), np.uint8)
    call(k_cache=fp8_model1, extra_k_cache=fp8_model1, is_fp8_kvcache=True)  # both caches fp8 MODEL1: fine
    with pytest.raises(smla.InvalidArgumentError, match="bfloat16 array was given where fp8_ds_mla_v4 was asked for"):
        call(k_cache=fp8_model1, is_fp8_kvcache=True)  # a bf16 extra cache beside it
    with pytest.raises(smla.InvalidArgumentError, match="extra_kv_cache"):
        call(extra_k_cache=fp8_model1)  # 8-bit beside a bf16 cache
    with pytest.raises(smla.InvalidArgumentError, match="kv_cache: fp8_ds_mla_v4 holds DeepSeek-V4's 512-wide heads"):
        flash_mla_with_kvcache(np.zeros((b, s_q, h_q, QK), bf16), fp8_model1, None, None, 512, get_mla_metadata()[0],
                               indices=indices, is_fp8_kvcache=True)


def model1_fp8_cache(rng, num_blocks, block_size, used):
    """FlashMLA's fp8 MODEL1 cache of random rows whose 64-value tiles differ in size: (its padded blocks, the
    k_cache view (num_blocks, block_size, 1, 584), the dequantised rows (float64)); every slot no counted index
    reads has NaN e4m3 values and NaN (255) scales, every token's pad byte (after its 7 scales) is 255 and the block
    padding is 0x7f."""
    n = num_blocks * block_size
    tile_size = np.repeat(np.exp2(rng.integers(-4, 1, size=(n, 8))), 64, axis=1)
    rows = np.clip(rng.standard_normal((n, LATENT)) * 0.3 * tile_size, -1, 1).astype(bf16)
    blocks = quantize_model1(rows, block_size)
    deq = dequantize_model1(blocks, block_size)
    for slot in np.flatnonzero(~used):
        block, t = divmod(int(slot), block_size)
        blocks[block, t * MODEL1_VALUE:t * MODEL1_VALUE + MODEL1_NOPE] = 0x7F
        blocks[block, block_size * MODEL1_VALUE + t * 8:block_size * MODEL1_VALUE + t * 8 + 7] = 0xFF
    assert np.all(blocks[:, block_size * MODEL1_VALUE + 7:block_size * MODEL1_ROW:8] == 0xFF)  # the pad bytes
    return blocks, model1_view(blocks, block_size), deq


@pytest.mark.parametrize("b,s_q,h_q,topk,extra_topk,block_size,extra_block_size", [
    (4, 1, 64, 64, 128, 64, 2),
    (3, 3, 128, 128, 64, 61, 576),
    (2, 2, 16, 576, 576, 1, 69),
    (74, 3, 16, 576, 2048, 2, 61),
    (321, 3, 8, 64, 128, 576, 1),
    (2, 1, 16, 64, 576, 69, 64),
])
def test_model1_fp8_sparse_decode(rng, b, s_q, h_q, topk, extra_topk, block_size, extra_block_size):
    """FlashMLA's fp8 MODEL1 cache (smla's fp8_ds_mla_v4), one cache and two, against float64 attention over the
    dequantised rows (FlashMLA's own reference dequantises the same way: e4m3 * power-of-two scale, bf16 rope)."""
    num_blocks, extra_blocks = -(-1024 // block_size), -(-700 // extra_block_size)
    num_slots, extra_slots = num_blocks * block_size, extra_blocks * extra_block_size
    indices = model1_indices(rng, b, s_q, topk, num_slots, extra_slots)
    extra_indices = model1_indices(rng, b, s_q, extra_topk, extra_slots, num_slots)
    extra_indices[1] = -1
    indices[-1, -1] = extra_indices[-1, -1] = -1  # the last token: every index of both lists -1, nothing to attend
    topk_length = rng.integers(0, topk + 1, size=(b,)).astype(np.int32)
    topk_length[0] = 0
    extra_topk_length = rng.integers(0, extra_topk + 1, size=(b, s_q)).astype(np.int32)
    main_idx = counted(indices, topk_length, num_slots)
    extra_idx = counted(extra_indices, extra_topk_length, extra_slots)
    used = np.zeros(num_slots, bool)
    used[main_idx[main_idx >= 0]] = True
    extra_used = np.zeros(extra_slots, bool)
    extra_used[extra_idx[extra_idx >= 0]] = True
    _, k_cache, rows = model1_fp8_cache(rng, num_blocks, block_size, used)
    _, extra_k_cache, extra_rows = model1_fp8_cache(rng, extra_blocks, extra_block_size, extra_used)
    assert k_cache.strides[0] == model1_block_bytes(block_size)  # FlashMLA's padded blocks
    q = np.clip(rng.standard_normal((b, s_q, h_q, LATENT)), -1, 1).astype(bf16)
    sink = rng.standard_normal(h_q).astype(np.float32)
    sink[:2] = np.inf, -np.inf
    q64 = np.asarray(q, np.float64).reshape(b * s_q, h_q, LATENT)
    # Two caches under one softmax.
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], None, is_fp8_kvcache=True,
                                      indices=indices, attn_sink=sink, topk_length=topk_length,
                                      extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
                                      extra_topk_length=extra_topk_length)
    both = np.concatenate([main_idx, np.where(extra_idx >= 0, extra_idx + num_slots, -1)], axis=2)
    ref_out, ref_lse = attention(q64, np.concatenate([rows, extra_rows]), both.reshape(b * s_q, -1), LATENT**-0.5,
                                 None, sink)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)
    assert np.all(np.isneginf(ref_lse[-1])) and np.all(np.isposinf(lse[-1, :, -1]))  # the empty token: +inf lse
    assert np.all(np.asarray(out[-1, -1], np.float64) == 0)  # and 0 out, the sink notwithstanding
    # One cache.
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], None, is_fp8_kvcache=True,
                                      indices=indices, topk_length=topk_length)
    ref_out, ref_lse = attention(q64, rows, main_idx.reshape(b * s_q, -1), LATENT**-0.5, None)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, flashmla_lse(ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-6, 8.01 / 65536)
    assert np.all(np.isposinf(lse[-1, :, -1])) and np.all(np.asarray(out[-1, -1], np.float64) == 0)


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_model1_fp8_write_matches_flashmla_quantiser(rng, block_size):
    """smla.write_mla_cache into FlashMLA's fp8 MODEL1 cache (latent = V4's whole 512-value row, no k_pe): the
    bytes of FlashMLA's quantize_k_cache recipe for every written token; skipped slots, the pad bytes and the block
    padding keep their poison."""
    num_blocks = -(-100 // block_size)
    n = num_blocks * block_size
    tile_size = np.repeat(np.exp2(rng.integers(-20, 8, size=(n, 8))), 64, axis=1)  # scales down to the 1e-4 floor
    rows = (rng.standard_normal((n, LATENT)) * tile_size).astype(bf16)
    expected = quantize_model1(rows, block_size)
    blocks = np.full((num_blocks, model1_block_bytes(block_size)), 0x7F, np.uint8)
    slots = rng.permutation(n).astype(np.int64)
    slots[::5] = -1  # skipped
    smla.ops.write_mla_cache(rows[np.arange(n)], None, slots, model1_view(blocks, block_size)[:, :, 0, :])
    # Row i went to slots[i]: compare with the quantiser's bytes of row i at that slot.
    placed = np.full((num_blocks, model1_block_bytes(block_size)), 0x7F, np.uint8)
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        block, t = divmod(int(slot), block_size)
        src_block, src_t = divmod(i, block_size)
        value, src_value = slice(t * MODEL1_VALUE, (t + 1) * MODEL1_VALUE), slice(src_t * MODEL1_VALUE,
                                                                                  (src_t + 1) * MODEL1_VALUE)
        placed[block, value] = expected[src_block, src_value]
        scale0, src_scale0 = block_size * MODEL1_VALUE + t * 8, block_size * MODEL1_VALUE + src_t * 8
        placed[block, scale0:scale0 + 7] = expected[src_block, src_scale0:src_scale0 + 7]
    np.testing.assert_array_equal(blocks, placed)
