#include "core/lora.h"

#include <algorithm>

namespace iris {
namespace {

// The first rows x cols elements of a flat scratch buffer as a matrix.
Tensor as_matrix(const Tensor& flat, int64_t rows, int64_t cols) {
  IRIS_CHECK(rows * cols <= flat.numel(), "LoRA scratch of ", flat.numel(),
             " elements is smaller than [", rows, ", ", cols, "]");
  return Tensor(flat.data, flat.dtype, flat.device, {rows, cols});
}

}  // namespace

void LoraScratchSize::cover(const LoraAdapters& adapters) {
  for (const LoraAdapter& p : adapters.parts) {
    rank = std::max(rank, p.a.rows());
    out = std::max(out, p.b.rows());
  }
}

LoraScratch allocate_lora_scratch(Arena& a, DType dtype, int64_t rows,
                                  const LoraScratchSize& size) {
  if (size.rank == 0 || rows == 0) return {};
  LoraScratch s;
  s.low = a.alloc(dtype, {rows * size.rank});
  s.dlow = a.alloc(dtype, {rows * size.rank});
  s.wide = a.alloc(dtype, {rows * size.out});
  return s;
}

void lora_forward(Backend& be, const LoraAdapters& adapters, const Tensor& y, const Tensor& x,
                  const LoraScratch& s) {
  const int64_t T = x.rows();
  for (const LoraAdapter& p : adapters.parts) {
    const int64_t r = p.a.rows(), out = p.b.rows();
    const Tensor low = as_matrix(s.low, T, r), wide = as_matrix(s.wide, T, out);
    be.linear(low, x, p.a, Tensor(), false);
    be.linear(wide, low, p.b, Tensor(), false);
    be.add_column_block(y, p.out_offset, wide, 0, out, adapters.scale, true);
  }
}

void lora_backward(Backend& be, const LoraAdapters& adapters, const LoraAdapters* g,
                   const Tensor& dx, const Tensor& dy, const Tensor& x, const LoraScratch& s) {
  const int64_t T = x.rows();
  for (size_t i = 0; i < adapters.parts.size(); ++i) {
    const LoraAdapter& p = adapters.parts[i];
    const LoraAdapter* gp = g != nullptr ? &g->parts[i] : nullptr;
    const int64_t r = p.a.rows(), out = p.b.rows();
    const Tensor low = as_matrix(s.low, T, r), dlow = as_matrix(s.dlow, T, r),
                 dwide = as_matrix(s.wide, T, out);
    // d(x A^T B^T) scaled, the adapter's rows of dy.
    be.add_column_block(dwide, 0, dy, p.out_offset, out, adapters.scale, false);
    const bool dB = gp != nullptr && gp->b.defined(), dA = gp != nullptr && gp->a.defined();
    if (dB) {
      be.linear(low, x, p.a, Tensor(), false);
      be.linear_backward_weight(gp->b, Tensor(), dwide, low);
    }
    if (!dA && !dx.defined()) continue;
    be.linear_backward_input(dlow, dwide, p.b, false);
    if (dA) be.linear_backward_weight(gp->a, Tensor(), dlow, x);
    if (dx.defined()) be.linear_backward_input(dx, dlow, p.a, true);
  }
}

}  // namespace iris
