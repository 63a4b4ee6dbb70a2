"""Inside a serving engine (issue 17): every torch op and every smla.flash_mla function captured with
torch.cuda.graph after an eager warm-up on another stream, and compiled with torch.compile(mode="reduce-overhead",
fullgraph=True). Each is run again after new inputs are copied into the captured (static) tensors: equal bit for
bit to an eager call on those inputs, different from the first inputs' result; torch's generator still works
afterwards. The workspaces come from torch's caching allocator. Skipped without torch, a GPU or a CUDA build."""

from __future__ import annotations

import pytest

import smla

torch = pytest.importorskip("torch")
from smla import torch_ops  # noqa: E402  (needs torch)
from smla.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()), reason="needs a CUDA GPU and a CUDA build"),
    pytest.mark.skipif(not torch_ops.available(), reason="torch < 2.4 has no torch.library.custom_op"),
]

BLOCKS, BLOCK_SIZE, HEADS, INDEX_HEADS, TOPK = 32, 64, 16, 32, 1024
KPOOL = 4  # GLM-5.3-Flash's pooled indexer
SLOTS = BLOCKS * BLOCK_SIZE


def bf16(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)


def slots(gen, *shape):
    return torch.randint(-1, SLOTS, shape, generator=gen, device="cuda", dtype=torch.int32)


def nan(*shape):
    *shape, dtype = shape
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def table(gen):
    return torch.randperm(BLOCKS, generator=gen, device="cuda").to(torch.int32)[None, :]


# Each case: (function of tensors returning tensors, a function making one set of its inputs from a generator).
# Inputs that must stay the same between the two sets (caches' shapes, tables) are drawn from the same seed.
def cases():
    kv_cache = lambda g: bf16(g, BLOCKS, BLOCK_SIZE, 576)  # noqa: E731
    index_cache = lambda g: bf16(g, BLOCKS, BLOCK_SIZE, 128)  # noqa: E731
    fixed = torch.Generator(device="cuda").manual_seed(7)
    tbl = table(fixed)
    write_slots = torch.randperm(SLOTS, generator=fixed, device="cuda")[:8]
    pool_slots = torch.randperm(SLOTS // KPOOL, generator=fixed, device="cuda")[:8]
    ape = torch.randn(KPOOL, 128, generator=fixed, device="cuda")
    ops = torch.ops.smla
    sched = {}

    def with_kvcache_dense(q, cache, seq_lens):
        meta = sched.setdefault("dense", get_mla_metadata()[0])
        return flash_mla_with_kvcache(q, cache[:, :, None, :], tbl, seq_lens, 512, meta, softmax_scale=0.07,
                                      causal=True)

    def with_kvcache_sparse(q, cache, indices, topk_length):
        meta = sched.setdefault("sparse", get_mla_metadata()[0])
        return flash_mla_with_kvcache(q, cache[:, :, None, :], None, None, 512, meta, softmax_scale=0.07,
                                      indices=indices, topk_length=topk_length)

    return {
        "write_mla_cache": (
            lambda lat, pe, cache: (ops.write_mla_cache(lat, pe, write_slots, cache), cache)[1:],
            lambda g: [bf16(g, 8, 512), bf16(g, 8, 64), kv_cache(g)]),
        "sparse_mla": (
            lambda q, cache, idx: ops.sparse_mla(q, cache, idx, None, None, 0.07),
            lambda g: [bf16(g, 1, HEADS, 576), kv_cache(g), slots(g, 1, TOPK)]),
        "sparse_mla.out": (  # the caller's buffers (an engine's), NaN before the first call
            lambda q, cache, idx, out, lse: (ops.sparse_mla.out(q, cache, idx, None, None, 0.07, out=out, lse=lse),
                                             out, lse)[1:],
            lambda g: [bf16(g, 1, HEADS, 576), kv_cache(g), slots(g, 1, TOPK), nan(1, HEADS, 512, torch.bfloat16),
                       nan(1, HEADS, torch.float32)]),
        "paged_mla_decode.out": (
            lambda q, cache, lens, out, lse: (ops.paged_mla_decode.out(q, cache, tbl, lens, None, 0.07, out=out,
                                                                       lse=lse), out, lse)[1:],
            lambda g: [bf16(g, 1, 1, HEADS, 576), kv_cache(g),
                       torch.randint(1200, 2000, (1,), generator=g, device="cuda", dtype=torch.int32),
                       nan(1, 1, HEADS, 512, torch.bfloat16), nan(1, 1, HEADS, torch.float32)]),
        "paged_mla_decode": (
            lambda q, cache, lens: ops.paged_mla_decode(q, cache, tbl, lens, None, 0.07),
            lambda g: [bf16(g, 1, 1, HEADS, 576), kv_cache(g),
                       torch.randint(1200, 2000, (1,), generator=g, device="cuda", dtype=torch.int32)]),
        "write_index_cache": (
            lambda k, cache: (ops.write_index_cache(k, write_slots, cache), cache)[1:],
            lambda g: [bf16(g, 8, 128), index_cache(g)]),
        "indexer_topk": (
            lambda q, w, cache, lens: (ops.indexer_topk(q, None, w, cache, torch.zeros_like(lens), tbl, lens, TOPK),),
            lambda g: [bf16(g, 1, INDEX_HEADS, 128), torch.rand(1, INDEX_HEADS, generator=g, device="cuda"),
                       index_cache(g), torch.randint(1500, 2000, (1,), generator=g, device="cuda", dtype=torch.int32)]),
        "positions_to_slots": (
            lambda pos: (ops.positions_to_slots(pos, torch.zeros(1, dtype=torch.int32, device="cuda"), tbl,
                                                BLOCK_SIZE),),
            lambda g: [torch.randint(0, SLOTS, (1, TOPK), generator=g, device="cuda", dtype=torch.int32)]),
        "write_pooled_index_cache": (
            lambda k, gate, cache: (ops.write_pooled_index_cache(k, gate, ape, pool_slots, cache), cache)[1:],
            lambda g: [bf16(g, 8, KPOOL, 128), bf16(g, 8, KPOOL, 128), bf16(g, BLOCKS, BLOCK_SIZE // KPOOL, 128)]),
        "pools_to_positions": (
            lambda pools, lens: (ops.pools_to_positions(pools, lens, KPOOL),),
            lambda g: [torch.randint(-1, SLOTS // KPOOL, (2, TOPK // KPOOL), generator=g, device="cuda",
                                     dtype=torch.int32),
                       torch.randint(0, SLOTS, (2,), generator=g, device="cuda", dtype=torch.int32)]),
        "rotate_index_q": (
            lambda q: ops.rotate_index_q(q, True),
            lambda g: [bf16(g, 2, INDEX_HEADS, 128)]),
        "dsa_decode_step": (
            lambda q, cache, iq, w, icache, lens: ops.dsa_decode_step(
                q, cache, iq, w, icache, torch.zeros_like(lens), tbl, lens, None, None, TOPK, 0.07),
            lambda g: [bf16(g, 1, HEADS, 576), kv_cache(g), bf16(g, 1, INDEX_HEADS, 128),
                       torch.rand(1, INDEX_HEADS, generator=g, device="cuda"), index_cache(g),
                       torch.randint(1500, 2000, (1,), generator=g, device="cuda", dtype=torch.int32)]),
        "flash_mla_with_kvcache (dense)": (
            with_kvcache_dense,
            lambda g: [bf16(g, 1, 1, HEADS, 576), kv_cache(g),
                       torch.randint(1200, 2000, (1,), generator=g, device="cuda", dtype=torch.int32)]),
        "flash_mla_with_kvcache (sparse, s_q 2)": (
            with_kvcache_sparse,
            lambda g: [bf16(g, 1, 2, HEADS, 576), kv_cache(g), slots(g, 1, 2, TOPK),
                       torch.randint(0, TOPK + 1, (1,), generator=g, device="cuda", dtype=torch.int32)]),
        "flash_mla_sparse_fwd": (
            lambda q, kv, idx: flash_mla_sparse_fwd(q, kv[:, None, :], idx, 0.07),
            lambda g: [bf16(g, 2, HEADS, 576), kv_cache(g).reshape(SLOTS, 576), slots(g, 2, 1, TOPK)]),
    }


CASES = ["write_mla_cache", "sparse_mla", "sparse_mla.out", "paged_mla_decode", "paged_mla_decode.out",
         "write_index_cache", "indexer_topk", "positions_to_slots", "write_pooled_index_cache", "pools_to_positions", "rotate_index_q", "dsa_decode_step",
         "flash_mla_with_kvcache (dense)",
         "flash_mla_with_kvcache (sparse, s_q 2)", "flash_mla_sparse_fwd"]


def inputs(name, seed):
    fn, make = cases()[name]
    return fn, make(torch.Generator(device="cuda").manual_seed(seed))


def bits(tensors):
    return [t.detach().contiguous().view(torch.uint8).clone() for t in tensors if t is not None]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def eager(fn, args):
    return bits(fn(*[x.clone() for x in args]))


@pytest.mark.parametrize("name", CASES)
def test_cuda_graph_after_warm_up_on_another_stream(name):
    fn, first = inputs(name, 1)
    _, second = inputs(name, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual engine warm-up: eager, on a stream other than the capture's
        first_result = eager(fn, first)
    torch.cuda.current_stream().wait_stream(side)

    static = [x.clone() for x in first]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # torch's own capture stream, never used by smla before
        outs = fn(*static)
    for s, x in zip(static, second):
        s.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = bits(outs)
    assert same(replayed, eager(fn, second)), "the replay differs from an eager call on the same inputs"
    assert not same(replayed, first_result), "the replay did not read the new inputs"
    assert torch.isfinite(torch.randn(16, device="cuda")).all()  # torch's generator still works


@pytest.mark.parametrize("name", CASES)
def test_torch_compile_reduce_overhead(name):
    fn, first = inputs(name, 3)
    _, second = inputs(name, 4)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    static = [x.clone() for x in first]
    for _ in range(3):  # compile, warm up, record the graph
        first_result = bits(compiled(*static))
        for s, x in zip(static, first):
            s.copy_(x)
    for s, x in zip(static, second):
        s.copy_(x)
    result = bits(compiled(*static))
    torch.cuda.synchronize()
    assert same(result, eager(fn, second))
    assert not same(result, first_result)
    assert torch.isfinite(torch.randn(16, device="cuda")).all()
