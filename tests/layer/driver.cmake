# The C++ side of tests/layer/test_hf_layer.py (make test-layer), built with the CPU tests.
add_executable(layer_driver ${CMAKE_CURRENT_LIST_DIR}/layer_driver.cpp)
target_link_libraries(layer_driver PRIVATE smla_static)
