// The parameters the training attention kernels share (attention_train.cu's mma.sync kernels and
// attention_train_wgmma.cu's Hopper backward), and the Hopper backward's entry points, which
// launch_attention_train_backward calls.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/attention/attention.h"
#include "core/error.h"

namespace iris::cuda {

inline constexpr float kTrainLog2e = 1.4426950408889634f;

struct TrainParams {
  const uint16_t* qkv;
  uint16_t* out;  // forward
  float* lse;     // forward output, backward input
  const uint16_t* dout;
  float* dsum;
  uint16_t* dqkv;
  const int32_t* cu;
  const int32_t* real_rows;  // segments from *real_rows on are padding (or null)
  int n_segments;
  int64_t total_rows;
  int nq, nkv, group;
  int64_t width;   // qkv / dqkv row stride, elements
  int64_t hidden;  // nq * hd: out / dout row stride, and the column of the first k head
  int64_t v_col;   // column of the first v head: (nq + nkv) * hd
  float scale, scale_log2;
};

// The checked parameters of one call (the forward's out and the backward's tensors are set by
// the caller).
inline TrainParams make_params(const uint16_t* qkv, const int32_t* cu, const int32_t* real_rows,
                               int n_segments, int64_t total_rows, int nq, int nkv, int hd,
                               float scale) {
  IRIS_CHECK(nq > 0 && nkv > 0 && nq % nkv == 0, "attention_train: ", nq,
             " query heads are not a multiple of ", nkv, " kv heads");
  IRIS_CHECK(hd > 0 && hd <= kAttentionTrainMaxHeadDim, "attention_train: head_dim ", hd,
             " outside [1, ", kAttentionTrainMaxHeadDim, "]");
  IRIS_CHECK(n_segments >= 0, "attention_train: negative segment count");
  // Row positions and lse / dsum indices are 32-bit in the kernels.
  IRIS_CHECK(total_rows * std::max(nq, 8) < (int64_t{1} << 31), "attention_train: ", total_rows,
             " rows of ", nq, " heads are too many");
  TrainParams p{};
  p.qkv = qkv;
  p.cu = cu;
  p.real_rows = real_rows;
  p.n_segments = n_segments;
  p.total_rows = total_rows;
  p.nq = nq;
  p.nkv = nkv;
  p.group = nq / nkv;
  p.hidden = static_cast<int64_t>(nq) * hd;
  p.v_col = static_cast<int64_t>(nq + nkv) * hd;
  p.width = static_cast<int64_t>(nq + 2 * nkv) * hd;
  p.scale = scale;
  p.scale_log2 = scale * kTrainLog2e;
  return p;
}

// Raises the Hopper backward kernels' shared-memory limits where they can run (an sm_90a build on
// a compute capability 9.0 device); called by attention_train_init.
void attention_train_wgmma_init();
// The backward's dK/dV and dQ blocks on Hopper's warpgroup MMA, after the dsum kernel has filled
// p.dsum and zeroed the rows outside every live segment; false, with nothing launched, where they
// do not serve the call (no such device, not head_dim 64 segments or 128 causal, unaligned).
bool launch_train_backward_wgmma(const TrainParams& p, int head_dim, bool causal, cudaStream_t s);

}  // namespace iris::cuda
