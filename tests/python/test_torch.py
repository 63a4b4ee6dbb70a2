"""PyTorch: torch tensors in and out, torch.ops.smla custom ops (opcheck,
torch.compile), and on a CUDA GPU: correctness against the float64
reference, streams, CUDA-graph capture, and FlashMLA's API the way
FlashMLA's tests call it. Skipped without torch (and the CUDA part without a
GPU or a CUDA build)."""

from __future__ import annotations

import numpy as np
import pytest

import smla
from reference import (INVALID_INDICES, LATENT, QK, ROPE, V, attention, cache_rows, dequantize_ds_mla, model1_view,
                       quantize_ds_mla, quantize_model1)
from smla.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
from smla import torch_ops  # noqa: E402  (needs torch)

needs_custom_ops = pytest.mark.skipif(not torch_ops.available(), reason="torch < 2.4 has no torch.library.custom_op")
cuda = pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()),
                          reason="needs a CUDA GPU and a CUDA build")


def to_torch(a: np.ndarray, device: str = "cpu") -> "torch.Tensor":
    """numpy (ml_dtypes bfloat16 included) -> torch, same bits."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def attention_case(rng, tokens=4, heads=16, topk=64, num_blocks=8, block_size=16, fp8=True):
    """numpy data: bf16 q, a cache with NaN in unread slots, indices with invalid entries."""
    num_slots = num_blocks * block_size
    used = rng.choice(num_slots, size=num_slots // 2, replace=False)
    lat = rng.standard_normal((num_slots, LATENT)).astype(np.float32)
    pe = rng.standard_normal((num_slots, ROPE)).astype(np.float32)
    if fp8:
        rows = quantize_ds_mla(lat, pe)
        rows[~np.isin(np.arange(num_slots), used), :LATENT] = 0x7F
    else:
        rows = np.concatenate([lat, pe], 1).astype(ml_dtypes.bfloat16)
        rows[~np.isin(np.arange(num_slots), used)] = np.nan
    cache = rows.reshape(num_blocks, block_size, -1)
    idx = np.stack([rng.choice(used, size=topk, replace=False) for _ in range(tokens)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = rng.choice(INVALID_INDICES)
    idx[-1] = -1
    q = rng.standard_normal((tokens, heads, QK)).astype(ml_dtypes.bfloat16)
    return q, cache, idx


def check(name, ans, ref, atol, rtol):
    ans = np.asarray(to_numpy(ans) if isinstance(ans, torch.Tensor) else ans, np.float64)
    assert ans.shape == ref.shape
    for special in (np.inf, -np.inf):
        np.testing.assert_array_equal(ans == special, ref == special, err_msg=name)
    assert not np.isnan(ans).any(), name
    f = np.isfinite(ref)
    np.testing.assert_allclose(ans[f], ref[f], atol=atol, rtol=rtol, err_msg=name)


# --- CPU -----------------------------------------------------------------------


def test_torch_in_torch_out_same_as_numpy(rng):
    q, cache, idx = attention_case(rng)
    out, lse = smla.sparse_mla(to_torch(q), to_torch(cache).view(torch.float8_e4m3fn), to_torch(idx),
                               softmax_scale=0.05)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, want_lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.05)
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # int8 and uint8 caches are fp8 too.
    out8, _ = smla.sparse_mla(to_torch(q), to_torch(cache).view(torch.int8), to_torch(idx), softmax_scale=0.05)
    assert torch.equal(out8, out)


def test_cache_write_lands_in_the_torch_tensor(rng):
    cache = torch.zeros((4, 8, 656), dtype=torch.float8_e4m3fn)
    latent = torch.randn(5, LATENT)
    k_pe = torch.randn(5, ROPE)
    slots = torch.tensor([0, 3, 9, -1, 31])
    assert smla.write_mla_cache(latent, k_pe, slots, cache) is cache
    got = cache.view(torch.uint8).view(-1, 656)[slots[slots >= 0]].numpy()
    want = quantize_ds_mla(latent.numpy(), k_pe.numpy())[slots.numpy() >= 0]
    np.testing.assert_array_equal(got, want)


def test_cpp_sees_torch_memory():
    from smla import _arrays, _smla

    t = torch.zeros(4, 6, 600, dtype=torch.bfloat16)[1:, :, :QK]
    info = _smla.tensor_info(_arrays.export(t))
    assert info["data"] == t.data_ptr() and info["shape"] == tuple(t.shape) and info["strides"] == t.stride()
    assert info["dtype"] == "bfloat16"
    f8 = torch.zeros(2, 656, dtype=torch.float8_e4m3fn)
    info = _smla.tensor_info(_arrays.export(f8, "fp8_ds_mla"))
    assert info["data"] == f8.data_ptr() and info["dtype"] == "fp8_ds_mla"


@needs_custom_ops
def test_custom_ops_are_registered_and_pass_opcheck(rng):
    for name in ("write_mla_cache", "sparse_mla", "paged_mla_decode", "write_index_cache", "indexer_topk",
                 "positions_to_slots", "dsa_decode_step"):
        assert hasattr(torch.ops.smla, name), name
    q, cache, idx = attention_case(rng, fp8=False)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.smla.sparse_mla.default, (to_torch(q), to_torch(cache), to_torch(idx), None, None, 0.05))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    clean_cache = torch.randn(8, 16, QK).to(torch.bfloat16)  # every position is read: no NaN
    opcheck(torch.ops.smla.paged_mla_decode.default,
            (to_torch(q)[:2, None], clean_cache, table, torch.tensor([5, 60], dtype=torch.int32), None, 0.05))
    opcheck(torch.ops.smla.write_mla_cache.default,
            (torch.randn(3, LATENT), torch.randn(3, ROPE), torch.tensor([1, 2, 70]),
             torch.zeros(8, 16, 656, dtype=torch.uint8)))
    opcheck(torch.ops.smla.positions_to_slots.default,
            (torch.tensor([[0, 5, -1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), table, 16))


@needs_custom_ops
def test_torch_compile_traces_the_ops(rng):
    q, cache, idx = attention_case(rng, fp8=False)
    tq, tc, ti = to_torch(q), to_torch(cache), to_torch(idx)

    def step(q, cache, idx):
        out, lse = smla.sparse_mla(q * 2, cache, idx, softmax_scale=0.05)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(tq, tc, ti), step(tq, tc, ti)):
        assert torch.equal(got, want)


def pooled_case(rng, pools=6, kpool=4, tokens=5, heads=3):
    """GLM-5.3-Flash's pooled indexer inputs as numpy arrays: keys, gates, ape, pool slots (one skipped), a NaN-filled
    fp8 index cache, top pools with invalid ids, context lengths, queries."""
    k = rng.uniform(-3, 3, (pools, kpool, 128)).astype(ml_dtypes.bfloat16)
    gate = rng.uniform(-4, 4, (pools, kpool, 128)).astype(ml_dtypes.bfloat16)
    ape = rng.uniform(-2, 2, (kpool, 128)).astype(np.float32)
    slots = rng.choice(4 * 4, size=pools, replace=False).astype(np.int64)
    slots[1] = -1
    cache = np.full((4, 4, 132), 0x7F, np.uint8)
    top = rng.integers(-2, 9, (tokens, 3)).astype(np.int32)
    ctx = rng.integers(0, 40, tokens).astype(np.int32)
    q = rng.uniform(-4, 4, (tokens, heads, 128)).astype(ml_dtypes.bfloat16)
    return k, gate, ape, slots, cache, top, ctx, q


@needs_custom_ops
def test_pooled_indexer_ops_are_torch_ops_with_numpys_results(rng):
    """write_pooled_index_cache, pools_to_positions and rotate_index_q on torch tensors go through torch.ops.smla
    (opcheck: schema, fake, in-place write declared) and give the bits the numpy path gives."""
    k, gate, ape, slots, cache, top, ctx, q = pooled_case(rng)
    want_cache = smla.write_pooled_index_cache(k, gate, ape, slots, cache.copy())
    got_cache = to_torch(cache)
    assert smla.write_pooled_index_cache(to_torch(k), to_torch(gate), to_torch(ape), to_torch(slots),
                                         got_cache) is got_cache
    np.testing.assert_array_equal(to_numpy(got_cache), want_cache)
    np.testing.assert_array_equal(to_numpy(smla.pools_to_positions(to_torch(top), to_torch(ctx), kpool=4)),
                                  smla.pools_to_positions(top, ctx, kpool=4))
    for fp8 in (True, False):
        want_q, want_scale = smla.rotate_index_q(q, fp8=fp8)
        got_q, got_scale = smla.rotate_index_q(to_torch(q), fp8=fp8)
        assert got_q.dtype == (torch.uint8 if fp8 else torch.bfloat16)
        np.testing.assert_array_equal(to_numpy(got_q), want_q)
        assert (got_scale is None) == (want_scale is None)
        if fp8:
            np.testing.assert_array_equal(to_numpy(got_scale), want_scale)

    opcheck = torch.library.opcheck
    opcheck(torch.ops.smla.write_pooled_index_cache.default,
            (to_torch(k), to_torch(gate), to_torch(ape), to_torch(slots), torch.zeros(4, 4, 132, dtype=torch.uint8)))
    opcheck(torch.ops.smla.pools_to_positions.default, (to_torch(top), to_torch(ctx), 4))
    opcheck(torch.ops.smla.rotate_index_q.default, (to_torch(q), True))
    opcheck(torch.ops.smla.rotate_index_q.default, (to_torch(q), False))


@needs_custom_ops
def test_torch_compile_traces_the_pooled_indexer_ops(rng):
    k, gate, ape, slots, cache, top, ctx, q = pooled_case(rng)
    args = [to_torch(a) for a in (k, gate, ape, slots, top, ctx, q)]

    def step(k, gate, ape, slots, top, ctx, q):
        cache = torch.zeros(4, 4, 132, dtype=torch.uint8)
        smla.write_pooled_index_cache(k, gate, ape, slots, cache)
        q_out, q_scale = smla.rotate_index_q(q * 2)
        return cache, smla.pools_to_positions(top + 1, ctx, kpool=4), q_out, q_scale

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*args), step(*args)):
        assert torch.equal(got, want)
    with pytest.raises(smla.InvalidArgumentError, match="pools_to_positions: pools: expected 2 dimensions"):
        smla.pools_to_positions(args[4][0], args[5], kpool=4)


def test_errors_from_torch_calls(rng):
    q, cache, idx = attention_case(rng)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: indices"):
        smla.sparse_mla(to_torch(q), to_torch(cache), to_torch(idx).long(), softmax_scale=0.05)


def test_flash_mla_with_torch_cpu_tensors(rng):
    q, cache, idx = attention_case(rng, tokens=4)
    tq = to_torch(q).view(2, 2, 16, QK)
    k_cache = to_torch(cache).view(torch.float8_e4m3fn).unsqueeze(2)
    out, lse = flash_mla_with_kvcache(tq, k_cache, None, None, 512, get_mla_metadata()[0], None, softmax_scale=0.05,
                                      is_fp8_kvcache=True, indices=to_torch(idx).view(2, 2, -1))
    assert out.shape == (2, 2, 16, V) and lse.shape == (2, 16, 2) and lse.is_contiguous()
    want_out, want_lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.05)
    assert torch.equal(out.reshape(4, 16, V), to_torch(want_out))
    want_lse = np.where(np.isneginf(want_lse), np.inf, want_lse).reshape(2, 2, 16).transpose(0, 2, 1)
    np.testing.assert_array_equal(lse.numpy(), want_lse)


@needs_custom_ops
def test_flash_mla_ops_pass_opcheck(rng):
    """smla.flash_mla's own ops (FlashMLA's layouts written by the kernels): schema, fake and kernel agree."""
    q, cache, idx = attention_case(rng, tokens=4, fp8=False)
    clean = torch.randn(8, 16, QK).to(torch.bfloat16)  # every slot may be read: no NaN
    tq = to_torch(q).view(2, 2, 16, QK)
    tidx = to_torch(idx).view(2, 2, -1)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.smla.flash_mla_with_kvcache.default,
            (tq, clean, None, None, tidx, torch.tensor([40, 7], dtype=torch.int32), None, 0.05, False))
    opcheck(torch.ops.smla.flash_mla_with_kvcache.default,
            (tq, clean, torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([5, 60], dtype=torch.int32),
             None, None, None, 0.05, True))
    opcheck(torch.ops.smla.flash_mla_sparse_fwd.default,
            (to_torch(q), clean.view(-1, 1, QK), to_torch(idx)[:, None, :], None, None, 0.05))


# --- CUDA ----------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("fp8", [True, False])
def test_cuda_sparse_mla_matches_reference(rng, fp8):
    q, cache, idx = attention_case(rng, tokens=6, heads=64, topk=128, num_blocks=16, block_size=64, fp8=fp8)
    sink = rng.standard_normal(64).astype(np.float32)
    sink[:2] = [np.inf, -np.inf]
    topk_length = rng.integers(0, 129, size=6).astype(np.int32)
    dev = "cuda"
    out, lse = smla.sparse_mla(to_torch(q, dev), to_torch(cache, dev), to_torch(idx, dev), softmax_scale=0.04,
                               topk_length=to_torch(topk_length, dev), attn_sink=to_torch(sink, dev))
    assert out.is_cuda and lse.is_cuda
    rows = cache_rows(cache) if fp8 else np.asarray(cache, np.float64).reshape(-1, QK)
    ref_out, ref_lse = attention(np.asarray(q, np.float64), rows, idx, 0.04, topk_length, sink)
    amax = np.nanmax(np.abs(rows[:, :V]))
    check("out", out, ref_out, 1e-3 + 2**-8 * amax, 2.01 / 128)
    check("lse", lse, ref_lse, 1e-5, 8.01 / 65536)


@cuda
def test_cuda_paged_decode_and_cache_write_match_cpu(rng):
    dev = "cuda"
    latent, k_pe = torch.randn(200, LATENT), torch.randn(200, ROPE)
    slots = torch.randperm(256)[:200]
    cpu_cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    gpu_cache = cpu_cache.to(dev)
    smla.write_mla_cache(latent, k_pe, slots, cpu_cache)
    smla.write_mla_cache(latent.to(dev), k_pe.to(dev), slots.to(dev), gpu_cache)
    assert torch.equal(gpu_cache.cpu(), cpu_cache)  # the same bits on both backends
    q = torch.randn(3, 2, 16, QK, dtype=torch.bfloat16)
    table = torch.tensor([[2, 0, 1, 3], [1, 3, 0, 2], [3, 2, 1, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([2, 130, 256], dtype=torch.int32)
    out, lse = smla.paged_mla_decode(q.to(dev), gpu_cache, table.to(dev), seq_lens.to(dev), softmax_scale=0.06)
    want_out, want_lse = smla.paged_mla_decode(q, cpu_cache, table, seq_lens, softmax_scale=0.06)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=2e-2, rtol=2.01 / 128)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-4, rtol=1e-4)


@cuda
def test_cuda_runs_on_the_current_stream_and_in_cuda_graphs(rng):
    q, cache, idx = attention_case(rng, tokens=8, heads=32, topk=128, num_blocks=8, block_size=64)
    tq, tc, ti = to_torch(q, "cuda"), to_torch(cache, "cuda"), to_torch(idx, "cuda")
    want_out, want_lse = smla.sparse_mla(tq, tc, ti, softmax_scale=0.05)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = smla.sparse_mla(tq, tc, ti, softmax_scale=0.05)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)

    static_q = tq.clone()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):  # an eager call on the capture stream first (test_capture.py covers the others)
        smla.sparse_mla(static_q, tc, ti, softmax_scale=0.05)
    torch.cuda.current_stream().wait_stream(capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        g_out, g_lse = smla.sparse_mla(static_q, tc, ti, softmax_scale=0.05)
    new_q = torch.randn_like(tq)
    static_q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    e_out, e_lse = smla.sparse_mla(new_q, tc, ti, softmax_scale=0.05)
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)


@cuda
@needs_custom_ops
def test_cuda_pooled_indexer_ops_match_the_cpu_and_are_captured(rng):
    """The pooled indexer's torch ops on CUDA tensors: rotate_index_q bit-identical to the CPU (docs/ops.md),
    pools_to_positions equal, the pooled keys within one e4m3 step of the CPU's; then all three captured in a CUDA
    graph and replayed with new inputs, equal to eager calls."""
    from reference import index_cache_keys

    k, gate, ape, slots, cache, top, ctx, q = pooled_case(rng)
    args = [to_torch(a, "cuda") for a in (k, gate, ape, slots, cache, top, ctx, q)]
    gk, ggate, gape, gslots, gcache, gtop, gctx, gq = args

    def step(cache, top, q):
        smla.write_pooled_index_cache(gk, ggate, gape, gslots, cache)
        return smla.pools_to_positions(top, gctx, kpool=4), smla.rotate_index_q(q)

    positions, (q_out, q_scale) = step(gcache, gtop, gq)
    want_cache = smla.write_pooled_index_cache(k, gate, ape, slots, cache.copy())
    np.testing.assert_array_equal(to_numpy(positions), smla.pools_to_positions(top, ctx, kpool=4))
    want_q, want_scale = smla.rotate_index_q(q)
    np.testing.assert_array_equal(to_numpy(q_out), want_q)
    np.testing.assert_array_equal(to_numpy(q_scale), want_scale)
    got_keys, got_scales = index_cache_keys(to_numpy(gcache))
    want_keys, want_scales = index_cache_keys(want_cache)
    written = np.unique(slots[slots >= 0])
    got, want = got_keys[written] * got_scales[written, None], want_keys[written] * want_scales[written, None]
    assert np.all(np.abs(got - want) <= 2.0**-3 * np.abs(want) + want_scales[written, None] * 2.0**-9)
    unwritten = np.setdiff1d(np.arange(16), written)
    assert np.isnan(got_keys[unwritten]).all()  # the NaN fill of slots no pool names (and the skipped one's) stays

    static_top, static_q, static_cache = gtop.clone(), gq.clone(), torch.zeros_like(gcache)
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        step(static_cache, static_top, static_q)  # an eager call on the capture stream first
    torch.cuda.current_stream().wait_stream(capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        g_positions, (g_q, g_scale) = step(static_cache, static_top, static_q)
    static_top.copy_(torch.randint(-2, 9, gtop.shape, dtype=torch.int32, device="cuda"))
    static_q.copy_(torch.randn_like(gq.float()).to(gq.dtype))
    static_cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    eager_cache = torch.zeros_like(gcache)
    want_positions, (want_gq, want_gscale) = step(eager_cache, static_top, static_q)
    assert torch.equal(g_positions, want_positions) and torch.equal(g_q, want_gq) and torch.equal(g_scale, want_gscale)
    assert torch.equal(static_cache, eager_cache)


@cuda
@needs_custom_ops
def test_cuda_torch_compile(rng):
    q, cache, idx = attention_case(rng, fp8=True)
    tq, tc, ti = to_torch(q, "cuda"), to_torch(cache, "cuda").view(torch.float8_e4m3fn), to_torch(idx, "cuda")

    def step(q, cache, idx):
        out, lse = smla.sparse_mla(q, cache, idx, softmax_scale=0.05)
        return out * 2, lse

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(tq, tc, ti), step(tq, tc, ti)):
        assert torch.equal(got, want)


def torch_indexer_args():
    gen = torch.Generator().manual_seed(7)
    tokens, heads, blocks, block_size = 3, 8, 6, 16
    keys = torch.randn(blocks * block_size, 128, generator=gen)
    cache = torch.zeros(blocks, block_size, 128, dtype=torch.bfloat16)
    smla.write_index_cache(keys, torch.arange(blocks * block_size), cache)
    q = torch.randn(tokens, heads, 128, generator=gen).to(torch.bfloat16)
    return (q, torch.randn(tokens, heads, generator=gen), cache, torch.tensor([0, 1, 1], dtype=torch.int32),
            torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32), torch.tensor([40, 7, 48], dtype=torch.int32))


def by_position(rows):
    """Best-first top-k rows in ascending position order, the -1 padding left last: what sorted=False gives."""
    valid = rows >= 0
    big = torch.iinfo(torch.int32).max
    return torch.where(valid, rows, big).sort(dim=1).values.masked_fill(~valid.sort(dim=1, descending=True).values, -1)


def test_indexer_topk_unsorted_on_torch_tensors():
    args = torch_indexer_args()
    want = smla.indexer_topk(*args, topk=16)
    got = smla.indexer_topk(*args, topk=16, sorted=False)
    assert not torch.equal(got, want)
    assert torch.equal(got, by_position(want))
    assert torch.equal(got[1, 7:], torch.full((9,), -1, dtype=torch.int32))  # 7 positions, then padding


@cuda
def test_cuda_indexer_ops_follow_the_declared_capabilities():
    args = torch_indexer_args()
    gpu_args = [a.cuda() for a in args]
    gpu = next(b for b in smla.backends() if b.name == "cuda_mma")
    if "indexer" not in gpu.ops:
        with pytest.raises(smla.UnsupportedError, match="indexer_topk"):
            smla.indexer_topk(*gpu_args, topk=16)
        return
    want = smla.indexer_topk(*args, topk=16)
    got = smla.indexer_topk(*gpu_args, topk=16).cpu()
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    assert torch.equal(smla.indexer_topk(*gpu_args, topk=16, sorted=False).cpu(), by_position(got))


# --- FlashMLA's API, called the way FlashMLA's tests call it ------------------------


def _flashmla_decode_testcase(rng, b, s_q, h_q, topk, block_size, s_k, device):
    """As FlashMLA's generate_testcase_for_decode: varlen cache_seqlens, a shuffled
    block table, abs indices -> indices in the kv cache, NaN in unread slots, FP8 cache."""
    seqlens = np.maximum(rng.normal(s_k, s_k / 2, size=b), s_q).astype(np.int64)
    pad = max(-(-int(seqlens.max()) // (4 * block_size)), 1) * 4 * block_size
    block_table = rng.permutation(b * pad // block_size).reshape(b, -1).astype(np.int32)
    num_blocks = block_table.size
    lat = np.clip(rng.standard_normal((num_blocks * block_size, LATENT)) * 0.1, -1, 1).astype(np.float32)
    pe = np.clip(rng.standard_normal((num_blocks * block_size, ROPE)) * 0.1, -1, 1).astype(np.float32)
    rows = quantize_ds_mla(lat, pe)
    abs_idx = np.full((b, s_q, topk), -1, np.int64)
    for i in range(b):
        for j in range(s_q):
            n = min(topk, int(seqlens[i]))
            abs_idx[i, j, :n] = rng.permutation(int(seqlens[i]))[:n]
    valid = abs_idx >= 0
    blocks = np.take_along_axis(np.broadcast_to(block_table[:, None, :], (b, s_q, block_table.shape[1])),
                                np.where(valid, abs_idx // block_size, 0), axis=2)
    indices = np.where(valid, blocks * block_size + abs_idx % block_size, -1).astype(np.int32)
    topk_length = rng.integers(0, topk + 1, size=b).astype(np.int32)
    counted = np.where(np.arange(topk)[None, None, :] < topk_length[:, None, None], indices, -1)
    unused = np.ones(rows.shape[0], bool)
    unused[counted[counted >= 0]] = False
    rows[unused, :LATENT] = 0x7F
    k_cache = torch.from_numpy(rows.reshape(num_blocks, block_size, 1, -1)).view(torch.float8_e4m3fn).to(device)
    q = torch.from_numpy(np.clip(rng.standard_normal((b, s_q, h_q, QK)), -1, 1).astype(np.float32))
    q = q.to(torch.bfloat16).to(device)
    sink = torch.randn(h_q)
    m = torch.randn(h_q)
    sink[m > 0.5], sink[m < -0.5] = float("inf"), float("-inf")
    return q, k_cache, torch.from_numpy(indices).to(device), torch.from_numpy(topk_length).to(device), \
        sink.to(device), rows


@cuda
@pytest.mark.parametrize("b,s_q,h_q,topk,block_size,s_k", [(4, 1, 128, 64, 64, 512), (3, 2, 64, 128, 61, 300),
                                                             (2, 1, 16, 576, 2, 1024)])
def test_flashmla_sparse_decoding_style(rng, b, s_q, h_q, topk, block_size, s_k):
    q, k_cache, indices, topk_length, sink, rows = _flashmla_decode_testcase(rng, b, s_q, h_q, topk, block_size, s_k,
                                                                             "cuda")
    tile_scheduler_metadata, num_splits = get_mla_metadata()
    sm_scale = QK**-0.55
    capture = torch.cuda.Stream()  # the eager call warms up the stream the graph is captured on
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, tile_scheduler_metadata, num_splits,
                                          softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True,
                                          indices=indices, attn_sink=sink, extra_k_cache=None,
                                          extra_indices_in_kvcache=None, topk_length=topk_length,
                                          extra_topk_length=None)
    torch.cuda.current_stream().wait_stream(capture)
    assert out.shape == (b, s_q, h_q, V) and lse.shape == (b, h_q, s_q)
    ref_out, ref_lse = attention(to_numpy(q).astype(np.float64).reshape(b * s_q, h_q, QK),
                                 dequantize_ds_mla(rows), to_numpy(indices).reshape(b * s_q, -1), sm_scale,
                                 np.repeat(to_numpy(topk_length), s_q), to_numpy(sink))
    ref_lse = np.where(np.isneginf(ref_lse), np.inf, ref_lse).reshape(b, s_q, h_q).transpose(0, 2, 1)
    check("out", out.reshape(b * s_q, h_q, V), ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, ref_lse, 1e-6, 8.01 / 65536)
    # The same call again on the now-initialised scheduling object, and inside a CUDA graph.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        g_out, g_lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, tile_scheduler_metadata, None,
                                              softmax_scale=sm_scale, is_fp8_kvcache=True, indices=indices,
                                              attn_sink=sink, topk_length=topk_length)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@cuda
@pytest.mark.parametrize("s_q,s_kv,topk,h_q", [(62, 592, 128, 128), (1, 95, 128, 64), (213, 153, 256, 16)])
def test_flashmla_sparse_prefill_style(rng, s_q, s_kv, topk, h_q):
    dev = "cuda"
    q = (torch.randn(s_q, h_q, QK) / 10 + (float(rng.random()) - 0.5) / 10).to(torch.bfloat16).to(dev)
    kv = (torch.randn(s_kv, 1, QK) / 10).to(torch.bfloat16).to(dev)
    invalid = torch.tensor([-2147483648, -123456, -1, s_kv, 114514, 1919810, 2147480000, 2147483647],
                           dtype=torch.int32)
    indices = torch.stack([torch.randperm(max(s_kv, topk))[:topk] for _ in range(s_q)]).to(torch.int32)
    bad = indices >= s_kv
    indices[bad] = invalid[torch.randint(0, len(invalid), (int(bad.sum()),))]
    indices = indices.view(s_q, 1, topk).to(dev)
    sink = torch.randn(h_q, device=dev)
    topk_length = torch.randint(0, max(topk + 1, 64), (s_q,), dtype=torch.int32, device=dev).clamp_max(topk)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, sm_scale=0.5, d_v=512, attn_sink=sink,
                                                topk_length=topk_length)
    idx = to_numpy(indices)[:, 0, :]
    kv64 = to_numpy(kv).astype(np.float64)[:, 0, :]
    ref_out, ref_lse = attention(to_numpy(q).astype(np.float64), kv64, idx, 0.5, to_numpy(topk_length),
                                 to_numpy(sink))
    check("out", out, ref_out, 8e-4 + 2**-8 * 0.5, 3.01 / 128)
    check("lse", lse, np.where(np.isneginf(ref_lse), np.inf, ref_lse), 1e-6, 2.01 / 65536)
    valid = (idx >= 0) & (idx < s_kv) & (np.arange(topk)[None, :] < to_numpy(topk_length)[:, None])
    scores = 0.5 * np.einsum("thd,tkd->thk", to_numpy(q).astype(np.float64), kv64[np.where(valid, idx, 0)])
    check("max_logits", max_logits, np.where(valid[:, None, :], scores, -np.inf).max(-1), 1e-6, 2.01 / 65536)


@cuda
def test_cupy_arrays(rng):
    cupy = pytest.importorskip("cupy")
    q, cache, idx = attention_case(rng, fp8=True)
    q16 = np.asarray(q, np.float16)
    out, lse = smla.sparse_mla(cupy.asarray(q16), cupy.asarray(cache), cupy.asarray(idx), softmax_scale=0.05)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
    want_out, want_lse = smla.sparse_mla(q16, cache, idx, softmax_scale=0.05)
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float32), want_out.astype(np.float32), atol=2e-3,
                               rtol=1e-2)
    np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, atol=1e-4, rtol=1e-4)


def model1_case(rng, b=3, s_q=2, h_q=16, topk=32, extra_topk=24):
    """DeepSeek-V4 (MODEL1) decode inputs: 512-wide bf16 caches (4 blocks of 16, 6 blocks of 5), indices into each
    with invalid entries, per-request lengths."""
    k_cache = (rng.standard_normal((4, 16, 1, LATENT)) / 3).astype(ml_dtypes.bfloat16)
    extra_k_cache = (rng.standard_normal((6, 5, 1, LATENT)) / 3).astype(ml_dtypes.bfloat16)
    q = np.clip(rng.standard_normal((b, s_q, h_q, LATENT)), -1, 1).astype(ml_dtypes.bfloat16)
    indices = rng.integers(-1, 64, size=(b, s_q, topk)).astype(np.int32)
    extra_indices = rng.integers(-1, 31, size=(b, s_q, extra_topk)).astype(np.int32)  # 30: past the 30 slots
    topk_length = rng.integers(0, topk + 1, size=b).astype(np.int32)
    extra_topk_length = rng.integers(0, extra_topk + 1, size=b).astype(np.int32)
    return q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length


def test_flash_mla_model1_torch_tensors_match_numpy(rng):
    """MODEL1 calls on torch tensors run through torch.ops.smla (with the extra cache): bit-identical to the numpy
    path."""
    case = model1_case(rng)
    q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length = case
    want_out, want_lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], indices=indices,
                                                topk_length=topk_length, extra_k_cache=extra_k_cache,
                                                extra_indices_in_kvcache=extra_indices,
                                                extra_topk_length=extra_topk_length)
    t = [to_torch(a) for a in case]
    out, lse = flash_mla_with_kvcache(t[0], t[1], None, None, 512, get_mla_metadata()[0], indices=t[2],
                                      topk_length=t[3], extra_k_cache=t[4], extra_indices_in_kvcache=t[5],
                                      extra_topk_length=t[6])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and lse.shape == (3, 16, 2)
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(to_numpy(lse), want_lse)


def model1_fp8_case(rng, block_size=16, num_blocks=4):
    """q (3, 2, 16, 512) and FlashMLA's fp8 MODEL1 k_cache (num_blocks, block_size, 1, 584) over padded blocks (a
    numpy view), with indices (some invalid) and per-request lengths."""
    rows = (rng.standard_normal((num_blocks * block_size, LATENT)) / 3).astype(ml_dtypes.bfloat16)
    blocks = quantize_model1(rows, block_size)
    q = np.clip(rng.standard_normal((3, 2, 16, LATENT)), -1, 1).astype(ml_dtypes.bfloat16)
    indices = rng.integers(-1, num_blocks * block_size + 1, size=(3, 2, 32)).astype(np.int32)
    topk_length = rng.integers(0, 33, size=3).astype(np.int32)
    return q, blocks, model1_view(blocks, block_size), indices, topk_length


def test_flash_mla_model1_fp8_torch_tensors_match_numpy(rng):
    """FlashMLA's fp8 MODEL1 cache (fp8_ds_mla_v4) as a torch uint8 view of padded blocks: torch.ops.smla (one cache)
    gives the numpy path's results bit for bit."""
    q, blocks, k_cache, indices, topk_length = model1_fp8_case(rng)
    want_out, want_lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0],
                                                is_fp8_kvcache=True, indices=indices, topk_length=topk_length)
    assert np.isfinite(want_out.astype(np.float32)).all()
    t_blocks = torch.from_numpy(blocks)
    t_cache = t_blocks[:, :k_cache.shape[1] * 584].view(k_cache.shape)
    assert t_cache.stride(0) == blocks.shape[1]  # FlashMLA's padded blocks
    out, lse = flash_mla_with_kvcache(to_torch(q), t_cache, None, None, 512, get_mla_metadata()[0],
                                      is_fp8_kvcache=True, indices=to_torch(indices), topk_length=to_torch(topk_length))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(to_numpy(lse), want_lse)


@needs_custom_ops
def test_flash_mla_model1_fp8_two_caches_torch_matches_numpy(rng):
    """Both caches in FlashMLA's fp8 MODEL1 layout (blocks of 16 and of 5, padded), per-token lengths and a sink:
    torch.ops.smla gives the numpy path's results bit for bit."""
    q, blocks, k_cache, indices, _ = model1_fp8_case(rng)
    rows = (rng.standard_normal((6 * 5, LATENT)) / 3).astype(ml_dtypes.bfloat16)
    extra_blocks = quantize_model1(rows, 5)
    extra_indices = rng.integers(-1, 31, size=(3, 2, 24)).astype(np.int32)
    topk_length = rng.integers(0, 33, size=(3, 2)).astype(np.int32)
    extra_topk_length = rng.integers(0, 25, size=(3, 2)).astype(np.int32)
    sink = rng.uniform(-2, 2, size=16).astype(np.float32)
    args = dict(indices=indices, topk_length=topk_length, attn_sink=sink, extra_indices_in_kvcache=extra_indices,
                extra_topk_length=extra_topk_length)
    want_out, want_lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0],
                                                is_fp8_kvcache=True, extra_k_cache=model1_view(extra_blocks, 5), **args)
    assert np.isfinite(want_out.astype(np.float32)).all()
    t_cache = torch.from_numpy(blocks)[:, :16 * 584].view(k_cache.shape)
    t_extra = torch.from_numpy(extra_blocks)[:, :5 * 584].view(6, 5, 1, 584)
    out, lse = flash_mla_with_kvcache(to_torch(q), t_cache, None, None, 512, get_mla_metadata()[0],
                                      is_fp8_kvcache=True, extra_k_cache=t_extra,
                                      **{k: to_torch(v) for k, v in args.items()})
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(to_numpy(lse), want_lse)


@needs_custom_ops
def test_model1_ops_pass_opcheck_and_trace(rng):
    """sparse_mla and flash_mla_with_kvcache with the extra cache: schema, fake and kernel agree (opcheck), and
    smla.flash_mla's MODEL1 call traces whole under torch.compile with the eager call's bits."""
    case = [to_torch(a) for a in model1_case(rng)]
    q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length = case
    opcheck = torch.library.opcheck
    opcheck(torch.ops.smla.flash_mla_with_kvcache.default,
            (q, k_cache, None, None, indices, topk_length, None, 0.05, False, "auto", "", extra_k_cache,
             extra_indices, extra_topk_length))
    opcheck(torch.ops.smla.sparse_mla.default,
            (q[:, 0], k_cache[:, :, 0], indices[:, 0], topk_length, None, 0.05, "auto", "", extra_k_cache[:, :, 0],
             extra_indices[:, 0], extra_topk_length))
    meta = get_mla_metadata()[0]

    def step(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length):
        out, lse = flash_mla_with_kvcache(q * 2, k_cache, None, None, 512, meta, indices=indices,
                                          topk_length=topk_length, extra_k_cache=extra_k_cache,
                                          extra_indices_in_kvcache=extra_indices, extra_topk_length=extra_topk_length)
        return out.float().sum(-1), lse

    want = step(*case)  # initialises meta eagerly
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, w in zip(compiled(*case), want):
        assert torch.equal(got, w)


def test_flash_mla_model1_errors_on_torch_tensors_are_numpys(rng):
    """Bad extra-cache arguments on torch tensors (now through torch.ops.smla) raise what the numpy path raises."""
    q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length = model1_case(rng)
    cases = [
        dict(indices=indices, extra_k_cache=extra_k_cache),  # no extra indices
        dict(indices=indices, extra_indices_in_kvcache=extra_indices),  # no extra cache
        dict(extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices),  # dense
        dict(indices=indices, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices[:, :1]),
        dict(indices=indices, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
             extra_topk_length=extra_topk_length[:2]),
        dict(indices=indices, extra_k_cache=np.repeat(extra_k_cache, 2, axis=2), extra_indices_in_kvcache=extra_indices),
        dict(indices=indices, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices.astype(np.int64)),
        dict(indices=indices, extra_k_cache=extra_k_cache[..., :448], extra_indices_in_kvcache=extra_indices),
    ]
    for kwargs in cases:
        errors = []
        for convert in (lambda a: a, to_torch):
            with pytest.raises(smla.InvalidArgumentError) as e:
                flash_mla_with_kvcache(convert(q), convert(k_cache), None, None, 512, get_mla_metadata()[0],
                                       **{k: convert(v) for k, v in kwargs.items()})
            errors.append(str(e.value))
        assert errors[0] == errors[1], kwargs



def test_flash_mla_errors_on_torch_tensors_are_numpys(rng):
    """flash_mla_with_kvcache on torch tensors leaves the shape checks to torch.ops.smla (no shape read in Python
    before it): every bad argument still raises the numpy path's class and message, an argument that is no tensor
    is named, and a call that fails does not set up its FlashMLASchedMeta."""
    q, cache, idx = attention_case(rng, tokens=4, fp8=False)
    q, k_cache, indices = q.reshape(2, 2, 16, QK), cache[:, :, None], idx.reshape(2, 2, -1)
    table, seqlens = np.arange(8, dtype=np.int32).reshape(2, 4), np.array([5, 60], np.int32)
    cases = [
        dict(q=q[:, 0]),                                               # 3-D q
        dict(q=q[None]),                                               # 5-D q
        dict(k_cache=np.repeat(k_cache, 2, axis=2)),                   # two heads in the cache
        dict(indices=np.zeros((3, 2, 16), np.int32)),                  # batch 3, q's is 2
        dict(indices=indices[:, :, None]),                             # 4-D indices
        dict(topk_length=np.zeros(3, np.int32)),
        dict(topk_length=np.zeros((2, 1), np.int32)),
        dict(k_cache=None), dict(k_cache=k_cache.tolist()), dict(indices=indices.tolist()),
        dict(k_cache=None, is_fp8_kvcache=True),
        dict(topk_length=[1, 2]),
        dict(is_fp8_kvcache=True),                                     # bf16 data
        dict(k_cache=np.zeros((8, 16, 1, 656), np.uint8)),             # 8-bit data without is_fp8_kvcache
        dict(q=q[:, 0], k_cache=np.zeros((8, 16, 1, 656), np.uint8)),  # both: the shapes named first
        dict(q=q[0, 0, 0, 0], softmax_scale=None),                     # 0-d q, the scale from its width
        dict(softmax_scale=1e300), dict(softmax_scale=-1.0),
        dict(causal=True),
        dict(indices=None, block_table=table),                         # dense without cache_seqlens
        dict(indices=None, block_table=table, cache_seqlens=seqlens, topk_length=seqlens),
        dict(head_dim_v=128),
        dict(num_splits=np.zeros(3, np.int32)),
    ]

    def call(convert, meta, **kwargs):
        args = dict(q=q, k_cache=k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                    tile_scheduler_metadata=meta, indices=indices, softmax_scale=0.05)
        args.update(kwargs)
        return flash_mla_with_kvcache(**{k: convert(v) if isinstance(v, np.ndarray) else v for k, v in args.items()})

    for kwargs in cases:
        errors = []
        for convert in (lambda a: a, to_torch):
            meta = get_mla_metadata()[0]
            with pytest.raises(smla.InvalidArgumentError) as e:
                call(convert, meta, **kwargs)
            errors.append((type(e.value), str(e.value)))
            assert not meta.have_initialized, kwargs
        assert errors[0] == errors[1], kwargs
    # A FlashMLASchedMeta set up by one call rejects another configuration, named by its field.
    errors = []
    for convert in (lambda a: a, to_torch):
        meta = get_mla_metadata()[0]
        call(convert, meta)
        for kwargs in (dict(indices=indices[..., :32]), dict(q=q[:, :1], indices=indices[:, :1]), dict(causal=False)):
            if "causal" in kwargs:
                call(convert, meta, **kwargs)  # the same configuration: accepted
                continue
            with pytest.raises(smla.InvalidArgumentError) as e:
                call(convert, meta, **kwargs)
            errors.append(str(e.value))
    assert errors[:2] == errors[2:] and "topk is 32 but was 64" in errors[0] and "s_q is 1 but was 2" in errors[1]

def two_cache_reference(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, scale,
                        sink=None):
    """Sparse attention over two caches under one softmax, in float64: both caches' rows stacked, the extra slots
    offset past the first cache's, entries past each list's length or out of their cache set to -1."""
    rows = np.concatenate([np.asarray(k_cache, np.float64).reshape(-1, LATENT),
                           np.asarray(extra_k_cache, np.float64).reshape(-1, LATENT)])
    n, n_extra = k_cache.shape[0] * k_cache.shape[1], extra_k_cache.shape[0] * extra_k_cache.shape[1]

    def kept(idx, lengths, slots, offset):
        valid = (idx >= 0) & (idx < slots) & (np.arange(idx.shape[1])[None, :] < lengths[:, None])
        return np.where(valid, idx.astype(np.int64) + offset, -1)

    both = np.concatenate([kept(indices, topk_length, n, 0), kept(extra_indices, extra_topk_length, n_extra, n)], 1)
    return attention(np.asarray(q, np.float64), rows, both, scale, None, sink)


def test_sparse_mla_extra_cache_matches_reference_and_numpy(rng):
    """smla.sparse_mla's extra cache on torch tensors (torch.ops.smla) gives the numpy path's bits, and both match
    the float64 reference of one softmax over the two caches (a sink, per-token lengths, invalid slots)."""
    q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length = model1_case(rng, b=5)
    q, indices, extra_indices = q[:, 0], indices[:, 0], extra_indices[:, 0]  # 5 tokens
    k_cache, extra_k_cache = k_cache[:, :, 0], extra_k_cache[:, :, 0]
    sink = rng.uniform(-2, 2, size=16).astype(np.float32)
    args = (q, k_cache, indices)
    kwargs = dict(topk_length=topk_length, attn_sink=sink, extra_kv_cache=extra_k_cache, extra_indices=extra_indices,
                  extra_topk_length=extra_topk_length)
    want_out, want_lse = smla.sparse_mla(*args, softmax_scale=0.06, **kwargs)
    out, lse = smla.sparse_mla(*(to_torch(a) for a in args), softmax_scale=0.06,
                               **{k: to_torch(v) for k, v in kwargs.items()})
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16), want_out.view(np.uint16))
    np.testing.assert_array_equal(to_numpy(lse), want_lse)
    ref_out, ref_lse = two_cache_reference(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                                           extra_topk_length, 0.06, sink)
    check("out", out, ref_out, 1e-3 + 2**-8, 2.01 / 128)
    check("lse", lse, ref_lse, 1e-5, 1e-5)


@cuda
@pytest.mark.parametrize("two_caches", [False, True])
def test_flash_mla_model1_fp8_on_cuda_matches_cpu(rng, two_caches):
    """FlashMLA's fp8 MODEL1 cache (fp8_ds_mla_v4, padded blocks of 16; the extra cache's of 5) on CUDA tensors runs on
    the CUDA backend, one cache or two with per-token lengths and a sink, and matches the CPU backend on the same
    bytes; out is fully written."""
    q, blocks, k_cache, indices, topk_length = model1_fp8_case(rng)
    kwargs = dict(indices=indices, topk_length=topk_length)
    t_extra = {}
    if two_caches:
        extra_blocks = quantize_model1((rng.standard_normal((6 * 5, LATENT)) / 3).astype(ml_dtypes.bfloat16), 5)
        kwargs.update(extra_indices_in_kvcache=rng.integers(-1, 31, size=(3, 2, 24)).astype(np.int32),
                      extra_topk_length=rng.integers(0, 25, size=(3, 2)).astype(np.int32),
                      attn_sink=rng.uniform(-2, 2, size=16).astype(np.float32))
        t_extra = dict(extra_k_cache=torch.from_numpy(extra_blocks).cuda()[:, :5 * 584].view(6, 5, 1, 584))
        kwargs_cpu = dict(kwargs, extra_k_cache=model1_view(extra_blocks, 5))
    else:
        kwargs_cpu = kwargs
    want_out, want_lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0],
                                                is_fp8_kvcache=True, **kwargs_cpu)
    assert np.isfinite(want_out.astype(np.float32)).all()
    t_cache = torch.from_numpy(blocks).cuda()[:, :k_cache.shape[1] * 584].view(k_cache.shape)
    out, lse = flash_mla_with_kvcache(to_torch(q, "cuda"), t_cache, None, None, 512, get_mla_metadata()[0],
                                      is_fp8_kvcache=True, **{k: to_torch(v, "cuda") for k, v in kwargs.items()},
                                      **t_extra)
    assert out.is_cuda and lse.is_cuda
    got = to_numpy(out).astype(np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want_out.astype(np.float32), atol=2e-3, rtol=2e-2)
    np.testing.assert_allclose(to_numpy(lse), want_lse, atol=1e-3, rtol=1e-4)


@cuda
def test_flash_mla_model1_on_cuda_matches_cpu(rng):
    """MODEL1 on CUDA tensors runs on the CUDA backend (both caches under one softmax, a sink) and matches the CPU
    backend on the same inputs; out is fully written (NaN never survives)."""
    case = model1_case(rng)
    sink = rng.uniform(-2, 2, size=16).astype(np.float32)
    kwargs = dict(indices=case[2], topk_length=case[3], extra_k_cache=case[4], extra_indices_in_kvcache=case[5],
                  extra_topk_length=case[6], attn_sink=sink)
    want_out, want_lse = flash_mla_with_kvcache(case[0], case[1], None, None, 512, get_mla_metadata()[0], **kwargs)
    t = {k: to_torch(v, "cuda") for k, v in kwargs.items()}
    out, lse = flash_mla_with_kvcache(to_torch(case[0], "cuda"), to_torch(case[1], "cuda"), None, None, 512,
                                      get_mla_metadata()[0], **t)
    assert out.is_cuda and lse.is_cuda and lse.shape == (3, 16, 2)
    got = to_numpy(out).astype(np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want_out.astype(np.float32), atol=2e-3, rtol=2e-2)
    np.testing.assert_allclose(to_numpy(lse), want_lse, atol=1e-3, rtol=1e-4)


@cuda
@needs_custom_ops
def test_flash_mla_model1_is_captured_in_a_cuda_graph(rng):
    """MODEL1 (two caches) through torch.ops.smla on a side stream and in a CUDA graph: the scratch comes from
    torch's allocator (capture-safe), the replay gives the eager bits, and new inputs copied in change the result."""
    case = model1_case(rng, b=4, s_q=2, h_q=64, topk=2048, extra_topk=128)  # many keys: split, with scratch
    q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length = (to_torch(a, "cuda")
                                                                                         for a in case)
    meta = get_mla_metadata()[0]

    def call():
        return flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, indices=indices, topk_length=topk_length,
                                      extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
                                      extra_topk_length=extra_topk_length)

    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        want_out, want_lse = call()
    torch.cuda.current_stream().wait_stream(capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        g_out, g_lse = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, want_out) and torch.equal(g_lse, want_lse)
    q.copy_(-q)
    graph.replay()
    eager_out, eager_lse = call()
    torch.cuda.synchronize()
    assert not torch.equal(g_out, want_out)
    assert torch.equal(g_out, eager_out) and torch.equal(g_lse, eager_lse)
