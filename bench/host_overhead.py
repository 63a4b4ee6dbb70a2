"""Host time per call (issue 17): 10,000 calls on a one-token problem (16 heads, top-k 64, bf16 cache of 256
slots), enqueued in batches of 200 behind a torch.cuda._sleep that holds the stream, so that the GPU runs none of
them while they are timed: the time is the host's alone. Also the same calls back to back, and a cProfile of the
torch op (where the host time goes), and flash_mla_sparse_fwd against sparse_mla on a prefill (issue 17 item 4).

    python bench/host_overhead.py [--cpp build/bench/bench_host_overhead] [--json out.json] [--profile]
    python bench/host_overhead.py --device cpu [--json out.json]

Each call also gets the number of torch operators it dispatches (torch.profiler, nested ones included: an op's
own torch.empty, select, transpose, ...), each of which costs host time. Every entry point is timed beside the bare
torch op it ends in (smla.sparse_mla in torch.ops.smla.sparse_mla, smla.flash_mla.flash_mla_with_kvcache in
torch.ops.smla.flash_mla_with_kvcache): the difference is its Python wrapper's cost. "no tokens" rows run the same
calls on an empty batch (every check and allocation, no attention work).

--device cpu measures the same calls on CPU tensors, on a machine without a GPU: the Python and dispatcher path up
to the backend call is the same code as on CUDA tensors. There the time is the calling thread's CPU time in the
plain loop (best of 7 rounds of 2,000 calls; no stream to hold), and the one-token rows include the CPU backend's
attention (tens of us), so the wrappers' cost is read from the no-tokens rows.

The out variant (torch.ops.smla.sparse_mla.out, and smla.sparse_mla with out= and lse=) writes buffers made once,
as an engine preallocates them: no allocation per call.

Prints us/call for torch.ops.smla.sparse_mla, smla.sparse_mla on torch tensors and
smla.flash_mla.flash_mla_with_kvcache (sparse), and the C++ API's (from bench_host_overhead, when given); says
whether torch.ops.smla runs the C++ kernels of smla._torch_ops (smla.torch_ops.native()), and times the Python
kernel of sparse_mla called directly for comparison."""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import tempfile
import time

import torch

import smla
from smla import torch_ops  # registers torch.ops.smla (with the C++ kernels when built)
from smla.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata

CALLS = 10_000


def per_call_us(fn) -> float:
    """Host time per call, the stream held by a sleeping kernel while each batch is enqueued."""
    batch = 200
    for _ in range(batch):  # warm up
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(CALLS // batch):
        torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: longer than a batch takes to enqueue
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        total += time.perf_counter() - start
        torch.cuda.synchronize()
    return total / CALLS * 1e6


def back_to_back_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def cpu_us(fn) -> float:
    """CPU time of this thread per call of the plain loop on CPU tensors: the best of 7 rounds of 2,000 calls.
    Thread time, not wall time, so that other work on a shared machine does not count (time the thread waits
    for a core is not host time of the call)."""
    for _ in range(200):  # warm up
        fn()
    rounds = []
    for _ in range(7):
        start = time.thread_time()
        for _ in range(2000):
            fn()
        rounds.append((time.thread_time() - start) / 2000 * 1e6)
    return min(rounds)


def dispatched_ops(fn) -> collections.Counter:
    """The torch operators one call of `fn` dispatches, nested ones included (torch.profiler's CPU events)."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(event.name for event in prof.events())


def gpu_ms(fn, reps: int = 10) -> float:
    """Median GPU time of `fn` in ms (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def sparse_fwd_against_sparse_mla() -> dict:
    """Issue 17 item 4: flash_mla_sparse_fwd (max_logits and lse from the kernel) against sparse_mla on the same
    prefill problem: 4096 tokens, 64 heads, top-k 2048 over 32768 bf16 rows."""
    tokens, heads, topk, s_kv = 4096, 64, 2048, 32768
    q = torch.randn(tokens, heads, 576, device="cuda").bfloat16()
    kv = torch.randn(s_kv, 1, 576, device="cuda").bfloat16()
    idx = torch.randint(0, s_kv, (tokens, 1, topk), device="cuda", dtype=torch.int32)
    return {
        "sparse_mla_prefill_ms": gpu_ms(lambda: smla.sparse_mla(q, kv, idx[:, 0], softmax_scale=0.07)),
        "flash_mla_sparse_fwd_prefill_ms": gpu_ms(lambda: flash_mla_sparse_fwd(q, kv, idx, 0.07)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the tensors live")
    parser.add_argument("--cpp", help="path of bench_host_overhead (the C++ API's figure; CUDA)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of 2,000 torch-op calls")
    args = parser.parse_args()
    device = args.device
    cuda = device == "cuda"

    torch.manual_seed(0)
    heads, topk = 16, 64
    q = torch.randn(1, heads, 576, device=device).bfloat16()
    cache = torch.randn(4, 64, 576, device=device).bfloat16()
    cache4 = cache[:, :, None]  # FlashMLA's 4-D cache, made once as an engine holds it
    idx = torch.randint(0, 256, (1, topk), device=device, dtype=torch.int32)
    meta, meta0 = get_mla_metadata()[0], get_mla_metadata()[0]
    q4, idx3 = q[:, None], idx[:, None]
    q0, idx0, q40, idx30 = q[:0], idx[:0], q4[:0], idx3[:0]  # no tokens: checks and allocations, no attention
    sparse_op, kvcache_op = torch.ops.smla.sparse_mla, torch.ops.smla.flash_mla_with_kvcache
    sparse_out_op = torch.ops.smla.sparse_mla.out
    out, lse = torch.empty(1, heads, 512, device=device).bfloat16(), torch.empty(1, heads, device=device)
    out0, lse0 = out[:0], lse[:0]  # an engine's preallocated buffers, as the out variant writes them
    calls = {
        "torch_ops_sparse_mla_us": lambda: sparse_op(q, cache, idx, None, None, 0.07),
        # the Python kernel torch.ops.smla ran before smla._torch_ops (and runs without it), without the dispatcher
        "python_kernel_sparse_mla_us": lambda: torch_ops._sparse_mla(q, cache, idx, None, None, 0.07),
        "smla_sparse_mla_torch_us": lambda: smla.sparse_mla(q, cache, idx, softmax_scale=0.07),
        "torch_ops_sparse_mla_out_us": lambda: sparse_out_op(q, cache, idx, None, None, 0.07, out=out, lse=lse),
        "smla_sparse_mla_torch_out_us": lambda: smla.sparse_mla(q, cache, idx, softmax_scale=0.07, out=out, lse=lse),
        "torch_ops_flash_mla_with_kvcache_us": lambda: kvcache_op(q4, cache4, None, None, idx3, None, None, 0.07,
                                                                  False),
        "flash_mla_with_kvcache_us": lambda: flash_mla_with_kvcache(q4, cache4, None, None, 512, meta,
                                                                    softmax_scale=0.07, indices=idx3),
        "torch_ops_sparse_mla_no_tokens_us": lambda: sparse_op(q0, cache, idx0, None, None, 0.07),
        "smla_sparse_mla_torch_no_tokens_us": lambda: smla.sparse_mla(q0, cache, idx0, softmax_scale=0.07),
        "torch_ops_sparse_mla_out_no_tokens_us": lambda: sparse_out_op(q0, cache, idx0, None, None, 0.07, out=out0,
                                                                       lse=lse0),
        "smla_sparse_mla_torch_out_no_tokens_us": lambda: smla.sparse_mla(q0, cache, idx0, softmax_scale=0.07,
                                                                          out=out0, lse=lse0),
        "torch_ops_flash_mla_with_kvcache_no_tokens_us": lambda: kvcache_op(q40, cache4, None, None, idx30, None,
                                                                            None, 0.07, False),
        "flash_mla_with_kvcache_no_tokens_us": lambda: flash_mla_with_kvcache(q40, cache4, None, None, 512, meta0,
                                                                              softmax_scale=0.07, indices=idx30),
        "torch_empty_us": lambda: torch.empty(512, device=device),  # the floor: one caching-allocator tensor
    }
    results = {"device": device, "torch_ops_native": torch_ops.native()}
    if cuda:
        results.update({key: per_call_us(fn) for key, fn in calls.items()})
        results.update({key.replace("_us", "_back_to_back_us"): back_to_back_us(fn) for key, fn in calls.items()})
    else:
        results.update({key: cpu_us(fn) for key, fn in calls.items()})
    ops = {key: dispatched_ops(fn) for key, fn in calls.items()}
    results.update({key.replace("_us", "_ops"): sum(counts.values()) for key, counts in ops.items()})
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            calls["torch_ops_sparse_mla_us"]()
        profiler.disable()
        if cuda:
            torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    if cuda:
        results.update(sparse_fwd_against_sparse_mla())
    if args.cpp:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([args.cpp, f.name], check=True, stdout=subprocess.DEVNULL)
            results.update(json.load(open(f.name)))
    names = {"cpp_sparse_mla_us": "C++ API smla::sparse_mla (caller workspace)",
             "cpp_sparse_mla_no_tokens_us": "  the same with no tokens (checks, no launch)",
             "cpp_memset_async_us": "  one cudaMemsetAsync (the floor of an enqueue)",
             "cpp_workspace_size_us": "  smla::workspace_size (checks, guard, split plan)",
             "cpp_cuda_sparse_mla_us": "  smla::cuda::sparse_mla in a guard (no checks)",
             "cpp_sparse_mla_split_us": "  the call at top-k 2048 (splits + combine)",
             "cpp_sparse_mla_split_sized_us": "    the same as workspace_size, then the op",
             "cpp_sparse_mla_split_source_us": "    the same, its workspace from a WorkspaceSource",
             "cpp_launch_chevrons_us": "  empty kernel, <<<>>>",
             "cpp_launch_runtime_us": "  empty kernel, cudaLaunchKernel",
             "cpp_launch_runtime_smem_us": "  the same, the attention's shared memory",
             "cpp_launch_ex_us": "  empty kernel, cudaLaunchKernelEx",
             "cpp_launch_ex_pdl_us": "  empty kernel, cudaLaunchKernelEx + PDL",
             "cpp_launch_driver_us": "  empty kernel, cuLaunchKernel (driver)",
             "cpp_get_device_us": "  cudaGetDevice",
             "cpp_get_last_error_us": "  cudaGetLastError",
             "torch_ops_sparse_mla_us": "torch.ops.smla.sparse_mla",
             "python_kernel_sparse_mla_us": "its Python kernel (smla.torch_ops._sparse_mla)",
             "smla_sparse_mla_torch_us": "smla.sparse_mla (torch tensors)",
             "torch_ops_sparse_mla_out_us": "torch.ops.smla.sparse_mla.out (caller's out, lse)",
             "smla_sparse_mla_torch_out_us": "smla.sparse_mla (torch tensors, out=, lse=)",
             "torch_ops_flash_mla_with_kvcache_us": "torch.ops.smla.flash_mla_with_kvcache (sparse)",
             "flash_mla_with_kvcache_us": "smla.flash_mla.flash_mla_with_kvcache (sparse)",
             "torch_ops_sparse_mla_no_tokens_us": "torch.ops.smla.sparse_mla, no tokens",
             "smla_sparse_mla_torch_no_tokens_us": "smla.sparse_mla (torch tensors), no tokens",
             "torch_ops_sparse_mla_out_no_tokens_us": "torch.ops.smla.sparse_mla.out, no tokens",
             "smla_sparse_mla_torch_out_no_tokens_us": "smla.sparse_mla (torch, out=, lse=), no tokens",
             "torch_ops_flash_mla_with_kvcache_no_tokens_us": "torch.ops.smla.flash_mla_with_kvcache, no tokens",
             "flash_mla_with_kvcache_no_tokens_us": "smla.flash_mla.flash_mla_with_kvcache, no tokens",
             "torch_empty_us": f"torch.empty (one {device.upper()} tensor, for scale)"}
    print(f"torch.ops.smla kernels: {'C++ (smla._torch_ops)' if results['torch_ops_native'] else 'Python'}; "
          f"tensors on the {device.upper()}")
    second = "back to back" if cuda else ""
    print(f"{'call (1 token, 16 heads, top-k 64)':52s} {'host us/call':>12s} {second:>13s} torch ops/call")
    for key, label in names.items():
        if key in results:
            ops_key = key.replace("_us", "_ops")
            back = results.get(key.replace("_us", "_back_to_back_us"))
            print(f"{label:52s} {results[key]:12.2f} {'' if back is None else f'{back:.2f}':>13s} "
                  f"{results.get(ops_key, ''):>14}")
    for key, counts in ops.items():
        if sum(counts.values()) > 1:
            print(f"  {key.replace('_us', '')}: {dict(counts)}")
    if cuda:
        fwd, plain = results["flash_mla_sparse_fwd_prefill_ms"], results["sparse_mla_prefill_ms"]
        print(f"prefill 4096 x 64 heads x top-k 2048: flash_mla_sparse_fwd {fwd:.2f} ms, sparse_mla {plain:.2f} ms "
              f"({(fwd / plain - 1) * 100:+.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": CALLS, **results}, f, indent=2)


if __name__ == "__main__":
    main()
