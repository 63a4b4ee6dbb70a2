"""The kernel entry of smla's vLLM pooled indexer (smla.vllm._pooled, no vLLM needed) for GLM-5.3-Flash, over a
sequence of scheduler steps on tensors in vLLM's layouts (pooled_case.py: the pooled index cache, vLLM's tail cache,
pool- and token-granular slot mappings, the metadata's fields) against float64; on the CPU backend and on a CUDA
GPU, where no step may synchronise the host. tests/vllm runs the same steps through vLLM's op. Skipped without
torch."""

from __future__ import annotations

import numpy as np
import pytest

import smla

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
from smla import torch_ops  # noqa: E402  (needs torch)

pytestmark = pytest.mark.skipif(not torch_ops.available(), reason="torch < 2.4: no torch.ops.smla")
cuda = pytest.mark.skipif(not (smla.with_cuda and torch.cuda.is_available()),
                          reason="needs a CUDA GPU and a CUDA build")

from pooled_case import KPOOL, STEPS, STEPS_DONE, TOPK, Model  # noqa: E402
from smla.vllm import _pooled  # noqa: E402


def run_steps(device):
    model = Model(np.random.default_rng(55773), num_requests=5, device=device)

    def call(meta, tail_meta, q, k, weights, gate, ape, positions):
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call in the entry raises
        try:
            return _pooled.run(meta, tail_meta, model.cache, model.tail, q, k, weights, gate, ape, positions,
                               model.buffer, TOPK, KPOOL)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")

    for decodes, prefills, split in STEPS:
        model.check(*model.step(call, decodes, prefills, split))
    assert model.done == STEPS_DONE
    return model


def test_pooled_kernel_entry_matches_float64_on_the_cpu():
    run_steps("cpu")


def test_a_buffer_narrower_than_the_row_is_refused():
    model = Model(np.random.default_rng(1), num_requests=1)
    meta = type("Meta", (), {"slot_mapping": torch.zeros(1, dtype=torch.int64)})
    with pytest.raises(ValueError, match="topk_indices_buffer: expected at least 19 columns"):
        _pooled.select(meta, model.cache, torch.zeros(1, 32, 128, dtype=torch.float8_e4m3fn), torch.zeros(1, 32),
                       torch.zeros(1, dtype=torch.int64), model.buffer[:, :18], TOPK, KPOOL)


@cuda
def test_pooled_kernel_entry_on_the_gpu_matches_float64_without_host_syncs():
    gpu = run_steps("cuda")
    cpu = run_steps("cpu")  # the same inputs: the tail caches hold the same raw keys and gates, NaN elsewhere
    torch.testing.assert_close(gpu.tail.cpu(), cpu.tail, rtol=0, atol=0, equal_nan=True)
