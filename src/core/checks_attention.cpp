// PLACEHOLDER: being written; replaced before the first commit.
#include "smla/backend.h"
#include "smla/error.h"
#include "smla/spec.h"
#include "cpu/kernels.h"
namespace smla {
void check(const WriteMlaCacheArgs&) {}
void check(const SparseMlaArgs&) {}
void check(const PagedMlaDecodeArgs&) {}
}
