// PLACEHOLDER: being written; replaced before the first commit.
#include "smla/backend.h"
#include "smla/error.h"
#include "smla/spec.h"
#include "cpu/kernels.h"
namespace smla::cpu {
void write_mla_cache(const WriteMlaCacheArgs&) { throw Error(ErrorKind::internal, "todo"); }
void sparse_mla(const SparseMlaArgs&) { throw Error(ErrorKind::internal, "todo"); }
void paged_mla_decode(const PagedMlaDecodeArgs&) { throw Error(ErrorKind::internal, "todo"); }
}
