"""smla's DSA indexer inside vLLM (0.33) where DeepGEMM cannot run (SM8x, SM12x).

vLLM's indexer op ``vllm::sparse_attn_indexer`` (``SparseAttnIndexer``'s
body, one of the compilation config's splitting ops) scores with DeepGEMM,
and the indexer's metadata builder asks DeepGEMM for a schedule, which fails
("Unsupported architecture") on GPUs DeepGEMM does not support. On those
GPUs ``install`` gives the op a CUDA kernel of smla's (torch's
``Library.impl`` override: the op, its schema, fake and splitting stay
vLLM's) and keeps the builder from calling DeepGEMM. The kernel writes the
index keys with ``smla.write_index_cache`` and fills vLLM's top-k buffer
with ``smla.indexer_topk``: per token, the logical positions of its request
with the highest scores, -1 padded, as vLLM's kernels leave them. On SM90 and
SM100 nothing changes.
"""

import logging
from typing import Any, Iterator, Optional, Tuple

import torch

import smla

logger = logging.getLogger("smla.vllm")

_LIBRARY = None  # the torch.library.Library holding the override (kept alive)


def deep_gemm_runs(major: int) -> bool:
    """DeepGEMM's indexer kernels: SM90 and SM100 families only."""
    return major in (9, 10)


def sparse_attn_indexer(hidden_states: torch.Tensor, k_cache_prefix: Any, kv_cache: torch.Tensor,
                        q_quant: torch.Tensor, q_scale: Optional[torch.Tensor], k: Optional[torch.Tensor],
                        weights: torch.Tensor, quant_block_size: int, scale_fmt: Optional[str], topk_tokens: int,
                        head_dim: int, max_model_len: int, total_seq_lens: int, topk_indices_buffer: torch.Tensor,
                        skip_k_cache_insert: bool, use_pcp: bool, pcp_shard_decode_requests: bool,
                        dense_mha_metadata_layer_name: Any, use_fp4_cache: bool = False, dcp_rank: int = 0,
                        dcp_world_size: int = 1, cp_kv_cache_interleave_size: int = 1,
                        skip_topk_buffer_clear: bool = False, candidate_blocks: Optional[torch.Tensor] = None,
                        candidate_block_size: int = 0, candidate_write: bool = False,
                        topk_backend: str = "auto") -> torch.Tensor:
    """``vllm::sparse_attn_indexer`` through smla (vLLM's signature; see the module's docstring)."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers import sparse_attn_indexer as vllm_indexer

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        # vLLM's memory-profiling run: its own path only reserves workspaces (no DeepGEMM call).
        return vllm_indexer.sparse_attn_indexer(
            hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights, quant_block_size, scale_fmt,
            topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer, skip_k_cache_insert, use_pcp,
            pcp_shard_decode_requests, dense_mha_metadata_layer_name, use_fp4_cache, dcp_rank, dcp_world_size,
            cp_kv_cache_interleave_size, skip_topk_buffer_clear, candidate_blocks=candidate_blocks,
            candidate_block_size=candidate_block_size, candidate_write=candidate_write, topk_backend=topk_backend)
    if (use_fp4_cache or use_pcp or dcp_world_size > 1 or candidate_blocks is not None or q_scale is not None
            or skip_k_cache_insert):
        # skip_k_cache_insert: the keys were written by another kernel, in a layout smla does not promise to read.
        raise NotImplementedError("smla's vLLM indexer runs the fp8 index cache it writes itself, without context "
                                  "parallelism or candidate blocks (DeepSeek-V3.2, GLM-5)")
    meta = attn_metadata[vllm_indexer._resolve_layer_name(k_cache_prefix)]
    return run(meta, kv_cache, q_quant, k, weights, topk_indices_buffer, topk_tokens,
               num_rows=hidden_states.shape[0], clear=not skip_topk_buffer_clear)


def run(meta: Any, kv_cache: torch.Tensor, q_quant: torch.Tensor, k: Optional[torch.Tensor], weights: torch.Tensor,
        topk_indices_buffer: torch.Tensor, topk_tokens: int, *, num_rows: int, write_keys: bool = True,
        clear: bool = True) -> torch.Tensor:
    """The indexer on ``meta``, vLLM's ``DeepseekV32IndexerMetadata`` (or any object with its fields: no vLLM
    import here): writes the new tokens' keys ``k`` at ``meta.slot_mapping``, then each token's top-k logical
    positions into ``topk_indices_buffer[:, :topk_tokens]`` (its first ``num_rows`` rows -1 first, with
    ``clear``). Capturable in a CUDA graph for decode batches (device tensors only, scratch from torch)."""
    if write_keys:
        smla.write_index_cache(k[:meta.slot_mapping.shape[0]], meta.slot_mapping, kv_cache)
    if clear:
        topk_indices_buffer[:num_rows] = -1
    # vLLM folds each query's fp8 scale into `weights`; smla takes fp8 queries with a scale of their own.
    # Unsorted (ascending positions): vLLM's own top-k kernel returns no order either and attention needs none;
    # the GPU then skips ordering the chosen by score.
    ones = torch.ones(q_quant.shape[:2], dtype=torch.float32, device=q_quant.device)
    for rows, request_ids, block_table, context_lens in topk_groups(meta, q_quant.device):
        smla.indexer_topk(q_quant[rows], weights[rows], kv_cache, request_ids, block_table, context_lens,
                          q_scale=ones[rows], out=topk_indices_buffer[rows, :topk_tokens], sorted=False)
    return topk_indices_buffer


def topk_groups(meta: Any, device: torch.device, decode_contexts: Optional[torch.Tensor] = None
                ) -> Iterator[Tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """vLLM's indexer metadata as ``smla.indexer_topk``'s arguments, per group of rows (the decode tokens, then
    each prefill chunk): (rows, request_ids, block_table, context_lens int32), the context lengths in the index
    cache's entries as vLLM's metadata counts them (tokens; whole pools for a pooled cache). With
    ``decode_contexts`` (each decode token's context, known to the caller) decode requests may have unequal query
    lengths. No host sync."""
    if meta.num_decodes > 0:
        decode = meta.decode
        if decode_contexts is not None:
            # decode_lens: the tokens of each block-table row (a request's, or one token's when vLLM flattens).
            rows = torch.arange(decode.block_table.shape[0], dtype=torch.int32, device=device)
            requests = torch.repeat_interleave(rows, decode.decode_lens.long(), output_size=meta.num_decode_tokens)
            yield slice(0, meta.num_decode_tokens), requests, decode.block_table, decode_contexts.to(torch.int32)
        elif decode.requires_padding:
            raise NotImplementedError("smla's vLLM indexer: decode requests of unequal query lengths")
        else:
            # seq_lens: [B] (one row per request, or per token when vLLM flattens) or [B, next_n] per token.
            batch = decode.seq_lens.shape[0]
            next_n = decode.seq_lens.shape[1] if decode.seq_lens.dim() == 2 else 1
            requests = torch.arange(batch * next_n, dtype=torch.int32, device=device) // next_n
            yield slice(0, batch * next_n), requests, decode.block_table, decode.seq_lens.reshape(-1).to(torch.int32)
    if meta.num_prefills > 0:
        for chunk in meta.prefill.chunks:
            if chunk.token_end == chunk.token_start:
                continue
            # A token's keys are [ks, ke) of its chunk's requests laid end to end (cu_seq_lens): ks is where its
            # request starts, ke - ks its causal context. A request with no entries yet (a pooled cache's first
            # tokens) starts where the next one does: its tokens may get that one's row, or none past the last
            # (the clamp), which is harmless as they read nothing.
            ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
            starts = chunk.cu_seq_lens
            requests = torch.searchsorted(starts, ks.to(starts.dtype), right=True) - 1
            requests = requests.clamp(max=chunk.block_table.shape[0] - 1).to(torch.int32)
            yield slice(chunk.token_start, chunk.token_end), requests, chunk.block_table, (ke - ks).to(torch.int32)


def install(major: int) -> bool:
    """On a GPU of compute capability ``major``.x where DeepGEMM cannot run, routes vLLM's indexer through smla.
    Returns whether it did."""
    global _LIBRARY
    if deep_gemm_runs(major) or _LIBRARY is not None:
        return False
    from vllm.model_executor.layers import sparse_attn_indexer as _registers_the_op  # noqa: F401
    from vllm.v1.attention.backends.mla import indexer as indexer_backend

    library = torch.library.Library("vllm", "IMPL")
    library.impl("sparse_attn_indexer", sparse_attn_indexer, "CUDA")
    _LIBRARY = library
    # The indexer's metadata builder asks DeepGEMM for a decode schedule whenever DeepGEMM is importable; the
    # schedule is DeepGEMM's alone, and asking fails on these GPUs.
    indexer_backend.has_deep_gemm = lambda: False
    logger.warning("smla: DeepGEMM does not run on compute capability %d.x; vLLM's DSA indexer runs through smla",
                   major)
    return True
