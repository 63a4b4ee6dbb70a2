"""FlashMLA's public Python API on smla's backends.

    from smla.flash_mla import get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd

in place of ``from flash_mla import ...``: the same functions, arguments,
shapes, output layouts and conventions (lse as (b, h_q, s_q) for
flash_mla_with_kvcache, +inf lse for a query with nothing to attend, the
sink left out of lse), on every GPU from SM80 to SM120 and on the CPU
(numpy arrays work too). Where FlashMLA only accepts a subset (64/128 heads,
FP8-only sparse decode, bf16 only), smla accepts more. docs/python.md lists
the mapping and every difference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

from . import _arrays, _smla
from . import ops as _ops

Tensor = Any

#: Columns of FlashMLA's tile_scheduler_metadata (its TileSchedulerMetaDataSize).
TILE_SCHEDULER_METADATA_SIZE = 8
_HEAD_DIM_QK = 576
_HEAD_DIM_V = 512


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling object. smla's kernels need no precomputed
    schedule: the object records the first call's configuration and later
    calls must match it, as with FlashMLA."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[Tensor] = None
    num_splits: Optional[Tensor] = None


def get_mla_metadata(*args: Any, **kwargs: Any) -> Tuple[Any, Any]:
    """FlashMLA's ``get_mla_metadata``, both forms.

    ``get_mla_metadata()`` returns ``(FlashMLASchedMeta(), None)``, filled
    lazily by the first ``flash_mla_with_kvcache`` call (FlashMLA's current
    API). The older form ``get_mla_metadata(cache_seqlens,
    num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
    is_fp8_kvcache=False, topk=None)`` returns ``(tile_scheduler_metadata
    (1, 8) int32, num_splits (batch_size + 1,) int32)`` on cache_seqlens'
    device: placeholders with FlashMLA's shapes and dtypes (one split per
    request), which flash_mla_with_kvcache accepts and ignores."""
    if not args and not kwargs:
        return FlashMLASchedMeta(), None
    return _legacy_metadata(*args, **kwargs)


def _legacy_metadata(cache_seqlens: Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_heads_q: Optional[int] = None, is_fp8_kvcache: bool = False,
                     topk: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    batch = int(cache_seqlens.shape[0])
    if _arrays.framework(cache_seqlens) == "torch":
        import torch

        device = cache_seqlens.device
        return (torch.zeros((1, TILE_SCHEDULER_METADATA_SIZE), dtype=torch.int32, device=device),
                torch.arange(batch + 1, dtype=torch.int32, device=device))
    xp = _array_module(cache_seqlens)
    return xp.zeros((1, TILE_SCHEDULER_METADATA_SIZE), dtype=xp.int32), xp.arange(batch + 1, dtype=xp.int32)


def flash_mla_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    block_table: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Any,
    num_splits: Any = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices_in_kvcache: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> Tuple[Tensor, Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache``: paged MLA decode.

    q (b, s_q, h_q, 576) bf16/fp16; k_cache (num_blocks, page_block_size,
    1, 576) in q's dtype, or (..., 1, 656) fp8_ds_mla bytes with
    ``is_fp8_kvcache=True`` (a 3-D cache without the head axis works too).
    Dense (``indices`` None): block_table (b, max_blocks) and cache_seqlens
    (b,) int32, ``causal`` masks the s_q new tokens among themselves.
    Sparse: indices (b, s_q, topk) int32 physical slots (block * block_size +
    offset; -1, any negative or >= num_slots is skipped), optional
    topk_length (b,) (or (b, s_q)) and attn_sink (h_q,) float32.
    softmax_scale defaults to 576^-0.5, as FlashMLA's does.

    Returns (out (b, s_q, h_q, 512) in q's dtype, lse (b, h_q, s_q)
    float32): natural log, without the sink, +inf where a query has nothing
    to attend (its out is 0). ``backend`` (smla only) forces a backend."""
    if head_dim_v != _HEAD_DIM_V:
        raise _smla.InvalidArgumentError(f"head_dim_v: must be {_HEAD_DIM_V}, got {head_dim_v}")
    if extra_k_cache is not None or extra_indices_in_kvcache is not None or extra_topk_length is not None:
        raise _smla.UnsupportedError("extra_k_cache / extra_indices_in_kvcache / extra_topk_length (FlashMLA's "
                                     "512-dim MODEL1 layout) are not supported by smla")
    if len(q.shape) != 4:
        raise _smla.InvalidArgumentError(f"q: expected (batch_size, seq_len_q, num_heads_q, 576), got {tuple(q.shape)}")
    b, s_q, h_q, d = (int(x) for x in q.shape)
    cache = _cache_3d(k_cache)
    topk = int(indices.shape[-1]) if indices is not None else None
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        if num_splits is not None:
            raise _smla.InvalidArgumentError("num_splits: must be None with a FlashMLASchedMeta")
        _check_sched_meta(tile_scheduler_metadata, FlashMLASchedMeta.Config(
            b, s_q, h_q, int(k_cache.shape[1]), int(k_cache.shape[2]) if len(k_cache.shape) == 4 else 1,
            bool(causal), bool(is_fp8_kvcache), topk, None, None))
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    kv_cache_dtype = _kv_cache_dtype(k_cache, is_fp8_kvcache)

    if indices is not None:
        if causal:
            raise _smla.InvalidArgumentError("causal: must be False when indices is given (sparse attention)")
        tokens = b * s_q
        if topk_length is not None and len(topk_length.shape) == 1 and s_q > 1:
            topk_length = _repeat(topk_length, s_q)  # FlashMLA's is per request; smla's per query token
        out, lse = _ops.sparse_mla(
            q.reshape(tokens, h_q, d), cache, indices.reshape(tokens, topk), softmax_scale=softmax_scale,
            topk_length=None if topk_length is None else topk_length.reshape(tokens), attn_sink=attn_sink,
            kv_cache_dtype=kv_cache_dtype, backend=backend)
        out = out.reshape(b, s_q, h_q, _HEAD_DIM_V)
        lse = lse.reshape(b, s_q, h_q)
    else:
        if topk_length is not None:
            raise _smla.InvalidArgumentError("topk_length: only valid with indices (sparse attention)")
        if block_table is None or cache_seqlens is None:
            raise _smla.InvalidArgumentError("block_table and cache_seqlens must be given for dense attention")
        out, lse = _ops.paged_mla_decode(
            q, cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal, attn_sink=attn_sink,
            kv_cache_dtype=kv_cache_dtype, backend=backend)
    return out, _flashmla_lse(_transpose_last_two(lse))


def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    *,
    return_max_logits: bool = True,
    backend: Optional[str] = None,
) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """FlashMLA's ``flash_mla_sparse_fwd``: sparse MLA prefill.

    q (s_q, h_q, 576), kv (s_kv, 1, 576) bf16 (fp16 works too), indices
    (s_q, 1, topk) int32 rows of kv (negative or >= s_kv: skipped), optional
    attn_sink (h_q,) float32 and topk_length (s_q,) int32.

    Returns (out (s_q, h_q, 512), max_logits (s_q, h_q), lse (s_q, h_q)):
    max_logits is the largest ``sm_scale * q.k`` over the valid indices
    (-inf if none), lse the natural-log sum of exp of those (+inf if none);
    neither includes the sink. smla's kernels do not produce max_logits: it
    is computed here from the gathered rows (in float64, chunked), which costs
    about as much as the attention; ``return_max_logits=False`` (smla only)
    skips it and returns None in its place."""
    if d_v != _HEAD_DIM_V:
        raise _smla.InvalidArgumentError(f"d_v: must be {_HEAD_DIM_V}, got {d_v}")
    if len(kv.shape) != 3 or int(kv.shape[1]) != 1:
        raise _smla.InvalidArgumentError(f"kv: expected (s_kv, 1, d_qk) (h_kv must be 1), got {tuple(kv.shape)}")
    if len(indices.shape) != 3 or int(indices.shape[1]) != 1:
        raise _smla.InvalidArgumentError(f"indices: expected (s_q, 1, topk) (h_kv must be 1), got "
                                         f"{tuple(indices.shape)}")
    idx = indices[:, 0, :]
    # kv is a paged cache of s_kv blocks of one token, so indices are its slots.
    out, lse = _ops.sparse_mla(q, kv, idx, softmax_scale=sm_scale, topk_length=topk_length, attn_sink=attn_sink,
                               backend=backend)
    max_logits = None
    if return_max_logits:
        if _arrays.is_8bit(kv):
            raise _smla.UnsupportedError("max_logits of an fp8 kv: pass return_max_logits=False")
        max_logits = _max_logits(q, kv[:, 0, :], idx, topk_length, float(sm_scale))
    return out, max_logits, _flashmla_lse(lse)


# --- helpers -------------------------------------------------------------------


def _check_sched_meta(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config) -> None:
    if not meta.have_initialized:
        meta.have_initialized = True
        meta.config = config
        return
    for field in dataclasses.fields(config):
        want, got = getattr(meta.config, field.name), getattr(config, field.name)
        if want != got:
            raise _smla.InvalidArgumentError(
                f"tile_scheduler_metadata: {field.name} is {got} but was {want} when this FlashMLASchedMeta was "
                "first used; use one get_mla_metadata() object per configuration")


def _cache_3d(k_cache: Tensor) -> Tensor:
    """FlashMLA's (num_blocks, page_block_size, 1, d) cache as smla's (num_blocks, page_block_size, d) view."""
    if len(k_cache.shape) == 4:
        if int(k_cache.shape[2]) != 1:
            raise _smla.InvalidArgumentError(f"k_cache: num_heads_k must be 1 (MLA), got {tuple(k_cache.shape)}")
        return k_cache[:, :, 0, :]
    return k_cache


def _kv_cache_dtype(k_cache: Tensor, is_fp8_kvcache: bool) -> str:
    if is_fp8_kvcache:
        return "fp8_ds_mla"
    if _arrays.is_8bit(k_cache):
        raise _smla.InvalidArgumentError("k_cache: 8-bit (FP8) data needs is_fp8_kvcache=True")
    return "auto"


def _array_module(x: Tensor) -> Any:
    if _arrays.framework(x) == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def _repeat(x: Tensor, times: int) -> Tensor:
    if _arrays.framework(x) == "torch":
        return x.repeat_interleave(times)
    return _array_module(x).repeat(x, times)


def _transpose_last_two(x: Tensor) -> Tensor:
    """(b, s_q, h_q) -> (b, h_q, s_q), contiguous as FlashMLA returns it."""
    if _arrays.framework(x) == "torch":
        return x.transpose(1, 2).contiguous()
    return _array_module(x).ascontiguousarray(x.transpose(0, 2, 1))


def _flashmla_lse(lse: Tensor) -> Tensor:
    """smla's lse of an empty row is -inf (the log of an empty sum); FlashMLA reports +inf."""
    if _arrays.framework(lse) == "torch":
        import torch

        return lse.masked_fill_(torch.isneginf(lse), math.inf)
    xp = _array_module(lse)
    lse[xp.isneginf(lse)] = math.inf
    return lse


_MAX_LOGITS_CHUNK_BYTES = 256 << 20


def _max_logits(q: Tensor, kv: Tensor, idx: Tensor, topk_length: Optional[Tensor], scale: float) -> Tensor:
    """max over valid k of scale * q[t, h] . kv[idx[t, k]], -inf where none is valid."""
    s_q, h_q, d = (int(x) for x in q.shape)
    topk, s_kv = int(idx.shape[-1]), int(kv.shape[0])
    chunk = max(1, _MAX_LOGITS_CHUNK_BYTES // (8 * topk * (d + h_q)))
    if _arrays.framework(q) == "torch":
        import torch

        valid = (idx >= 0) & (idx < s_kv)
        if topk_length is not None:
            valid &= torch.arange(topk, device=idx.device)[None, :] < topk_length[:, None]
        safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
        result = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
        for start in range(0, s_q, chunk):
            end = min(start + chunk, s_q)
            rows = kv[safe[start:end]].double()  # (c, topk, d); float64: exact products, no TF32
            logits = torch.einsum("chd,ckd->chk", q[start:end].double(), rows) * scale
            logits.masked_fill_(~valid[start:end, None, :], -math.inf)
            result[start:end] = logits.amax(dim=-1).float()
        return result
    xp = _array_module(q)
    idx = xp.asarray(idx)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= xp.arange(topk)[None, :] < xp.asarray(topk_length)[:, None]
    safe = xp.where(valid, idx, 0)
    result = xp.empty((s_q, h_q), dtype=xp.float32)
    for start in range(0, s_q, chunk):
        end = min(start + chunk, s_q)
        rows = xp.take(kv, safe[start:end], axis=0).astype(xp.float64)
        logits = xp.einsum("chd,ckd->chk", q[start:end].astype(xp.float64), rows) * scale
        logits = xp.where(valid[start:end, None, :], logits, -math.inf)
        result[start:end] = logits.max(axis=-1)
    return result
