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
    in = std::max(in, p.a.cols());
  }
  dropout = dropout || (!adapters.empty() && adapters.dropout > 0.0f);
}

LoraScratch allocate_lora_scratch(Arena& a, DType dtype, int64_t rows,
                                  const LoraScratchSize& size) {
  if (size.rank == 0 || rows == 0) return {};
  LoraScratch s;
  s.low = a.alloc(dtype, {rows * size.rank});
  s.dlow = a.alloc(dtype, {rows * size.rank});
  s.wide = a.alloc(dtype, {rows * size.out});
  if (size.dropout) s.dropped = a.alloc(dtype, {rows * size.in});
  return s;
}

namespace {

// The adapter's input as it reads it: x, or x with dropout applied (into the scratch).
Tensor adapter_input(Backend& be, const LoraAdapters& adapters, const LoraAdapter& p,
                     const Tensor& x, const LoraScratch& s) {
  if (adapters.dropout <= 0.0f || !s.seed.defined()) return x;
  const Tensor dropped = as_matrix(s.dropped, x.rows(), x.cols());
  be.dropout(dropped, x, adapters.dropout, s.seed, p.dropout_stream);
  return dropped;
}

}  // namespace

void lora_forward(Backend& be, const LoraAdapters& adapters, const Tensor& y, const Tensor& x,
                  const LoraScratch& s) {
  const int64_t T = x.rows();
  for (const LoraAdapter& p : adapters.parts) {
    const int64_t r = p.a.rows(), out = p.b.rows();
    const Tensor low = as_matrix(s.low, T, r), wide = as_matrix(s.wide, T, out);
    be.linear(low, adapter_input(be, adapters, p, x, s), p.a, Tensor(), false);
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
    const bool dropout = adapters.dropout > 0.0f && s.seed.defined();
    const Tensor xin = dB || dA ? adapter_input(be, adapters, p, x, s) : x;
    if (dB) {
      be.linear(low, xin, p.a, Tensor(), false);
      be.linear_backward_weight(gp->b, Tensor(), dwide, low);
    }
    if (!dA && !dx.defined()) continue;
    be.linear_backward_input(dlow, dwide, p.b, false);
    if (dA) be.linear_backward_weight(gp->a, Tensor(), dlow, xin);
    if (!dx.defined()) continue;
    if (!dropout) {
      be.linear_backward_input(dx, dlow, p.a, true);
      continue;
    }
    // Through the dropout: the same mask on the input's gradient.
    const Tensor dxin = as_matrix(s.dropped, T, p.a.cols());
    be.linear_backward_input(dxin, dlow, p.a, false);
    be.dropout(dxin, dxin, adapters.dropout, s.seed, p.dropout_stream);
    be.add_column_block(dx, 0, dxin, 0, p.a.cols(), 1.0f, true);
  }
}

}  // namespace iris
