target_sources(smla_objects PRIVATE
  cpu/backend.cpp
  cpu/memory_bandwidth.cpp
  cpu/mla_attention.cpp
  cpu/attention_kernels.cpp
  cpu/indexer.cpp
  cpu/indexer_scores.cpp
  cpu/isa.cpp)
