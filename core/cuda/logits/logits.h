// Host-side launchers of the kernels over rows of logits (logits.cu): the argmax of greedy
// decoding and the training loss. bf16 travels as uint16_t bits; every launcher enqueues on `s`
// without synchronising or allocating (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- argmax (greedy decoding) ----
// Rows of 32k+ columns use `key_scratch` (one 64-bit key per row, up to scratch_rows rows) to
// spread a row over many blocks.
void launch_argmax_rows(int32_t* out, const uint16_t* x, int64_t rows, int64_t cols,
                        unsigned long long* key_scratch, int64_t scratch_rows, cudaStream_t s);

// ---- cross-entropy over an f32 logits chunk (training) ----
// loss_sum[0] += sum over rows of (logsumexp(logits[r]) - logits[r, targets[r]]) (per-row losses
// in scratch, summed in f64 in a fixed order); when dlogits is not null, dlogits bf16 [rows,
// vocab] = grad_scale[0] * (softmax - onehot(target)). dlogits must not alias logits. A target
// outside [0, vocab) gives a zero loss and a zero gradient row. Needs
// cross_entropy_scratch_floats(rows).
void launch_cross_entropy(float* loss_sum, uint16_t* dlogits, const float* logits,
                          const int32_t* targets, const float* grad_scale, int64_t rows,
                          int64_t vocab, float* scratch, int64_t scratch_floats, cudaStream_t s);

// The scratch launch_cross_entropy needs: one float per row.
int64_t cross_entropy_scratch_floats(int64_t rows);

}  // namespace iris::cuda
