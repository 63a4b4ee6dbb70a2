"""The out variants torch.ops.smla.sparse_mla.out and paged_mla_decode.out (PyTorch's out= convention: the
caller's out and lse, keyword-only, written in place, nothing returned), on CPU tensors: the bits of the
allocating ops, with the C++ kernels and the Python ones; smla.sparse_mla / paged_mla_decode with torch out= and
lse= route to them; bad outputs are refused with smla's errors naming the argument and nothing written; the fakes
trace them under torch.compile(fullgraph=True). Skipped without torch."""

from __future__ import annotations

import pytest

import smla

torch = pytest.importorskip("torch")
from smla import torch_ops  # noqa: E402  (needs torch)

pytestmark = pytest.mark.skipif(not torch_ops.available(), reason="torch < 2.4 cannot register torch.ops.smla")
QK, V = 576, 512


def same_bits(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def poisoned(*shape, dtype):
    """An output buffer of NaN: anything the op leaves unwritten shows."""
    return torch.full(shape, float("nan"), dtype=dtype)


def sparse_problem(seed=3, tokens=4, heads=16, topk=64, blocks=8, block_size=16):
    g = torch.Generator().manual_seed(seed)
    n = blocks * block_size
    cache = torch.full((blocks, block_size, QK), float("nan"), dtype=torch.bfloat16)  # unwritten slots: NaN
    written = torch.randperm(n, generator=g)[: n // 2]
    cache.view(n, QK)[written] = torch.randn(len(written), QK, generator=g).to(torch.bfloat16)
    q = torch.randn(tokens, heads, QK, generator=g).to(torch.bfloat16)
    idx = written[torch.randint(0, len(written), (tokens, topk), generator=g)].to(torch.int32)
    idx[0, :5] = -1  # skipped
    lengths = torch.tensor([topk, 10, 0, 33], dtype=torch.int32)[:tokens]
    return q, cache, idx, lengths, torch.randn(heads, generator=g)


def paged_problem(seed=4, batch=2, s_q=3, heads=16):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(8, 16, QK, generator=g).to(torch.bfloat16)
    table = torch.randperm(8, generator=g, dtype=torch.int32).view(batch, 4)
    seq_lens = torch.tensor([37, 64], dtype=torch.int32)[:batch]
    q = torch.randn(batch, s_q, heads, QK, generator=g).to(torch.bfloat16)
    return q, cache, table, seq_lens


@pytest.mark.parametrize("kernels", ["op", "python"])
def test_sparse_mla_out_writes_the_allocating_ops_bits(kernels):
    q, cache, idx, lengths, sink = sparse_problem()
    run = torch.ops.smla.sparse_mla.out if kernels == "op" else torch_ops._sparse_mla_out
    for extra in ((None, None), (lengths, sink)):
        want_out, want_lse = torch.ops.smla.sparse_mla(q, cache, idx, *extra, 0.07)
        # out a view into a wider buffer (the last dimension contiguous, the rest strided): the rest untouched
        buffer = poisoned(4, 16, 2 * V, dtype=torch.bfloat16)
        out, lse = buffer[..., :V], poisoned(4, 16, dtype=torch.float32)
        assert run(q, cache, idx, *extra, 0.07, out=out, lse=lse) is None
        assert same_bits(out, want_out) and same_bits(lse, want_lse)
        assert torch.isnan(buffer[..., V:].float()).all()
        assert torch.isfinite(out.float()).all()
        if extra[0] is None:
            assert torch.isfinite(lse).all()
        else:  # token 2: topk_length 0, nothing to attend
            assert (lse[2] == float("-inf")).all() and torch.isfinite(lse[[0, 1, 3]]).all()


@pytest.mark.parametrize("kernels", ["op", "python"])
def test_paged_mla_decode_out_writes_the_allocating_ops_bits(kernels):
    q, cache, table, seq_lens = paged_problem()
    run = torch.ops.smla.paged_mla_decode.out if kernels == "op" else torch_ops._paged_mla_decode_out
    for causal in (True, False):
        want = torch.ops.smla.paged_mla_decode(q, cache, table, seq_lens, None, 0.05, causal)
        out, lse = poisoned(2, 3, 16, V, dtype=torch.bfloat16), poisoned(2, 3, 16, dtype=torch.float32)
        assert run(q, cache, table, seq_lens, None, 0.05, causal, out=out, lse=lse) is None
        assert same_bits(out, want[0]) and same_bits(lse, want[1]) and torch.isfinite(lse).all()


def test_smla_functions_route_torch_out_to_the_out_ops():
    q, cache, idx, lengths, _ = sparse_problem()
    out, lse = poisoned(4, 16, V, dtype=torch.bfloat16), poisoned(4, 16, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = smla.sparse_mla(q, cache, idx, softmax_scale=0.07, topk_length=lengths, out=out, lse=lse)
    names = [e.name for e in prof.events()]
    assert "smla::sparse_mla" in names and "aten::empty" not in names, names  # the out op: nothing allocated
    assert got[0] is out and got[1] is lse
    want = smla.sparse_mla(q, cache, idx, softmax_scale=0.07, topk_length=lengths)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])

    q4, cache4, table, seq_lens = paged_problem()
    out, lse = poisoned(2, 3, 16, V, dtype=torch.bfloat16), poisoned(2, 3, 16, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = smla.paged_mla_decode(q4, cache4, table, seq_lens, softmax_scale=0.05, out=out, lse=lse)
    names = [e.name for e in prof.events()]
    assert "smla::paged_mla_decode" in names and "aten::empty" not in names, names
    assert got[0] is out and got[1] is lse
    want = smla.paged_mla_decode(q4, cache4, table, seq_lens, softmax_scale=0.05)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])


def bad_outputs(q):
    """(out, lse, the start of the error) for outputs sparse_mla.out must refuse."""
    t, h = q.shape[:2]
    out, lse = poisoned(t, h, V, dtype=torch.bfloat16), poisoned(t, h, dtype=torch.float32)
    wide = poisoned(t, h, 2 * V, dtype=torch.bfloat16)
    return [
        (poisoned(t, h, V - 1, dtype=torch.bfloat16), lse, "sparse_mla: out"),          # shape
        (poisoned(t + 1, h, V, dtype=torch.bfloat16), lse, "sparse_mla: out"),
        (poisoned(t, h, V, dtype=torch.float16), lse, "sparse_mla: out"),               # q's dtype
        (out, poisoned(t, h, dtype=torch.bfloat16), "sparse_mla: lse"),                 # float32
        (out, poisoned(t, h + 1, dtype=torch.float32), "sparse_mla: lse"),
        (wide[..., ::2], lse, "sparse_mla: out"),                                       # last dim strided
        (poisoned(1, 1, V, dtype=torch.bfloat16).expand(t, h, V), lse, "sparse_mla: out"),  # elements shared
        (q[..., :V], lse, "sparse_mla: out"),                                           # a view into q
        (out, out.view(torch.float32)[..., 0], "sparse_mla: lse"),                     # lse inside out
    ]


def test_bad_outputs_are_refused_naming_the_argument_and_nothing_is_written():
    q, cache, idx, _, _ = sparse_problem()
    q_bits = q.clone()
    for out, lse, message in bad_outputs(q):
        before = (out.clone(), lse.clone())
        with pytest.raises(ValueError, match=message):
            torch.ops.smla.sparse_mla.out(q, cache, idx, None, None, 0.07, out=out, lse=lse)
        with pytest.raises(smla.InvalidArgumentError, match=message):
            smla.sparse_mla(q, cache, idx, softmax_scale=0.07, out=out, lse=lse)
        assert same_bits(out, before[0]) and same_bits(lse, before[1]) and same_bits(q, q_bits)
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: out"):
        torch_ops._sparse_mla_out(q, cache, idx, None, None, 0.07, out=bad_outputs(q)[0][0],
                                  lse=poisoned(4, 16, dtype=torch.float32))
    # the out variant's own arguments are keyword-only and required
    with pytest.raises((RuntimeError, TypeError)):
        torch.ops.smla.sparse_mla.out(q, cache, idx, None, None, 0.07, poisoned(4, 16, V, dtype=torch.bfloat16),
                                      poisoned(4, 16, dtype=torch.float32))
    with pytest.raises((RuntimeError, TypeError)):
        torch.ops.smla.sparse_mla.out(q, cache, idx, None, None, 0.07, out=poisoned(4, 16, V, dtype=torch.bfloat16))

    q4, cache4, table, seq_lens = paged_problem()
    out, lse = poisoned(2, 3, 16, V, dtype=torch.bfloat16), poisoned(2, 3, 16, dtype=torch.float32)
    for bad_out, bad_lse, message in [(out[:, :2], lse, "paged_mla_decode: out"),
                                      (out, lse.half(), "paged_mla_decode: lse"),
                                      (q4[..., :V], lse, "paged_mla_decode: out")]:
        with pytest.raises(smla.InvalidArgumentError, match=message):
            smla.paged_mla_decode(q4, cache4, table, seq_lens, softmax_scale=0.05, out=bad_out, lse=bad_lse)
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()


def test_the_out_ops_compile_with_fullgraph_and_pass_opcheck():
    q, cache, idx, lengths, sink = sparse_problem()

    def step(q, cache, idx, out, lse):
        torch.ops.smla.sparse_mla.out(q * 2, cache, idx, None, None, 0.05, out=out, lse=lse)
        return out.float().sum(-1) + lse

    outputs = lambda: (poisoned(4, 16, V, dtype=torch.bfloat16), poisoned(4, 16, dtype=torch.float32))  # noqa: E731
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_out, compiled_out = outputs(), outputs()
    want = step(q, cache, idx, *eager_out)
    got = compiled(q, cache, idx, *compiled_out)
    assert same_bits(got, want)
    assert same_bits(compiled_out[0], eager_out[0]) and same_bits(compiled_out[1], eager_out[1])  # written through

    clean = cache.nan_to_num()
    out, lse = outputs()
    torch.library.opcheck(torch.ops.smla.sparse_mla.out, (q, clean, idx, lengths, sink, 0.05),
                          {"out": out, "lse": lse})
    q4, cache4, table, seq_lens = paged_problem()
    torch.library.opcheck(torch.ops.smla.paged_mla_decode.out, (q4, cache4, table, seq_lens, None, 0.05),
                          {"out": poisoned(2, 3, 16, V, dtype=torch.bfloat16),
                           "lse": poisoned(2, 3, 16, dtype=torch.float32)})


def test_inductor_writes_the_callers_buffers_through_two_out_ops():
    """torch.compile's default backend (inductor: functionalization, then its reinplacing) with two out ops writing
    the same graph inputs in turn: the buffers end as eagerly, on two sets of inputs (no stale result)."""
    q, cache, _, _, _ = sparse_problem()
    idx = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    table, seq_lens = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([60], dtype=torch.int32)
    clean = cache.nan_to_num()

    def step(q, cache, idx, out, lse):
        torch.ops.smla.sparse_mla.out(q * 2, cache, idx, None, None, 0.05, out=out, lse=lse)
        first = out.float().sum(-1) + lse
        torch.ops.smla.paged_mla_decode.out(q[None], cache, table, seq_lens, None, 0.05, out=out[None], lse=lse[None])
        return first

    compiled = torch.compile(step, fullgraph=True)
    for shift in (0.0, 1.0):
        eager = (poisoned(4, 16, V, dtype=torch.bfloat16), poisoned(4, 16, dtype=torch.float32))
        inductor = (poisoned(4, 16, V, dtype=torch.bfloat16), poisoned(4, 16, dtype=torch.float32))
        want = step(q + shift, clean, idx, *eager)
        got = compiled(q + shift, clean, idx, *inductor)
        assert same_bits(got, want) and torch.isfinite(want).all()
        assert same_bits(inductor[0], eager[0]) and same_bits(inductor[1], eager[1])


@pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()), reason="needs a CUDA GPU and a CUDA build")
def test_on_a_gpu_the_out_ops_write_the_allocating_ops_bits_on_the_current_stream():
    """CUDA tensors on a side stream, top-k 2048 (the keys split: scratch from torch's allocator through the C++
    API's WorkspaceSource): the out ops' bits are the allocating ops', and a bad out is refused on the GPU too."""
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(64, 64, QK, generator=g).to(torch.bfloat16).cuda()
    q = torch.randn(3, 16, QK, generator=g).to(torch.bfloat16).cuda()
    idx = torch.randint(-1, 64 * 64, (3, 2048), generator=g, dtype=torch.int32).cuda()
    q4, table = q[:2, None], torch.randperm(64, generator=g, dtype=torch.int32).view(2, 32).cuda()
    seq_lens = torch.tensor([2000, 777], dtype=torch.int32).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        want = torch.ops.smla.sparse_mla(q, cache, idx, None, None, 0.05)
        out = torch.full((3, 16, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((3, 16), float("nan"), device="cuda")
        torch.ops.smla.sparse_mla.out(q, cache, idx, None, None, 0.05, out=out, lse=lse)
        want4 = torch.ops.smla.paged_mla_decode(q4, cache, table, seq_lens, None, 0.05)
        out4 = torch.full((2, 1, 16, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse4 = torch.full((2, 1, 16), float("nan"), device="cuda")
        torch.ops.smla.paged_mla_decode.out(q4, cache, table, seq_lens, None, 0.05, out=out4, lse=lse4)
        side.synchronize()
    assert same_bits(out, want[0]) and same_bits(lse, want[1]) and torch.isfinite(lse).all()
    assert same_bits(out4, want4[0]) and same_bits(lse4, want4[1]) and torch.isfinite(lse4).all()
    with pytest.raises(smla.InvalidArgumentError, match="sparse_mla: out"):
        smla.sparse_mla(q, cache, idx, softmax_scale=0.05, out=out.cpu(), lse=lse)  # on another device
