// Low-rank adapters (LoRA, as Hugging Face PEFT defines them) on a model's projections: an adapted
// projection computes y = x W^T + scale * (x A^T) B^T, with A [r, in] and B [out, r] trained and W
// frozen. Iris fuses several HF projections into one (q/k/v, gate/up), so a fused projection holds
// one adapter per adapted HF module, each writing its own rows of the fused output: an adapter on
// q and v alone leaves k's columns untouched. The adapters are data: a projection without any has
// an empty set, and the ops below then do nothing, so one model definition serves both.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"

namespace iris {

struct LoraAdapter {
  Tensor a;                     // [r, in]: lora_A
  Tensor b;                     // [out, r]: lora_B
  int64_t out_offset = 0;       // its first row of the fused projection's output
  uint64_t dropout_stream = 0;  // its dropout mask's stream (Backend::dropout), per HF module
};

// A fused projection's adapters; a gradient mirror has the same parts with f32 tensors (undefined
// where not trained).
struct LoraAdapters {
  std::vector<LoraAdapter> parts;
  float scale = 0.0f;    // lora_alpha / r (/ sqrt(r) with rsLoRA)
  float dropout = 0.0f;  // PEFT's lora_dropout on each adapter's input, in training only
  bool empty() const { return parts.empty(); }
};

// Scratch that every adapter of a model shares, planned for the most rows a call runs: low and
// dlow hold [rows, r], wide [rows, out] for the largest adapted output (each used as a matrix of
// the call's shape over its first elements).
struct LoraScratch {
  Tensor low, dlow, wide;  // flat, compute dtype
  // With dropout: a call's dropped input (or its gradient), [rows, in], and the micro-batch's
  // seed (i64 [1]; negative or undefined: no dropout, as in evaluation and inference).
  Tensor dropped, seed;
  bool defined() const { return low.defined(); }
};
// Elements of each scratch buffer for at most `rows` rows of these adapters.
struct LoraScratchSize {
  int64_t rank = 0, out = 0, in = 0;
  bool dropout = false;
  void cover(const LoraAdapters& adapters);
};
// The scratch for calls of at most `rows` rows, or none when no adapter was covered.
LoraScratch allocate_lora_scratch(Arena& a, DType dtype, int64_t rows, const LoraScratchSize& size);

// y[:, part rows] += scale * (x A^T) B^T for every part (y: [rows, out of the fused projection],
// x: [rows, in]). Nothing when `adapters` is empty.
void lora_forward(Backend& be, const LoraAdapters& adapters, const Tensor& y, const Tensor& x,
                  const LoraScratch& s);
// From dy, the gradient of the fused projection's output: dx (f32 or compute; undefined: none)
// += each adapter's input gradient, and g's defined parts (f32) += dA and dB. Recomputes x A^T
// (and the dropped input, from the same seed) rather than keeping it from the forward. Nothing
// when `adapters` is empty.
void lora_backward(Backend& be, const LoraAdapters& adapters, const LoraAdapters* g,
                   const Tensor& dx, const Tensor& dy, const Tensor& x, const LoraScratch& s);

}  // namespace iris
