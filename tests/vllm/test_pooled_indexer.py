"""smla.vllm.pooled_indexer: GLM-5.3-Flash's pooled indexer as vLLM constructs and calls it (its
SparseAttnIndexerKpool CustomOp, replaced through register_oot), over a sequence of scheduler steps on vLLM's own
metadata classes (filled as vLLM's builder fills them for a pool-granular cache: its builder runs Triton kernels,
so the CPU test writes the fields from their documented meaning), against float64: every pool in the cache is the
model's pool of its tokens' raw keys, gates and ape (including pools whose tokens came in earlier steps, through
vLLM's tail cache), and each token's top-k row holds its best pools by the scores of the cached keys, then its
incomplete pool's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.models.glm5next.sparse_indexer import SparseAttnIndexerKpool
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    DeepSeekV32IndexerDecodeMetadata,
)

from reference import index_cache_keys, indexer_scores, pooled
from smla.vllm import pooled_indexer

H_I, ACTIVE_HEADS, D = 32, 16, 128  # vLLM pads the model's 16 indexer heads to 32 with zero weights for DeepGEMM
KPOOL, BLOCK, RING, TOPK = 4, 16, 8, 16  # RING: kpool * next_pow2(ceil((kpool + 1 draft) / kpool))
ROWS = BLOCK // KPOOL  # pool rows per block
SELECT = TOPK // KPOOL
WIDTH = SELECT * KPOOL + KPOOL - 1
BUFFER_WIDTH = 24  # vLLM rounds index_topk + kpool - 1 up (to 128 for the model)
PREFIX, TAIL = "model.layers.0.self_attn.indexer.k_cache", "model.layers.0.self_attn.indexer.tail_cache"
MAX_LEN = 64


def int32(values):
    return torch.tensor(np.asarray(values), dtype=torch.int32)


class Model:
    """Requests' raw index keys and gates, their block tables and tail blocks, and the caches vLLM allocates."""

    def __init__(self, rng, num_requests):
        self.k = rng.uniform(-3, 3, (num_requests, MAX_LEN, D)).astype(ml_dtypes.bfloat16)
        self.gate = rng.uniform(-4, 4, (num_requests, MAX_LEN, D)).astype(ml_dtypes.bfloat16)
        self.ape = rng.uniform(-2, 2, (KPOOL, D)).astype(np.float32)
        blocks_per_request = MAX_LEN // BLOCK
        num_blocks = num_requests * blocks_per_request + 3
        self.table = rng.permutation(num_blocks)[:num_requests * blocks_per_request].reshape(
            num_requests, blocks_per_request).astype(np.int32)
        self.tail_block = rng.permutation(num_requests + 2)[:num_requests]
        self.cache = torch.full((num_blocks, ROWS, 132), 0x7F, dtype=torch.uint8)  # e4m3 NaN: never written
        self.tail = torch.full((num_requests + 2, 2, RING, D), float("nan"), dtype=torch.bfloat16)
        self.buffer = torch.full((64, BUFFER_WIDTH), 7, dtype=torch.int32)  # rows past a batch stay as they are
        self.done = [0] * num_requests
        self.rng = rng

    def pool_slot(self, r, p):
        return int(self.table[r, p // ROWS]) * ROWS + p % ROWS

    def step(self, op, decodes, prefills, split=None):
        """decodes: (request, new tokens, the same for all); prefills: (request, new tokens), in one chunk or two
        parted at prefill token ``split``. Runs the op; returns the batch's (request, position) per token, q and
        weights."""
        self.buffer.fill_(7)
        tokens = [(r, self.done[r] + j) for r, new in decodes + prefills for j in range(new)]
        n = len(tokens)
        k = torch.from_numpy(np.stack([self.k[r, p] for r, p in tokens]).view(np.int16)).view(torch.bfloat16)
        gate = torch.from_numpy(np.stack([self.gate[r, p] for r, p in tokens]).view(np.int16)).view(torch.bfloat16)
        positions = torch.tensor([p for _, p in tokens], dtype=torch.int64)
        pool_slots = [self.pool_slot(r, (p + 1) // KPOOL - 1) if (p + 1) % KPOOL == 0 else -1 for r, p in tokens]
        tail_slots = [int(self.tail_block[r]) * RING + p % RING for r, p in tokens]
        q = torch.from_numpy(self.rng.standard_normal((n, H_I, D)).astype(np.float32) * 4).to(torch.float8_e4m3fn)
        weights = torch.from_numpy(self.rng.standard_normal((n, H_I)).astype(np.float32))
        weights[:, ACTIVE_HEADS:] = 0

        decode_tokens = sum(new for _, new in decodes)
        decode = None
        if decodes:
            next_n = decodes[0][1]
            assert all(new == next_n for _, new in decodes)
            # Per token, whole pools of its context ([B, next_n]; [B, 1] without drafts), as vLLM divides them.
            seq_lens = int32([[(self.done[r] + j + 1) // KPOOL for j in range(next_n)] for r, _ in decodes])
            decode = DeepSeekV32IndexerDecodeMetadata(
                block_table=torch.from_numpy(self.table[[r for r, _ in decodes]]), seq_lens=seq_lens,
                decode_lens=int32([next_n] * len(decodes)), requires_padding=False, schedule_metadata=torch.empty(0))
        prefill = None
        if prefills:  # the requests' pools laid end to end
            pools = [(self.done[r] + new) // KPOOL for r, new in prefills]
            cu = np.concatenate([[0], np.cumsum(pools)]).astype(np.int32)
            ks = [cu[i] for i, (_, new) in enumerate(prefills) for _ in range(new)]
            ke = [cu[i] + (self.done[r] + j + 1) // KPOOL for i, (r, new) in enumerate(prefills) for j in range(new)]
            parts = [(0, len(ks))] if split is None else [(0, split), (split, len(ks))]
            prefill = DeepseekV32IndexerPrefillMetadata(chunks=[DeepseekV32IndexerPrefillChunkMetadata(
                block_table=torch.from_numpy(self.table[[r for r, _ in prefills]]), cu_seqlen_ks=int32(ks[a:b]),
                cu_seqlen_ke=int32(ke[a:b]), cu_seq_lens=torch.from_numpy(cu), token_to_seq=torch.empty(0),
                total_seq_lens=int(cu[-1]), max_seqlen_k=max(pools), token_start=decode_tokens + a,
                token_end=decode_tokens + b, num_reqs=len(prefills)) for a, b in parts])
        meta = DeepseekV32IndexerMetadata(
            seq_lens=int32([(self.done[r] + new) // KPOOL for r, new in decodes + prefills]),
            max_seq_len=max((self.done[r] + new) // KPOOL for r, new in decodes + prefills),
            slot_mapping=torch.tensor(pool_slots, dtype=torch.int64), num_decodes=len(decodes),
            num_decode_tokens=decode_tokens, num_prefills=len(prefills), num_prefill_tokens=n - decode_tokens,
            decode=decode, prefill=prefill)
        tail_meta = DeepseekV32IndexerMetadata(
            seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len, slot_mapping=torch.tensor(tail_slots),
            num_decodes=0, num_decode_tokens=0, num_prefills=0, num_prefill_tokens=0)
        with set_forward_context({PREFIX: meta, TAIL: tail_meta}, VllmConfig()):
            # vLLM pads k and the gate to the CUDA-graph batch; the op reads the slot mapping's tokens only.
            result = op(torch.empty(n, 8), q, torch.cat([k, k[:1]]), weights,
                        gate_score=torch.cat([gate, gate[:1]]), compress_ape=torch.from_numpy(self.ape),
                        index_kpool=KPOOL, positions=positions)
        assert result is self.buffer
        for r, new in decodes + prefills:
            self.done[r] += new
        return tokens, q, weights

    def check(self, tokens, q, weights):
        keys, scales = index_cache_keys(self.cache.numpy())
        # Every pool completed so far: the model's pool of its tokens (fp8 with a power-of-two scale).
        for r, done in enumerate(self.done):
            for p in range(done // KPOOL):
                want = pooled(self.k[r, None, p * KPOOL:(p + 1) * KPOOL], self.gate[r, None, p * KPOOL:(p + 1) * KPOOL],
                              self.ape)[0]
                slot = self.pool_slot(r, p)
                got = keys[slot] * scales[slot]
                tol = 6.7e-2 * np.abs(want) + 4e-3 * np.abs(want).max() + scales[slot] * 2.0**-9
                assert np.all(np.abs(got - want) <= tol), (r, p)
        q64 = q.float().numpy().astype(np.float64)
        for t, (r, p) in enumerate(tokens):
            row = self.buffer[t].numpy()
            whole = (p + 1) // KPOOL
            slots = np.array([self.pool_slot(r, i) for i in range(whole)], dtype=np.int64)
            n = min(SELECT, whole)
            chosen = row[:n * KPOOL].reshape(n, KPOOL)
            pools = chosen[:, 0] // KPOOL
            np.testing.assert_array_equal(chosen, pools[:, None] * KPOOL + np.arange(KPOOL))  # whole pools
            assert len(set(pools.tolist())) == n and np.all((pools >= 0) & (pools < whole))
            if n:
                scores = indexer_scores(q64[t], weights[t].numpy(), keys, scales, slots)
                np.testing.assert_allclose(scores[pools], np.sort(scores)[::-1][:n], rtol=1e-5, atol=1e-6)
            assert np.all(row[n * KPOOL:SELECT * KPOOL] == -1)
            tail = np.arange(whole * KPOOL, p + 1)  # the incomplete pool's tokens, the current one included
            np.testing.assert_array_equal(row[SELECT * KPOOL:WIDTH], np.pad(tail, (0, KPOOL - 1 - len(tail)),
                                                                            constant_values=-1))
            assert np.all(row[WIDTH:] == -1)
        assert torch.all(self.buffer[len(tokens):] == 7)


@pytest.fixture(scope="module")
def installed():
    assert not pooled_indexer.install(9) and not pooled_indexer.install(10)  # DeepGEMM's GPUs: vLLM's own
    assert pooled_indexer.install(12)
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
    model = Model(np.random.default_rng(53963), num_requests=5)
    op = make_op(model)
    steps = [
        ([], [(0, 23), (1, 9), (2, 2)], None),  # prefill: pools completed in the batch, tails left behind
        ([(0, 1), (1, 1), (2, 1)], [(3, 13)], 5),  # decodes, a prefill in two chunks
        ([(0, 1), (1, 1), (2, 1)], [(4, 6)], None),
        ([(0, 1), (1, 1), (2, 1), (3, 1)], [(4, 9)], None),  # a prefill chunk starting inside a pool (at 6)
        ([(0, 2), (1, 2), (2, 2), (3, 2), (4, 2)], [], None),  # a draft token each
        ([(0, 2), (1, 2), (2, 2), (3, 2), (4, 2)], [], None),
        ([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)], [], None),
    ]
    for decodes, prefills, split in steps:
        model.check(*model.step(op, decodes, prefills, split))
    assert model.done == [31, 17, 10, 19, 20]


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
