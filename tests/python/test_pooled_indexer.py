"""GLM-5.3-Flash's pooled indexer through the Python API on the CPU backend:
write_pooled_index_cache against a float64 numpy computation of the model's
pool (softmax over the pool of gate + ape, the Walsh-Hadamard rotation), and
pools_to_positions against a loop over its definition (pools cut by the
context's end, invalid pool ids), rotate_index_q against the float64 rotation
and vLLM's ue8m0 rule."""
import ml_dtypes
import numpy as np
import pytest

import smla
from reference import INDEX_DIM, INDEX_FP8_ROW, hadamard128, pooled


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("kind", ["bfloat16", "fp8_e4m3"])
def test_write_pooled_index_cache_is_the_models_pool(rng, kind, rotate):
    pools, kpool, num_blocks, rows = 7, 4, 3, 4
    k = rng.uniform(-3, 3, (pools, kpool, INDEX_DIM)).astype(ml_dtypes.bfloat16)
    gate = rng.uniform(-4, 4, (pools, kpool, INDEX_DIM)).astype(ml_dtypes.bfloat16)
    ape = rng.uniform(-2, 2, (kpool, INDEX_DIM)).astype(np.float32)
    slots = rng.choice(num_blocks * rows, size=pools, replace=False).astype(np.int64)
    slots[3] = -1  # skipped
    if kind == "bfloat16":
        cache = np.full((num_blocks, rows, INDEX_DIM * 2), 0xFF, np.uint8).view(ml_dtypes.bfloat16)
    else:
        cache = np.full((num_blocks, rows, INDEX_FP8_ROW), 0xFF, np.uint8)
    before = cache.copy()
    assert smla.write_pooled_index_cache(k, gate, ape, slots, cache, hadamard=rotate) is cache
    want = pooled(k, gate, ape, rotate)
    flat = cache.reshape(num_blocks, -1).view(np.uint8)
    for p, s in enumerate(slots):
        b, off = divmod(int(s), rows)
        if s < 0:
            continue
        if kind == "bfloat16":
            got = cache[b, off].astype(np.float64)
            tol = 4e-3 * np.abs(want[p]) + 4e-3 * np.abs(want[p]).max()
        else:
            codes = flat[b, off * INDEX_DIM:(off + 1) * INDEX_DIM].view(ml_dtypes.float8_e4m3fn)
            scale = flat[b, rows * INDEX_DIM + off * 4:rows * INDEX_DIM + off * 4 + 4].view(np.float32)[0]
            assert np.log2(scale) == np.round(np.log2(scale))  # ue8m0: a power of two
            got = codes.astype(np.float64) * scale
            tol = 6.7e-2 * np.abs(want[p]) + 4e-3 * np.abs(want[p]).max() + scale * 2.0**-9
        assert np.all(np.abs(got - want[p]) <= tol), (p, np.max(np.abs(got - want[p]) - tol))
    # The skipped pool's slot, and every slot no pool names, are untouched.
    written = {int(s) for s in slots if s >= 0}
    for s in range(num_blocks * rows):
        if s not in written:
            b, off = divmod(s, rows)
            row = slice(off * INDEX_DIM * (2 if kind == "bfloat16" else 1),
                        (off + 1) * INDEX_DIM * (2 if kind == "bfloat16" else 1))
            np.testing.assert_array_equal(flat[b, row], before.reshape(num_blocks, -1).view(np.uint8)[b, row])


def test_write_pooled_index_cache_names_bad_arguments(rng):
    k = rng.uniform(-1, 1, (2, 4, INDEX_DIM)).astype(np.float32)
    cache = np.zeros((2, 4, INDEX_DIM), ml_dtypes.bfloat16)
    ape = np.zeros((4, INDEX_DIM), np.float32)
    slots = np.array([0, 1], np.int64)
    with pytest.raises(smla.InvalidArgumentError, match="gate"):
        smla.write_pooled_index_cache(k, k.astype(ml_dtypes.bfloat16), ape, slots, cache)
    with pytest.raises(smla.InvalidArgumentError, match="ape"):
        smla.write_pooled_index_cache(k, k, ape[:3], slots, cache)
    with pytest.raises(smla.InvalidArgumentError, match="slot_mapping.*row 1"):
        smla.write_pooled_index_cache(k, k, ape, np.array([0, 8], np.int64), cache)
    assert not cache.astype(np.float32).any()  # nothing written


def test_pools_to_positions(rng):
    kpool, kp, tokens = 4, 5, 30
    pools = rng.integers(-3, 12, (tokens, kp)).astype(np.int32)
    ctx = np.concatenate([np.arange(6), rng.integers(0, 50, tokens - 6)]).astype(np.int32)
    got = smla.pools_to_positions(pools, ctx, kpool=kpool)
    assert got.shape == (tokens, kp * kpool + kpool - 1) and got.dtype == np.int32
    for t in range(tokens):
        whole = ctx[t] // kpool
        want = []
        for p in pools[t]:
            want += [p * kpool + m if 0 <= p < whole else -1 for m in range(kpool)]
        want += [whole * kpool + m if whole * kpool + m < ctx[t] else -1 for m in range(kpool - 1)]
        np.testing.assert_array_equal(got[t], want)
    with pytest.raises(smla.InvalidArgumentError, match="context_lens.*row 0"):
        smla.pools_to_positions(pools[:1], np.array([-1], np.int32), kpool=kpool)
    with pytest.raises(smla.InvalidArgumentError, match="kpool"):
        smla.pools_to_positions(pools, ctx, kpool=0)


@pytest.mark.parametrize("fp8", [True, False])
def test_rotate_index_q(rng, fp8):
    q = rng.uniform(-4, 4, (3, 5, INDEX_DIM)).astype(np.float32)
    q[1, 2] *= 1e-3  # a small head: its own scale
    q_out, q_scale = smla.rotate_index_q(q, fp8=fp8)
    want = q.astype(np.float64) @ hadamard128().T
    amax = np.abs(want).max(axis=2, keepdims=True)
    if fp8:
        assert q_out.dtype == np.uint8 and q_scale.shape == (3, 5) and q_scale.dtype == np.float32
        # ue8m0 as vLLM's fwht128_quant_fp8: 2^ceil(log2(max(amax, 1e-4) / 448)) of the bf16-rounded head, a power
        # of two taking the head's amax into (224, 448] (up to that rounding).
        assert np.all(np.log2(q_scale) == np.round(np.log2(q_scale)))
        ratio = amax[..., 0] / q_scale
        assert np.all((ratio > 224 * (1 - 1e-2)) & (ratio <= 448 * (1 + 1e-2))), ratio
        got = q_out.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * q_scale[..., None]
        tol = 6.7e-2 * np.abs(want) + 2.0**-8 * amax + q_scale[..., None] * 2.0**-9
    else:
        assert q_out.dtype == ml_dtypes.bfloat16 and q_scale is None
        got = q_out.astype(np.float64)
        tol = 2.0**-8 * np.abs(want) + 1e-6 * amax
    assert np.all(np.abs(got - want) <= tol)
    with pytest.raises(smla.InvalidArgumentError, match="q_scale"):
        smla.rotate_index_q(q, fp8=False, q_scale=np.empty((3, 5), np.float32))
