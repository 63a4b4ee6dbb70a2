"""smla's pooled indexer (GLM-5.3-Flash, ``glm5_next``) inside vLLM (0.33) where DeepGEMM cannot run (SM8x, SM12x).

vLLM's ``SparseAttnIndexerKpool`` (a ``CustomOp``, ``vllm/models/glm5next/nvidia/sparse_indexer.py``) scores
pools with DeepGEMM's MQA-logits kernels, which do not run on those GPUs. There ``install`` registers, through
``CustomOp.register_oot``, a subclass whose forward runs smla's ops on vLLM's own caches and metadata:

- Keys. vLLM's metadata gives the pooled index cache a pool-granular ``slot_mapping`` (a pool's slot on the
  token that completes it, -1 on the others) and its tail cache (``[blocks, 2 (key, gate), ring, 128]`` bf16, one
  block a request) a token-granular one (``block * ring + position % ring``). A pool's ``kpool`` keys and gates
  come from this batch, or from the tail cache for tokens of earlier steps; ``smla.write_pooled_index_cache``
  writes the pool (softmax of gate + ape, Walsh-Hadamard rotation, fp8 with a ue8m0 scale). The last ``ring``
  tokens of each request are then kept in the tail cache (``smla.write_index_cache``), as vLLM's kernels keep them.
- Top-k. ``smla.indexer_topk`` over the pooled cache (context lengths in whole pools, as vLLM's metadata counts
  them) picks ``index_topk / kpool`` pools; ``smla.pools_to_positions`` writes their tokens, then those of the
  incomplete last pool, into vLLM's top-k buffer (-1 elsewhere), the layout of vLLM's ``expand_pools_and_append_tail``.
  Where every pool fits, vLLM writes the causal positions in order; smla writes the same positions in score order.

Refused (NotImplementedError, with the reason): fp4 index caches, context parallelism, a missing tail cache or
positions, keys written elsewhere (``skip_k_cache_insert``). Decode requests may have unequal query lengths
(draft tokens): each decode token's context comes from its position.
"""

import logging
from typing import Any, Optional

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.models.glm5next.nvidia.sparse_indexer import SparseAttnIndexerKpool
from vllm.utils.torch_utils import _resolve_layer_name

from . import _pooled, indexer

logger = logging.getLogger("smla.vllm")

_OOT_NAME = SparseAttnIndexerKpool.__name__  # CustomOp.__new__ looks out-of-tree ops up by the class's name


@eager_break_during_capture  # as vLLM's own body: its metadata changes between steps
def _forward(op: "SmlaSparseAttnIndexerKpool", hidden_states: torch.Tensor, q_quant: Any, k: torch.Tensor,
             weights: torch.Tensor, gate_score: Optional[torch.Tensor], compress_ape: Optional[torch.Tensor],
             index_kpool: int, positions: Optional[torch.Tensor]) -> torch.Tensor:
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        # vLLM's memory-profiling run: vLLM's own body only reserves its workspaces there (no DeepGEMM call).
        return SparseAttnIndexerKpool.forward_cuda(op, hidden_states, q_quant, k, weights, gate_score=gate_score,
                                                   compress_ape=compress_ape, index_kpool=index_kpool,
                                                   positions=positions)
    tail = op.tail_cache
    if (isinstance(q_quant, tuple) or op.use_fp4_cache or op.dcp_world_size > 1 or op.skip_k_cache_insert
            or tail is None or gate_score is None or compress_ape is None or positions is None or index_kpool < 2):
        raise NotImplementedError(
            "smla's vLLM pooled indexer runs the fp8 pool cache it writes itself, with vLLM's tail cache, gate, ape "
            "and positions, without context parallelism (GLM-5.3-Flash)")
    meta = attn_metadata[_resolve_layer_name(op.k_cache.prefix)]
    tail_meta = attn_metadata.get(_resolve_layer_name(tail.prefix))
    if tail_meta is None:
        raise NotImplementedError("smla's vLLM pooled indexer needs the tail cache's metadata")
    return _pooled.run(meta, tail_meta, op.k_cache.kv_cache, tail.kv_cache, q_quant, k, weights, gate_score,
                       compress_ape, positions, op.topk_indices_buffer, op.topk_tokens, index_kpool)


class SmlaSparseAttnIndexerKpool(SparseAttnIndexerKpool):
    """vLLM's ``SparseAttnIndexerKpool`` (its constructor, caches and profiling run) with smla's forward."""

    def forward_cuda(self, hidden_states: torch.Tensor, q_quant: Any, k: torch.Tensor, weights: torch.Tensor, *,
                     gate_score: Optional[torch.Tensor] = None, compress_ape: Optional[torch.Tensor] = None,
                     index_kpool: int = 1, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _forward(self, hidden_states, q_quant, k, weights, gate_score, compress_ape, index_kpool, positions)

    forward_native = forward_cuda  # vLLM's forward_native is its CUDA path too


def install(major: int) -> bool:
    """On a GPU of compute capability ``major``.x where DeepGEMM cannot run, GLM-5.3-Flash's pooled indexer runs
    through smla. Returns whether it did."""
    if indexer.deep_gemm_runs(major) or _OOT_NAME in op_registry_oot:
        return False
    CustomOp.register_oot(SmlaSparseAttnIndexerKpool, name=_OOT_NAME)
    logger.warning("smla: DeepGEMM does not run on compute capability %d.x; GLM-5.3-Flash's pooled indexer runs "
                   "through smla", major)
    return True
