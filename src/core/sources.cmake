target_sources(smla_objects PRIVATE
  core/types.cpp
  core/spec.cpp
  core/capabilities.cpp
  core/select.cpp
  core/explain.cpp
  core/check_util.cpp
  core/checks_attention.cpp
  core/checks_indexer.cpp
  core/ops.cpp)
