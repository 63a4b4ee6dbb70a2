target_sources(smla_test_support PRIVATE
  support/test_util.cpp)
