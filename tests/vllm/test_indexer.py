"""smla.vllm.indexer: vLLM's indexer op body through smla, on vLLM's own metadata classes (filled as vLLM's
builder fills them: its builder runs Triton kernels, so the CPU test writes the fields from their documented
meaning), against the float64 reference; and install() only where DeepGEMM cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backends.mla import indexer as indexer_backend
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    DeepSeekV32IndexerDecodeMetadata,
)

import smla
from reference import index_cache_keys, indexer_scores
from smla.vllm import indexer

H_I, D, TOPK, BLOCK = 8, 128, 16, 16
PREFIX = "model.layers.0.self_attn.indexer.k_cache"


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


def run_case(rng, decodes, prefills, split=None, next_n=1):
    """decodes: context lengths of one-token requests; prefills: (context, new tokens), in one chunk or, with
    ``split``, two chunks over the same requests whose rows part at that prefill token (vLLM's query slices);
    ``next_n`` > 1: each decode request has that many new tokens (speculative decoding), seq_lens [B, next_n].
    Returns what the op wrote into the top-k buffer, with everything the reference needs."""
    requests = [(ctx, next_n) for ctx in decodes] + list(prefills)
    blocks = [-(-ctx // BLOCK) for ctx, _ in requests]
    num_blocks = sum(blocks) + 2
    order = rng.permutation(num_blocks)
    tables, start = [], 0
    for n in blocks:
        tables.append(order[start:start + n])
        start += n
    width = max(blocks)
    table = np.full((len(requests), width), -1, np.int32)  # entries past a context: never read
    for r, t in enumerate(tables):
        table[r, :len(t)] = t
    cache = torch.full((num_blocks, BLOCK, 132), 0x7F, dtype=torch.uint8)  # e4m3 NaN where nothing was written
    keys_new, slots_new, token_rows = [], [], []
    for r, (ctx, new) in enumerate(requests):
        slots = table[r, np.arange(ctx) // BLOCK] * BLOCK + np.arange(ctx) % BLOCK
        k = torch.from_numpy(rng.standard_normal((ctx, D)).astype(np.float32)).to(torch.bfloat16)
        smla.write_index_cache(k[:ctx - new], torch.from_numpy(slots[:ctx - new].astype(np.int64)), cache)
        keys_new.append(k[ctx - new:])  # the op writes the new tokens' keys itself
        slots_new.append(slots[ctx - new:])
        token_rows += [(r, ctx - new + j + 1) for j in range(new)]
    tokens = len(token_rows)
    q = torch.from_numpy(rng.standard_normal((tokens, H_I, D)).astype(np.float32) * 4).to(torch.float8_e4m3fn)
    weights = torch.from_numpy(rng.standard_normal((tokens, H_I)).astype(np.float32))
    buffer = torch.full((tokens + 3, TOPK), 7, dtype=torch.int32)  # rows past the batch must stay as they are

    num_decodes, decode_tokens = len(decodes), len(decodes) * next_n
    seq_lens = int32(decodes) if next_n == 1 else int32([[ctx - next_n + j + 1 for j in range(next_n)]
                                                         for ctx in decodes])
    decode = DeepSeekV32IndexerDecodeMetadata(
        block_table=torch.from_numpy(table[:num_decodes]), seq_lens=seq_lens,
        decode_lens=int32([next_n] * num_decodes), requires_padding=False,
        schedule_metadata=torch.empty(0)) if decodes else None
    prefill = None
    if prefills:  # one chunk: its requests' keys laid end to end
        lens = [ctx for ctx, _ in prefills]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ks = [cu[i] for i, (ctx, new) in enumerate(prefills) for _ in range(new)]
        ke = [cu[i] + ctx - new + j + 1 for i, (ctx, new) in enumerate(prefills) for j in range(new)]
        parts = [(0, len(ks))] if split is None else [(0, split), (split, len(ks))]
        chunks = [DeepseekV32IndexerPrefillChunkMetadata(
            block_table=torch.from_numpy(table[num_decodes:]), cu_seqlen_ks=int32(ks[a:b]),
            cu_seqlen_ke=int32(ke[a:b]), cu_seq_lens=torch.from_numpy(cu), token_to_seq=torch.empty(0),
            total_seq_lens=int(cu[-1]), max_seqlen_k=max(lens), token_start=decode_tokens + a,
            token_end=decode_tokens + b, num_reqs=len(prefills)) for a, b in parts]
        prefill = DeepseekV32IndexerPrefillMetadata(chunks=chunks)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=int32([ctx for ctx, _ in requests]), max_seq_len=max(ctx for ctx, _ in requests),
        slot_mapping=torch.from_numpy(np.concatenate(slots_new).astype(np.int64)), num_decodes=num_decodes,
        num_decode_tokens=decode_tokens, num_prefills=len(prefills), num_prefill_tokens=tokens - decode_tokens,
        decode=decode, prefill=prefill)
    with set_forward_context({PREFIX: meta}, VllmConfig()):
        result = indexer.sparse_attn_indexer(
            torch.empty(tokens, 16), PREFIX, cache, q, None, torch.cat(keys_new), weights, 128, "ue8m0", TOPK, D,
            4096, 4096, buffer, False, False, False, "")
    assert result is buffer
    return buffer, cache, table, token_rows, q, weights


@pytest.mark.parametrize("decodes,prefills,split", [([37, 5, 90], [], None), ([], [(20, 6), (3, 3)], None),
                                                    ([12, 60], [(40, 9), (17, 2)], None),
                                                    ([12], [(40, 9), (17, 2)], 4)])
@pytest.mark.parametrize("next_n", [1, 2])
def test_the_indexer_op_matches_float64(decodes, prefills, split, next_n):
    rng = np.random.default_rng(46726)
    buffer, cache, table, token_rows, q, weights = run_case(rng, decodes, prefills, split, next_n)
    keys, scales = index_cache_keys(cache.numpy())
    assert not np.isnan(keys[table[0, 0] * BLOCK]).any()  # the op wrote the new tokens' keys
    q64 = q.float().numpy().astype(np.float64)
    for t, (r, visible) in enumerate(token_rows):
        pos = np.arange(visible)
        slots = table[r, pos // BLOCK] * BLOCK + pos % BLOCK
        assert not np.isnan(keys[slots]).any()
        scores = indexer_scores(q64[t], weights[t].numpy(), keys, scales, slots)
        n = min(TOPK, visible)
        chosen = buffer[t, :n].numpy()
        assert np.all(buffer[t, n:].numpy() == -1)
        assert len(set(chosen.tolist())) == n and np.all((chosen >= 0) & (chosen < visible))
        assert np.all(np.diff(chosen) > 0)  # unsorted top-k: ascending positions
        np.testing.assert_allclose(np.sort(scores[chosen])[::-1], np.sort(scores)[::-1][:n], rtol=1e-5, atol=1e-6)
    assert torch.all(buffer[len(token_rows):] == 7)


def test_unsupported_indexer_modes_are_refused():
    meta = DeepseekV32IndexerMetadata(seq_lens=int32([4]), max_seq_len=4,
                                      slot_mapping=torch.zeros(1, dtype=torch.int64), num_decodes=1,
                                      num_decode_tokens=1, num_prefills=0, num_prefill_tokens=0)
    args = (torch.empty(1, 16), PREFIX, torch.zeros(1, BLOCK, 132, dtype=torch.uint8),
            torch.zeros(1, H_I, D, dtype=torch.float8_e4m3fn))
    with set_forward_context({PREFIX: meta}, VllmConfig()):
        for skip_insert, dcp in ((False, 2), (True, 1)):
            with pytest.raises(NotImplementedError, match="fp8 index cache it writes itself, without context"):
                indexer.sparse_attn_indexer(*args, None, None, torch.zeros(1, H_I), 128, "ue8m0", TOPK, D, 64, 64,
                                            torch.zeros(1, TOPK, dtype=torch.int32), skip_insert, False, False, "",
                                            dcp_world_size=dcp)


def test_install_only_where_deep_gemm_cannot_run():
    assert indexer.deep_gemm_runs(9) and indexer.deep_gemm_runs(10)
    assert not indexer.install(9) and not indexer.install(10)
    assert indexer_backend.has_deep_gemm()  # untouched
    assert indexer.install(12)  # SM120: the op's CUDA kernel is smla's; the builder asks DeepGEMM for no schedule
    active = [line for line in torch._C._dispatch_dump("vllm::sparse_attn_indexer").splitlines()
              if line.startswith("CUDA:")]
    assert len(active) == 1 and "smla/vllm/indexer.py" in active[0], active
    assert not indexer_backend.has_deep_gemm()
    assert not indexer.install(8)  # once per process
