// The CUDA backend's ops (compiled only with nvcc). Args arrive checked.
#pragma once

#include "smla/ops.h"

namespace smla::cuda {

void write_mla_cache(const WriteMlaCacheArgs& args);
void sparse_mla(const SparseMlaArgs& args);
void paged_mla_decode(const PagedMlaDecodeArgs& args);

}  // namespace smla::cuda
