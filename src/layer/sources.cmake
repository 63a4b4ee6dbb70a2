target_sources(smla_objects PRIVATE
  layer/layer.cpp
  layer/layer_math.cpp
  layer/unabsorbed.cpp)

# The layer's GEMMs run on OpenBLAS (Debian libopenblas-dev).
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
# smla and smla_static are made from smla_objects' objects once src/CMakeLists.txt has read every sources.cmake.
# BLAS_LIBRARIES is a plain path, so the installed package needs no find_dependency(BLAS).
cmake_language(DEFER CALL target_link_libraries smla PRIVATE ${BLAS_LIBRARIES})
cmake_language(DEFER CALL target_link_libraries smla_static PRIVATE ${BLAS_LIBRARIES})
