// PLACEHOLDER: being written; replaced before the first commit.
#include "smla/backend.h"
#include "smla/error.h"
#include "smla/spec.h"
#include "cpu/kernels.h"
namespace smla::cpu {
void write_index_cache(const WriteIndexCacheArgs&) { throw Error(ErrorKind::internal, "todo"); }
void indexer_topk(const IndexerTopkArgs&) { throw Error(ErrorKind::internal, "todo"); }
void positions_to_slots(const PositionsToSlotsArgs&) { throw Error(ErrorKind::internal, "todo"); }
}
