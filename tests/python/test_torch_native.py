"""smla._torch_ops, the C++ kernels of torch.ops.smla (python/src/torch_ops.cpp), on the CPU: active when built,
bit for bit the results of the Python kernels they replace (smla.torch_ops._sparse_mla, ...), the same errors
with the same messages, and traceable through the fakes. Skipped without torch; the comparisons are skipped
when the package was built without the extension (SMLA_REQUIRE_TORCH_OPS=1 makes that a failure, as in CI)."""

from __future__ import annotations

import os

import pytest

import smla

torch = pytest.importorskip("torch")
from smla import torch_ops  # noqa: E402  (needs torch)

LIBRARY = os.path.join(os.path.dirname(torch_ops.__file__), "_torch_ops.so")
native = pytest.mark.skipif(not torch_ops.native(), reason="smla was built without smla._torch_ops")
QK, V = 576, 512


def test_the_built_extension_is_active():
    if os.environ.get("SMLA_REQUIRE_TORCH_OPS") == "1":
        assert os.path.exists(LIBRARY), f"{LIBRARY} was not built"
    if os.environ.get("SMLA_TORCH_OPS") == "python":
        assert not torch_ops.native()
    else:
        assert torch_ops.native() == os.path.exists(LIBRARY)
    # smla's functions translate torch.ops.smla's errors only when the C++ kernels run (the Python kernels' errors
    # are smla's own).
    assert torch_ops.routed()._translate == torch_ops.native()


def same_bits(a, b) -> bool:
    """Equal bit for bit (NaN included), with the same shape, dtype and device."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    a, b = a.contiguous(), b.contiguous()
    return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def sparse_indices(g, slots, shape, num_slots):
    """Indices into the written `slots`, with skipped ones: -1, -2^31 and num_slots."""
    idx = slots[torch.randint(0, len(slots), shape, generator=g)].to(torch.int32)
    invalid = torch.tensor([-1, -(2**31), num_slots], dtype=torch.int32)
    mask = torch.rand(shape, generator=g) < 0.2
    idx[mask] = invalid[torch.randint(0, 3, (int(mask.sum()),), generator=g)]
    return idx


def assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert same_bits(g, w), (g, w)


def gen(seed=5):
    return torch.Generator().manual_seed(seed)


def mla_caches(g, blocks=8, block_size=16, written=0.5):
    """A bf16 cache, an fp8_ds_mla one (656-byte rows) and an fp8_ds_mla_nope one (528) of the same random tokens
    in a `written` share of the slots (returned), by the Python kernel; the other slots hold NaN (0x7F bytes in
    fp8)."""
    n = blocks * block_size
    latent, k_pe = torch.randn(n, V, generator=g), torch.randn(n, 64, generator=g)
    slots = torch.randperm(n, generator=g)[: int(n * written)]
    bf16 = torch.full((blocks, block_size, QK), float("nan"), dtype=torch.bfloat16)
    fp8 = torch.full((blocks, block_size, 656), 0x7F, dtype=torch.uint8)
    nope = torch.full((blocks, block_size, 528), 0x7F, dtype=torch.uint8)
    torch_ops._write_mla_cache(latent[slots], k_pe[slots], slots, bf16)
    torch_ops._write_mla_cache(latent[slots], k_pe[slots], slots, fp8)
    torch_ops._write_mla_cache(latent[slots], torch.empty(len(slots), 0), slots, nope)
    return bf16, fp8, nope, slots


@native
def test_cache_writes_match_the_python_kernels():
    g = gen()
    n = 40
    latent, k_pe = torch.randn(n, V, generator=g), torch.randn(n, 64, generator=g)
    slot_mapping = torch.randperm(128, generator=g)[:n]
    slot_mapping[3] = -1  # skipped
    for width, dtype, kv_cache_dtype in ((QK, torch.bfloat16, "auto"), (656, torch.uint8, "auto"),
                                         (656, torch.float8_e4m3fn, "fp8"), (528, torch.uint8, "fp8_ds_mla_nope")):
        pe = torch.empty(n, 0) if width == 528 else k_pe
        start = torch.randint(0, 255, (8, 16, width), generator=g, dtype=torch.uint8)
        if dtype == torch.bfloat16:
            start = torch.randn(8, 16, width, generator=g).to(dtype)
        start = start.view(dtype)
        got, want = start.clone(), start.clone()
        torch.ops.smla.write_mla_cache(latent, pe, slot_mapping, got, kv_cache_dtype)
        torch_ops._write_mla_cache(latent, pe, slot_mapping, want, kv_cache_dtype)
        assert same_bits(got, want) and not same_bits(got, start), (width, dtype)

    keys = torch.randn(n, 128, generator=g)
    for cache in (torch.zeros(8, 16, 128, dtype=torch.bfloat16), torch.zeros(8, 16, 132, dtype=torch.uint8)):
        got, want = cache.clone(), cache.clone()
        torch.ops.smla.write_index_cache(keys, slot_mapping, got)
        torch_ops._write_index_cache(keys, slot_mapping, want)
        assert same_bits(got, want) and not same_bits(got, cache)


@native
def test_attention_ops_match_the_python_kernels():
    g = gen()
    bf16, fp8, nope, slots = mla_caches(g)
    tokens, heads, topk = 4, 16, 64
    q = torch.randn(tokens, heads, QK, generator=g).to(torch.bfloat16)
    indices = sparse_indices(g, slots, (tokens, topk), 128)
    lengths = torch.tensor([64, 10, 0, 33], dtype=torch.int32)
    sink = torch.randn(heads, generator=g)
    cases = [(q, bf16, "auto"), (q, fp8, "auto"), (q, fp8.view(torch.float8_e4m3fn), "auto"), (q, fp8, "FP8"),
             (q[..., :V], nope, "auto"), (q[..., :V], fp8, "fp8_ds_mla"), (q.half(), bf16.half(), "float16")]
    for qq, cache, kv_cache_dtype in cases:
        for extra in ((None, None), (lengths, sink)):
            args = (qq, cache, indices, *extra, 0.07, kv_cache_dtype)
            got = torch.ops.smla.sparse_mla(*args)
            assert_same(got, torch_ops._sparse_mla(*args))
            assert torch.isfinite(got[0].float()).all() and not same_bits(got[1], torch.zeros_like(got[1]))

    table = torch.randperm(8, generator=g, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([37, 64], dtype=torch.int32)
    clean, fp8_clean, _, _ = mla_caches(g, written=1.0)  # every position may be read: no NaN
    q4 = torch.randn(2, 3, heads, QK, generator=g).to(torch.bfloat16)
    for causal in (True, False):
        for cache in (clean, fp8_clean):
            args = (q4, cache, table, seq_lens, sink, 0.05, causal)
            assert_same(torch.ops.smla.paged_mla_decode(*args), torch_ops._paged_mla_decode(*args))


@native
def test_flash_mla_ops_match_the_python_kernels():
    g = gen()
    _, fp8, _, slots = mla_caches(g)
    b, s_q, heads, topk = 2, 2, 16, 64
    q = torch.randn(b, s_q, heads, QK, generator=g).to(torch.bfloat16)
    indices = sparse_indices(g, slots, (b, s_q, topk), 128)
    for lengths in (None, torch.tensor([64, 5], dtype=torch.int32), torch.tensor([[1, 0], [64, 9]], dtype=torch.int32)):
        for cache in (fp8, fp8.unsqueeze(2)):  # smla's 3-D cache and FlashMLA's 4-D one
            args = (q, cache, None, None, indices, lengths, None, 0.05, False, "fp8_ds_mla")
            assert_same(torch.ops.smla.flash_mla_with_kvcache(*args), torch_ops._flash_mla_with_kvcache(*args))
    table = torch.randperm(8, generator=g, dtype=torch.int32).view(2, 4)
    clean = torch.randn(8, 16, QK, generator=g).to(torch.bfloat16)  # every position may be read: no NaN
    args = (q, clean, table, torch.tensor([20, 64], dtype=torch.int32), None, None, None, 0.05, True, "auto")
    assert_same(torch.ops.smla.flash_mla_with_kvcache(*args), torch_ops._flash_mla_with_kvcache(*args))

    kv = torch.randn(100, 1, QK, generator=g).to(torch.bfloat16)
    q3 = torch.randn(5, heads, QK, generator=g).to(torch.bfloat16)
    fwd_indices = sparse_indices(g, torch.arange(100), (5, 1, 32), 100)
    args = (q3, kv, fwd_indices, torch.tensor([32, 0, 7, 32, 1], dtype=torch.int32), torch.randn(heads), 0.06)
    assert_same(torch.ops.smla.flash_mla_sparse_fwd(*args), torch_ops._flash_mla_sparse_fwd(*args))


def model1_inputs(g, b=3, s_q=2, heads=16):
    """DeepSeek-V4 (MODEL1): q (b, s_q, heads, 512) and two 512-wide bf16 caches, FlashMLA's 4-D ones (blocks of 16
    and of 5), with indices (some skipped) into each."""
    q = torch.randn(b, s_q, heads, V, generator=g).to(torch.bfloat16)
    cache = torch.randn(4, 16, 1, V, generator=g).to(torch.bfloat16)
    extra = torch.randn(6, 5, 1, V, generator=g).to(torch.bfloat16)
    indices = sparse_indices(g, torch.arange(64), (b, s_q, 32), 64)
    extra_indices = sparse_indices(g, torch.arange(30), (b, s_q, 24), 30)
    return q, cache, indices, extra, extra_indices


@native
def test_model1_ops_match_the_python_kernels():
    """The extra cache through sparse_mla and flash_mla_with_kvcache (per-request and per-token lengths, a sink):
    the C++ kernels give the Python kernels' bits."""
    g = gen()
    q, cache, indices, extra, extra_indices = model1_inputs(g)
    sink = torch.randn(16, generator=g)
    lengths = [(None, None), (torch.tensor([32, 0, 9], dtype=torch.int32), torch.tensor([3, 24, 0], dtype=torch.int32)),
               (torch.randint(0, 33, (3, 2), generator=g, dtype=torch.int32),
                torch.randint(0, 25, (3, 2), generator=g, dtype=torch.int32))]
    for topk_length, extra_topk_length in lengths:
        for k_cache, extra_cache in ((cache, extra), (cache[:, :, 0], extra[:, :, 0])):  # FlashMLA's 4-D and 3-D
            args = (q, k_cache, None, None, indices, topk_length, sink, 0.05, False, "auto", "", extra_cache,
                    extra_indices, extra_topk_length)
            assert_same(torch.ops.smla.flash_mla_with_kvcache(*args), torch_ops._flash_mla_with_kvcache(*args))
        if topk_length is None or topk_length.dim() == 1:
            args = (q[:, 0], cache[:, :, 0], indices[:, 0], topk_length, sink, 0.05, "auto", "", extra[:, :, 0],
                    extra_indices[:, 0], extra_topk_length)
            assert_same(torch.ops.smla.sparse_mla(*args), torch_ops._sparse_mla(*args))


def indexer_inputs(g, cache_dtype):
    tokens, heads, blocks, block_size = 3, 8, 6, 16
    cache = torch.zeros(blocks, block_size, 128 if cache_dtype == torch.bfloat16 else 132, dtype=cache_dtype)
    torch_ops._write_index_cache(torch.randn(blocks * block_size, 128, generator=g),
                                 torch.arange(blocks * block_size), cache)
    q = torch.randn(tokens, heads, 128, generator=g).to(torch.bfloat16)
    return (q, None, torch.randn(tokens, heads, generator=g), cache, torch.tensor([0, 1, 1], dtype=torch.int32),
            torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32), torch.tensor([40, 7, 48], dtype=torch.int32))


@native
def test_indexer_and_decode_step_match_the_python_kernels():
    g = gen()
    for cache_dtype in (torch.bfloat16, torch.uint8):
        args = (*indexer_inputs(g, cache_dtype), 16)
        positions = torch.ops.smla.indexer_topk(*args)
        assert_same(positions, torch_ops._indexer_topk(*args))
        unsorted = torch.ops.smla.indexer_topk(*args, sorted=False)
        assert_same(unsorted, torch_ops._indexer_topk(*args, sorted=False))
        assert not torch.equal(unsorted, positions)  # 16 of 40 and 48 positions: best first is not position order
        slot_args = (positions, args[4], args[5], 16)
        assert_same(torch.ops.smla.positions_to_slots(*slot_args), torch_ops._positions_to_slots(*slot_args))

    (iq, _, weights, index_cache, request_ids, table, context_lens) = indexer_inputs(g, torch.uint8)
    _, fp8, _, _ = mla_caches(g, blocks=6, written=1.0)
    q = torch.randn(3, 16, QK, generator=g).to(torch.bfloat16)
    args = (q, fp8, iq, weights, index_cache, request_ids, table, context_lens, None, torch.randn(16), 16, 0.05)
    assert_same(torch.ops.smla.dsa_decode_step(*args), torch_ops._dsa_decode_step(*args))
    assert_same(torch.ops.smla.dsa_decode_step(*args, sorted=False), torch_ops._dsa_decode_step(*args, sorted=False))


def error_of(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the type is what is compared)
        return type(e), str(e)
    pytest.fail("no error raised")


@native
def test_errors_are_smlas_with_the_python_kernels_messages():
    """smla's functions raise the same class with the same message as the Python kernels; torch.ops.smla itself
    raises ValueError / NotImplementedError with that message."""
    g = gen()
    bf16, fp8, _, _ = mla_caches(g)
    q = torch.randn(2, 16, QK, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 128, (2, 64), generator=g, dtype=torch.int32)
    routed = torch_ops.routed()
    cases = [
        ("sparse_mla", (q, bf16, idx.long(), None, None, 0.05)),           # checks: indices dtype
        ("sparse_mla", (q, bf16, idx, None, None, 0.05, "int4")),          # kv_cache_dtype name
        ("sparse_mla", (q, bf16, idx, None, None, 1e300)),                 # scale float32 cannot hold
        ("sparse_mla", (q, bf16, idx, None, None, -0.0)),
        ("sparse_mla", (q.double(), bf16, idx, None, None, 0.05)),         # no smla dtype
        ("sparse_mla", (q, fp8, idx, None, None, 0.05, "bfloat16")),       # bytes are not bfloat16
        ("sparse_mla", (q, bf16, idx, None, None, 0.05, "auto", "nope")),  # unknown backend
        ("paged_mla_decode", (q[:, None], bf16, idx[:, :4], torch.tensor([3, 4]), None, 0.05)),
        ("indexer_topk", (*indexer_inputs(g, torch.uint8), -1)),
        ("indexer_topk", (*indexer_inputs(g, torch.uint8), 2**31)),
        ("indexer_topk", (*indexer_inputs(g, torch.uint8), 16, "int4")),
        ("positions_to_slots", (idx, torch.tensor([0, 0], dtype=torch.int32), idx[:, :4], 0)),
        ("write_index_cache", (torch.randn(3, 64), torch.arange(3), torch.zeros(2, 16, 128, dtype=torch.bfloat16))),
        ("sparse_mla", (q, bf16, idx, None, None, 0.05, "auto", "cuda_mma")),  # a GPU backend for CPU tensors
        ("flash_mla_with_kvcache", (q[:, None], bf16[:, :, None].expand(-1, -1, 2, -1), None, None, idx[:, None],
                                    None, None, 0.05, False, "auto")),  # two heads in the cache
        ("flash_mla_with_kvcache", (q, bf16, None, None, idx[:, None], None, None, 0.05, False)),  # 3-D q
    ]
    # MODEL1's extra cache, as smla.flash_mla._extra_cache and the core check it.
    q1, cache1, idx1, extra1, extra_idx1 = model1_inputs(g)
    q1_args = (q1, cache1, None, None, idx1, None, None, 0.05, False, "auto", "")
    cases += [
        ("flash_mla_with_kvcache", (*q1_args, extra1, None, None)),               # no extra indices
        ("flash_mla_with_kvcache", (*q1_args, None, extra_idx1, None)),           # no extra cache
        ("flash_mla_with_kvcache", (*q1_args[:4], None, *q1_args[5:], extra1, extra_idx1, None)),  # dense
        ("flash_mla_with_kvcache", (*q1_args, extra1, extra_idx1[:, :1], None)),  # s_q 1, q's is 2
        ("flash_mla_with_kvcache", (*q1_args[:4], idx1[:, :1], *q1_args[5:])),  # the main indices' s_q too
        ("flash_mla_sparse_fwd", (q, bf16.reshape(-1, 2, QK), idx[:, None], None, None, 0.05)),  # kv's h_kv 2
        ("flash_mla_sparse_fwd", (q, bf16.reshape(-1, 1, QK), idx[:, None].expand(-1, 2, -1), None, None, 0.05)),
        ("flash_mla_sparse_fwd", (q, bf16.reshape(-1, 1, QK), idx.new_empty((2, 0, 64)), None, None, 0.05)),
        ("flash_mla_with_kvcache", (*q1_args[:5], torch.full((3, 1), 8, dtype=torch.int32), *q1_args[6:])),  # (b, 1)
        ("flash_mla_with_kvcache", (*q1_args, extra1, extra_idx1, torch.zeros(2, dtype=torch.int32))),
        ("flash_mla_with_kvcache", (*q1_args, extra1.expand(-1, -1, 2, -1), extra_idx1, None)),  # two heads
        ("flash_mla_with_kvcache", (*q1_args, extra1, extra_idx1.long(), None)),  # int64 extra indices
        ("flash_mla_with_kvcache", (*q1_args, extra1[..., :448], extra_idx1, None)),  # rows of 448
        ("sparse_mla", (q1[:, 0], cache1[:, :, 0], idx1[:, 0], None, None, 0.05, "auto", "", None,
                        extra_idx1[:, 0], None)),  # extra indices without the extra cache
    ]
    kinds = set()
    for name, args in cases:
        kind, message = error_of(lambda: getattr(torch_ops, "_" + name)(*args))
        assert issubclass(kind, smla.Error), (name, kind, message)
        assert error_of(lambda: getattr(routed, name)(*args)) == (kind, message), name
        raw_kind, raw_message = error_of(lambda: getattr(torch.ops.smla, name)(*args))
        assert raw_message == message
        assert issubclass(raw_kind, ValueError if kind is smla.InvalidArgumentError else NotImplementedError)
        kinds.add(kind)
    assert kinds == {smla.InvalidArgumentError, smla.UnsupportedError}
    # Through smla's public function as a user calls it.
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: indices"):
        smla.sparse_mla(q, bf16, idx.long(), softmax_scale=0.05)


@native
def test_fakes_still_trace_the_native_ops():
    g = gen()
    bf16, _, _, _ = mla_caches(g)
    q = torch.randn(2, 16, QK, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 128, (2, 64), generator=g, dtype=torch.int32)

    def step(q, cache, idx):
        out, lse = torch.ops.smla.sparse_mla(q * 2, cache, idx, None, None, 0.05)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert_same(compiled(q, bf16, idx), step(q, bf16, idx))
    torch.library.opcheck(torch.ops.smla.sparse_mla.default, (q, bf16.nan_to_num(), idx, None, None, 0.05))


cuda = pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()), reason="needs a CUDA GPU and build")


@native
@cuda
def test_cuda_kernels_match_the_python_kernels_on_a_side_stream_and_in_a_graph():
    """On a GPU: the C++ kernels give the Python kernels' bits, on torch's current stream (a side stream here), and
    replay in a CUDA graph on new inputs (outputs and scratch from torch's allocator, no host sync)."""
    g = gen()
    bf16, fp8, _, slots = mla_caches(g)
    q = torch.randn(3, 16, QK, generator=g).to(torch.bfloat16)
    idx = sparse_indices(g, slots, (3, 2048), 128)  # enough keys to split: the op needs scratch
    table = torch.randperm(8, generator=g, dtype=torch.int32).view(2, 4)
    full, _, _, _ = mla_caches(g, written=1.0)
    q4 = torch.randn(2, 1, 16, QK, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([40, 64], dtype=torch.int32)  # at most the 4 blocks of 16 a request has
    dsa = (*indexer_inputs(g, torch.uint8), 16)
    # flash_mla_with_kvcache slices each new token out of q, indices, lengths, out and lse as views made in C++:
    # two new tokens with per-token lengths over FlashMLA's 4-D cache, and the dense path through the 4-D cache.
    q42 = torch.randn(2, 2, 16, QK, generator=g).to(torch.bfloat16)
    idx2 = sparse_indices(g, slots, (2, 2, 2048), 128)
    lengths2 = torch.tensor([[2048, 5], [0, 700]], dtype=torch.int32)
    to = lambda xs: tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in xs)  # noqa: E731
    calls = [("sparse_mla", to((q, fp8, idx, None, None, 0.05))),
             ("sparse_mla", to((q, bf16, idx, torch.tensor([2048, 7, 0], dtype=torch.int32), torch.randn(16), 0.05))),
             ("paged_mla_decode", to((q4, full, table, seq_lens, None, 0.05, True))),
             ("indexer_topk", to(dsa)),
             ("flash_mla_with_kvcache", to((q4, fp8, None, None, idx[:2, None], None, None, 0.05, False, "auto"))),
             ("flash_mla_with_kvcache", to((q42, bf16[:, :, None], None, None, idx2, lengths2, torch.randn(16), 0.05,
                                            False, "auto"))),
             ("flash_mla_with_kvcache", to((q42, full[:, :, None], table, seq_lens, None, None, None, 0.05, True,
                                            "auto"))),
             ("flash_mla_sparse_fwd", to((q, full.view(-1, 1, QK), idx[:, None], None, None, 0.05)))]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for name, args in calls:
            got = getattr(torch.ops.smla, name)(*args)
            want = getattr(torch_ops, "_" + name)(*args)
            side.synchronize()
            assert_same(got, want)

        name, args = calls[1]
        q_in = args[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = torch.ops.smla.sparse_mla(q_in, *args[1:])
        q_in.copy_(torch.randn(q_in.shape, generator=g).to(q_in))
        graph.replay()
        want = torch_ops._sparse_mla(q_in, *args[1:])
        side.synchronize()
        assert_same((out, lse), want)
        assert not same_bits(out, torch.ops.smla.sparse_mla(*args)[0])
