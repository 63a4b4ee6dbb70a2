"""The sparse-MLA kernel entry of smla's vLLM backend, on torch tensors in
vLLM's layouts; no vLLM import (the GPU contract tests call it without vLLM).

vLLM (0.33) hands a sparse-MLA impl's ``_forward_mqa_kernel``:

- ``q``: ``[T, H, 576]`` (512 absorbed nope + 64 rope), or the pair
  ``(ql_nope [T, H, 512], q_pe [T, H, 64 | 0])``; bf16 or fp16.
- ``kv_cache``: ``[num_blocks, block_size, 576 | 512]`` in q's dtype, or
  ``[num_blocks, block_size, 656]`` uint8 (fp8_ds_mla); its block stride may
  exceed ``block_size`` rows (other layers' pages sit in between).
- ``topk_indices``: ``[T, K]`` int32 rows of the flat row view of the cache,
  ``block_id * block_stride_rows + offset`` (``flat_kv_row_view``), the valid
  ones compacted to the front, the rest -1; ``valid_counts``: ``[T]`` int32,
  how many are valid.

smla's ``sparse_mla`` addresses a cache of ``[blocks, block_size, row]`` by
slot ``block * block_size + offset``: the same rows seen as blocks of one
token (block stride = row stride) make vLLM's row index smla's slot, with no
copy, and ``valid_counts`` is smla's ``topk_length`` (entries past it are
never read). The only copy is the concatenation of a ``(ql_nope, q_pe)``
pair with a rope part (smla takes q whole); heads with no rope part pass
``ql_nope`` as it is.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .. import torch_ops


def _cache_dtype(kv_cache: Tensor) -> str:
    """smla's name for vLLM's cache: 8-bit rows are fp8_ds_mla (656 bytes a token, also for heads of 512, whose
    rope part is then unused); otherwise the cache holds q's dtype."""
    return "fp8_ds_mla" if kv_cache.element_size() == 1 else "auto"


def query(q: Union[Tensor, Tuple[Tensor, Tensor]]) -> Tensor:
    """vLLM's MQA query as one ``[T, H, 576 | 512]`` tensor."""
    if not isinstance(q, tuple):
        return q
    ql_nope, q_pe = q
    if q_pe.shape[-1] == 0:  # heads with no rope part: nothing to append
        return ql_nope
    return torch.cat((ql_nope, q_pe), dim=-1)


def cache_rows(kv_cache: Tensor) -> Tensor:
    """vLLM's paged cache ``[num_blocks, block_size, row]`` as ``[num_rows, 1, row]``: one token per block, so
    that the flat row index ``block_id * block_stride_rows + offset`` is the slot. Rows between this layer's
    blocks (other layers' pages) are never indexed by vLLM's conversion; no data moves."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, row], got shape {tuple(kv_cache.shape)}")
    num_blocks, block_size, row = kv_cache.shape
    row_stride = kv_cache.stride(1) if block_size > 1 else row
    if kv_cache.stride(2) != 1 or row_stride != row or kv_cache.stride(0) % row != 0:
        raise ValueError(
            f"kv_cache: expected rows of {row} elements packed within a block and a block stride that is a whole "
            f"number of rows, got strides {tuple(kv_cache.stride())}")
    block_stride_rows = kv_cache.stride(0) // row
    num_rows = (num_blocks - 1) * block_stride_rows + block_size if num_blocks > 0 else 0
    return kv_cache.as_strided((num_rows, 1, row), (row, row, 1))


def sparse_mla_forward(q: Union[Tensor, Tuple[Tensor, Tensor]], kv_cache: Tensor, topk_indices: Tensor,
                       valid_counts: Optional[Tensor], *, scale: float, attn_sink: Optional[Tensor] = None,
                       backend: str = "", out: Optional[Tensor] = None,
                       lse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Sparse MLA on vLLM's tensors through ``torch.ops.smla.sparse_mla``: returns (out ``[T, H, 512]`` in q's
    dtype, lse ``[T, H]`` float32, natural log, -inf for a token with no valid index). Given both ``out`` and
    ``lse`` (an engine's preallocated buffers), ``sparse_mla.out`` writes them and they are returned: no
    allocation. Capturable in a CUDA graph (outputs and scratch come from torch's caching allocator, on the
    current stream)."""
    q = query(q)
    ops = torch_ops.routed()
    args = (q, cache_rows(kv_cache), topk_indices, valid_counts, attn_sink, float(scale), _cache_dtype(kv_cache),
            backend)
    if out is None and lse is None:
        return ops.sparse_mla(*args)
    if out is None or lse is None:
        raise ValueError("out and lse: give both (the buffers sparse_mla.out writes) or neither")
    ops.sparse_mla_out(*args, out=out, lse=lse)
    return out, lse
