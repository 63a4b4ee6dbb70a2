"""Bad input as a hostile user would give it, on numpy arrays (and torch CPU tensors where torch is installed):
every case is an error naming the argument, raised before anything is allocated or computed, and empty batches
just work (issue 17, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

import smla
import smla.flash_mla as flash_mla

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16
QK, V, INDEX_DIM = 576, 512, 128


def bf16(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(BF16)


def indexer_inputs(rng, tokens: int = 2, heads: int = 4, blocks: int = 4, block_size: int = 16):
    q = bf16(rng, tokens, heads, INDEX_DIM)
    weights = rng.random((tokens, heads), np.float32) + 0.1
    cache = bf16(rng, blocks, block_size, INDEX_DIM)
    request_ids = np.zeros(tokens, np.int32)
    block_table = rng.permutation(blocks).astype(np.int32)[None, :]
    context_lens = np.full(tokens, blocks * block_size, np.int32)
    return q, weights, cache, request_ids, block_table, context_lens


def attention_inputs(rng, tokens: int = 2, heads: int = 8, topk: int = 16):
    cache = bf16(rng, 4, 16, QK)
    q = bf16(rng, tokens, heads, QK)
    indices = rng.integers(0, 64, (tokens, topk)).astype(np.int32)
    return q, cache, indices


def test_empty_batches_just_work(rng):
    """numpy gives zero-token arrays zero strides: no op may take that for a bad layout."""
    _, cache, _ = attention_inputs(rng)
    before = cache.copy()
    q = np.empty((0, 8, QK), BF16)
    out, lse = smla.sparse_mla(q, cache, np.empty((0, 16), np.int32), softmax_scale=0.1)
    assert out.shape == (0, 8, V) and lse.shape == (0, 8)
    out, lse = smla.paged_mla_decode(np.empty((0, 1, 8, QK), BF16), cache, np.empty((0, 4), np.int32),
                                     np.empty(0, np.int32), softmax_scale=0.1)
    assert out.shape == (0, 1, 8, V) and lse.shape == (0, 1, 8)
    smla.write_mla_cache(np.empty((0, 512), np.float32), np.empty((0, 64), np.float32), np.empty(0, np.int64), cache)
    np.testing.assert_array_equal(cache.view(np.uint16), before.view(np.uint16))

    iq, w, icache, rid, table, lens = indexer_inputs(rng)
    ibefore = icache.copy()
    smla.write_index_cache(np.empty((0, INDEX_DIM), np.float32), np.empty(0, np.int64), icache)
    np.testing.assert_array_equal(icache.view(np.uint16), ibefore.view(np.uint16))
    empty = dict(q=iq[:0], weights=w[:0], index_cache=icache, request_ids=rid[:0], block_table=table,
                 context_lens=lens[:0])
    assert smla.indexer_topk(**empty, topk=8).shape == (0, 8)
    assert smla.positions_to_slots(np.empty((0, 8), np.int32), rid[:0], table, block_size=16).shape == (0, 8)
    out, lse, positions, slots = smla.dsa_decode_step(
        q, cache, iq[:0], w[:0], icache, rid[:0], table, lens[:0], topk=8, softmax_scale=0.1)
    assert out.shape == (0, 8, V) and positions.shape == (0, 8) and slots.shape == (0, 8)
    out, lse = flash_mla.flash_mla_with_kvcache(np.empty((0, 1, 8, QK), BF16), cache[:, :, None, :], None, None, V,
                                                None, indices=np.empty((0, 1, 16), np.int32))
    assert out.shape == (0, 1, 8, V) and lse.shape == (0, 8, 1)


def test_topk_is_checked_before_the_output_is_allocated(rng):
    q, w, cache, rid, table, lens = indexer_inputs(rng)
    args = (q, w, cache, rid, table, lens)
    for bad in (-1, 0, 2**31, 65537):
        with pytest.raises(smla.InvalidArgumentError, match=rf"topk: expected an int from 1 to 65536, got {bad}"):
            smla.indexer_topk(*args, topk=bad)
    with pytest.raises(smla.InvalidArgumentError, match="topk: expected an int from 1 to 65536, got float"):
        smla.indexer_topk(*args, topk=16.0)
    with pytest.raises(smla.InvalidArgumentError, match="topk: required"):
        smla.indexer_topk(*args)
    s_q, kv, _ = attention_inputs(rng)
    with pytest.raises(smla.InvalidArgumentError, match="topk: expected an int from 1 to 65536, got -1"):
        smla.dsa_decode_step(s_q, kv, q, w, cache, rid, table, lens, topk=-1, softmax_scale=0.1)


def test_topk_and_out_must_agree(rng):
    q, w, cache, rid, table, lens = indexer_inputs(rng)
    args = (q, w, cache, rid, table, lens)
    wide = np.full((2, 32), -7, np.int32)
    with pytest.raises(smla.InvalidArgumentError, match="out: has 32 columns but topk is 16"):
        smla.indexer_topk(*args, topk=16, out=wide)
    assert (wide == -7).all()  # nothing written
    with pytest.raises(smla.InvalidArgumentError, match="topk: expected an int from 1 to 65536, got -1"):
        smla.indexer_topk(*args, topk=-1, out=wide)
    # topk left out: out's width; given and equal: the same result.
    by_width = smla.indexer_topk(*args, out=np.full((2, 32), -7, np.int32))
    np.testing.assert_array_equal(by_width, smla.indexer_topk(*args, topk=32))
    assert (by_width >= 0).all() and len(set(by_width[0])) == 32


def test_outputs_overlapping_inputs_are_refused(rng):
    q, cache, indices = attention_inputs(rng)
    inside_cache = cache.reshape(-1)[: q.shape[0] * 8 * V].reshape(q.shape[0], 8, V)
    before = cache.copy()
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: out: overlaps input kv_cache"):
        smla.sparse_mla(q, cache, indices, softmax_scale=0.1, out=inside_cache)
    np.testing.assert_array_equal(cache.view(np.uint16), before.view(np.uint16))
    one_row = np.empty((1, 8, V), BF16)
    shared_rows = np.lib.stride_tricks.as_strided(one_row, (2, 8, V), (0, V * 2, 2), writeable=True)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: out: elements share memory: dimension 0"):
        smla.sparse_mla(q, cache, indices, softmax_scale=0.1, out=shared_rows)
    lse = np.empty((2, 8), np.float32)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: lse: overlaps input indices"):
        smla.sparse_mla(q, cache, lse.view(np.int32), softmax_scale=0.1, lse=lse)
    positions = np.zeros((2, 8), np.int32)
    with pytest.raises(smla.InvalidArgumentError, match="positions_to_slots: slots: overlaps input positions"):
        smla.positions_to_slots(positions, np.zeros(2, np.int32), np.zeros((1, 4), np.int32), block_size=16,
                                out=positions)


def test_numbers_are_checked_as_given(rng):
    q, cache, indices = attention_inputs(rng)
    with pytest.raises(smla.InvalidArgumentError, match=r"softmax_scale: .* got 1e\+300"):
        smla.sparse_mla(q, cache, indices, softmax_scale=1e300)
    with pytest.raises(smla.InvalidArgumentError, match="softmax_scale: .* got nan"):
        smla.sparse_mla(q, cache, indices, softmax_scale=float("nan"))
    with pytest.raises(smla.InvalidArgumentError, match="softmax_scale: expected a number, got str"):
        smla.sparse_mla(q, cache, indices, softmax_scale="0.1")
    with pytest.raises(smla.InvalidArgumentError, match="block_size: expected an int from 1 to 2147483647, got 2147483648"):
        smla.positions_to_slots(indices, np.zeros(2, np.int32), np.zeros((1, 4), np.int32), block_size=2**31)
    with pytest.raises(smla.InvalidArgumentError, match="kv_cache_dtype: expected one of .* got 'int4'"):
        smla.sparse_mla(q, cache, indices, softmax_scale=0.1, kv_cache_dtype="int4")


def test_non_tensors_are_named(rng):
    q, cache, indices = attention_inputs(rng)
    with pytest.raises(smla.InvalidArgumentError, match="kv_cache: expected a DLPack-capable tensor .* got NoneType"):
        smla.sparse_mla(q, None, indices, softmax_scale=0.1)
    with pytest.raises(TypeError, match="q: expected a DLPack-capable tensor .* got memoryview"):
        smla.sparse_mla(memoryview(q.view(np.uint16)), cache, indices, softmax_scale=0.1)
    with pytest.raises(smla.InvalidArgumentError, match="q: expected a DLPack-capable tensor .* got list"):
        smla.sparse_mla(q.tolist(), cache, indices, softmax_scale=0.1)


def test_flash_mla_with_kvcache_names_the_argument(rng):
    q4 = bf16(rng, 2, 1, 8, QK)
    cache4 = bf16(rng, 4, 16, 1, QK)
    indices = rng.integers(0, 64, (2, 1, 16)).astype(np.int32)

    def call(**kw):
        args = dict(q=q4, k_cache=cache4, block_table=None, cache_seqlens=None, head_dim_v=V,
                    tile_scheduler_metadata=None, indices=indices)
        args.update(kw)
        return flash_mla.flash_mla_with_kvcache(**args)

    call()  # valid as given
    with pytest.raises(smla.InvalidArgumentError, match=r"indices: expected \(batch_size, seq_len_q, topk\) with "
                                                        r"q's batch_size 2 and seq_len_q 1, got \(3, 2, 16\)"):
        call(indices=np.zeros((3, 2, 16), np.int32))
    with pytest.raises(smla.InvalidArgumentError, match=r"topk_length: expected \(2,\) .* got \(3,\)"):
        call(topk_length=np.zeros(3, np.int32))
    for name in ("q", "k_cache", "indices"):
        value = {"q": q4, "k_cache": cache4, "indices": indices}[name].tolist()
        with pytest.raises(smla.InvalidArgumentError, match=f"{name}: expected a DLPack-capable tensor .* got list"):
            call(**{name: value})
    with pytest.raises(smla.InvalidArgumentError, match="k_cache: expected a DLPack-capable tensor .* got NoneType"):
        call(k_cache=None)
    with pytest.raises(TypeError, match="q: expected a DLPack-capable tensor .* got memoryview"):
        call(q=memoryview(q4.view(np.uint16)))
    with pytest.raises(smla.InvalidArgumentError, match="k_cache: is_fp8_kvcache=True needs 8-bit data .* got bfloat16"):
        call(is_fp8_kvcache=True)
    with pytest.raises(smla.InvalidArgumentError, match=r"softmax_scale: .* got 1e\+300"):
        call(softmax_scale=1e300)
    kv = bf16(rng, 64, 1, QK)
    with pytest.raises(smla.InvalidArgumentError, match=r"sm_scale: .* got 1e\+300"):
        flash_mla.flash_mla_sparse_fwd(bf16(rng, 2, 8, QK), kv, indices.reshape(2, 1, 16), 1e300)


def test_a_spec_edited_from_python_is_validated_by_explain():
    spec = smla.load_model_spec("glm-5")
    spec.softmax_scale = float("nan")
    with pytest.raises(smla.InvalidArgumentError, match="glm-5: softmax_scale must be finite and > 0, got nan"):
        smla.explain(spec, device="cpu")
    spec = smla.load_model_spec("glm-5")
    spec.v_head_dim = 2**31 - 1
    with pytest.raises(smla.InvalidArgumentError, match="v_head_dim must be at most 4096, got 2147483647"):
        smla.explain(spec, device="cpu")


def test_config_sizes_are_bounded(tmp_path):
    import json
    import pathlib

    config = json.loads((pathlib.Path(__file__).parents[1] / "data" / "configs" / "glm-5.json").read_text())
    config["hidden_size"] = 2**31 - 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(smla.InvalidArgumentError, match="hidden_size must be at most 131072, got 2147483647"):
        smla.load_model_spec(str(path))


def test_missing_gpu_is_named():
    with pytest.raises(smla.InvalidArgumentError, match=r"device='cuda:99': this (machine has no CUDA GPU|build)"):
        smla.explain("glm-5", device="cuda:99")


def test_torch_topk_is_checked_first():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 4, INDEX_DIM, dtype=torch.bfloat16)
    w = torch.rand(2, 4) + 0.1
    cache = torch.randn(4, 16, INDEX_DIM, dtype=torch.bfloat16)
    rid, table, lens = torch.zeros(2, dtype=torch.int32), torch.arange(4, dtype=torch.int32)[None], torch.full(
        (2,), 64, dtype=torch.int32)
    for bad in (-1, 2**31):
        with pytest.raises(smla.InvalidArgumentError, match=f"topk: expected an int from 1 to 65536, got {bad}"):
            smla.indexer_topk(q, w, cache, rid, table, lens, topk=bad)
    empty = smla.indexer_topk(q[:0], w[:0], cache, rid[:0], table, lens[:0], topk=8)
    assert tuple(empty.shape) == (0, 8)


def test_torch_numbers_are_checked_as_given():
    """On torch tensors smla.sparse_mla and flash_mla_with_kvcache hand a float scale to the op unchecked (host
    time): the op's check must say what the Python one says; other types are still checked in Python."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, QK, generator=gen).bfloat16()
    cache = torch.randn(4, 16, QK, generator=gen).bfloat16()
    indices = torch.randint(0, 64, (2, 16), generator=gen, dtype=torch.int32)
    calls = (lambda scale: smla.sparse_mla(q, cache, indices, softmax_scale=scale),
             lambda scale: flash_mla.flash_mla_with_kvcache(q[:, None], cache[:, :, None], None, None, V, None,
                                                            softmax_scale=scale, indices=indices[:, None]))
    for call in calls:
        for bad, shown in ((1e300, r"1e\+300"), (float("nan"), "nan"), (float("inf"), "inf"), (-0.0, "-0.0"),
                           (0, "0")):
            with pytest.raises(smla.InvalidArgumentError, match=rf"softmax_scale: must be finite, > 0 and at most "
                                                                rf"3.402823e\+38 \(float32\), got {shown}$"):
                call(bad)
        with pytest.raises(smla.InvalidArgumentError, match="softmax_scale: expected a number, got str"):
            call("0.1")
        out, lse = call(np.float32(0.1))  # not a float: converted in Python
        assert torch.equal(out, call(float(np.float32(0.1)))[0])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_empty_batches_on_torch(device):
    """torch hands out empty tensors with null data: every op, through the torch custom ops and flash_mla."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and (not torch.cuda.is_available() or smla.detect_device() == "cpu"):
        pytest.skip("needs a CUDA GPU and a build of smla with CUDA")
    gen = torch.Generator().manual_seed(5)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=device)

    i32 = torch.int32
    cache, icache = randn(4, 16, QK), randn(4, 16, INDEX_DIM)
    table = torch.arange(4, dtype=i32, device=device)[None]
    before, ibefore = cache.clone(), icache.clone()
    out, lse = smla.sparse_mla(empty(0, 8, QK), cache, empty(0, 16, dtype=i32), softmax_scale=0.1)
    assert tuple(out.shape) == (0, 8, V) and tuple(lse.shape) == (0, 8)
    out, lse = smla.paged_mla_decode(empty(0, 1, 8, QK), cache, empty(0, 4, dtype=i32), empty(0, dtype=i32),
                                     softmax_scale=0.1)
    assert tuple(out.shape) == (0, 1, 8, V)
    smla.write_mla_cache(empty(0, 512), empty(0, 64), empty(0, dtype=torch.int64), cache)
    smla.write_index_cache(empty(0, INDEX_DIM), empty(0, dtype=torch.int64), icache)
    assert tuple(smla.indexer_topk(empty(0, 4, INDEX_DIM), empty(0, 4, dtype=torch.float32), icache,
                                   empty(0, dtype=i32), table, empty(0, dtype=i32), topk=8).shape) == (0, 8)
    assert tuple(smla.positions_to_slots(empty(0, 8, dtype=i32), empty(0, dtype=i32), table,
                                         block_size=16).shape) == (0, 8)
    out, lse, positions, slots = smla.dsa_decode_step(
        empty(0, 8, QK), cache, empty(0, 4, INDEX_DIM), empty(0, 4, dtype=torch.float32), icache,
        empty(0, dtype=i32), table, empty(0, dtype=i32), topk=8, softmax_scale=0.1)
    assert tuple(out.shape) == (0, 8, V) and tuple(slots.shape) == (0, 8)
    out, lse = flash_mla.flash_mla_with_kvcache(empty(0, 1, 8, QK), cache[:, :, None, :], None, None, V, None,
                                                indices=empty(0, 1, 16, dtype=i32))
    assert tuple(out.shape) == (0, 1, 8, V) and tuple(lse.shape) == (0, 8, 1)
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(empty(0, 8, QK), randn(64, 1, QK),
                                                          empty(0, 1, 16, dtype=i32), 0.1)
    assert tuple(out.shape) == (0, 8, V) and tuple(max_logits.shape) == (0, 8)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(cache, before) and torch.equal(icache, ibefore)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_out_inside_the_cache_is_refused(device):
    torch = pytest.importorskip("torch")
    if device == "cuda" and (not torch.cuda.is_available() or smla.detect_device() == "cpu"):
        pytest.skip("needs a CUDA GPU and a build of smla with CUDA")
    cache = torch.randn(4, 16, QK).to(dtype=torch.bfloat16, device=device)
    before = cache.clone()
    q = torch.randn(2, 8, QK).to(dtype=torch.bfloat16, device=device)
    indices = torch.randint(0, 64, (2, 16), dtype=torch.int32, device=device)
    inside = cache.view(-1)[: 2 * 8 * V].view(2, 8, V)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: out: overlaps input kv_cache"):
        smla.sparse_mla(q, cache, indices, softmax_scale=0.1, out=inside)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(cache, before)
