"""The ops on numpy arrays (CPU) against float64 references (reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

import smla
from reference import (FP8_ROW, INDEX_DIM, INDEX_FP8_ROW, INVALID_INDICES, LATENT, QK, ROPE, V, attention,
                       cache_rows, dequantize_ds_mla, dtype, e4m3, index_cache_keys, index_key_scale, indexer_scores,
                       make_mla_cache, paged_slots, quantize_ds_mla, rounded)

ml_dtypes = pytest.importorskip("ml_dtypes")  # bfloat16 / float8 numpy arrays

# (q dtype, cache dtype)
ATTENTION_DTYPES = [("float16", "float16"), ("bfloat16", "bfloat16"), ("bfloat16", "fp8_ds_mla"),
                    ("float16", "fp8_ds_mla")]


def assert_close(name: str, ans: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> None:
    ans = np.asarray(ans, np.float64)
    assert ans.shape == ref.shape, f"{name}: shape {ans.shape} != {ref.shape}"
    for special in (np.inf, -np.inf):
        np.testing.assert_array_equal(ans == special, ref == special, err_msg=f"{name}: {special} positions differ")
    assert not np.isnan(ans).any(), f"{name}: NaN in the result"
    finite = np.isfinite(ref)
    np.testing.assert_allclose(ans[finite], ref[finite], atol=atol, rtol=rtol, err_msg=name)


def out_tolerance(q_dtype: str, values: np.ndarray) -> float:
    # docs/ops.md: bf16 queries may round P to bf16 (error <= 2^-8 max|c|), plus output rounding.
    return 1e-3 + (2.0**-8 * float(np.nanmax(np.abs(values[:, :V]))) if q_dtype == "bfloat16" else 0.0)


def fill_cache(rng, cache: np.ndarray, slots: np.ndarray, kind: str) -> None:
    """Writes random rows at `slots` of the cache view (reference layout, not smla's writer)."""
    lat = rng.standard_normal((len(slots), LATENT)).astype(np.float32)
    pe = rng.standard_normal((len(slots), ROPE)).astype(np.float32)
    bs = cache.shape[1]
    rows = quantize_ds_mla(lat, pe) if kind == "fp8_ds_mla" else np.concatenate([lat, pe], 1).astype(dtype(kind))
    for s, row in zip(slots, rows):
        cache[s // bs, s % bs] = row


def sparse_case(rng, q_dtype: str, kv: str, tokens: int = 5, heads: int = 16, topk: int = 48,
                num_blocks: int = 9, block_size: int = 16):
    cache, buf = make_mla_cache(rng, num_blocks, block_size, kv, pad_rows=3)
    num_slots = num_blocks * block_size
    used = rng.choice(num_slots, size=num_slots // 2, replace=False)
    fill_cache(rng, cache, used, kv)
    # Non-contiguous indices: rows of a wider buffer; a mix of used slots and invalid values.
    idx_buf = np.full((tokens, topk + 5), 7, np.int32)
    idx = idx_buf[:, :topk]
    for t in range(tokens):
        idx[t] = rng.choice(used, size=topk, replace=False)
        bad = rng.random(topk) < 0.25
        idx[t, bad] = rng.choice(list(INVALID_INDICES) + [num_slots, num_slots + 1000], size=int(bad.sum()))
    idx[tokens - 1] = -1  # a token with nothing to attend
    # Non-contiguous q: every other token of a buffer with padded rows.
    q_buf = rng.standard_normal((2 * tokens, heads, QK + 8)).astype(dtype(q_dtype))
    q = q_buf[::2, :, :QK]
    return q, cache, idx, cache_rows(np.ascontiguousarray(cache))


@pytest.mark.parametrize("q_dtype,kv", ATTENTION_DTYPES)
def test_sparse_mla_matches_reference(rng, q_dtype, kv):
    q, cache, idx, rows = sparse_case(rng, q_dtype, kv)
    scale = QK**-0.5
    out, lse = smla.sparse_mla(q, cache, idx, softmax_scale=scale)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], V)
    assert lse.dtype == np.float32 and lse.shape == q.shape[:2]
    ref_out, ref_lse = attention(np.asarray(q, np.float64), rows, idx, scale)
    assert_close("out", out, ref_out, out_tolerance(q_dtype, rows[np.isfinite(rows[:, 0])]), 2.01 / 128)
    assert_close("lse", lse, ref_lse, 1e-5, 8.01 / 65536)
    assert np.all(out[-1] == 0) and np.all(np.isneginf(lse[-1]))


@pytest.mark.parametrize("q_dtype,kv", [("bfloat16", "fp8_ds_mla"), ("float16", "float16")])
def test_sparse_mla_topk_length_and_sink(rng, q_dtype, kv):
    q, cache, idx, rows = sparse_case(rng, q_dtype, kv, tokens=6, heads=8)
    tokens, _, topk = q.shape[0], q.shape[1], idx.shape[1]
    topk_length = rng.integers(0, topk + 1, size=tokens).astype(np.int32)
    topk_length[0] = topk
    # Entries past topk_length point at never-written (NaN) slots: they must not be read.
    nan_slot = int(np.flatnonzero(np.isnan(rows[:, 0]))[0])
    for t in range(tokens):
        idx[t, topk_length[t]:] = nan_slot
    sink = rng.standard_normal(q.shape[1]).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    scale = 0.1
    out, lse = smla.sparse_mla(q, cache, idx, softmax_scale=scale, topk_length=topk_length, attn_sink=sink)
    ref_out, ref_lse = attention(np.asarray(q, np.float64), rows, idx, scale, topk_length, sink)
    assert_close("out", out, ref_out, out_tolerance(q_dtype, rows[np.isfinite(rows[:, 0])]), 2.01 / 128)
    assert_close("lse", lse, ref_lse, 1e-5, 8.01 / 65536)  # lse leaves the sink out
    assert np.all(out[:, 0] == 0)  # sink +inf


@pytest.mark.parametrize("q_dtype,kv", ATTENTION_DTYPES)
@pytest.mark.parametrize("s_q,causal", [(1, True), (3, True), (2, False)])
def test_paged_mla_decode_matches_reference(rng, q_dtype, kv, s_q, causal):
    batch, heads, block_size, max_blocks = 3, 8, 8, 6
    num_blocks = batch * max_blocks + 2
    cache, _ = make_mla_cache(rng, num_blocks, block_size, kv)
    block_table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    seq_lens = np.array([s_q, 17, max_blocks * block_size], np.int32)
    # Only positions inside the context are written; entries past it are garbage that must not be read.
    for b in range(batch):
        p = np.arange(seq_lens[b])
        fill_cache(rng, cache, block_table[b, p // block_size] * block_size + p % block_size, kv)
        used_blocks = -(-int(seq_lens[b]) // block_size)
        block_table[b, used_blocks:] = [-7, 10**6, num_blocks][: max_blocks - used_blocks] + [-1] * max(
            0, max_blocks - used_blocks - 3)
    q = rng.standard_normal((batch, s_q, heads, QK)).astype(dtype(q_dtype))
    sink = rng.standard_normal(heads).astype(np.float32)
    scale = 0.08
    out, lse = smla.paged_mla_decode(q, cache, block_table, seq_lens, softmax_scale=scale, causal=causal,
                                     attn_sink=sink)
    assert out.shape == (batch, s_q, heads, V) and lse.shape == (batch, s_q, heads)
    rows = cache_rows(cache)
    slots = paged_slots(block_table, seq_lens, s_q, block_size, causal).reshape(batch * s_q, -1)
    ref_out, ref_lse = attention(np.asarray(q, np.float64).reshape(batch * s_q, heads, QK), rows, slots, scale,
                                 attn_sink=sink)
    tol = out_tolerance(q_dtype, rows[np.isfinite(rows[:, 0])])
    assert_close("out", out.reshape(batch * s_q, heads, V), ref_out, tol, 2.01 / 128)
    assert_close("lse", lse.reshape(batch * s_q, heads), ref_lse, 1e-5, 8.01 / 65536)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "fp8_ds_mla"])
@pytest.mark.parametrize("src", ["float32", "bfloat16"])
def test_write_mla_cache(rng, kind, src):
    n, num_blocks, block_size = 11, 4, 8
    cache, buf = make_mla_cache(rng, num_blocks, block_size, kind, pad_rows=2)
    latent = (rng.standard_normal((n, LATENT)) * rng.uniform(0.01, 30, (n, 1))).astype(dtype(src))
    k_pe = rng.standard_normal((n, ROPE)).astype(dtype(src))
    slots = rng.choice(num_blocks * block_size, size=n, replace=False).astype(np.int64)
    slots[3] = -1  # skipped
    before = buf.copy()
    assert smla.write_mla_cache(latent, k_pe, slots, cache) is cache
    written = slots >= 0
    got = np.stack([cache[s // block_size, s % block_size] for s in slots[written]])
    if kind == "fp8_ds_mla":
        # Bit-identical to the recipe in docs/ops.md.
        np.testing.assert_array_equal(got, quantize_ds_mla(np.asarray(latent, np.float32)[written],
                                                           np.asarray(k_pe, np.float32)[written]))
    else:
        want = np.concatenate([latent, k_pe], 1).astype(np.float32)[written]
        np.testing.assert_array_equal(got.astype(np.float64), rounded(want, kind))
    # Nothing else changed: not the skipped row's slot, not the padding rows.
    mask = np.ones(buf.shape[:2], bool)
    for s in slots[written]:
        mask[s // block_size, s % block_size] = False
    np.testing.assert_array_equal(buf[mask].view(np.uint8), before[mask].view(np.uint8))


def test_write_mla_cache_slot_out_of_range_writes_nothing(rng):
    cache = np.zeros((2, 4, QK), np.float16)
    latent = np.ones((3, LATENT), np.float16)
    k_pe = np.ones((3, ROPE), np.float16)
    with pytest.raises(smla.InvalidArgumentError, match="slot_mapping") as e:
        smla.write_mla_cache(latent, k_pe, np.array([0, 1, 8], np.int64), cache)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    assert not cache.any()


@pytest.mark.parametrize("kind", ["bfloat16", "fp8_e4m3"])
def test_write_index_cache(rng, kind):
    n, num_blocks, block_size = 9, 3, 4
    width = INDEX_DIM if kind == "bfloat16" else INDEX_FP8_ROW
    dtype = ml_dtypes.bfloat16 if kind == "bfloat16" else np.uint8

    def filled(byte):  # a cache whose every byte is `byte`
        return np.full((num_blocks, block_size, width * np.dtype(dtype).itemsize), byte, np.uint8).view(dtype)

    cache, other = filled(0xFF), filled(0x00)
    k = (rng.standard_normal((n + 1, INDEX_DIM)) * rng.uniform(0.001, 10, (n + 1, 1))).astype(np.float32)
    slots = np.append(rng.choice(num_blocks * block_size, size=n, replace=False), -1).astype(np.int64)  # -1: skip
    assert smla.write_index_cache(k, slots, cache) is cache
    smla.write_index_cache(k, slots, other)
    # The bytes the two caches still differ in are those no write touched: all but the n rows written (a row of
    # the fp8 layout is its 128 codes and its 4-byte scale).
    row_bytes = INDEX_DIM * 2 if kind == "bfloat16" else INDEX_FP8_ROW
    untouched = np.count_nonzero(cache.view(np.uint8) != other.view(np.uint8))
    assert untouched == cache.nbytes - n * row_bytes
    k, slots = k[:n], slots[:n]
    keys, scales = index_cache_keys(cache)
    if kind == "bfloat16":
        np.testing.assert_array_equal(keys[slots], rounded(k, "bfloat16"))
    else:
        scale = index_key_scale(np.abs(k).max(axis=1).astype(np.float64))
        np.testing.assert_array_equal(scales[slots], scale)
        blocks = cache.reshape(num_blocks, -1)
        for i, s in enumerate(slots):
            b, off = divmod(int(s), block_size)
            np.testing.assert_array_equal(blocks[b, off * INDEX_DIM:(off + 1) * INDEX_DIM],
                                          e4m3(k[i] / scale[i].astype(np.float32)))


def indexer_case(rng, q_kind: str, cache_kind: str, tokens: int = 4, heads: int = 8):
    requests, block_size, max_blocks = 2, 8, 5
    num_blocks = requests * max_blocks
    width = INDEX_DIM if cache_kind == "bfloat16" else INDEX_FP8_ROW
    cache = np.zeros((num_blocks, block_size, width), ml_dtypes.bfloat16 if cache_kind == "bfloat16" else np.uint8)
    block_table = rng.permutation(num_blocks).reshape(requests, max_blocks).astype(np.int32)
    keys = rng.standard_normal((num_blocks * block_size, INDEX_DIM)).astype(np.float32)
    smla.write_index_cache(keys, np.arange(num_blocks * block_size, dtype=np.int64), cache)
    request_ids = np.array([0, 1, 1, 0][:tokens], np.int32)
    context_lens = np.array([40, 3, 25, 1][:tokens], np.int32)
    weights = (rng.standard_normal((tokens, heads)) * heads**-0.5 * INDEX_DIM**-0.5).astype(np.float32)
    q_scale = None
    if q_kind == "fp8_e4m3":
        qf = rng.standard_normal((tokens, heads, INDEX_DIM)).astype(np.float32)
        q_scale = index_key_scale(np.abs(qf).max(axis=2)).astype(np.float32)
        q = e4m3(qf / q_scale[:, :, None])
        q_values = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        q = rng.standard_normal((tokens, heads, INDEX_DIM)).astype(dtype(q_kind))
        q_values = np.asarray(q, np.float64)
    return dict(q=q, q_values=q_values, q_scale=q_scale, weights=weights, cache=cache, request_ids=request_ids,
                block_table=block_table, context_lens=context_lens, block_size=block_size)


@pytest.mark.parametrize("q_kind,cache_kind", [("bfloat16", "bfloat16"), ("float16", "bfloat16"),
                                               ("bfloat16", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3")])
def test_indexer_topk_matches_reference(rng, q_kind, cache_kind):
    c = indexer_case(rng, q_kind, cache_kind)
    topk = 16
    got = smla.indexer_topk(c["q"], c["weights"], c["cache"], c["request_ids"], c["block_table"],
                            c["context_lens"], topk=topk, q_scale=c["q_scale"])
    assert got.dtype == np.int32 and got.shape == (len(c["request_ids"]), topk)
    keys, scales = index_cache_keys(c["cache"])
    bs = c["block_size"]
    for t, (r, ctx) in enumerate(zip(c["request_ids"], c["context_lens"])):
        pos = np.arange(ctx)
        slots = c["block_table"][r, pos // bs] * bs + pos % bs
        scores = indexer_scores(c["q_values"][t], c["weights"][t], keys, scales, slots,
                                None if c["q_scale"] is None else c["q_scale"][t])
        n = min(topk, int(ctx))
        chosen = got[t, :n]
        assert np.all(got[t, n:] == -1)
        assert len(set(chosen.tolist())) == n and np.all((chosen >= 0) & (chosen < ctx))
        best = np.sort(scores)[::-1][:n]
        np.testing.assert_allclose(scores[chosen], best, rtol=1e-5, atol=1e-6)


def by_position(rows: np.ndarray) -> np.ndarray:
    """Best-first top-k rows in ascending position order, their -1 padding left last: what sorted=False gives."""
    out = rows.copy()
    for row in out:
        n = int(np.count_nonzero(row >= 0))
        row[:n] = np.sort(row[:n])
    return out


@pytest.mark.parametrize("cache_kind", ["bfloat16", "fp8_e4m3"])
def test_indexer_topk_unsorted_is_the_sorted_set_by_position(rng, cache_kind):
    c = indexer_case(rng, "bfloat16", cache_kind)
    args = (c["q"], c["weights"], c["cache"], c["request_ids"], c["block_table"], c["context_lens"])
    for topk in (16, 64):  # rows longer and shorter than k; all shorter
        want = smla.indexer_topk(*args, topk=topk)
        got = smla.indexer_topk(*args, topk=topk, sorted=False)
        assert np.any(want != got) or topk == 64  # k = 16 of 40 positions: best first is not position order
        np.testing.assert_array_equal(got, by_position(want))
        out = np.full_like(got, 777)
        assert smla.indexer_topk(*args, out=out, sorted=False) is out
        np.testing.assert_array_equal(out, got)


def test_positions_to_slots():
    block_table = np.array([[3, 1, -2], [0, 2, 5]], np.int32)
    positions = np.array([[0, 5, 4, -1, 9], [8, 7, 2, 100, 4]], np.int32)
    request_ids = np.array([0, 1], np.int32)
    slots = smla.positions_to_slots(positions, request_ids, block_table, block_size=4)
    # token 0: pos 9 -> block -2 (negative) -> -1; token 1: pos 100 past the table -> -1.
    np.testing.assert_array_equal(slots, [[12, 5, 4, -1, -1], [20, 11, 2, -1, 8]])


@pytest.mark.parametrize("kv,index_kind", [("bfloat16", "bfloat16"), ("fp8_ds_mla", "fp8_e4m3")])
def test_dsa_decode_step_is_the_three_ops(rng, kv, index_kind):
    c = indexer_case(rng, "bfloat16", index_kind)
    bs, num_blocks = c["block_size"], c["cache"].shape[0]
    mla_cache, _ = make_mla_cache(rng, num_blocks, bs, kv)
    fill_cache(rng, mla_cache, np.arange(num_blocks * bs), kv)
    q = rng.standard_normal((len(c["request_ids"]), 16, QK)).astype(ml_dtypes.bfloat16)
    args = (c["request_ids"], c["block_table"], c["context_lens"])
    out, lse, positions, slots = smla.dsa_decode_step(q, mla_cache, c["q"], c["weights"], c["cache"], *args,
                                                      topk=16, softmax_scale=0.07)
    want_pos = smla.indexer_topk(c["q"], c["weights"], c["cache"], *args, topk=16)
    want_slots = smla.positions_to_slots(want_pos, c["request_ids"], c["block_table"], block_size=bs)
    want_out, want_lse = smla.sparse_mla(q, mla_cache, want_slots, softmax_scale=0.07)
    np.testing.assert_array_equal(positions, want_pos)
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(out.view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(lse, want_lse)

    # Unsorted: the positions in ascending order, their slots, and the attention of those slots in that order.
    out_u, lse_u, positions_u, slots_u = smla.dsa_decode_step(q, mla_cache, c["q"], c["weights"], c["cache"], *args,
                                                              topk=16, softmax_scale=0.07, sorted=False)
    np.testing.assert_array_equal(positions_u, by_position(want_pos))
    np.testing.assert_array_equal(slots_u, smla.positions_to_slots(positions_u, c["request_ids"], c["block_table"],
                                                                   block_size=bs))
    want_out, want_lse = smla.sparse_mla(q, mla_cache, slots_u, softmax_scale=0.07)
    np.testing.assert_array_equal(out_u.view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(lse_u, want_lse)
    np.testing.assert_allclose(lse_u, lse, rtol=1e-5)


# --- zero copy -------------------------------------------------------------------


def test_cpp_sees_the_callers_memory():
    from smla import _arrays, _smla

    buf = np.zeros((6, 10, QK + 4), np.float16)
    view = buf[::2, 1:, :QK]
    info = _smla.tensor_info(_arrays.export(view))
    assert info["data"] == view.ctypes.data
    assert info["shape"] == view.shape
    assert info["strides"] == tuple(s // view.itemsize for s in view.strides)
    assert info["dtype"] == "float16" and info["device"] == "cpu"
    bf = np.zeros((3, QK), ml_dtypes.bfloat16)
    info = _smla.tensor_info(_arrays.export(bf))
    assert info["data"] == bf.ctypes.data and info["dtype"] == "bfloat16"
    fp8 = np.zeros((2, 3, FP8_ROW), np.uint8)
    info = _smla.tensor_info(_arrays.export(fp8, "fp8_ds_mla"))
    assert info["data"] == fp8.ctypes.data and info["dtype"] == "fp8_ds_mla"


def test_outputs_land_in_caller_arrays(rng):
    q, cache, idx, _ = sparse_case(rng, "float16", "float16", tokens=3, heads=4)
    out_buf = np.full((3, 4, V + 16), 5.0, np.float16)
    out = out_buf[:, :, :V]
    lse = np.empty((3, 4), np.float32)
    got_out, got_lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.1, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    want_out, want_lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.1)
    np.testing.assert_array_equal(out_buf[:, :, :V], want_out)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.all(out_buf[:, :, V:] == 5.0)  # padding untouched


def test_read_only_inputs_are_accepted(rng):
    q, cache, idx, _ = sparse_case(rng, "float16", "float16", tokens=2, heads=4)
    q = np.ascontiguousarray(q)
    for a in (q, cache, idx):
        a.setflags(write=False)
    out, _ = smla.sparse_mla(q, cache, idx, softmax_scale=0.1)
    assert out.shape == (2, 4, V)


# --- errors ---------------------------------------------------------------------


def test_errors_carry_the_cpp_message(rng):
    q, cache, idx, _ = sparse_case(rng, "float16", "float16", tokens=2, heads=4)
    with pytest.raises(smla.InvalidArgumentError, match=r"^sparse_mla: q: .*3 dimensions"):
        smla.sparse_mla(q[0], cache, idx, softmax_scale=0.1)
    with pytest.raises(ValueError, match="indices"):
        smla.sparse_mla(q, cache, idx.astype(np.int64), softmax_scale=0.1)
    with pytest.raises(smla.Error, match="softmax_scale"):
        smla.sparse_mla(q, cache, idx, softmax_scale=float("nan"))
    with pytest.raises(smla.InvalidArgumentError, match="slot_mapping"):
        smla.write_mla_cache(np.zeros((1, LATENT), np.float16), np.zeros((1, ROPE), np.float16),
                             np.zeros(1, np.int32), cache)
    with pytest.raises(smla.InvalidArgumentError, match="q: expected a DLPack-capable tensor"):
        smla.sparse_mla([[1.0]], cache, idx, softmax_scale=0.1)
    with pytest.raises(smla.InvalidArgumentError, match="latent: expected a DLPack"):
        smla.write_mla_cache([1.0], np.zeros((1, ROPE), np.float16), np.zeros(1, np.int64), cache)
    with pytest.raises(smla.InvalidArgumentError, match="not bfloat16"):
        smla.sparse_mla(q, cache, idx, softmax_scale=0.1, kv_cache_dtype="bfloat16")
    with pytest.raises(smla.InvalidArgumentError, match=r"sparse_mla: kv_cache: dimension 2 .* must be 656"):
        smla.sparse_mla(q, np.zeros((2, 4, QK), np.uint8), idx, softmax_scale=0.1)


def test_value_errors_from_the_backend():
    q = np.zeros((1, 1, 2, QK), np.float16)
    cache = np.zeros((2, 4, QK), np.float16)
    with pytest.raises(smla.InvalidArgumentError, match="seq_lens"):
        smla.paged_mla_decode(q, cache, np.zeros((1, 2), np.int32), np.array([9], np.int32), softmax_scale=0.1)
    with pytest.raises(smla.InvalidArgumentError, match="request_ids"):
        smla.positions_to_slots(np.zeros((1, 2), np.int32), np.array([3], np.int32), np.zeros((1, 2), np.int32),
                                block_size=4)


def test_backend_choice(rng):
    q, cache, idx, _ = sparse_case(rng, "float16", "float16", tokens=2, heads=4)
    out, _ = smla.sparse_mla(q, cache, idx, softmax_scale=0.1, backend="cpu")
    assert out.shape == (2, 4, V)
    with pytest.raises(smla.InvalidArgumentError, match="backend: unknown backend 'flashmla'; this build has cpu"):
        smla.sparse_mla(q, cache, idx, softmax_scale=0.1, backend="flashmla")
    with pytest.raises(smla.UnsupportedError, match="backend: cuda_mma does not run on tensors on the CPU"):
        smla.sparse_mla(q, cache, idx, softmax_scale=0.1, backend="cuda_mma")


def test_unwritable_output_is_refused(rng):
    q, cache, idx, _ = sparse_case(rng, "float16", "float16", tokens=2, heads=4)
    lse = np.zeros((2, 4), np.float32)
    lse.setflags(write=False)
    with pytest.raises(smla.InvalidArgumentError, match="lse: expected a writable"):
        smla.sparse_mla(q, cache, idx, softmax_scale=0.1, lse=lse)


def test_ops_from_several_threads(rng):
    # The GIL is released while an op runs; concurrent calls must not interfere.
    import threading

    q, cache, idx, _ = sparse_case(rng, "bfloat16", "fp8_ds_mla", tokens=8, heads=16)
    want_out, want_lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.1)
    assert not np.isnan(want_out.astype(np.float32)).any()
    results = []

    def work():
        results.append(smla.sparse_mla(q, cache, idx, softmax_scale=0.1))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for out, lse in results:  # each the single call's result, bit for bit
        np.testing.assert_array_equal(out.view(np.uint16), want_out.view(np.uint16))
        np.testing.assert_array_equal(lse, want_lse)


def test_dequantize_reference_round_trips(rng):
    # The reference's own fp8_ds_mla codec: dequantize(quantize(x)) is close to x.
    lat = rng.standard_normal((5, LATENT)).astype(np.float32)
    pe = rng.standard_normal((5, ROPE)).astype(np.float32)
    back = dequantize_ds_mla(quantize_ds_mla(lat, pe))
    np.testing.assert_allclose(back[:, :LATENT], lat, rtol=0.07, atol=0.02)
    np.testing.assert_allclose(back[:, LATENT:], pe, rtol=1e-2)
