"""PyTorch integration: the ops registered as ``torch.ops.smla.*`` operators
(torch >= 2.4) with fake (meta) implementations, so torch.compile traces them
and CUDA graphs capture them. Importing this module registers them; the
``smla`` functions route torch tensors here on their own.

The ops allocate their outputs, and the scratch the GPU ops need, with torch
(on the inputs' device, through torch's caching allocator, which CUDA-graph
capture handles) and run on torch's current stream; the out variants
``sparse_mla.out`` and ``paged_mla_decode.out`` write the caller's out and lse
(keyword-only) instead. fp8 tensors
(float8_e4m3fn, int8 or uint8) are read as bytes.

They are defined with ``torch.library.Library`` (a schema, one
CompositeExplicitAutograd kernel, a fake) rather than ``custom_op``, whose
Python wrapper costs several microseconds more per call: these are
inference ops, with no autograd formula.

This module is the one place of the schemas and fakes. When the package was
built against this torch (``pip install --no-build-isolation .`` with torch
installed), the library ``smla/_torch_ops.so`` then registers C++ kernels
for the CPU and CUDA keys of the hot ops, which call smla's C++ API with no
Python in between (python/src/torch_ops.cpp); the Python kernels below
serve the rest. ``native()`` says whether the C++ kernels are active.
"""

import os
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from . import _smla
from . import flash_mla as _flash_mla
from . import ops as _ops

_LATENT_DIM = 512
_LIBRARY = None  # the torch.library.Library that holds the definitions (kept alive)


def available() -> bool:
    """True when this torch can register the ops (torch >= 2.4)."""
    return _REGISTERED


def native() -> bool:
    """True when the CPU and CUDA kernels of ``torch.ops.smla`` are C++ (smla._torch_ops, built against this
    torch); False when they are the Python kernels of this module."""
    return _NATIVE


def ops() -> Any:
    """The ``torch.ops.smla`` namespace."""
    return torch.ops.smla


def _overload(name: str) -> Any:
    """The overload of ``torch.ops.smla`` that `name` calls: ``sparse_mla_out`` is ``sparse_mla.out``, any other
    name its op's default. Called through the overload itself: no overload resolution per call."""
    if name.endswith("_out"):
        return getattr(torch.ops.smla, name[:-len("_out")]).out
    return getattr(torch.ops.smla, name).default


class _Overloads:
    """``torch.ops.smla``'s overloads by name (_overload), found as plain attributes after the first use."""

    def __getattr__(self, name: str) -> Any:
        op = _overload(name)
        setattr(self, name, op)
        return op


class _Routed:
    """``torch.ops.smla`` as smla's functions call it, by name (``sparse_mla``, ``sparse_mla_out`` for
    ``sparse_mla.out``). With the C++ kernels (`translate`), their bad-input errors (ValueError) and unsupported
    cases (NotImplementedError) come back as smla.InvalidArgumentError / smla.UnsupportedError, as the Python
    kernels raise them. ``overloads`` has the same names without that wrapper (a Python call less: the hot
    functions catch and translate those errors themselves, through smla.ops._smla_error)."""

    overloads = _Overloads()

    def __init__(self, translate: bool) -> None:
        self._translate = translate

    def __getattr__(self, name: str) -> Callable:
        op = getattr(self.overloads, name)
        if not self._translate:
            setattr(self, name, op)
            return op

        def call(*args, **kwargs):
            try:
                return op(*args, **kwargs)
            except _smla.Error:
                raise
            except (ValueError, NotImplementedError) as e:
                raise _ops._smla_error(e) from None

        setattr(self, name, call)  # found as an attribute from now on: no __getattr__
        return call


def routed() -> Any:
    """What smla's functions call for torch tensors: ``torch.ops.smla``'s overloads by name (``_Routed``),
    with the C++ kernels' errors raised as smla's classes."""
    return _ROUTED


def _attention_out(q: Tensor) -> Tuple[Tensor, Tensor]:
    lead = tuple(q.shape[:-1])
    return q.new_empty(lead + (_LATENT_DIM,)), q.new_empty(lead, dtype=torch.float32)


def _kvcache_out(q: Tensor) -> Tuple[Tensor, Tensor]:
    """flash_mla_with_kvcache's out (b, s_q, h_q, 512) and lse (b, h_q, s_q)."""
    b, s_q, h_q = q.shape[:3]
    return q.new_empty((b, s_q, h_q, _LATENT_DIM)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


def _topk_out(q: Tensor, topk: int) -> Tensor:
    return q.new_empty((q.shape[0], _ops._topk_columns(topk)), dtype=torch.int32)  # topk checked first


# --- kernels (eager bodies) and fakes, by op ------------------------------------


def _write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype="auto", backend=""):
    _ops._write_mla_cache(latent, k_pe, slot_mapping, cache, kv_cache_dtype, None, backend)


def _sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype="auto", backend="",
                extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
    out, lse = _attention_out(q)
    _ops._sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, out, lse, kv_cache_dtype, None,
                     backend, extra=(extra_kv_cache, extra_indices, extra_topk_length))
    return out, lse


def _sparse_mla_out(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype="auto", backend="",
                    extra_kv_cache=None, extra_indices=None, extra_topk_length=None, *, out, lse):
    _ops._sparse_mla(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, out, lse, kv_cache_dtype, None,
                     backend, extra=(extra_kv_cache, extra_indices, extra_topk_length))


def _paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal=True,
                      kv_cache_dtype="auto", backend=""):
    out, lse = _attention_out(q)
    _ops._paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, out, lse,
                           kv_cache_dtype, None, backend)
    return out, lse


def _paged_mla_decode_out(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal=True,
                          kv_cache_dtype="auto", backend="", *, out, lse):
    _ops._paged_mla_decode(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, out, lse,
                           kv_cache_dtype, None, backend)


def _write_index_cache(k, slot_mapping, cache, index_cache_dtype="auto", backend=""):
    _ops._write_index_cache(k, slot_mapping, cache, index_cache_dtype, None, backend)


def _indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, topk,
                  index_cache_dtype="auto", backend="", sorted=True):
    out = _topk_out(q, topk)
    _ops._indexer_topk(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, out,
                       index_cache_dtype, None, backend, sorted=sorted)
    return out


def _positions_to_slots(positions, request_ids, block_table, block_size, backend=""):
    slots = positions.new_empty(positions.shape, dtype=torch.int32)
    _ops._positions_to_slots(positions, request_ids, block_table, block_size, slots, None, backend)
    return slots


def _write_pooled_index_cache(k, gate, ape, slot_mapping, cache, hadamard=True, index_cache_dtype="auto", backend=""):
    _ops._write_pooled_index_cache(k, gate, ape, slot_mapping, cache, hadamard, index_cache_dtype, None, backend)


def _pools_to_positions(pools, context_lens, kpool, backend=""):
    positions = pools.new_empty(_ops._pools_to_positions_shape(pools, kpool), dtype=torch.int32)
    _ops._pools_to_positions(pools, context_lens, kpool, positions, None, backend)
    return positions


def _rotate_index_q_out(q: Tensor, fp8: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """rotate_index_q's q_out [T, H_I, 128] (e4m3 codes as uint8, or bfloat16) and, with fp8, q_scale [T, H_I]."""
    q_out = q.new_empty(q.shape, dtype=torch.uint8 if fp8 else torch.bfloat16)
    return q_out, (q.new_empty(q.shape[:2], dtype=torch.float32) if fp8 else None)


def _rotate_index_q(q, fp8=True, backend=""):
    q_out, q_scale = _rotate_index_q_out(q, fp8)
    _ops._rotate_index_q(q, q_out, q_scale, None, backend)
    return q_out, q_scale


def _dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens,
                     index_q_scale, attn_sink, topk, softmax_scale, kv_cache_dtype="auto", index_cache_dtype="auto",
                     backend="", sorted=True):
    out, lse = _attention_out(q)
    positions, slots = _topk_out(q, topk), _topk_out(q, topk)
    _ops._dsa_decode_step(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens,
                          index_q_scale, attn_sink, softmax_scale, out, lse, positions, slots, kv_cache_dtype,
                          index_cache_dtype, None, backend, sorted=sorted)
    return out, lse, positions, slots


# smla.flash_mla's two attention functions, with FlashMLA's output layouts written by the kernels.
def _flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, softmax_scale,
                            causal, kv_cache_dtype="auto", backend="", extra_k_cache=None,
                            extra_indices_in_kvcache=None, extra_topk_length=None):
    _, k_shape, extra = _flash_mla._check_shapes(q, k_cache, indices, topk_length, extra_k_cache,
                                                 extra_indices_in_kvcache, extra_topk_length)
    out, lse = _kvcache_out(q)
    k_cache = _flash_mla._cache_3d(k_cache, k_shape)  # FlashMLA's 4-D cache too
    _flash_mla._with_kvcache_into(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink,
                                  softmax_scale, causal, kv_cache_dtype, out, lse, backend, extra)
    return out, lse


def _flash_mla_sparse_fwd(q, kv, indices, topk_length, attn_sink, sm_scale, backend=""):
    out, lse = _attention_out(q)
    max_logits = torch.empty_like(lse)
    _flash_mla._sparse_fwd_into(q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse, backend)
    return out, max_logits, lse


# Fakes: the outputs' shapes and dtypes, for tracing.
def _no_output_fake(*args, **kwargs):
    return None


def _attention_fake(q, *args, **kwargs):
    return _attention_out(q)


def _indexer_topk_fake(q, q_scale, weights, index_cache, request_ids, block_table, context_lens, topk, *args,
                       **kwargs):
    return _topk_out(q, topk)


def _positions_to_slots_fake(positions, *args, **kwargs):
    return positions.new_empty(positions.shape, dtype=torch.int32)


def _pools_to_positions_fake(pools, context_lens, kpool, *args, **kwargs):
    return pools.new_empty(_ops._pools_to_positions_shape(pools, kpool), dtype=torch.int32)


def _rotate_index_q_fake(q, fp8=True, *args, **kwargs):
    return _rotate_index_q_out(q, fp8)


def _dsa_decode_step_fake(q, kv_cache, index_q, index_weights, index_cache, request_ids, block_table, context_lens,
                          index_q_scale, attn_sink, topk, *args, **kwargs):
    out, lse = _attention_out(q)
    return out, lse, _topk_out(q, topk), _topk_out(q, topk)


def _flash_mla_with_kvcache_fake(q, *args, **kwargs):
    return _kvcache_out(q)


def _flash_mla_sparse_fwd_fake(q, *args, **kwargs):
    out, lse = _attention_out(q)
    return out, torch.empty_like(lse), lse


# (schema, kernel, fake). Tensor(a!) marks what an op writes in place. The attention ops' `.out` overloads write
# caller-allocated out and lse (keyword-only, PyTorch's out= convention) and return nothing: torch.compile
# functionalizes a mutating custom op that returns nothing on every torch this package supports.
_OPS = [
    ("write_mla_cache(Tensor latent, Tensor k_pe, Tensor slot_mapping, Tensor(a!) cache, "
     "str kv_cache_dtype='auto', str backend='') -> ()", _write_mla_cache, _no_output_fake),
    ("sparse_mla(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
     "float softmax_scale, str kv_cache_dtype='auto', str backend='', Tensor? extra_kv_cache=None, "
     "Tensor? extra_indices=None, Tensor? extra_topk_length=None) -> (Tensor, Tensor)",
     _sparse_mla, _attention_fake),
    ("sparse_mla.out(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
     "float softmax_scale, str kv_cache_dtype='auto', str backend='', Tensor? extra_kv_cache=None, "
     "Tensor? extra_indices=None, Tensor? extra_topk_length=None, *, Tensor(a!) out, Tensor(b!) lse) -> ()",
     _sparse_mla_out, _no_output_fake),
    ("paged_mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor? attn_sink, "
     "float softmax_scale, bool causal=True, str kv_cache_dtype='auto', str backend='') -> (Tensor, Tensor)",
     _paged_mla_decode, _attention_fake),
    ("paged_mla_decode.out(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor? attn_sink, "
     "float softmax_scale, bool causal=True, str kv_cache_dtype='auto', str backend='', *, Tensor(a!) out, "
     "Tensor(b!) lse) -> ()", _paged_mla_decode_out, _no_output_fake),
    ("write_index_cache(Tensor k, Tensor slot_mapping, Tensor(a!) cache, str index_cache_dtype='auto', "
     "str backend='') -> ()", _write_index_cache, _no_output_fake),
    ("indexer_topk(Tensor q, Tensor? q_scale, Tensor weights, Tensor index_cache, Tensor request_ids, "
     "Tensor block_table, Tensor context_lens, int topk, str index_cache_dtype='auto', str backend='', "
     "bool sorted=True) -> Tensor",
     _indexer_topk, _indexer_topk_fake),
    ("positions_to_slots(Tensor positions, Tensor request_ids, Tensor block_table, int block_size, "
     "str backend='') -> Tensor", _positions_to_slots, _positions_to_slots_fake),
    ("write_pooled_index_cache(Tensor k, Tensor gate, Tensor ape, Tensor slot_mapping, Tensor(a!) cache, "
     "bool hadamard=True, str index_cache_dtype='auto', str backend='') -> ()",
     _write_pooled_index_cache, _no_output_fake),
    ("pools_to_positions(Tensor pools, Tensor context_lens, int kpool, str backend='') -> Tensor",
     _pools_to_positions, _pools_to_positions_fake),
    ("rotate_index_q(Tensor q, bool fp8=True, str backend='') -> (Tensor, Tensor?)",
     _rotate_index_q, _rotate_index_q_fake),
    ("dsa_decode_step(Tensor q, Tensor kv_cache, Tensor index_q, Tensor index_weights, Tensor index_cache, "
     "Tensor request_ids, Tensor block_table, Tensor context_lens, Tensor? index_q_scale, Tensor? attn_sink, "
     "int topk, float softmax_scale, str kv_cache_dtype='auto', str index_cache_dtype='auto', str backend='', "
     "bool sorted=True) -> (Tensor, Tensor, Tensor, Tensor)", _dsa_decode_step, _dsa_decode_step_fake),
    ("flash_mla_with_kvcache(Tensor q, Tensor k_cache, Tensor? block_table, Tensor? cache_seqlens, "
     "Tensor? indices, Tensor? topk_length, Tensor? attn_sink, float softmax_scale, bool causal, "
     "str kv_cache_dtype='auto', str backend='', Tensor? extra_k_cache=None, "
     "Tensor? extra_indices_in_kvcache=None, Tensor? extra_topk_length=None) -> (Tensor, Tensor)",
     _flash_mla_with_kvcache, _flash_mla_with_kvcache_fake),
    ("flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
     "float sm_scale, str backend='') -> (Tensor, Tensor, Tensor)", _flash_mla_sparse_fwd, _flash_mla_sparse_fwd_fake),
]


def _register() -> bool:
    global _LIBRARY
    library = torch.library
    if not hasattr(library, "register_fake"):
        return False
    _LIBRARY = library.Library("smla", "DEF")
    for schema, kernel, fake in _OPS:
        name = schema.split("(", 1)[0]  # with the overload: "sparse_mla.out"
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        library.register_fake(f"smla::{name}", fake, lib=_LIBRARY)
    return True


def _load_native() -> bool:
    """Loads smla/_torch_ops.so when it is there and matches this torch; SMLA_TORCH_OPS=python keeps the Python
    kernels (to compare the two)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_ops.so")
    if not _REGISTERED or os.environ.get("SMLA_TORCH_OPS") == "python" or not os.path.exists(path):
        return False
    try:
        torch.ops.load_library(path)
    except OSError as e:  # built against another torch: its symbols are missing
        import warnings

        warnings.warn(f"smla: {path} does not load with torch {torch.__version__} ({e}); torch.ops.smla runs the "
                      "Python kernels. Rebuild smla with `pip install --no-build-isolation .` against this torch.")
        return False
    return True


_REGISTERED = _register()
_NATIVE = _load_native()
_ROUTED = _Routed(translate=_NATIVE)
