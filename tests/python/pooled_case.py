"""A GLM-5.3-Flash pooled-indexer case as vLLM's scheduler steps produce it, for the kernel entry of smla's vLLM
pooled indexer (tests/python/test_vllm_pooled.py, no vLLM) and the op inside vLLM (tests/vllm): requests' raw index
keys and gates, their block tables and tail blocks, the caches vLLM allocates (NaN where never written), and per
step the metadata vLLM's builder fills for a pool-granular cache (written from the fields' documented meaning: the
builder runs Triton kernels), in vLLM's classes or in stand-ins with the same fields. ``check`` compares the caches
and the top-k buffer with float64: every pool in the cache is the model's pool of its tokens (including tokens of
earlier steps, kept in the tail cache), and each token's row holds its best pools by the scores of the cached keys,
then its incomplete pool's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import torch

from reference import index_cache_keys, indexer_scores, pooled

H_I, ACTIVE_HEADS, D = 32, 16, 128  # vLLM pads the model's 16 indexer heads to 32 with zero weights for DeepGEMM
KPOOL, BLOCK, RING, TOPK = 4, 16, 8, 16  # RING: kpool * next_pow2(ceil((kpool + 1 draft) / kpool))
ROWS = BLOCK // KPOOL  # pool rows per block
SELECT = TOPK // KPOOL
WIDTH = SELECT * KPOOL + KPOOL - 1
BUFFER_WIDTH = 24  # vLLM rounds index_topk + kpool - 1 up (to 128 for the model)
MAX_LEN = 64


# Steps covering what a server meets: a prefill leaving tails behind, decodes crossing pool boundaries through
# the tail cache, a prefill in two chunks, a chunk starting inside a pool, draft tokens, decodes of unequal
# lengths. (decodes, prefills, split)
STEPS = [
    ([], [(0, 23), (1, 9), (2, 2)], None),
    ([(0, 1), (1, 1), (2, 1)], [(3, 13)], 5),
    ([(0, 1), (1, 1), (2, 1)], [(4, 6)], None),
    ([(0, 1), (1, 1), (2, 1), (3, 1)], [(4, 9)], None),
    ([(0, 2), (1, 2), (2, 2), (3, 2), (4, 2)], [], None),
    ([(0, 2), (1, 2), (2, 2), (3, 2), (4, 2)], [], None),
    ([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)], [], None),
    ([(0, 2), (1, 1), (2, 2), (3, 1)], [(4, 3)], None),  # drafts accepted unequally: decode rows of unequal lengths
]
STEPS_DONE = [33, 18, 12, 20, 23]  # each request's tokens after STEPS

#: Stand-ins for vLLM's metadata classes (vllm/v1/attention/backends/mla/indexer.py): the same fields.
STAND_INS = SimpleNamespace(Metadata=SimpleNamespace, Decode=SimpleNamespace, Prefill=SimpleNamespace,
                            Chunk=SimpleNamespace)


def int32(values, device="cpu"):
    return torch.tensor(np.asarray(values), dtype=torch.int32, device=device)


class Model:
    """Requests' raw index keys and gates, their block tables and tail blocks, and the caches vLLM allocates, on
    ``device``; ``classes`` builds the metadata (STAND_INS, or vLLM's classes under the same names)."""

    def __init__(self, rng, num_requests, device="cpu", classes=STAND_INS):
        self.k = rng.uniform(-3, 3, (num_requests, MAX_LEN, D)).astype(ml_dtypes.bfloat16)
        self.gate = rng.uniform(-4, 4, (num_requests, MAX_LEN, D)).astype(ml_dtypes.bfloat16)
        self.ape = rng.uniform(-2, 2, (KPOOL, D)).astype(np.float32)
        blocks_per_request = MAX_LEN // BLOCK
        num_blocks = num_requests * blocks_per_request + 3
        self.table = rng.permutation(num_blocks)[:num_requests * blocks_per_request].reshape(
            num_requests, blocks_per_request).astype(np.int32)
        self.tail_block = rng.permutation(num_requests + 2)[:num_requests]
        self.cache = torch.full((num_blocks, ROWS, 132), 0x7F, dtype=torch.uint8, device=device)  # e4m3 NaN
        self.tail = torch.full((num_requests + 2, 2, RING, D), float("nan"), dtype=torch.bfloat16, device=device)
        self.buffer = torch.full((64, BUFFER_WIDTH), 7, dtype=torch.int32, device=device)  # rows past a batch: kept
        self.done = [0] * num_requests
        self.rng, self.device, self.classes = rng, device, classes

    def pool_slot(self, r, p):
        return int(self.table[r, p // ROWS]) * ROWS + p % ROWS

    def step(self, call, decodes, prefills, split=None):
        """decodes: (request, new tokens); prefills: (request, new tokens), in one chunk or two
        parted at prefill token ``split``. ``call(meta, tail_meta, q, k, weights, gate, ape, positions)`` runs the
        indexer (k and gate padded past the batch, as vLLM pads them to the CUDA-graph batch) and returns the
        buffer. Returns the batch's (request, position) per token, q and weights."""
        dev, cls = self.device, self.classes
        self.buffer.fill_(7)
        tokens = [(r, self.done[r] + j) for r, new in decodes + prefills for j in range(new)]
        n = len(tokens)
        k, gate = (torch.from_numpy(np.stack([x[r, p] for r, p in tokens] + [x[0, 0]]).view(np.int16))
                   .view(torch.bfloat16).to(dev) for x in (self.k, self.gate))
        positions = torch.tensor([p for _, p in tokens], dtype=torch.int64, device=dev)
        pool_slots = [self.pool_slot(r, (p + 1) // KPOOL - 1) if (p + 1) % KPOOL == 0 else -1 for r, p in tokens]
        tail_slots = [int(self.tail_block[r]) * RING + p % RING for r, p in tokens]
        q = torch.from_numpy(self.rng.standard_normal((n, H_I, D)).astype(np.float32) * 4).to(torch.float8_e4m3fn)
        weights = torch.from_numpy(self.rng.standard_normal((n, H_I)).astype(np.float32))
        q, weights = q.to(dev), weights.to(dev)
        weights[:, ACTIVE_HEADS:] = 0

        decode_tokens = sum(new for _, new in decodes)
        decode = None
        if decodes:
            next_n = max(new for _, new in decodes)
            # Whole pools of each token's context, [B, next_n] ([B, 1] without drafts) as vLLM divides them; with
            # unequal query lengths a request's tokens are its row's last columns (vLLM's padded native layout).
            seq_lens = int32([[max(self.done[r] + new - next_n + j + 1, 0) // KPOOL for j in range(next_n)]
                              for r, new in decodes], dev)
            decode = cls.Decode(
                block_table=torch.from_numpy(self.table[[r for r, _ in decodes]]).to(dev), seq_lens=seq_lens,
                decode_lens=int32([new for _, new in decodes], dev),
                requires_padding=any(new != next_n for _, new in decodes), schedule_metadata=torch.empty(0))
        prefill = None
        if prefills:  # the requests' pools laid end to end
            pools = [(self.done[r] + new) // KPOOL for r, new in prefills]
            cu = np.concatenate([[0], np.cumsum(pools)]).astype(np.int32)
            ks = [cu[i] for i, (_, new) in enumerate(prefills) for _ in range(new)]
            ke = [cu[i] + (self.done[r] + j + 1) // KPOOL for i, (r, new) in enumerate(prefills) for j in range(new)]
            parts = [(0, len(ks))] if split is None else [(0, split), (split, len(ks))]
            prefill = cls.Prefill(chunks=[cls.Chunk(
                block_table=torch.from_numpy(self.table[[r for r, _ in prefills]]).to(dev),
                cu_seqlen_ks=int32(ks[a:b], dev), cu_seqlen_ke=int32(ke[a:b], dev),
                cu_seq_lens=torch.from_numpy(cu).to(dev), token_to_seq=torch.empty(0),
                total_seq_lens=int(cu[-1]), max_seqlen_k=max(pools), token_start=decode_tokens + a,
                token_end=decode_tokens + b, num_reqs=len(prefills)) for a, b in parts])
        meta = cls.Metadata(
            seq_lens=int32([(self.done[r] + new) // KPOOL for r, new in decodes + prefills], dev),
            max_seq_len=max((self.done[r] + new) // KPOOL for r, new in decodes + prefills),
            slot_mapping=torch.tensor(pool_slots, dtype=torch.int64, device=dev), num_decodes=len(decodes),
            num_decode_tokens=decode_tokens, num_prefills=len(prefills), num_prefill_tokens=n - decode_tokens,
            decode=decode, prefill=prefill)
        tail_meta = cls.Metadata(
            seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len, slot_mapping=torch.tensor(tail_slots, device=dev),
            num_decodes=0, num_decode_tokens=0, num_prefills=0, num_prefill_tokens=0, decode=None, prefill=None)
        result = call(meta, tail_meta, q, k, weights, gate, torch.from_numpy(self.ape).to(dev), positions)
        assert result is self.buffer
        for r, new in decodes + prefills:
            self.done[r] += new
        return tokens, q, weights

    def check(self, tokens, q, weights):
        keys, scales = index_cache_keys(self.cache.cpu().numpy())
        # Every pool completed so far: the model's pool of its tokens (fp8 with a power-of-two scale).
        for r, done in enumerate(self.done):
            for p in range(done // KPOOL):
                want = pooled(self.k[r, None, p * KPOOL:(p + 1) * KPOOL], self.gate[r, None, p * KPOOL:(p + 1) * KPOOL],
                              self.ape)[0]
                slot = self.pool_slot(r, p)
                got = keys[slot] * scales[slot]
                tol = 6.7e-2 * np.abs(want) + 4e-3 * np.abs(want).max() + scales[slot] * 2.0**-9
                assert np.all(np.abs(got - want) <= tol), (r, p)
        q64 = q.float().cpu().numpy().astype(np.float64)
        buffer, weights = self.buffer.cpu(), weights.cpu()
        for t, (r, p) in enumerate(tokens):
            row = buffer[t].numpy()
            whole = (p + 1) // KPOOL
            slots = np.array([self.pool_slot(r, i) for i in range(whole)], dtype=np.int64)
            n = min(SELECT, whole)
            chosen = row[:n * KPOOL].reshape(n, KPOOL)
            pools = chosen[:, 0] // KPOOL
            np.testing.assert_array_equal(chosen, pools[:, None] * KPOOL + np.arange(KPOOL))  # whole pools
            assert len(set(pools.tolist())) == n and np.all((pools >= 0) & (pools < whole))
            if n:
                scores = indexer_scores(q64[t], weights[t].numpy(), keys, scales, slots)
                assert np.all(np.diff(pools) > 0)  # unsorted top-k: ascending pools
                np.testing.assert_allclose(np.sort(scores[pools])[::-1], np.sort(scores)[::-1][:n], rtol=1e-5,
                                           atol=1e-6)
            assert np.all(row[n * KPOOL:SELECT * KPOOL] == -1)
            tail = np.arange(whole * KPOOL, p + 1)  # the incomplete pool's tokens, the current one included
            np.testing.assert_array_equal(row[SELECT * KPOOL:WIDTH], np.pad(tail, (0, KPOOL - 1 - len(tail)),
                                                                            constant_values=-1))
            assert np.all(row[WIDTH:] == -1)
        assert torch.all(buffer[len(tokens):] == 7)
