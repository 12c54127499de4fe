// The CUDA backend's lm_head loss workspace, as a formula that a memory plan can evaluate on a
// machine without a GPU (training/memory_plan.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace iris {

// f32 logits, then bf16 d(logits), of `chunk_rows` rows over the vocabulary, each 256-byte
// aligned.
inline size_t cuda_lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t vocab) {
  const auto align256 = [](size_t b) { return (b + 255) / 256 * 256; };
  return align256(size_t(chunk_rows) * size_t(vocab) * sizeof(float)) +
         align256(size_t(chunk_rows) * size_t(vocab) * sizeof(uint16_t));
}

}  // namespace iris
