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
positions, keys written elsewhere (``skip_k_cache_insert``), decode requests of unequal query lengths.
"""

import logging
from typing import Any, Optional

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.models.glm5next.nvidia.sparse_indexer import SparseAttnIndexerKpool
from vllm.utils.torch_utils import _resolve_layer_name

import smla

from . import indexer

logger = logging.getLogger("smla.vllm")

_OOT_NAME = SparseAttnIndexerKpool.__name__  # CustomOp.__new__ looks out-of-tree ops up by the class's name


def write_pools(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                pool_slots: torch.Tensor, tail_slots: torch.Tensor, kv_cache: torch.Tensor,
                tail_cache: torch.Tensor, kpool: int) -> None:
    """Writes the pools this batch completes into ``kv_cache`` and keeps each request's last tokens in
    ``tail_cache`` (see the module's docstring). ``pool_slots`` [N] (pool slot, or -1) and ``tail_slots`` [N]
    are vLLM's slot mappings of the two caches; the batch's first N rows of ``k``, ``gate`` (bf16 [*, 128]) and
    ``positions`` are its tokens, each request's consecutive. No host sync."""
    n = pool_slots.shape[0]
    k, gate, positions, tail_slots = k[:n], gate[:n], positions[:n].long(), tail_slots[:n].long()
    ring = tail_cache.shape[2]
    # A request's tokens share its tail block; a token without a tail slot is a group of its own.
    rows = torch.arange(n, device=k.device)
    group = torch.where(tail_slots >= 0, torch.div(tail_slots, ring, rounding_mode="floor"), -1 - rows)
    back = torch.arange(kpool - 1, -1, -1, device=k.device)  # member m of a token's pool: kpool - 1 - m tokens back
    src = rows[:, None] - back
    src_row = src.clamp(min=0)
    in_batch = (src >= 0) & (group[src_row] == group[:, None])
    ring_pos = (positions[:, None] - back) % ring
    tail_block = group.clamp(min=0)[:, None]
    members_k = torch.where(in_batch[..., None], k[src_row], tail_cache[:, 0][tail_block, ring_pos])
    members_gate = torch.where(in_batch[..., None], gate[src_row], tail_cache[:, 1][tail_block, ring_pos])
    # A pool with members from earlier steps needs its request's tail cache.
    whole = (pool_slots >= 0) & (in_batch.all(dim=1) | (tail_slots >= 0))
    smla.write_pooled_index_cache(members_k, members_gate, ape, torch.where(whole, pool_slots.long(), -1), kv_cache)
    # The tail keeps the last `ring` tokens of each request (the next steps' pools, drafts included): distinct slots.
    ahead = rows + ring
    last = (ahead >= n) | (group[ahead.clamp(max=n - 1)] != group)
    keep = torch.where(last & (tail_slots >= 0), tail_slots, -1)
    smla.write_index_cache(k, keep, tail_cache[:, 0])
    smla.write_index_cache(gate, keep, tail_cache[:, 1])


def select(meta: Any, kv_cache: torch.Tensor, q_quant: torch.Tensor, weights: torch.Tensor,
           positions: torch.Tensor, topk_indices_buffer: torch.Tensor, topk_tokens: int, kpool: int) -> None:
    """Each of the batch's ``meta.slot_mapping.shape[0]`` tokens' top ``topk_tokens / kpool`` pools, as token
    positions then its incomplete pool's tokens, into ``topk_indices_buffer``'s row (-1 elsewhere)."""
    n = meta.slot_mapping.shape[0]
    width = topk_tokens // kpool * kpool + kpool - 1
    if topk_indices_buffer.shape[1] < width:
        raise ValueError(f"topk_indices_buffer: expected at least {width} columns (index_topk + kpool - 1), "
                         f"got {topk_indices_buffer.shape[1]}")
    topk_indices_buffer[:n] = -1
    ones = torch.ones(q_quant.shape[:2], dtype=torch.float32, device=q_quant.device)  # vLLM's weights hold q_scale
    context = (positions[:n] + 1).to(torch.int32)
    for rows, request_ids, block_table, pools in indexer.topk_groups(meta, q_quant.device):
        top = smla.indexer_topk(q_quant[rows], weights[rows], kv_cache, request_ids, block_table, pools,
                                topk=topk_tokens // kpool, q_scale=ones[rows])
        smla.pools_to_positions(top, context[rows], kpool=kpool, out=topk_indices_buffer[rows, :width])


def run(meta: Any, tail_meta: Any, kv_cache: torch.Tensor, tail_cache: torch.Tensor, q_quant: torch.Tensor,
        k: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
        topk_indices_buffer: torch.Tensor, topk_tokens: int, kpool: int) -> torch.Tensor:
    """The pooled indexer on vLLM's ``DeepseekV32IndexerMetadata`` of the pooled cache (``meta``) and of the tail
    cache (``tail_meta``), or any objects with their fields (no vLLM import needed)."""
    write_pools(k, gate, ape, positions, meta.slot_mapping, tail_meta.slot_mapping, kv_cache, tail_cache, kpool)
    select(meta, kv_cache, q_quant, weights, positions, topk_indices_buffer, topk_tokens, kpool)
    return topk_indices_buffer


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
    return run(meta, tail_meta, op.k_cache.kv_cache, tail.kv_cache, q_quant, k, weights, gate_score, compress_ape,
               positions, op.topk_indices_buffer, op.topk_tokens, index_kpool)


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
