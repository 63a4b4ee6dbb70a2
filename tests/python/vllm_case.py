"""Test data in vLLM's (0.33) sparse-MLA layouts, built the way vLLM builds them, and its float64 reference.

- the paged cache ``[num_blocks, block_size, 576 | 512]`` (bf16/fp16) or ``[..., 656]`` uint8 (fp8_ds_mla), a view
  of a larger buffer whose blocks are ``block_size + pad_rows`` rows apart (other layers' pages in between);
  every row nobody wrote is NaN;
- ``topk_indices`` as vLLM's ``triton_convert_req_index_to_global_index(..., return_valid_counts=True)`` leaves
  them: each token's logical top-k positions through its request's block-table row to
  ``block * block_stride_rows + offset``, the valid ones compacted to the front, then -1; ``valid_counts`` counts
  them. Past the count we put rows that hold NaN: the op must never read there;
- ``q`` whole ``[T, H, 576 | 512]`` or as vLLM's pair ``(ql_nope [T, H, 512], q_pe [T, H, 64 | 0])``.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import numpy as np

from reference import FP8_ROW, LATENT, ROPE, attention, dequantize_ds_mla, dtype, quantize_ds_mla


@dataclasses.dataclass
class VllmCase:
    q: np.ndarray             # [T, H, d_qk] in the query dtype
    buffer: np.ndarray        # [num_blocks, block_size + pad_rows, row]: the whole allocation
    block_size: int
    topk_indices: np.ndarray  # [T, K] int32 physical rows, compacted, -1 padded
    valid_counts: np.ndarray  # [T] int32
    scale: float
    kind: str                 # bfloat16 | float16 | fp8_ds_mla

    @property
    def kv_cache(self) -> np.ndarray:
        """vLLM's cache tensor: the buffer's first block_size rows of every block."""
        return self.buffer[:, :self.block_size, :]

    def reference(self) -> Tuple[np.ndarray, np.ndarray]:
        """(out [T, H, 512], lse [T, H]) in float64; entries past valid_counts are not part of the top-k."""
        flat = self.buffer.reshape(-1, self.buffer.shape[-1])
        rows = dequantize_ds_mla(flat) if self.kind == "fp8_ds_mla" else np.asarray(flat, np.float64)
        d_qk = self.q.shape[-1]
        q = np.asarray(self.q, np.float64)
        return attention(q, rows[:, :d_qk], self.topk_indices, self.scale, topk_length=self.valid_counts)


def make_case(rng: np.random.Generator, *, kind: str, q_dtype: str = "bfloat16", heads: int = 8,
              block_size: int = 16, pad_rows: int = 3, topk: int = 64, rope: bool = True,
              requests: List[Tuple[int, int]] = ((37, 1), (5, 1), (130, 1), (20, 6), (90, 9))) -> VllmCase:
    """``requests``: (context length including the new tokens, new tokens) each; decodes (1 new token) first, as
    vLLM orders the batch. Tokens whose context is shorter than topk attend to all of it, longer ones to a random
    subset."""
    d_qk = LATENT + (ROPE if rope else 0)
    row = FP8_ROW if kind == "fp8_ds_mla" else d_qk
    blocks_per_request = [-(-ctx // block_size) for ctx, _ in requests]
    num_blocks = sum(blocks_per_request) + 3  # some blocks no request owns
    stride_rows = block_size + pad_rows
    if kind == "fp8_ds_mla":
        buffer = np.full((num_blocks, stride_rows, row), 0x7F, np.uint8)  # e4m3 0x7f is NaN
    else:
        buffer = np.full((num_blocks, stride_rows, row), np.nan, dtype(kind))
    flat = buffer.reshape(-1, row)
    order = rng.permutation(num_blocks).astype(np.int32)  # requests' blocks in no particular order
    tables, start = [], 0
    for n in blocks_per_request:
        tables.append(order[start:start + n])
        start += n

    def physical(table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return table[positions // block_size] * stride_rows + positions % block_size

    for (ctx, _), table in zip(requests, tables):
        slots = physical(table, np.arange(ctx))
        latent = rng.standard_normal((ctx, LATENT)).astype(np.float32)
        k_pe = rng.standard_normal((ctx, ROPE)).astype(np.float32)
        if kind == "fp8_ds_mla":
            flat[slots] = quantize_ds_mla(latent, k_pe)  # rope-free heads leave the rope bytes unread
        else:
            flat[slots] = np.concatenate([latent, k_pe], 1)[:, :d_qk].astype(dtype(kind))

    unwritten = np.flatnonzero(np.isnan(np.asarray(flat[:, 0], np.float64) if kind != "fp8_ds_mla"
                                        else dequantize_ds_mla(flat[:, :])[:, 0]))
    indices, counts = [], []
    for (ctx, new), table in zip(requests, tables):
        for j in range(new):
            visible = ctx - new + j + 1  # causal: positions [0, visible)
            chosen = np.arange(visible) if visible <= topk else rng.choice(visible, size=topk, replace=False)
            chosen = rng.permutation(chosen)
            rows = np.full(topk, -1, np.int64)
            rows[:chosen.size] = physical(table, chosen)
            if chosen.size < topk and unwritten.size:  # past the count: NaN rows that must not be read
                rows[chosen.size:chosen.size + 2] = rng.choice(unwritten, size=min(2, topk - chosen.size))
            indices.append(rows)
            counts.append(chosen.size)
    tokens = len(indices)
    q = rng.standard_normal((tokens, heads, d_qk)).astype(dtype(q_dtype))
    return VllmCase(q=q, buffer=buffer, block_size=block_size, topk_indices=np.asarray(indices, np.int32),
                    valid_counts=np.asarray(counts, np.int32), scale=d_qk ** -0.5, kind=kind)


def check(name: str, ans: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> None:
    """ans against the float64 reference: same infinities, no NaN, close elsewhere."""
    ans = np.asarray(ans, np.float64)
    assert ans.shape == ref.shape, (name, ans.shape, ref.shape)
    for special in (np.inf, -np.inf):
        np.testing.assert_array_equal(ans == special, ref == special, err_msg=name)
    assert not np.isnan(ans).any(), name
    finite = np.isfinite(ref)
    np.testing.assert_allclose(ans[finite], ref[finite], atol=atol, rtol=rtol, err_msg=name)


def out_tolerance(ref_out: np.ndarray) -> Tuple[float, float]:
    """bf16/fp16 outputs: one rounding of the output plus accumulated error."""
    return 1e-3 + 2**-8 * float(np.abs(ref_out).max()), 2.01 / 128
