"""smla.vllm.pooled_indexer: GLM-5.3-Flash's pooled indexer as vLLM constructs and calls it (its
SparseAttnIndexerKpool CustomOp, replaced through register_oot), over a sequence of scheduler steps on vLLM's own
metadata classes, against float64 (tests/python/pooled_case.py says what is checked)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.models.glm5next.sparse_indexer import SparseAttnIndexerKpool
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    DeepSeekV32IndexerDecodeMetadata,
)

from pooled_case import D, H_I, KPOOL, MAX_LEN, STEPS, STEPS_DONE, TOPK, Model, int32
from smla.vllm import pooled_indexer

OOT_NAME = SparseAttnIndexerKpool.__name__
PREFIX, TAIL = "model.layers.0.self_attn.indexer.k_cache", "model.layers.0.self_attn.indexer.tail_cache"
VLLM_CLASSES = SimpleNamespace(Metadata=DeepseekV32IndexerMetadata, Decode=DeepSeekV32IndexerDecodeMetadata,
                               Prefill=DeepseekV32IndexerPrefillMetadata, Chunk=DeepseekV32IndexerPrefillChunkMetadata)


@pytest.fixture(scope="module")
def installed():
    if OOT_NAME not in op_registry_oot:  # the plugin's register() did not install it yet in this process
        assert not pooled_indexer.install(9) and not pooled_indexer.install(10)  # DeepGEMM's GPUs: vLLM's own
        assert OOT_NAME not in op_registry_oot
        assert pooled_indexer.install(12)
    assert op_registry_oot[OOT_NAME] is pooled_indexer.SmlaSparseAttnIndexerKpool
    assert not pooled_indexer.install(8)  # once per process


def make_op(model):
    """The op as GLM-5.3-Flash's Indexer constructs it (vllm/models/glm5next/common/attention.py); its caches'
    layers stand in as objects with the two attributes the op reads."""
    with set_current_vllm_config(VllmConfig()):
        op = SparseAttnIndexerKpool(SimpleNamespace(prefix=PREFIX, kv_cache=model.cache), 128, "ue8m0", TOPK, D,
                                    MAX_LEN // KPOOL, 4096, model.buffer,
                                    tail_cache=SimpleNamespace(prefix=TAIL, kv_cache=model.tail))
    assert type(op) is pooled_indexer.SmlaSparseAttnIndexerKpool
    return op


def test_the_pooled_indexer_across_steps_matches_float64(installed):
    model = Model(np.random.default_rng(53963), num_requests=5, classes=VLLM_CLASSES)
    op = make_op(model)

    def call(meta, tail_meta, q, k, weights, gate, ape, positions):
        with set_forward_context({PREFIX: meta, TAIL: tail_meta}, VllmConfig()):
            return op(torch.empty(q.shape[0], 8), q, k, weights, gate_score=gate, compress_ape=ape,
                      index_kpool=KPOOL, positions=positions)

    for decodes, prefills, split in STEPS:
        model.check(*model.step(call, decodes, prefills, split))
    assert model.done == STEPS_DONE


def test_unsupported_modes_are_refused(installed):
    model = Model(np.random.default_rng(1), num_requests=1)
    op = make_op(model)
    meta = DeepseekV32IndexerMetadata(seq_lens=int32([1]), max_seq_len=1, slot_mapping=torch.tensor([-1]),
                                      num_decodes=0, num_decode_tokens=0, num_prefills=1, num_prefill_tokens=1)
    args = (torch.empty(1, 8), torch.zeros(1, H_I, D, dtype=torch.float8_e4m3fn), torch.zeros(1, D),
            torch.zeros(1, H_I))
    kwargs = dict(gate_score=torch.zeros(1, D), compress_ape=torch.zeros(KPOOL, D), index_kpool=KPOOL,
                  positions=torch.zeros(1, dtype=torch.int64))
    with set_forward_context({PREFIX: meta, TAIL: meta}, VllmConfig()):
        with pytest.raises(NotImplementedError, match="fp8 pool cache it writes itself"):
            op(*args, **{**kwargs, "positions": None})
        with pytest.raises(NotImplementedError, match="fp8 pool cache it writes itself"):
            op(args[0], (args[1], torch.ones(1, H_I)), *args[2:], **kwargs)  # an fp4 cache's (values, scales)
    with set_forward_context({PREFIX: meta}, VllmConfig()):
        with pytest.raises(NotImplementedError, match="tail cache's metadata"):
            op(*args, **kwargs)
