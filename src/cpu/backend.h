#pragma once

#include <memory>

#include "smla/backend.h"

namespace smla::cpu {
std::unique_ptr<Backend> make_backend();
}  // namespace smla::cpu
