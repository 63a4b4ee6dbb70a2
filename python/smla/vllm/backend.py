"""smla's sparse-MLA attention backend for vLLM (>= 0.33): ``SMLA``.

What it can run is what smla's ``cuda_mma`` backend declares (``smla
backends``), read here from smla itself, and every run is checked by smla's
own selector (``smla.explain``): vLLM's selector and ``smla explain`` give
the same answer and the same reasons. Decode and prefill tokens both run
smla's sparse attention (``torch.ops.smla.sparse_mla``) over the top-k rows
vLLM's indexer chose; cache writes stay vLLM's (``concat_and_cache_mla``).
"""

from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    MultipleOf,
)

import smla

from . import NAME, _kernel

#: The smla backend whose declaration and kernels this one uses.
SMLA_BACKEND = "cuda_mma"

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# smla's cache dtypes that vLLM can allocate, by vLLM's --kv-cache-dtype name (smla's fp8_ds_mla_nope, 528 bytes a
# token, has no vLLM name: vLLM gives rope-free heads the 656-byte fp8_ds_mla rows, which smla reads too).
_VLLM_KV_CACHE_DTYPES = ("bfloat16", "float16", "fp8_ds_mla")


def declaration() -> "smla.BackendInfo":
    """What smla's CUDA backend declares it can run."""
    for info in smla.backends():
        if info.name == SMLA_BACKEND:
            return info
    raise RuntimeError(f"smla has no backend named {SMLA_BACKEND!r}")


_DECLARED = declaration()


def _smla_kv_cache_dtype(kv_cache_dtype: Optional[str]) -> Optional[str]:
    """vLLM's --kv-cache-dtype as smla's name; None when smla has no such cache."""
    if kv_cache_dtype in (None, "auto"):
        return "auto"
    return kv_cache_dtype if kv_cache_dtype in _VLLM_KV_CACHE_DTYPES else None


def smla_reasons(device_capability: Any, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                 block_size: Optional[int]) -> List[str]:
    """Why smla cannot run the current vLLM model this way, as smla's selector says it (empty: it can).

    The model is vLLM's current one (its hf_text_config, as config.json gives it) under vLLM's tensor-parallel
    size; only sparse attention is asked of smla (the indexer is vLLM's)."""
    dtype_name = next((n for n, t in _TORCH_DTYPES.items() if t == dtype), None)
    if dtype_name is None:
        return [f"smla: query dtype {dtype} not supported ({', '.join(_DECLARED.q_dtypes)})"]
    kv = _smla_kv_cache_dtype(kv_cache_dtype)
    if kv is None:
        return [f"smla: kv_cache_dtype {kv_cache_dtype} not supported (smla reads auto, "
                f"{', '.join(_VLLM_KV_CACHE_DTYPES)}; for fp8 pass --kv-cache-dtype fp8_ds_mla)"]
    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    if model_config is None:
        return []  # no model yet: the declaration's checks (head size, dtypes, capability) are all there is
    config = model_config.hf_text_config.to_dict()
    tp = vllm_config.parallel_config.tensor_parallel_size
    device = f"sm_{device_capability.major * 10 + device_capability.minor}"
    explanation = smla.explain(config, device=device, dtype=dtype_name, kv_cache_dtype=kv,
                               block_size=block_size or vllm_config.cache_config.block_size or 64, tp=tp,
                               ops=("sparse attention",))
    for candidate in explanation.candidates:
        if candidate.name == SMLA_BACKEND:
            return [f"smla: {reason}" for reason in candidate.reasons]
    return [f"smla: backend {SMLA_BACKEND} missing from the selection"]


class SmlaSparseMLABackend(AttentionBackend):
    """DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2) through smla on SM80..SM12x."""

    supported_dtypes: ClassVar[List[torch.dtype]] = [_TORCH_DTYPES[d] for d in _DECLARED.q_dtypes]
    supported_kv_cache_dtypes: ClassVar[List[str]] = ["auto"] + [
        d for d in _VLLM_KV_CACHE_DTYPES if d in _DECLARED.kv_cache_dtypes]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type:
        return SmlaSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type:
        return SmlaSparseMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> List[Any]:
        # smla reads any block size (up to its declared maximum, which smla_reasons checks).
        return [MultipleOf(_DECLARED.block_size_multiple)]

    @classmethod
    def get_supported_head_sizes(cls) -> List[int]:
        return list(_DECLARED.qk_head_dims)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # smla's kernels take sinks, but vLLM's MLA layer hands an impl none (0.33): claiming them would drop them.
        return False

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        low, high = _DECLARED.compute_capability
        return low <= capability.major * 10 + capability.minor <= high

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                             block_size: Optional[int], use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability: Any) -> Optional[str]:
        if not (use_mla and use_sparse):
            return None  # vLLM's own checks name it
        if get_current_vllm_config().attention_config.hisparse_config is not None:
            return f"{NAME} does not support HiSparse KV offloading (its hot-buffer rows)"
        reasons = smla_reasons(device_capability, dtype, kv_cache_dtype, block_size)
        return "; ".join(reasons) if reasons else None


@dataclass
class SmlaSparseMLAMetadata(SparseMLACommonMetadata):
    """vLLM's sparse-MLA metadata as it is: the impl needs nothing more."""


class SmlaSparseMLAMetadataBuilder(SparseMLACommonMetadataBuilder[SmlaSparseMLAMetadata]):
    metadata_cls = SmlaSparseMLAMetadata
    # One sparse_mla call per layer over device tensors only (indices, counts, cache views): capturable for
    # batches of any uniform query length, as the in-tree sparse builders declare.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: List[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decode and prefill take the same kernel; the split only orders the batch as vLLM expects.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)


class SmlaSparseMLAImpl(SparseMLACommonImpl[SmlaSparseMLAMetadata]):
    """Every token, prefill and decode, through smla's sparse attention over its top-k rows."""

    # No dense-MHA prefill: vLLM's prefill backends do not run on every arch smla serves, and top-k covers the
    # whole context when it is shorter than index_topk, so sparse attention computes the same function.
    supports_dense_mha_prefill = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[List[float]], sliding_window: Optional[int], kv_cache_dtype: str,
                 logits_soft_cap: Optional[float], attn_type: str, kv_sharing_target_layer_name: Optional[str],
                 indexer: Any = None, **mla_args: Any) -> None:
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError(f"{NAME} does not support alibi_slopes, sliding_window or logits_soft_cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{NAME} supports decoder self-attention only, got {attn_type}")
        if _smla_kv_cache_dtype(kv_cache_dtype) is None:
            raise NotImplementedError(f"{NAME} reads auto, {', '.join(_VLLM_KV_CACHE_DTYPES)} caches, "
                                      f"got kv_cache_dtype={kv_cache_dtype!r}")
        topk_indices_buffer = mla_args.pop("topk_indices_buffer", None)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, indexer=indexer,
                         topk_indices_buffer=topk_indices_buffer, **mla_args)
        self.supports_quant_query_input = False  # smla takes bf16/fp16 queries

    def _forward_mqa_kernel(self, q: Any, kv_cache: torch.Tensor, topk_indices: torch.Tensor,
                            valid_counts: torch.Tensor, *, layer: AttentionLayer, block_size: int,
                            is_decode: bool) -> Any:
        return _kernel.sparse_mla_forward(q, kv_cache, topk_indices, valid_counts, scale=self.scale)
