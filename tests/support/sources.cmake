target_sources(smla_test_support PRIVATE
  support/layer_util.cpp
  support/test_util.cpp)
