target_sources(smla_objects PRIVATE
  layer/layer.cpp
  layer/cpu_compute.cpp
  layer/layer_math.cpp
  layer/unabsorbed.cpp)

# The layer's GEMMs run on OpenBLAS (Debian libopenblas-dev).
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
# Debian puts cblas.h on the default include path; elsewhere (a prefix, Fedora's openblas/) it is found here.
find_path(SMLA_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas REQUIRED)
target_include_directories(smla_objects PRIVATE ${SMLA_CBLAS_INCLUDE_DIR})
# smla and smla_static are made from smla_objects' objects once src/CMakeLists.txt has read every sources.cmake.
# BLAS_LIBRARIES is a plain path, so the installed package needs no find_dependency(BLAS).
cmake_language(DEFER CALL target_link_libraries smla PRIVATE ${BLAS_LIBRARIES})
cmake_language(DEFER CALL target_link_libraries smla_static PRIVATE ${BLAS_LIBRARIES})

# On a GPU: cuBLAS for the GEMMs, small kernels for the rest. The installed package's find_dependency(CUDAToolkit)
# provides CUDA::cublas to smla_static's users.
if(SMLA_WITH_CUDA)
  target_sources(smla_objects PRIVATE layer/cuda_compute.cu)
  cmake_language(DEFER CALL target_link_libraries smla PRIVATE CUDA::cublas)
  cmake_language(DEFER CALL target_link_libraries smla_static PRIVATE CUDA::cublas)
endif()
