// The selection explained, as text (what `smla explain` prints) and as JSON
// (schema in docs/explain-json.md).
#pragma once

#include <string>

#include "smla/select.h"

namespace smla {

std::string explain_text(const AttentionSpec& spec, const RunSpec& run, const Selection& selection);
std::string explain_json(const AttentionSpec& spec, const RunSpec& run, const Selection& selection);

}  // namespace smla
