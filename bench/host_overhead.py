"""Host time per call (issue 17): 10,000 calls on a one-token problem (16 heads, top-k 64, bf16 cache of 256
slots), enqueued in batches of 200 behind a torch.cuda._sleep that holds the stream, so that the GPU runs none of
them while they are timed: the time is the host's alone. Also the same calls back to back, and a cProfile of the
torch op (where the host time goes), and flash_mla_sparse_fwd against sparse_mla on a prefill (issue 17 item 4).

    python bench/host_overhead.py [--cpp build/bench/bench_host_overhead] [--json out.json] [--profile]

Prints us/call for torch.ops.smla.sparse_mla, smla.sparse_mla on torch tensors and
smla.flash_mla.flash_mla_with_kvcache (sparse), and the C++ API's (from bench_host_overhead, when given); says
whether torch.ops.smla runs the C++ kernels of smla._torch_ops (smla.torch_ops.native()), and times the Python
kernel of sparse_mla called directly for comparison."""

from __future__ import annotations

import argparse
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
    parser.add_argument("--cpp", help="path of bench_host_overhead (the C++ API's figure)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of 2,000 torch-op calls")
    args = parser.parse_args()

    torch.manual_seed(0)
    heads, topk = 16, 64
    q = torch.randn(1, heads, 576, device="cuda").bfloat16()
    cache = torch.randn(4, 64, 576, device="cuda").bfloat16()
    idx = torch.randint(0, 256, (1, topk), device="cuda", dtype=torch.int32)
    meta = get_mla_metadata()[0]
    q4, idx3 = q[:, None], idx[:, None]
    calls = {
        "torch_ops_sparse_mla_us": lambda: torch.ops.smla.sparse_mla(q, cache, idx, None, None, 0.07),
        # the Python kernel torch.ops.smla ran before smla._torch_ops (and runs without it), without the dispatcher
        "python_kernel_sparse_mla_us": lambda: torch_ops._sparse_mla(q, cache, idx, None, None, 0.07),
        "smla_sparse_mla_torch_us": lambda: smla.sparse_mla(q, cache, idx, softmax_scale=0.07),
        "flash_mla_with_kvcache_us": lambda: flash_mla_with_kvcache(q4, cache[:, :, None], None, None, 512, meta,
                                                                    softmax_scale=0.07, indices=idx3),
        "torch_empty_us": lambda: torch.empty(512, device="cuda"),  # the floor: one caching-allocator tensor
    }
    results = {"torch_ops_native": torch_ops.native()}
    results.update({key: per_call_us(fn) for key, fn in calls.items()})
    results.update({key.replace("_us", "_back_to_back_us"): back_to_back_us(fn) for key, fn in calls.items()})
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            calls["torch_ops_sparse_mla_us"]()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    results.update(sparse_fwd_against_sparse_mla())
    if args.cpp:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([args.cpp, f.name], check=True, stdout=subprocess.DEVNULL)
            results.update(json.load(open(f.name)))
    names = {"cpp_sparse_mla_us": "C++ API smla::sparse_mla (caller workspace)",
             "cpp_sparse_mla_no_tokens_us": "  the same with no tokens (checks, no launch)",
             "cpp_memset_async_us": "  one cudaMemsetAsync (the floor of an enqueue)",
             "torch_ops_sparse_mla_us": "torch.ops.smla.sparse_mla",
             "python_kernel_sparse_mla_us": "its Python kernel (smla.torch_ops._sparse_mla)",
             "smla_sparse_mla_torch_us": "smla.sparse_mla (torch tensors)",
             "flash_mla_with_kvcache_us": "smla.flash_mla.flash_mla_with_kvcache (sparse)",
             "torch_empty_us": "torch.empty (one CUDA tensor, for scale)"}
    print(f"torch.ops.smla kernels: {'C++ (smla._torch_ops)' if results['torch_ops_native'] else 'Python'}")
    print(f"{'call (1 token, 16 heads, top-k 64)':50s} host us/call   back to back")
    for key, label in names.items():
        if key in results:
            print(f"{label:50s} {results[key]:7.2f} {results.get(key.replace('_us', '_back_to_back_us'), float('nan')):14.2f}")
    fwd, plain = results["flash_mla_sparse_fwd_prefill_ms"], results["sparse_mla_prefill_ms"]
    print(f"prefill 4096 x 64 heads x top-k 2048: flash_mla_sparse_fwd {fwd:.2f} ms, sparse_mla {plain:.2f} ms "
          f"({(fwd / plain - 1) * 100:+.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": CALLS, **results}, f, indent=2)


if __name__ == "__main__":
    main()
