"""The MLA / DSA ops on any DLPack-capable tensors (numpy on the CPU, torch or
cupy on the GPU), without copying them. docs/ops.md is the contract.

Outputs are allocated like the first tensor argument (numpy in, numpy out;
torch in, torch out, on its device) unless passed as ``out=`` (and
``lse=``). torch tensors go through the registered ``torch.ops.smla``
custom ops (traceable by torch.compile, capturable in CUDA graphs) unless
outputs or a stream are passed explicitly. GPU work runs on ``stream``:
by default the current stream of the tensors' framework.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

from . import _arrays, _smla

Tensor = Any  # numpy.ndarray, torch.Tensor, cupy.ndarray or any DLPack producer

_MLA_FP8_ALIASES = ("fp8", "fp8_e4m3", "float8_e4m3fn", "e4m3", "fp8_ds_mla")
_LATENT_DIM = 512
_FP8_NOPE_ROW_BYTES = 528  # fp8_ds_mla_nope: 512 e4m3 + 4 fp32 scales
_FP8_V4_ROW_BYTES = 584  # fp8_ds_mla_v4 (DeepSeek-V4, FlashMLA's MODEL1): 448 e4m3, 64 bf16, 7 ue8m0 scales, a pad


def _fp8_mla_cache_dtype(cache: Tensor) -> str:
    """The fp8 MLA cache format of 8-bit rows, told by their width: 528 bytes a token is fp8_ds_mla_nope (no rope
    part), 584 fp8_ds_mla_v4 (DeepSeek-V4), anything else fp8_ds_mla (656 bytes; the checks name a wrong width)."""
    width = int(cache.shape[-1])
    return {_FP8_NOPE_ROW_BYTES: "fp8_ds_mla_nope", _FP8_V4_ROW_BYTES: "fp8_ds_mla_v4"}.get(width, "fp8_ds_mla")


def _mla_cache_dtype(cache: Tensor, kv_cache_dtype: Optional[str], name: str = "kv_cache") -> Optional[str]:
    """The smla dtype to read an MLA cache as: 8-bit data is fp8_ds_mla (656
    bytes a token) or, 528 bytes wide, fp8_ds_mla_nope, or, 584 bytes wide,
    fp8_ds_mla_v4; else the tensor's own dtype. An explicit bfloat16 / float16 is checked against the tensor."""
    if cache is None:
        _arrays.shape(cache, name)  # NotATensorError naming it
    _checked_name(kv_cache_dtype, "kv_cache_dtype", _MLA_CACHE_DTYPES)
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return _fp8_mla_cache_dtype(cache) if _arrays.is_8bit(cache) else None
    name = str(kv_cache_dtype).lower()
    return _fp8_mla_cache_dtype(cache) if name in _MLA_FP8_ALIASES and name != "fp8_ds_mla" else name


def _index_dtype(x: Tensor, dtype: Optional[str]) -> Optional[str]:
    """The smla dtype of an indexer tensor (q or cache): 8-bit data is fp8_e4m3."""
    _checked_name(dtype, "index_cache_dtype", _INDEX_CACHE_DTYPES)
    if dtype is None or dtype == "auto":
        return "fp8_e4m3" if _arrays.is_8bit(x) else None
    name = str(dtype).lower()
    return "fp8_e4m3" if name in ("fp8", "float8_e4m3fn", "e4m3") else name


_MAX_TOPK = 65536  # the ops' K limit (a backend may have a lower one: cuda_mma's indexer 8192)
_FLOAT32_MAX = 3.4028234663852886e38
_MLA_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "fp8_ds_mla_nope",
                     "fp8_ds_mla_v4") + _MLA_FP8_ALIASES
_INDEX_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "fp8", "fp8_e4m3", "float8_e4m3fn", "e4m3")


def _softmax_scale(value: Any, name: str = "softmax_scale") -> float:
    """softmax_scale as the float32 the kernels take, checked first, so that a value float32 cannot hold
    (1e300) is reported as given rather than as the inf it would round to."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        scale = float(value)
    except (TypeError, ValueError):
        raise _smla.InvalidArgumentError(f"{name}: expected a number, got {type(value).__name__}") from None
    if not 0.0 < scale <= _FLOAT32_MAX:
        raise _smla.InvalidArgumentError(
            f"{name}: must be finite, > 0 and at most {_FLOAT32_MAX:.7g} (float32), got {value!r}")
    return scale


def _op_softmax_scale(value: Any) -> float:
    """softmax_scale for a torch.ops.smla op on the per-call path: a float goes as it is (the op checks its range
    with _softmax_scale's message), anything else through _softmax_scale."""
    return value if type(value) is float else _softmax_scale(value)


def _int_in(value: Any, name: str, low: int, high: int) -> int:
    """An int argument within [low, high], checked before anything is allocated with it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _smla.InvalidArgumentError(f"{name}: expected an int from {low} to {high}, got {type(value).__name__}")
    if not low <= value <= high:
        raise _smla.InvalidArgumentError(f"{name}: expected an int from {low} to {high}, got {value}")
    return int(value)


def _topk_columns(topk: Optional[int], out: Optional[Tensor] = None) -> int:
    """K of a top-k output, checked before the output is allocated. With ``out=``, ``topk`` may be left out (it
    is out's column count) and, when given, must equal it: a wider out would otherwise be filled silently."""
    if topk is None:
        if out is None:
            raise _smla.InvalidArgumentError(f"topk: required (an int from 1 to {_MAX_TOPK}) unless out= is given")
        shape = _arrays.shape(out, "out")
        return shape[-1] if shape else 0  # a wrong rank is reported by the op's checks
    topk = _int_in(topk, "topk", 1, _MAX_TOPK)
    if out is not None:
        shape = _arrays.shape(out, "out")
        if len(shape) == 2 and shape[1] != topk:
            raise _smla.InvalidArgumentError(
                f"out: has {shape[1]} columns but topk is {topk}; pass an out of topk columns, or leave topk out "
                "to take out's")
    return topk


def _checked_name(value: Optional[str], name: str, allowed: Tuple[str, ...]) -> Optional[str]:
    if value is not None and str(value).lower() not in allowed:
        raise _smla.InvalidArgumentError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


_torch_ops_namespace: Any = None  # resolved on first use: the lookup runs on every call


def _torch_ops(x: Tensor) -> Any:
    """torch.ops.smla when `x` is a torch tensor and the custom ops are registered."""
    global _torch_ops_namespace
    if not _arrays.is_torch(x):
        return None
    if _torch_ops_namespace is None:
        from . import torch_ops

        _torch_ops_namespace = torch_ops.routed() if torch_ops.available() else False
    return _torch_ops_namespace or None


def _smla_error(e: Exception) -> Exception:
    """A torch.ops.smla C++ kernel's error (smla's bad input leaves as ValueError, what is unsupported as
    NotImplementedError: python/src/torch_ops.cpp) as smla's class, with its message."""
    return (_smla.UnsupportedError if isinstance(e, NotImplementedError) else _smla.InvalidArgumentError)(str(e))


def _backend(backend: Optional[str]) -> str:
    return backend or ""


def _workspace(ref: Tensor, workspace: Any) -> Any:
    """The op's scratch: the caller's `workspace` (a uint8 tensor, or a callable taking a byte count), else one
    allocated by `ref`'s framework when the op needs it (torch's caching allocator, cupy's pool), else None
    (numpy: the CPU backend needs none; other GPU arrays: the library's own)."""
    return workspace if workspace is not None else _arrays.workspace_allocator(ref)


# --- eager implementations (also the bodies of the torch custom ops) ---------


def _write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype, stream, backend) -> None:
    _smla.write_mla_cache(
        _arrays.export(latent), _arrays.export(k_pe), _arrays.export(slot_mapping),
        _arrays.export(cache, _mla_cache_dtype(cache, kv_cache_dtype, "cache")),
        _arrays.resolve_stream(cache, stream), _backend(backend))


def _sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, out, lse, kv_cache_dtype, stream,
                backend, max_logits=None, empty_lse_plus_inf=False, workspace=None, extra=None) -> None:
    """`extra`: (extra_kv_cache, extra_indices, extra_topk_length or None), a second cache read as kv_cache is."""
    cache_dtype = _mla_cache_dtype(kv_cache, kv_cache_dtype)
    extra_cache, extra_indices, extra_lengths = extra if extra is not None else (None, None, None)
    _smla.sparse_mla(
        _arrays.export(q), _arrays.export(kv_cache, cache_dtype),
        _arrays.export(indices), _arrays.export(topk_length), _arrays.export(attn_sink), _softmax_scale(softmax_scale),
        _arrays.export(out), _arrays.export(lse), _arrays.resolve_stream(q, stream), _backend(backend),
        _arrays.export(max_logits), empty_lse_plus_inf, _workspace(q, workspace),
        _arrays.export(extra_cache, cache_dtype), _arrays.export(extra_indices), _arrays.export(extra_lengths))


def _paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, out, lse,
                      kv_cache_dtype, stream, backend, empty_lse_plus_inf=False, workspace=None) -> None:
    _smla.paged_mla_decode(
        _arrays.export(q), _arrays.export(kv_cache, _mla_cache_dtype(kv_cache, kv_cache_dtype)),
        _arrays.export(block_table), _arrays.export(seq_lens), _arrays.export(attn_sink), _softmax_scale(softmax_scale),
        bool(causal), _arrays.export(out), _arrays.export(lse), _arrays.resolve_stream(q, stream),
        _backend(backend), empty_lse_plus_inf, _workspace(q, workspace))


def _write_index_cache(k, slot_mapping, cache, index_cache_dtype, stream, backend) -> None:
    _smla.write_index_cache(
        _arrays.export(k), _arrays.export(slot_mapping),
        _arrays.export(cache, _index_dtype(cache, index_cache_dtype)),
        _arrays.resolve_stream(cache, stream), _backend(backend))


def _indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, topk_out,
                  index_cache_dtype, stream, backend, workspace=None, sorted=True) -> None:
    _smla.indexer_topk(
        _arrays.export(q, _index_dtype(q, None)), _arrays.export(q_scale), _arrays.export(weights),
        _arrays.export(index_cache, _index_dtype(index_cache, index_cache_dtype)), _arrays.export(request_ids),
        _arrays.export(block_table), _arrays.export(context_lens), _arrays.export(topk_out),
        _arrays.resolve_stream(q, stream), _backend(backend), _workspace(q, workspace), bool(sorted))


def _positions_to_slots(positions, request_ids, block_table, block_size, slots, stream, backend) -> None:
    _smla.positions_to_slots(
        _arrays.export(positions), _arrays.export(request_ids), _arrays.export(block_table),
        _int_in(block_size, "block_size", 1, 2**31 - 1),
        _arrays.export(slots), _arrays.resolve_stream(positions, stream), _backend(backend))


def _write_pooled_index_cache(k, gate, ape, slot_mapping, cache, hadamard, index_cache_dtype, stream,
                              backend) -> None:
    _smla.write_pooled_index_cache(
        _arrays.export(k), _arrays.export(gate), _arrays.export(ape), _arrays.export(slot_mapping),
        _arrays.export(cache, _index_dtype(cache, index_cache_dtype)), bool(hadamard),
        _arrays.resolve_stream(cache, stream), _backend(backend))


def _pools_to_positions(pools, context_lens, kpool, positions, stream, backend) -> None:
    _smla.pools_to_positions(_arrays.export(pools), _arrays.export(context_lens), _int_in(kpool, "kpool", 1, 128),
                             _arrays.export(positions), _arrays.resolve_stream(pools, stream), _backend(backend))


def _pools_to_positions_shape(pools: Tensor, kpool: int) -> Tuple[int, int]:
    """pools_to_positions' output shape [T, Kp * kpool + kpool - 1]."""
    shape = _arrays.shape(pools, "pools")
    if len(shape) != 2:
        raise _smla.InvalidArgumentError(f"pools_to_positions: pools: expected 2 dimensions [T, Kp], got {shape}")
    kpool = _int_in(kpool, "kpool", 1, 128)
    return shape[0], shape[1] * kpool + kpool - 1


def _rotate_index_q(q, q_out, q_scale, stream, backend) -> None:
    """q_scale None: bfloat16 q_out; else fp8_e4m3 q_out with its per-head scales."""
    fp8 = q_scale is not None
    _smla.rotate_index_q(_arrays.export(q), _arrays.export(q_out, "fp8_e4m3" if fp8 else None),
                         _arrays.export(q_scale) if fp8 else None, _arrays.resolve_stream(q, stream),
                         _backend(backend))


def _dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens,
                     index_q_scale, attn_sink, softmax_scale, out, lse, topk_out, slots, kv_cache_dtype,
                     index_cache_dtype, stream, backend, workspace=None, sorted=True) -> None:
    _smla.dsa_decode_step(
        _arrays.export(index_q, _index_dtype(index_q, None)), _arrays.export(index_q_scale),
        _arrays.export(index_weights), _arrays.export(index_cache, _index_dtype(index_cache, index_cache_dtype)),
        _arrays.export(request_ids), _arrays.export(block_table), _arrays.export(context_lens),
        _arrays.export(topk_out), _arrays.export(slots), _arrays.export(q),
        _arrays.export(kv_cache, _mla_cache_dtype(kv_cache, kv_cache_dtype)), _arrays.export(attn_sink),
        _softmax_scale(softmax_scale), _arrays.export(out), _arrays.export(lse), _arrays.resolve_stream(q, stream),
        _backend(backend), _workspace(q, workspace), bool(sorted))


def _attention_outputs(q: Tensor, out: Optional[Tensor], lse: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    # Shapes follow q ([..., 576] -> [..., 512] and [...]); a q of the wrong rank
    # is reported by the C++ checks, which look at q first.
    lead = _arrays.shape(q, "q")[:-1]
    if out is None:
        out = _arrays.empty(q, lead + (_LATENT_DIM,))
    if lse is None:
        lse = _arrays.empty(q, lead, "float32")
    return out, lse


def _tokens(q: Tensor) -> int:
    # A q of the wrong rank gets its message from the C++ checks.
    s = _arrays.shape(q, "q")
    return s[0] if s else 0


# --- public API ----------------------------------------------------------------


def write_mla_cache(latent: Tensor, k_pe: Optional[Tensor], slot_mapping: Tensor, cache: Tensor, *,
                    kv_cache_dtype: Optional[str] = "auto", stream: Any = None,
                    backend: Optional[str] = None) -> Tensor:
    """Writes latents [N, 512] and rope keys [N, 64] into the paged MLA cache
    [num_blocks, block_size, 576 | 656] in place, at the physical slots
    ``slot_mapping`` [N] (int64, negative = skip). An 8-bit cache (uint8,
    int8, float8_e4m3fn) is fp8_ds_mla, or fp8_ds_mla_nope when 528 bytes
    wide, or fp8_ds_mla_v4 when 584. Heads with no rope part: ``k_pe`` None
    (or [N, 0]) and a cache of [..., 512] in a 16-bit type, [..., 528]
    fp8_ds_mla_nope or [..., 656] fp8_ds_mla (whose rope bytes are left
    alone); DeepSeek-V4's fp8 cache [..., 584] fp8_ds_mla_v4 takes its whole
    512-value row as ``latent`` (docs/ops.md). Returns ``cache``."""
    if k_pe is None:
        k_pe = _arrays.empty(latent, (int(latent.shape[0]), 0))  # width 0: no rope part
    ops = _torch_ops(cache) if stream is None else None
    if ops is not None:
        ops.write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype or "auto", _backend(backend))
    else:
        _write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype, stream, backend)
    return cache


def sparse_mla(q: Tensor, kv_cache: Tensor, indices: Tensor, *, softmax_scale: float,
               topk_length: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
               kv_cache_dtype: Optional[str] = "auto", out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
               stream: Any = None, backend: Optional[str] = None, extra_kv_cache: Optional[Tensor] = None,
               extra_indices: Optional[Tensor] = None,
               extra_topk_length: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Sparse MLA: token t attends to the cache slots ``indices[t]`` (int32
    physical slots; negative or >= num_slots are skipped).

    q [T, H, 576] bf16/f16, kv_cache [num_blocks, block_size, 576 | 656];
    heads with no rope part (GLM-5.3-Flash): q [T, H, 512] over a cache of
    [..., 512] (16-bit), [..., 528] (fp8_ds_mla_nope) or [..., 656]
    (fp8_ds_mla, rope bytes never read). Optional topk_length [T] int32 and
    attn_sink [H] float32. DeepSeek-V4 (512-wide q and caches): a second
    cache under the same softmax, extra_kv_cache [blocks2, block_size2, row]
    (kv_cache's dtype and row) with extra_indices [T, K2] int32 slots of it
    and optional extra_topk_length [T]. Returns
    (out [T, H, 512] in q's dtype, lse [T, H] float32, natural log, without
    the sink; -inf for a row with no valid index)."""
    ops = _torch_ops(q) if stream is None else None
    if ops is not None:  # the hot paths (host time per call): the overloads themselves, their errors caught here
        try:
            if out is None and lse is None:
                return ops.overloads.sparse_mla(q, kv_cache, indices, topk_length, attn_sink,
                                                _op_softmax_scale(softmax_scale), kv_cache_dtype or "auto",
                                                backend or "", extra_kv_cache, extra_indices, extra_topk_length)
            if _arrays.is_torch(out) and _arrays.is_torch(lse):
                ops.overloads.sparse_mla_out(q, kv_cache, indices, topk_length, attn_sink,
                                             _op_softmax_scale(softmax_scale), kv_cache_dtype or "auto",
                                             backend or "", extra_kv_cache, extra_indices, extra_topk_length,
                                             out=out, lse=lse)
                return out, lse
        except _smla.Error:
            raise
        except (ValueError, NotImplementedError) as e:
            raise _smla_error(e) from None
    out, lse = _attention_outputs(q, out, lse)
    _sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, out, lse, kv_cache_dtype, stream,
                backend, extra=(extra_kv_cache, extra_indices, extra_topk_length))
    return out, lse


def paged_mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, softmax_scale: float,
                     causal: bool = True, attn_sink: Optional[Tensor] = None,
                     kv_cache_dtype: Optional[str] = "auto", out: Optional[Tensor] = None,
                     lse: Optional[Tensor] = None, stream: Any = None,
                     backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Dense paged MLA decode: q [B, s_q, H, 576] (or 512, caches as in
    sparse_mla) over each request's first
    ``seq_lens[b]`` positions through ``block_table`` [B, max_blocks] (int32).
    With ``causal``, token j of s_q sees positions < seq_len - s_q + j + 1.
    Returns (out [B, s_q, H, 512], lse [B, s_q, H] float32)."""
    ops = _torch_ops(q) if stream is None else None
    if ops is not None:
        if out is None and lse is None:
            return ops.paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink,
                                        _softmax_scale(softmax_scale), bool(causal), kv_cache_dtype or "auto",
                                        _backend(backend))
        if _arrays.is_torch(out) and _arrays.is_torch(lse):
            ops.paged_mla_decode_out(q, kv_cache, block_table, seq_lens, attn_sink, _softmax_scale(softmax_scale),
                                     bool(causal), kv_cache_dtype or "auto", _backend(backend), out=out, lse=lse)
            return out, lse
    out, lse = _attention_outputs(q, out, lse)
    _paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, out, lse,
                      kv_cache_dtype, stream, backend)
    return out, lse


def write_index_cache(k: Tensor, slot_mapping: Tensor, cache: Tensor, *, index_cache_dtype: Optional[str] = "auto",
                      stream: Any = None, backend: Optional[str] = None) -> Tensor:
    """Writes indexer keys k [N, 128] into the index cache in place:
    [num_blocks, block_size, 128] bf16, or [num_blocks, block_size, 132]
    fp8_e4m3 (any 8-bit tensor). Returns ``cache``."""
    ops = _torch_ops(cache) if stream is None else None
    if ops is not None:
        ops.write_index_cache(k, slot_mapping, cache, index_cache_dtype or "auto", _backend(backend))
    else:
        _write_index_cache(k, slot_mapping, cache, index_cache_dtype, stream, backend)
    return cache


def indexer_topk(q: Tensor, weights: Tensor, index_cache: Tensor, request_ids: Tensor, block_table: Tensor,
                 context_lens: Tensor, *, topk: Optional[int] = None, q_scale: Optional[Tensor] = None,
                 index_cache_dtype: Optional[str] = "auto", out: Optional[Tensor] = None, stream: Any = None,
                 backend: Optional[str] = None, sorted: bool = True) -> Tensor:
    """Lightning-indexer scores and exact top-k over each token's visible
    context [0, context_lens[t]). q [T, H_I, 128] bf16/f16 or 8-bit (fp8_e4m3,
    then q_scale [T, H_I] float32), weights [T, H_I] float32. Returns the
    logical positions [T, topk] int32, best first (``sorted=False``: the same
    positions in ascending order, which the GPU finds faster), -1 padded.
    ``topk`` (1 to 65536) is required unless ``out=`` [T, K] is given: then it
    defaults to K and, when given, must equal it."""
    topk = _topk_columns(topk, out)
    ops = _torch_ops(q) if out is None and stream is None else None
    if ops is not None:
        return ops.indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens,
                                topk, index_cache_dtype or "auto", _backend(backend), bool(sorted))
    if out is None:
        out = _arrays.empty(q, (_tokens(q), topk), "int32")
    _indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, out,
                  index_cache_dtype, stream, backend, sorted=sorted)
    return out


def positions_to_slots(positions: Tensor, request_ids: Tensor, block_table: Tensor, *, block_size: int,
                       out: Optional[Tensor] = None, stream: Any = None,
                       backend: Optional[str] = None) -> Tensor:
    """Logical positions [T, K] (int32, negative = invalid) -> physical slots
    through each token's block-table row; -1 where invalid."""
    ops = _torch_ops(positions) if out is None and stream is None else None
    if ops is not None:
        return ops.positions_to_slots(positions, request_ids, block_table,
                                      _int_in(block_size, "block_size", 1, 2**31 - 1), _backend(backend))
    if out is None:
        out = _arrays.empty(positions, _arrays.shape(positions, "positions"), "int32")
    _positions_to_slots(positions, request_ids, block_table, block_size, out, stream, backend)
    return out


def write_pooled_index_cache(k: Tensor, gate: Tensor, ape: Tensor, slot_mapping: Tensor, cache: Tensor, *,
                             hadamard: bool = True, index_cache_dtype: Optional[str] = "auto", stream: Any = None,
                             backend: Optional[str] = None) -> Tensor:
    """GLM-5.3-Flash's pooled index keys: k and gate [P, kpool, 128] (the
    index keys and gate scores of each pool's tokens), ape [kpool, 128]
    float32; per dimension a softmax over the pool of gate + ape weights the
    keys, then (hadamard) the 128-point Walsh-Hadamard rotation. Written at the
    pool slots slot_mapping [P] int64 (negative: skipped) of an index cache of
    block_size / kpool rows a block, as write_index_cache writes. Returns
    ``cache``."""
    ops = _torch_ops(cache) if stream is None else None
    if ops is not None:
        ops.write_pooled_index_cache(k, gate, ape, slot_mapping, cache, bool(hadamard), index_cache_dtype or "auto",
                                     _backend(backend))
    else:
        _write_pooled_index_cache(k, gate, ape, slot_mapping, cache, hadamard, index_cache_dtype, stream, backend)
    return cache


def pools_to_positions(pools: Tensor, context_lens: Tensor, *, kpool: int, out: Optional[Tensor] = None,
                       stream: Any = None, backend: Optional[str] = None) -> Tensor:
    """The top pools [T, Kp] int32 (indexer_topk over a pooled index cache)
    -> the logical positions [T, Kp * kpool + kpool - 1] int32 attended: each
    pool's kpool tokens, then those of the incomplete last pool of the
    context [0, context_lens[t]); -1 padded."""
    kpool = _int_in(kpool, "kpool", 1, 128)
    ops = _torch_ops(pools) if out is None and stream is None else None
    if ops is not None:
        return ops.pools_to_positions(pools, context_lens, kpool, _backend(backend))
    if out is None:
        out = _arrays.empty(pools, _pools_to_positions_shape(pools, kpool), "int32")
    _pools_to_positions(pools, context_lens, kpool, out, stream, backend)
    return out


def rotate_index_q(q: Tensor, *, fp8: bool = True, out: Optional[Tensor] = None, q_scale: Optional[Tensor] = None,
                   stream: Any = None, backend: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """GLM-5.3-Flash's indexer queries: q [T, H_I, 128] (float32 / float16 /
    bfloat16) rotated by 128^-0.5 H_128 per head and rounded to bfloat16;
    with ``fp8`` then e4m3 codes (uint8, or any 8-bit out=) with one ue8m0
    scale per head. Returns (q_out, q_scale [T, H_I] float32, None without
    fp8): indexer_topk's q and q_scale."""
    if q_scale is not None and not fp8:
        raise _smla.InvalidArgumentError("rotate_index_q: q_scale: must be absent unless fp8 (bfloat16 out has none)")
    ops = _torch_ops(q) if out is None and q_scale is None and stream is None else None
    if ops is not None:
        return ops.rotate_index_q(q, bool(fp8), _backend(backend))
    if out is None:
        out = _arrays.empty(q, _arrays.shape(q, "q"), "uint8" if fp8 else "bfloat16")
    if fp8 and q_scale is None:
        q_scale = _arrays.empty(q, _arrays.shape(q, "q")[:2], "float32")
    _rotate_index_q(q, out, q_scale if fp8 else None, stream, backend)
    return out, (q_scale if fp8 else None)


def dsa_decode_step(q: Tensor, kv_cache: Tensor, index_q: Tensor, index_weights: Tensor, index_cache: Tensor,
                    request_ids: Tensor, block_table: Tensor, context_lens: Tensor, *, topk: int,
                    softmax_scale: float, index_q_scale: Optional[Tensor] = None,
                    attn_sink: Optional[Tensor] = None, kv_cache_dtype: Optional[str] = "auto",
                    index_cache_dtype: Optional[str] = "auto", stream: Any = None,
                    backend: Optional[str] = None, sorted: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One DSA decode step: indexer_topk -> positions_to_slots -> sparse_mla.
    The MLA cache and the index cache share ``block_table`` and the block
    size. Returns (out [T, H, 512], lse [T, H], positions [T, topk] (logical,
    what the indexer chose, best first; ``sorted=False``: in ascending
    order, as indexer_topk), slots [T, topk] (physical, what was attended, in
    the positions' order))."""
    topk = _topk_columns(topk)
    ops = _torch_ops(q) if stream is None else None
    if ops is not None:
        return ops.dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table,
                                   context_lens, index_q_scale, attn_sink, topk, _softmax_scale(softmax_scale),
                                   kv_cache_dtype or "auto", index_cache_dtype or "auto", _backend(backend),
                                   bool(sorted))
    out, lse = _attention_outputs(q, None, None)
    tokens = _tokens(q)
    positions = _arrays.empty(q, (tokens, topk), "int32")
    slots = _arrays.empty(q, (tokens, topk), "int32")
    _dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens,
                     index_q_scale, attn_sink, softmax_scale, out, lse, positions, slots, kv_cache_dtype,
                     index_cache_dtype, stream, backend, sorted=sorted)
    return out, lse, positions, slots
