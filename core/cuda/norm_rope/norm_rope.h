// Host-side launchers of the normalisation and RoPE kernels (norm_rope.cu): LayerNorm, RMSNorm and
// the fused per-head q/k RMSNorm + RoPE, their training forwards (which save the statistics) and
// backwards. bf16 travels as uint16_t bits; every launcher enqueues on `s` without synchronising
// or allocating (graph-capturable). Parameters typed `const void*` with a `bool ..._f32` flag are
// f32 when the flag is set, bf16 otherwise.
//
// Determinism of the backwards: no float atomics. The reductions over rows into per-column results
// (the norm weight gradients) run on a fixed number of partial blocks (kTrainReducePartials,
// kQkNormPartials; independent of the row count) that write to `scratch` (train_scratch.h), then a
// second kernel adds the partials in order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- inference ----
void launch_layer_norm(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* b,
                       int64_t rows, int64_t cols, float eps, cudaStream_t s);
void launch_rms_norm(uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t rows, int64_t cols,
                     float eps, cudaStream_t s);
// q_norm_w / k_norm_w may be null (no per-head norm for that block).
void launch_qkv_norm_rope(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                          float eps, const float* cos, const float* sin, int64_t tokens,
                          int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                          cudaStream_t s);
// launch_qkv_norm_rope, and in the same kernel the rotated k heads and the v heads of row t
// stored at cache row past_len[0] + t (rows past max_len dropped, as launch_kv_store does).
// Returns false, having launched nothing, where the shapes or alignments do not suit the fused
// kernel (the caller then launches the two ops).
bool launch_qkv_norm_rope_kv_store(uint16_t* qkv, const uint16_t* q_norm_w,
                                   const uint16_t* k_norm_w, float eps, const float* cos,
                                   const float* sin, int64_t tokens, int n_q_heads, int n_kv_heads,
                                   int head_dim, bool round_tables, uint16_t* k_cache,
                                   uint16_t* v_cache, const int32_t* past_len, int64_t max_len,
                                   cudaStream_t s);

// ---- training: scratch sizes (floats) ----
constexpr int kTrainReducePartials = 128;  // partial blocks of the norm column reductions
constexpr int kQkNormPartials = 512;       // partial blocks of the q/k norm weight gradients
// layer_norm_backward / rms_norm_backward with dw or db: 2 * kTrainReducePartials * cols.
int64_t norm_backward_scratch_floats(int64_t cols);
// qkv_norm_rope_backward with a norm-weight gradient: 2 * kQkNormPartials * head_dim.
int64_t qkv_norm_rope_backward_scratch_floats(int head_dim);

// ---- training: norms ----
// launch_layer_norm (same kernels, same bits of y) that also saves mean[rows], rstd[rows] (f32).
// y must not alias x.
void launch_layer_norm_train(uint16_t* y, float* mean, float* rstd, const uint16_t* x,
                             const uint16_t* w, const uint16_t* b, int64_t rows, int64_t cols,
                             float eps, cudaStream_t s);
// dx[rows, cols] f32 += d/dx; dw, db f32 [cols] += d/dw, d/db. Each of dx, dw, db may be null
// (skipped); scratch is needed only with dw or db.
void launch_layer_norm_backward(float* dx, float* dw, float* db, const void* dy, bool dy_f32,
                                const uint16_t* x, const float* mean, const float* rstd,
                                const uint16_t* w, int64_t rows, int64_t cols, float* scratch,
                                int64_t scratch_floats, cudaStream_t s);
// launch_rms_norm (same kernels, same bits of y) that also saves rstd[rows] (f32).
void launch_rms_norm_train(uint16_t* y, float* rstd, const uint16_t* x, const uint16_t* w,
                           int64_t rows, int64_t cols, float eps, cudaStream_t s);
// dx f32 += d/dx; dw f32 [cols] += d/dw; either may be null (scratch needed only with dw).
void launch_rms_norm_backward(float* dx, float* dw, const void* dy, bool dy_f32, const uint16_t* x,
                              const float* rstd, const uint16_t* w, int64_t rows, int64_t cols,
                              float* scratch, int64_t scratch_floats, cudaStream_t s);

// ---- training: q/k norm + RoPE ----
// The largest head_dim the q/k norm + RoPE training kernels take.
constexpr int kQkvNormRopeMaxHeadDim = 256;
// out[T, (nq + 2 nkv) hd] = launch_qkv_norm_rope(in) out of place (same kernels and bits); v heads
// copied. With q_norm_w / k_norm_w, rstd[T, nq + nkv] (may be null) receives each normed head's
// 1/rms and out must not alias in; without norms out may alias in. head_dim even, <= 256.
void launch_qkv_norm_rope_train(uint16_t* out, float* rstd, const uint16_t* in,
                                const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                                const float* cos, const float* sin, int64_t tokens, int n_q_heads,
                                int n_kv_heads, int head_dim, bool round_tables, cudaStream_t s);
// Overwrites din (bf16; may alias dout): the adjoint of the rotation (with the bf16-rounded
// tables when round_tables), then of the per-head RMSNorm for heads with a norm weight; v heads
// copied. dq_norm_w / dk_norm_w f32 [hd] += (each may be null; scratch needed when one is set
// together with its norm weight). in and rstd are read only for normed heads.
void launch_qkv_norm_rope_backward(uint16_t* din, float* dq_norm_w, float* dk_norm_w,
                                   const uint16_t* dout, const uint16_t* in, const float* rstd,
                                   const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                                   const float* cos, const float* sin, int64_t tokens,
                                   int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                                   float* scratch, int64_t scratch_floats, cudaStream_t s);

}  // namespace iris::cuda
