"""The kernel entry of smla's vLLM backend (smla.vllm._kernel, no vLLM needed) on tensors in vLLM's exact
layouts (vllm_case.py): padded block strides, physical rows from vLLM's top-k conversion compacted to the front
with valid_counts, q whole or as vLLM's (ql_nope, q_pe) pair. On the CPU against the float64 reference; on a
CUDA GPU against the same call on the CPU backend, and under CUDA-graph capture. Skipped without torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import smla
from vllm_case import check, make_case, out_tolerance

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
from smla import torch_ops  # noqa: E402  (needs torch)

pytestmark = pytest.mark.skipif(not torch_ops.available(), reason="torch < 2.4: no torch.ops.smla")
cuda = pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()),
                          reason="needs a CUDA GPU and a CUDA build")

from smla.vllm import _kernel  # noqa: E402


def to_torch(a: np.ndarray, device: str = "cpu") -> "torch.Tensor":
    """numpy (ml_dtypes bfloat16 included) -> torch with the same bits and strides."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def vllm_tensors(case, device="cpu", pair=False):
    """The case as vLLM hands it to _forward_mqa_kernel: the cache a view of the padded buffer (its strides kept),
    indices and counts int32, q whole or as the pair of two separately allocated tensors."""
    buffer = to_torch(case.buffer, device)
    kv_cache = buffer[:, :case.block_size, :]
    q = to_torch(case.q, device)
    if pair:
        q = (q[..., :512].contiguous(), q[..., 512:].contiguous())
    return q, kv_cache, to_torch(case.topk_indices, device), to_torch(case.valid_counts, device)


def assert_matches_reference(case, out, lse):
    ref_out, ref_lse = case.reference()
    check("out", out.float().cpu().numpy(), ref_out, *out_tolerance(ref_out))
    check("lse", lse.cpu().numpy(), ref_lse, 1e-5, 8.01 / 65536)


CASES = [  # kind, q dtype, rope part, block size, padded rows between blocks
    ("bfloat16", "bfloat16", True, 16, 3),
    ("float16", "float16", True, 1, 0),
    ("fp8_ds_mla", "bfloat16", True, 64, 0),
    ("fp8_ds_mla", "float16", True, 7, 5),
    ("bfloat16", "bfloat16", False, 16, 2),    # GLM-5.3-Flash: 512-wide heads, no rope part
    ("fp8_ds_mla", "bfloat16", False, 32, 0),  # the same over the 656-byte rows vLLM allocates for it
]


@pytest.mark.parametrize("kind,q_dtype,rope,block_size,pad_rows", CASES)
@pytest.mark.parametrize("pair", [False, True])
def test_kernel_entry_matches_float64_on_the_cpu(rng, kind, q_dtype, rope, block_size, pad_rows, pair):
    case = make_case(rng, kind=kind, q_dtype=q_dtype, rope=rope, block_size=block_size, pad_rows=pad_rows)
    q, kv_cache, indices, counts = vllm_tensors(case, pair=pair)
    out, lse = _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=case.scale)
    assert out.dtype == (q[0] if pair else q).dtype and out.shape == (*case.q.shape[:2], 512)
    assert_matches_reference(case, out, lse)


def test_sinks_reach_the_kernel(rng):
    """The entry takes attention sinks (vLLM's MLA layer passes none today; the backend declares none)."""
    from reference import attention, dequantize_ds_mla

    case = make_case(rng, kind="fp8_ds_mla", heads=8)
    sink = torch.from_numpy(rng.standard_normal(8).astype(np.float32))
    out, lse = _kernel.sparse_mla_forward(*vllm_tensors(case, pair=True), scale=case.scale, attn_sink=sink)
    rows = dequantize_ds_mla(case.buffer.reshape(-1, case.buffer.shape[-1]))
    ref_out, ref_lse = attention(np.asarray(case.q, np.float64), rows, case.topk_indices, case.scale,
                                 topk_length=case.valid_counts, attn_sink=sink.numpy())
    check("out", out.float().numpy(), ref_out, *out_tolerance(ref_out))
    check("lse", lse.numpy(), ref_lse, 1e-5, 8.01 / 65536)


def test_the_cache_is_read_in_place(rng):
    """No copy of the cache: smla sees vLLM's storage through a strided view."""
    case = make_case(rng, kind="bfloat16", block_size=16, pad_rows=3)
    _, kv_cache, _, _ = vllm_tensors(case)
    rows = _kernel.cache_rows(kv_cache)
    assert rows.data_ptr() == kv_cache.data_ptr()
    assert rows.shape == ((kv_cache.shape[0] - 1) * 19 + 16, 1, 576) and rows.stride() == (576, 576, 1)


def test_a_query_without_rope_part_is_not_copied(rng):
    ql_nope = torch.randn(3, 4, 512, dtype=torch.bfloat16)
    assert _kernel.query((ql_nope, ql_nope.new_empty((3, 4, 0)))) is ql_nope


def test_an_empty_batch_returns_empty_outputs(rng):
    case = make_case(rng, kind="fp8_ds_mla")
    q, kv_cache, indices, counts = vllm_tensors(case)
    out, lse = _kernel.sparse_mla_forward(q[:0], kv_cache, indices[:0], counts[:0], scale=case.scale)
    assert out.shape == (0, q.shape[1], 512) and lse.shape == (0, q.shape[1])


def test_the_engines_buffers_are_written_in_place(rng):
    """out= / lse= (vLLM's preallocated output): sparse_mla.out writes them, bit for bit the allocating call."""
    case = make_case(rng, kind="fp8_ds_mla")
    q, kv_cache, indices, counts = vllm_tensors(case, pair=True)
    want_out, want_lse = _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=case.scale)
    out = torch.full_like(want_out, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))
    got = _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=case.scale, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert_matches_reference(case, out, lse)
    with pytest.raises(ValueError, match="out and lse: give both"):
        _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=case.scale, out=out)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: lse"):
        _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=case.scale, out=out, lse=lse[:-1])


def test_bad_layouts_are_refused_with_the_reason(rng):
    case = make_case(rng, kind="bfloat16")
    q, kv_cache, indices, counts = vllm_tensors(case)
    with pytest.raises(ValueError, match="kv_cache: expected \\[num_blocks, block_size, row\\]"):
        _kernel.cache_rows(kv_cache[0])
    with pytest.raises(ValueError, match="whole number of rows"):
        _kernel.cache_rows(torch.empty(4 * 16 * 576 + 8, dtype=torch.bfloat16).as_strided((4, 16, 576),
                                                                                            (16 * 576 + 2, 576, 1)))
    with pytest.raises(smla.InvalidArgumentError, match="topk_length"):
        _kernel.sparse_mla_forward(q, kv_cache, indices, counts[:-1], scale=case.scale)


# --- CUDA -----------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("kind,q_dtype,rope,block_size,pad_rows", CASES)
def test_kernel_entry_on_the_gpu_matches_the_cpu_backend(rng, kind, q_dtype, rope, block_size, pad_rows):
    case = make_case(rng, kind=kind, q_dtype=q_dtype, rope=rope, block_size=block_size, pad_rows=pad_rows,
                     heads=64, topk=128)
    cpu_out, cpu_lse = _kernel.sparse_mla_forward(*vllm_tensors(case), scale=case.scale)
    out, lse = _kernel.sparse_mla_forward(*vllm_tensors(case, "cuda", pair=rope), scale=case.scale)
    torch.cuda.synchronize()
    # The CUDA kernels compute in the cache's 16-bit type, bf16 for fp8 rows: f16 queries are rounded to it first
    # (docs/ops.md, "The CUDA backend"), so the float64 reference starts from those rounded queries.
    computed = case
    if q_dtype == "float16" and kind != "float16":
        computed = dataclasses.replace(case, q=case.q.astype(ml_dtypes.bfloat16))
    assert_matches_reference(computed, out, lse)
    torch.testing.assert_close(out.cpu().float(), cpu_out.float(), atol=2e-2, rtol=2.01 / 128)
    if computed is case:  # the CPU backend keeps f16 queries exact: its lse is the unrounded queries'
        torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-4, rtol=1e-4)


@cuda
def test_kernel_entry_is_captured_by_a_cuda_graph(rng):
    """Warm up eagerly on one stream, capture on torch.cuda.graph's side stream, replay after new inputs are copied
    in: bit for bit the eager result, and not the first inputs' result."""
    first = make_case(rng, kind="fp8_ds_mla", heads=64, topk=128)
    second = make_case(rng, kind="fp8_ds_mla", heads=64, topk=128)
    q, kv_cache, indices, counts = vllm_tensors(first, "cuda", pair=True)
    _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=first.scale)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=first.scale)
    g.replay()
    first_out = out.clone()
    q2, kv2, indices2, counts2 = vllm_tensors(second, "cuda", pair=True)
    for dst, src in ((q[0], q2[0]), (q[1], q2[1]), (kv_cache, kv2), (indices, indices2), (counts, counts2)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = _kernel.sparse_mla_forward(q2, kv2, indices2, counts2, scale=second.scale)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert not torch.equal(out, first_out)
    assert_matches_reference(second, out, lse)


@cuda
def test_kernel_entry_into_the_engines_buffers_is_captured_by_a_cuda_graph(rng):
    """As above, into preallocated out and lse (sparse_mla.out): the replay writes the engine's own buffers."""
    first = make_case(rng, kind="bfloat16", heads=64, topk=128)
    second = make_case(rng, kind="bfloat16", heads=64, topk=128)
    q, kv_cache, indices, counts = vllm_tensors(first, "cuda")
    out = torch.full((q.shape[0], 64, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((q.shape[0], 64), float("nan"), device="cuda")
    _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=first.scale, out=out, lse=lse)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _kernel.sparse_mla_forward(q, kv_cache, indices, counts, scale=first.scale, out=out, lse=lse)
    first_out = out.clone()
    q2, kv2, indices2, counts2 = vllm_tensors(second, "cuda")
    for dst, src in ((q, q2), (kv_cache, kv2), (indices, indices2), (counts, counts2)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = _kernel.sparse_mla_forward(q2, kv2, indices2, counts2, scale=second.scale)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert not torch.equal(out, first_out)


# --- the indexer body (smla.vllm.indexer.run) on vLLM's metadata fields, no vLLM needed -----------------------------

from types import SimpleNamespace  # noqa: E402

from smla.vllm import indexer  # noqa: E402

INDEX_HEADS, INDEX_BLOCK, INDEX_TOPK = 32, 64, 2048


def indexer_case(rng, device, decodes=(3000, 70, 2500), prefills=((2300, 5), (40, 3))):
    """vLLM's DeepseekV32IndexerMetadata fields (decode: per-request seq_lens and block-table rows; prefill: one
    chunk, per-token key ranges [ks, ke) over its requests laid end to end), the fp8 index cache with every
    context key written but the new tokens', fp8 queries and float32 weights."""
    requests = [(ctx, 1) for ctx in decodes] + list(prefills)
    blocks = [-(-ctx // INDEX_BLOCK) for ctx, _ in requests]
    order = rng.permutation(sum(blocks) + 1)
    table = np.full((len(requests), max(blocks)), -1, np.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[start:start + n]
        start += n
    cache = torch.full((len(order), INDEX_BLOCK, 132), 0x7F, dtype=torch.uint8)
    new_keys, new_slots = [], []
    for r, (ctx, new) in enumerate(requests):
        slots = torch.from_numpy((table[r, np.arange(ctx) // INDEX_BLOCK] * INDEX_BLOCK
                                  + np.arange(ctx) % INDEX_BLOCK).astype(np.int64))
        keys = torch.randn(ctx, 128, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
        smla.write_index_cache(keys[:ctx - new], slots[:ctx - new], cache)
        new_keys.append(keys[ctx - new:])
        new_slots.append(slots[ctx - new:])
    tokens = sum(new for _, new in requests)
    q = (torch.from_numpy(rng.standard_normal((tokens, INDEX_HEADS, 128)).astype(np.float32)) * 4
         ).to(torch.float8_e4m3fn)
    weights = torch.from_numpy(rng.standard_normal((tokens, INDEX_HEADS)).astype(np.float32))
    nd = len(decodes)
    cu = np.concatenate([[0], np.cumsum([ctx for ctx, _ in prefills])]).astype(np.int32)
    ks = [cu[i] for i, (ctx, new) in enumerate(prefills) for _ in range(new)]
    ke = [cu[i] + ctx - new + j + 1 for i, (ctx, new) in enumerate(prefills) for j in range(new)]

    def t(x):
        return torch.as_tensor(np.asarray(x)).to(device)

    meta = SimpleNamespace(
        slot_mapping=torch.cat(new_slots).to(device), num_decodes=nd, num_prefills=len(prefills),
        decode=SimpleNamespace(block_table=t(table[:nd]), seq_lens=t(np.int32(decodes)), requires_padding=False),
        prefill=SimpleNamespace(chunks=[SimpleNamespace(
            block_table=t(table[nd:]), cu_seqlen_ks=t(np.int32(ks)), cu_seqlen_ke=t(np.int32(ke)),
            cu_seq_lens=t(cu), token_start=nd, token_end=tokens)]))
    return meta, cache.to(device), q.to(device), torch.cat(new_keys).to(device), weights.to(device)


def run_indexer(meta, cache, q, k, weights):
    buffer = torch.full((q.shape[0], INDEX_TOPK), 7, dtype=torch.int32, device=q.device)
    return indexer.run(meta, cache, q, k, weights, buffer, INDEX_TOPK, num_rows=q.shape[0])


@cuda
def test_indexer_body_on_the_gpu_matches_the_cpu_backend():
    cpu = run_indexer(*indexer_case(np.random.default_rng(7), "cpu"))
    gpu = run_indexer(*indexer_case(np.random.default_rng(7), "cuda")).cpu()
    # min(top-k, causal context) positions a token, then -1: decodes of 3000, 70, 2500; prefills of 2300 (5 new)
    # and 40 (3 new)
    assert (cpu >= 0).sum(dim=1).tolist() == [2048, 70, 2048] + [2048] * 5 + [38, 39, 40]
    assert torch.equal(gpu, cpu)  # unsorted top-k: ascending positions, then -1, on both backends


@cuda
def test_indexer_decode_is_captured_by_a_cuda_graph():
    meta, cache, q, k, weights = indexer_case(np.random.default_rng(8), "cuda", prefills=())
    meta.num_prefills = 0
    buffer = torch.full((q.shape[0], INDEX_TOPK), 7, dtype=torch.int32, device="cuda")
    indexer.run(meta, cache, q, k, weights, buffer, INDEX_TOPK, num_rows=q.shape[0], write_keys=False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        indexer.run(meta, cache, q, k, weights, buffer, INDEX_TOPK, num_rows=q.shape[0], write_keys=False)
    first = buffer.clone()
    q.copy_((torch.randn(q.shape, device="cuda") * 4).to(torch.float8_e4m3fn))
    g.replay()
    torch.cuda.synchronize()
    eager = indexer.run(meta, cache, q, k, weights, buffer.clone(), INDEX_TOPK, num_rows=q.shape[0],
                        write_keys=False)
    assert torch.equal(buffer, eager) and not torch.equal(buffer, first)
