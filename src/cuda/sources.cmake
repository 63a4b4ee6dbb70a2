# Compiled only when nvcc is found (SMLA_WITH_CUDA).
target_sources(smla_objects PRIVATE
  cuda/device_query.cu
  cuda/common/runtime.cu
  cuda/mla/attention.cu
  cuda/mla/attention_small_heads.cu
  cuda/mla/attention_wgmma.cu
  cuda/mla/attention_wide.cu
  cuda/mla/cache_write.cu
  cuda/mla/kernel_choice_check.cu
  cuda/indexer/index_cache.cu
  cuda/indexer/indexer_scores.cu
  cuda/indexer/indexer_topk.cu)
