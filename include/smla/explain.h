// The selection explained, as text (what `smla explain` prints) and as JSON
// (schema in docs/explain-json.md).
#pragma once

#include <string>

#include "smla/select.h"

namespace smla {

std::string explain_text(const AttentionSpec& spec, const RunSpec& run, const Selection& selection);
std::string explain_json(const AttentionSpec& spec, const RunSpec& run, const Selection& selection);

// A Markdown table of every registered backend's declared capabilities (the
// README's support matrix; a test keeps the two equal).
std::string support_matrix_markdown(const Registry& registry = Registry::global());

}  // namespace smla
