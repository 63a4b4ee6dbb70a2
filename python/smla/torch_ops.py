"""PyTorch integration: the ops registered as ``torch.ops.smla.*`` custom ops
(torch >= 2.4) with fake (meta) implementations, so torch.compile traces them
and CUDA graphs capture them. Importing this module registers them; the
``smla`` functions route torch tensors here on their own.

The ops allocate their outputs with torch (on the inputs' device, through
torch's caching allocator) and run on torch's current stream. fp8 tensors
(float8_e4m3fn, int8 or uint8) are read as bytes.
"""

# No `from __future__ import annotations`: torch.library reads the real
# annotations to infer each op's schema.
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import flash_mla as _flash_mla
from . import ops as _ops

_LATENT_DIM = 512


def available() -> bool:
    """True when this torch can register custom ops (torch >= 2.4)."""
    return _REGISTERED


def ops() -> Any:
    """The ``torch.ops.smla`` namespace."""
    return torch.ops.smla


def _attention_out(q: Tensor) -> Tuple[Tensor, Tensor]:
    lead = tuple(q.shape[:-1])
    return q.new_empty(lead + (_LATENT_DIM,)), q.new_empty(lead, dtype=torch.float32)


def _register() -> bool:
    library = torch.library
    if not (hasattr(library, "custom_op") and hasattr(library, "register_fake")):
        return False
    custom_op = library.custom_op

    @custom_op("smla::write_mla_cache", mutates_args=("cache",))
    def write_mla_cache(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, cache: Tensor,
                        kv_cache_dtype: str = "auto", backend: str = "") -> None:
        _ops._write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype, None, backend)

    @write_mla_cache.register_fake
    def _(latent, k_pe, slot_mapping, cache, kv_cache_dtype="auto", backend=""):
        return None

    @custom_op("smla::sparse_mla", mutates_args=())
    def sparse_mla(q: Tensor, kv_cache: Tensor, indices: Tensor, topk_length: Optional[Tensor],
                   attn_sink: Optional[Tensor], softmax_scale: float, kv_cache_dtype: str = "auto",
                   backend: str = "") -> Tuple[Tensor, Tensor]:
        out, lse = _attention_out(q)
        _ops._sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, out, lse, kv_cache_dtype,
                         None, backend)
        return out, lse

    @sparse_mla.register_fake
    def _(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype="auto", backend=""):
        return _attention_out(q)

    @custom_op("smla::paged_mla_decode", mutates_args=())
    def paged_mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                         attn_sink: Optional[Tensor], softmax_scale: float, causal: bool = True,
                         kv_cache_dtype: str = "auto", backend: str = "") -> Tuple[Tensor, Tensor]:
        out, lse = _attention_out(q)
        _ops._paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, out, lse,
                               kv_cache_dtype, None, backend)
        return out, lse

    @paged_mla_decode.register_fake
    def _(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal=True, kv_cache_dtype="auto",
          backend=""):
        return _attention_out(q)

    @custom_op("smla::write_index_cache", mutates_args=("cache",))
    def write_index_cache(k: Tensor, slot_mapping: Tensor, cache: Tensor, index_cache_dtype: str = "auto",
                          backend: str = "") -> None:
        _ops._write_index_cache(k, slot_mapping, cache, index_cache_dtype, None, backend)

    @write_index_cache.register_fake
    def _(k, slot_mapping, cache, index_cache_dtype="auto", backend=""):
        return None

    @custom_op("smla::indexer_topk", mutates_args=())
    def indexer_topk(q: Tensor, q_scale: Optional[Tensor], weights: Tensor, index_cache: Tensor,
                     request_ids: Tensor, block_table: Tensor, context_lens: Tensor, topk: int,
                     index_cache_dtype: str = "auto", backend: str = "") -> Tensor:
        out = q.new_empty((q.shape[0], topk), dtype=torch.int32)
        _ops._indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, out,
                           index_cache_dtype, None, backend)
        return out

    @indexer_topk.register_fake
    def _(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, topk,
          index_cache_dtype="auto", backend=""):
        return q.new_empty((q.shape[0], topk), dtype=torch.int32)

    @custom_op("smla::positions_to_slots", mutates_args=())
    def positions_to_slots(positions: Tensor, request_ids: Tensor, block_table: Tensor, block_size: int,
                           backend: str = "") -> Tensor:
        slots = positions.new_empty(positions.shape, dtype=torch.int32)
        _ops._positions_to_slots(positions, request_ids, block_table, block_size, slots, None, backend)
        return slots

    @positions_to_slots.register_fake
    def _(positions, request_ids, block_table, block_size, backend=""):
        return positions.new_empty(positions.shape, dtype=torch.int32)

    @custom_op("smla::dsa_decode_step", mutates_args=())
    def dsa_decode_step(q: Tensor, kv_cache: Tensor, index_q: Tensor, index_weights: Tensor, index_cache: Tensor,
                        request_ids: Tensor, block_table: Tensor, context_lens: Tensor,
                        index_q_scale: Optional[Tensor], attn_sink: Optional[Tensor], topk: int,
                        softmax_scale: float, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto",
                        backend: str = "") -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        out, lse = _attention_out(q)
        positions = q.new_empty((q.shape[0], topk), dtype=torch.int32)
        slots = q.new_empty((q.shape[0], topk), dtype=torch.int32)
        _ops._dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table,
                              context_lens, index_q_scale, attn_sink, softmax_scale, out, lse, positions, slots,
                              kv_cache_dtype, index_cache_dtype, None, backend)
        return out, lse, positions, slots

    @dsa_decode_step.register_fake
    def _(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens, index_q_scale,
          attn_sink, topk, softmax_scale, kv_cache_dtype="auto", index_cache_dtype="auto", backend=""):
        out, lse = _attention_out(q)
        return (out, lse, q.new_empty((q.shape[0], topk), dtype=torch.int32),
                q.new_empty((q.shape[0], topk), dtype=torch.int32))

    # smla.flash_mla's two attention functions, with FlashMLA's output layouts written by the kernels.
    @custom_op("smla::flash_mla_with_kvcache", mutates_args=())
    def flash_mla_with_kvcache(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor],
                               cache_seqlens: Optional[Tensor], indices: Optional[Tensor],
                               topk_length: Optional[Tensor], attn_sink: Optional[Tensor], softmax_scale: float,
                               causal: bool, kv_cache_dtype: str = "auto", backend: str = "") -> Tuple[Tensor, Tensor]:
        out, lse = _kvcache_out(q)
        _flash_mla._with_kvcache_into(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink,
                                      softmax_scale, causal, kv_cache_dtype, out, lse, backend)
        return out, lse

    @flash_mla_with_kvcache.register_fake
    def _(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, softmax_scale, causal,
          kv_cache_dtype="auto", backend=""):
        return _kvcache_out(q)

    @custom_op("smla::flash_mla_sparse_fwd", mutates_args=())
    def flash_mla_sparse_fwd(q: Tensor, kv: Tensor, indices: Tensor, topk_length: Optional[Tensor],
                             attn_sink: Optional[Tensor], sm_scale: float,
                             backend: str = "") -> Tuple[Tensor, Tensor, Tensor]:
        out, lse = _attention_out(q)
        max_logits = torch.empty_like(lse)
        _flash_mla._sparse_fwd_into(q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse, backend)
        return out, max_logits, lse

    @flash_mla_sparse_fwd.register_fake
    def _(q, kv, indices, topk_length, attn_sink, sm_scale, backend=""):
        out, lse = _attention_out(q)
        return out, torch.empty_like(lse), lse

    return True


def _kvcache_out(q: Tensor) -> Tuple[Tensor, Tensor]:
    """flash_mla_with_kvcache's out (b, s_q, h_q, 512) and lse (b, h_q, s_q)."""
    b, s_q, h_q = q.shape[:3]
    return q.new_empty((b, s_q, h_q, _LATENT_DIM)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


_REGISTERED = _register()
