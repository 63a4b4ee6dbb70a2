"""The kernel entry of smla's pooled indexer in vLLM (smla.vllm.pooled_indexer), on torch tensors in vLLM's
layouts and any objects with the fields of vLLM's indexer metadata; no vLLM import (the GPU tests call it without
vLLM). See pooled_indexer's docstring for what it computes."""

from typing import Any

import torch

import smla

from .indexer import topk_groups


def write_pools(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                pool_slots: torch.Tensor, tail_slots: torch.Tensor, kv_cache: torch.Tensor,
                tail_cache: torch.Tensor, kpool: int) -> None:
    """Writes the pools this batch completes into ``kv_cache`` and keeps each request's last tokens in
    ``tail_cache`` (smla.vllm.pooled_indexer's docstring says how). ``pool_slots`` [N] (pool slot, or -1) and
    ``tail_slots`` [N] are vLLM's slot mappings of the two caches; the batch's first N rows of ``k``, ``gate``
    (bf16 [*, 128]) and ``positions`` are its tokens, each request's consecutive. No host sync."""
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
    decode_pools = torch.div(context[:meta.num_decode_tokens], kpool, rounding_mode="floor")
    for rows, request_ids, block_table, pools in topk_groups(meta, q_quant.device, decode_pools):
        top = smla.indexer_topk(q_quant[rows], weights[rows], kv_cache, request_ids, block_table, pools,
                                topk=topk_tokens // kpool, q_scale=ones[rows], sorted=False)  # order unused
        smla.pools_to_positions(top, context[rows], kpool=kpool, out=topk_indices_buffer[rows, :width])


def run(meta: Any, tail_meta: Any, kv_cache: torch.Tensor, tail_cache: torch.Tensor, q_quant: torch.Tensor,
        k: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
        topk_indices_buffer: torch.Tensor, topk_tokens: int, kpool: int) -> torch.Tensor:
    """The pooled indexer on vLLM's ``DeepseekV32IndexerMetadata`` of the pooled cache (``meta``) and of the tail
    cache (``tail_meta``), or any objects with their fields (no vLLM import needed)."""
    write_pools(k, gate, ape, positions, meta.slot_mapping, tail_meta.slot_mapping, kv_cache, tail_cache, kpool)
    select(meta, kv_cache, q_quant, weights, positions, topk_indices_buffer, topk_tokens, kpool)
    return topk_indices_buffer
