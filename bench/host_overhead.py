"""Host time per call (issue 17): 10,000 back-to-back calls on a one-token problem (16 heads, top-k 64, bf16 cache
of 256 slots), so small that the GPU waits on the host; the loop's wall time over the calls is the host's cost.

    python bench/host_overhead.py [--cpp build/bench/bench_host_overhead] [--json out.json]

Prints us/call for torch.ops.smla.sparse_mla, smla.sparse_mla on torch tensors and
smla.flash_mla.flash_mla_with_kvcache (sparse), and the C++ API's (from bench_host_overhead, when given)."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time

import torch

import smla
from smla.flash_mla import flash_mla_with_kvcache, get_mla_metadata

CALLS = 10_000


def per_call_us(fn) -> float:
    for _ in range(200):  # warm up
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpp", help="path of bench_host_overhead (the C++ API's figure)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    torch.manual_seed(0)
    heads, topk = 16, 64
    q = torch.randn(1, heads, 576, device="cuda").bfloat16()
    cache = torch.randn(4, 64, 576, device="cuda").bfloat16()
    idx = torch.randint(0, 256, (1, topk), device="cuda", dtype=torch.int32)
    meta = get_mla_metadata()[0]
    q4, idx3 = q[:, None], idx[:, None]
    results = {
        "torch_ops_sparse_mla_us": per_call_us(lambda: torch.ops.smla.sparse_mla(q, cache, idx, None, None, 0.07)),
        "smla_sparse_mla_torch_us": per_call_us(lambda: smla.sparse_mla(q, cache, idx, softmax_scale=0.07)),
        "flash_mla_with_kvcache_us": per_call_us(
            lambda: flash_mla_with_kvcache(q4, cache[:, :, None], None, None, 512, meta, softmax_scale=0.07,
                                           indices=idx3)),
    }
    if args.cpp:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([args.cpp, f.name], check=True, stdout=subprocess.DEVNULL)
            results.update(json.load(open(f.name)))
    names = {"cpp_sparse_mla_us": "C++ API smla::sparse_mla (caller workspace)",
             "torch_ops_sparse_mla_us": "torch.ops.smla.sparse_mla",
             "smla_sparse_mla_torch_us": "smla.sparse_mla (torch tensors)",
             "flash_mla_with_kvcache_us": "smla.flash_mla.flash_mla_with_kvcache (sparse)"}
    print(f"{'call (1 token, 16 heads, top-k 64)':50s} us/call")
    for key, label in names.items():
        if key in results:
            print(f"{label:50s} {results[key]:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": CALLS, **results}, f, indent=2)


if __name__ == "__main__":
    main()
