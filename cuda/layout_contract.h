// Sizes that the layout kernels, the FFI handlers and Python (through mok_jax._mok_cpu) must
// agree on. Plain C++ with no CUDA include, so that every module can see it.
#pragma once

#include <cstdint>

namespace mok {

// Routes per CTA of the layout kernels: the layout scratch holds one count per expert for each
// chunk of this many routes.
constexpr int64_t kLayoutChunk = 1024;

constexpr int64_t LayoutScratchInts(int64_t routes, int64_t experts) {
  return (routes + kLayoutChunk - 1) / kLayoutChunk * experts;
}

}  // namespace mok
