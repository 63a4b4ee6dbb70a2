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
    # `config`'s fields as a tuple: one comparison per call, which torch.compile traces (vars() it cannot).
    _config_fields: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)


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
    Heads with no rope part (GLM-5.3-Flash, smla only): q (..., 512) with a
    512-wide cache in q's dtype, the 656-byte fp8_ds_mla envelope (its rope
    part unused) or the 528-byte fp8_ds_mla_nope rows.
    Dense (``indices`` None): block_table (b, max_blocks) and cache_seqlens
    (b,) int32, ``causal`` masks the s_q new tokens among themselves.
    Sparse: indices (b, s_q, topk) int32 physical slots (block * block_size +
    offset; -1, any negative or >= num_slots is skipped), optional
    topk_length (b,) (or (b, s_q)) and attn_sink (h_q,) float32.
    softmax_scale defaults to d_qk^-0.5 (576^-0.5), as FlashMLA's does.

    DeepSeek-V4 (FlashMLA's MODEL1, sparse only): q (..., 512), 512-wide
    caches in q's dtype (the value is the whole row, rope dims included),
    and a second cache under the same softmax: extra_k_cache
    (extra_num_blocks, extra_page_block_size, 1, 512) with its own block
    size, extra_indices_in_kvcache (b, s_q, extra_topk) int32 slots of it
    and optional extra_topk_length (b,) (or (b, s_q)). With
    ``is_fp8_kvcache=True`` both caches are FlashMLA's 584-byte fp8 MODEL1
    layout (fp8_ds_mla_v4: (num_blocks, page_block_size, 1, 584) bytes, each
    block's bytes padded to a multiple of 576 as FlashMLA's quantize_k_cache
    makes them). The CPU and CUDA backends run the second cache in every
    cache format they read: bf16/f16, smla's fp8_ds_mla / fp8_ds_mla_nope
    rows and the fp8 MODEL1 cache (on CUDA its blocks 16-byte aligned, as
    FlashMLA's padding keeps them).

    Returns (out (b, s_q, h_q, 512) in q's dtype, lse (b, h_q, s_q)
    float32): natural log, without the sink, +inf where a query has nothing
    to attend (its out is 0). ``backend`` (smla only) forces a backend."""
    if head_dim_v != _HEAD_DIM_V:
        raise _smla.InvalidArgumentError(f"head_dim_v: must be {_HEAD_DIM_V}, got {head_dim_v}")
    sched = tile_scheduler_metadata if isinstance(tile_scheduler_metadata, FlashMLASchedMeta) else None
    if sched is not None and num_splits is not None:
        raise _smla.InvalidArgumentError("num_splits: must be None with a FlashMLASchedMeta")
    if indices is not None:
        if causal:
            raise _smla.InvalidArgumentError("causal: must be False when indices is given (sparse attention)")
    else:
        if topk_length is not None:
            raise _smla.InvalidArgumentError("topk_length: only valid with indices (sparse attention)")
        if block_table is None or cache_seqlens is None:
            raise _smla.InvalidArgumentError("block_table and cache_seqlens must be given for dense attention")
    torch_ops = _ops._torch_ops(q)
    if torch_ops is not None:
        # Host time per call matters here (a decode step calls this once per layer, issue 17): the op checks the
        # shapes (python/src/torch_ops.cpp, or the Python kernel, with _check_shapes' messages), so the wrapper
        # reads none before it; the FlashMLASchedMeta is set up or compared after the call, from shapes the op has
        # accepted (a call that fails leaves it as it was).
        if _arrays.is_8bit(k_cache) != bool(is_fp8_kvcache):
            # The shapes first, as the other arrays' path checks them, then the dtype mismatch (raises).
            _check_shapes(q, k_cache, indices, topk_length, extra_k_cache, extra_indices_in_kvcache,
                          extra_topk_length)
            _kv_cache_dtype(k_cache, is_fp8_kvcache)
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5 if q.dim() else 1.0  # a 0-d q: the op names it
        try:
            # "auto": the op reads 8-bit data as the fp8 format its row width names, as _kv_cache_dtype would.
            out, lse = torch_ops.overloads.flash_mla_with_kvcache(
                q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink,
                _ops._op_softmax_scale(softmax_scale), bool(causal), "auto", backend or "", extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length)
        except _smla.Error:
            raise
        except (ValueError, NotImplementedError) as e:
            raise _ops._smla_error(e) from None
        except RuntimeError:  # torch's own for an argument that is no tensor: named as the other arrays' path does
            try:
                _check_shapes(q, k_cache, indices, topk_length, extra_k_cache, extra_indices_in_kvcache,
                              extra_topk_length)
            except _smla.Error as err:
                raise err from None
            raise
        if sched is not None:
            _check_sched_meta(sched, _sched_config(q.shape, k_cache.shape, causal, is_fp8_kvcache, indices,
                                                   extra_k_cache, extra_indices_in_kvcache))
        return out, lse
    q_shape, k_shape, extra = _check_shapes(q, k_cache, indices, topk_length, extra_k_cache,
                                            extra_indices_in_kvcache, extra_topk_length)
    kv_cache_dtype = _kv_cache_dtype(k_cache, is_fp8_kvcache)
    if softmax_scale is None:
        softmax_scale = q_shape[3] ** -0.5
    b, s_q, h_q, _ = q_shape
    out = _arrays.empty(q, (b, s_q, h_q, _HEAD_DIM_V))
    lse = _arrays.empty(q, (b, h_q, s_q), "float32")
    _with_kvcache_into(q, _cache_3d(k_cache, k_shape), block_table, cache_seqlens, indices, topk_length, attn_sink,
                       softmax_scale, causal, kv_cache_dtype, out, lse, backend, extra)
    if sched is not None:  # as on torch tensors: set up or compared once the call has gone through
        _check_sched_meta(sched, _sched_config(q_shape, k_shape, causal, is_fp8_kvcache, indices, extra_k_cache,
                                               extra_indices_in_kvcache))
    return out, lse


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

    q (s_q, h_q, d_qk), kv (s_kv, 1, d_qk) bf16 (fp16 works too), d_qk 576
    (or 512 for heads with no rope part, smla only), indices
    (s_q, 1, topk) int32 rows of kv (negative or >= s_kv: skipped), optional
    attn_sink (h_q,) float32 and topk_length (s_q,) int32.

    Returns (out (s_q, h_q, 512), max_logits (s_q, h_q), lse (s_q, h_q)):
    max_logits is the largest ``sm_scale * q.k`` over the valid indices
    (-inf if none), lse the natural-log sum of exp of those (+inf if none);
    neither includes the sink. Both come from the attention kernel itself;
    ``return_max_logits=False`` (smla only) returns None in max_logits' place."""
    if d_v != _HEAD_DIM_V:
        raise _smla.InvalidArgumentError(f"d_v: must be {_HEAD_DIM_V}, got {d_v}")
    _arrays.shape(q, "q")
    sm_scale = _ops._softmax_scale(sm_scale, "sm_scale")
    # kv is a paged cache of s_kv blocks of one token, so indices are its slots.
    torch_ops = _ops._torch_ops(q)
    if torch_ops is not None:
        out, max_logits, lse = torch_ops.flash_mla_sparse_fwd(q, kv, indices, topk_length, attn_sink, sm_scale,
                                                              backend or "")
    else:
        s_q, h_q = (int(x) for x in q.shape[:2])
        out = _arrays.empty(q, (s_q, h_q, _HEAD_DIM_V))
        max_logits = _arrays.empty(q, (s_q, h_q), "float32")
        lse = _arrays.empty(q, (s_q, h_q), "float32")
        _sparse_fwd_into(q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse, backend)
    return out, max_logits if return_max_logits else None, lse


# --- helpers -------------------------------------------------------------------


def _check_sched_meta(meta: FlashMLASchedMeta, config: tuple) -> None:
    """`config`: this call's FlashMLASchedMeta.Config fields, in order (a tuple: cheap to compare per call)."""
    if not meta.have_initialized:
        meta.have_initialized = True
        meta.config = FlashMLASchedMeta.Config(*config)
        meta._config_fields = config
        return
    if meta._config_fields == config:
        return
    for field, got in zip(dataclasses.fields(meta.config), config):
        want = getattr(meta.config, field.name)
        if want != got:
            raise _smla.InvalidArgumentError(
                f"tile_scheduler_metadata: {field.name} is {got} but was {want} when this FlashMLASchedMeta was "
                "first used; use one get_mla_metadata() object per configuration")


def _check_shapes(q: Tensor, k_cache: Tensor, indices: Optional[Tensor], topk_length: Optional[Tensor],
                  extra_k_cache: Optional[Tensor], extra_indices: Optional[Tensor],
                  extra_topk_length: Optional[Tensor]) -> Tuple[tuple, tuple, Optional[tuple]]:
    """q's and k_cache's shapes and MODEL1's second cache (_extra_cache), after checking flash_mla_with_kvcache's
    shapes against each other; python/src/torch_ops.cpp checks them in the same order with the same messages."""
    q_shape = _arrays.shape(q, "q")
    if len(q_shape) != 4:
        raise _smla.InvalidArgumentError(f"q: expected (batch_size, seq_len_q, num_heads_q, 576 | 512), got {q_shape}")
    k_shape = _arrays.shape(k_cache, "k_cache")
    _check_heads_k(k_shape)
    b, s_q = q_shape[:2]
    if indices is not None:
        _sparse_shapes(b, s_q, indices, topk_length)
    return q_shape, k_shape, _extra_cache(b, s_q, indices, extra_k_cache, extra_indices, extra_topk_length)


def _sched_config(q_shape: tuple, k_shape: tuple, causal: bool, is_fp8_kvcache: bool, indices: Optional[Tensor],
                  extra_k_cache: Optional[Tensor], extra_indices: Optional[Tensor]) -> tuple:
    """FlashMLASchedMeta.Config's fields for a call whose shapes were checked (_check_shapes), in order (indexed,
    not sliced: a torch.Size slice is a new torch.Size, per call)."""
    extra = extra_k_cache is not None
    return (q_shape[0], q_shape[1], q_shape[2], k_shape[1], k_shape[2] if len(k_shape) == 4 else 1, bool(causal),
            bool(is_fp8_kvcache), None if indices is None else indices.shape[2],
            extra_k_cache.shape[1] if extra else None, extra_indices.shape[2] if extra else None)


def _sparse_shapes(b: int, s_q: int, indices: Tensor, topk_length: Optional[Tensor], indices_name: str = "indices",
                   lengths_name: str = "topk_length") -> None:
    """Checks indices (b, s_q, topk) and topk_length (b,) or (b, s_q) against q's b and s_q."""
    shape = _arrays.shape(indices, indices_name)
    if len(shape) != 3 or shape[:2] != (b, s_q):
        raise _smla.InvalidArgumentError(
            f"{indices_name}: expected (batch_size, seq_len_q, topk) with q's batch_size {b} and seq_len_q {s_q}, "
            f"got {shape}")
    if topk_length is not None:
        lengths = _arrays.shape(topk_length, lengths_name)
        if lengths != (b,) and lengths != (b, s_q):
            raise _smla.InvalidArgumentError(
                f"{lengths_name}: expected ({b},) (per request) or ({b}, {s_q}) (per query token), got {lengths}")


def _extra_cache(b: int, s_q: int, indices: Optional[Tensor], extra_k_cache: Optional[Tensor],
                 extra_indices: Optional[Tensor], extra_topk_length: Optional[Tensor]) -> Optional[tuple]:
    """MODEL1's second cache as (extra cache (blocks, block_size, d), extra_indices, extra_topk_length), after
    checking that they come together, with indices, in FlashMLA's shapes; None without one."""
    if extra_k_cache is None and extra_indices is None and extra_topk_length is None:
        return None
    if extra_k_cache is None or extra_indices is None:
        raise _smla.InvalidArgumentError("extra_k_cache and extra_indices_in_kvcache: give both or neither "
                                         "(extra_topk_length needs them too)")
    if indices is None:
        raise _smla.InvalidArgumentError("extra_k_cache: only valid with indices (sparse attention)")
    shape = _arrays.shape(extra_k_cache, "extra_k_cache")
    _sparse_shapes(b, s_q, extra_indices, extra_topk_length, "extra_indices_in_kvcache", "extra_topk_length")
    if len(shape) == 4 and int(shape[2]) != 1:
        raise _smla.InvalidArgumentError(f"extra_k_cache: num_heads_k must be 1 (MLA), got {shape}")
    return (_select(extra_k_cache, 2, 0) if len(shape) == 4 else extra_k_cache), extra_indices, extra_topk_length


def _check_heads_k(shape: tuple) -> None:
    """A 4-D k_cache (num_blocks, page_block_size, num_heads_k, d) has one head (MLA); `shape`: k_cache's."""
    if len(shape) == 4 and shape[2] != 1:
        raise _smla.InvalidArgumentError(f"k_cache: num_heads_k must be 1 (MLA), got {shape}")


def _cache_3d(k_cache: Tensor, shape: tuple) -> Tensor:
    """FlashMLA's (num_blocks, page_block_size, 1, d) cache as smla's (num_blocks, page_block_size, d) view;
    `shape`: k_cache's. (python/src/torch_ops.cpp does the same for torch.ops.smla.flash_mla_with_kvcache.)"""
    _check_heads_k(shape)
    return _select(k_cache, 2, 0) if len(shape) == 4 else k_cache


def _select(x: Tensor, dim: int, index: int) -> Tensor:
    """x with dimension `dim` fixed at `index` (a view): torch's select is several times cheaper than indexing."""
    if _arrays.is_torch(x):
        return x.select(dim, index)
    return x[(slice(None),) * dim + (index,)]


def _kv_cache_dtype(k_cache: Tensor, is_fp8_kvcache: bool) -> str:
    if is_fp8_kvcache:
        if not _arrays.is_8bit(k_cache):
            raise _smla.InvalidArgumentError(
                f"k_cache: is_fp8_kvcache=True needs 8-bit data (uint8, int8 or float8_e4m3fn rows of 656 bytes, or "
                f"{_ops._FP8_V4_ROW_BYTES} for MODEL1), "
                f"got {_arrays.dtype_name(k_cache)}")
        return _ops._fp8_mla_cache_dtype(k_cache)
    if _arrays.is_8bit(k_cache):
        raise _smla.InvalidArgumentError("k_cache: 8-bit (FP8) data needs is_fp8_kvcache=True")
    return "auto"


def _array_module(x: Tensor) -> Any:
    if _arrays.framework(x) == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def _with_kvcache_into(q: Tensor, cache: Tensor, block_table: Optional[Tensor], cache_seqlens: Optional[Tensor],
                       indices: Optional[Tensor], topk_length: Optional[Tensor], attn_sink: Optional[Tensor],
                       softmax_scale: float, causal: bool, kv_cache_dtype: str, out: Tensor, lse: Tensor,
                       backend: Optional[str], extra: Optional[tuple] = None) -> None:
    """flash_mla_with_kvcache into out (b, s_q, h_q, 512) and lse (b, h_q, s_q): the kernels write lse through a
    (b, s_q, h_q) view of it, +inf where a query has nothing to attend; no other kernel runs. `extra`: MODEL1's
    second cache (_extra_cache)."""
    lse_view = lse.swapaxes(-1, -2)
    if indices is None:
        _ops._paged_mla_decode(q, cache, block_table, cache_seqlens, attn_sink, softmax_scale, causal, out, lse_view,
                               kv_cache_dtype, None, backend, empty_lse_plus_inf=True)
        return
    # One sparse_mla call per new token j: its tokens are the requests, whose lse rows (b, h_q) are a strided view;
    # FlashMLA's per-request topk_length (b,) serves every j as it is.
    def per_token(lengths: Optional[Tensor], j: int) -> Optional[Tensor]:
        return _select(lengths, 1, j) if lengths is not None and len(lengths.shape) == 2 else lengths

    for j in range(int(q.shape[1])):
        extra_j = None if extra is None else (extra[0], _select(extra[1], 1, j), per_token(extra[2], j))
        _ops._sparse_mla(_select(q, 1, j), cache, _select(indices, 1, j), per_token(topk_length, j), attn_sink,
                         softmax_scale, _select(out, 1, j), _select(lse_view, 1, j), kv_cache_dtype, None, backend,
                         empty_lse_plus_inf=True, extra=extra_j)


def _sparse_fwd_into(q: Tensor, kv: Tensor, indices: Tensor, topk_length: Optional[Tensor],
                     attn_sink: Optional[Tensor], sm_scale: float, out: Tensor, max_logits: Tensor, lse: Tensor,
                     backend: Optional[str]) -> None:
    """flash_mla_sparse_fwd into out, max_logits and lse, all three from the kernel (+inf lse for empty rows)."""
    if len(_arrays.shape(kv, "kv")) != 3 or int(kv.shape[1]) != 1:
        raise _smla.InvalidArgumentError(f"kv: expected (s_kv, 1, d_qk) (h_kv must be 1), got {tuple(kv.shape)}")
    if len(_arrays.shape(indices, "indices")) != 3 or int(indices.shape[1]) != 1:
        raise _smla.InvalidArgumentError(f"indices: expected (s_q, 1, topk) (h_kv must be 1), got "
                                         f"{tuple(indices.shape)}")
    _ops._sparse_mla(q, kv, _select(indices, 1, 0), topk_length, attn_sink, sm_scale, out, lse, "auto", None, backend,
                     max_logits=max_logits, empty_lse_plus_inf=True)
