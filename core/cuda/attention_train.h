// Training attention (attention_train.cu): the forward that saves the log-sum-exp, and its
// deterministic backward, for Backend::attention_train / attention_backward (core/backend.h,
// "Training ops"). bf16 data travels as uint16_t bits; every launcher enqueues on `s` without
// allocating, synchronising or reading device memory on the host, so all can be captured into a
// CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// Raises the dynamic shared-memory limits of the training attention kernels; called once per
// device at backend creation (not a stream operation).
void attention_train_init();

// Whether head_dim takes the tensor-core kernels (16, 32, 64, 72, 80, 128); any other head_dim
// up to kAttentionTrainMaxHeadDim runs on simple (slow, exact-f32) kernels.
bool attention_train_fast_head_dim(int head_dim);
constexpr int kAttentionTrainMaxHeadDim = 256;

// out [T, nq*hd] bf16 and lse f32 [T, nq] (natural-log log-sum-exp of the scaled scores) from
// qkv [T, (nq + 2 nkv)*hd] bf16: row i attends to the rows j of its segment [cu[s], cu[s+1])
// (j <= i when causal); query head h reads kv head h / (nq / nkv). cu_seqlens (device, i32
// [n_segments + 1]) starts at 0, never decreases and ends at most at total_rows. Rows past
// cu[n_segments], and the rows of segments starting at or past real_rows[0] (device i32[1],
// nullable: padding), get zero output and zero lse. num_sms is accepted for kernel choices by
// size and not used yet.
void launch_attention_train_forward(uint16_t* out, float* lse, const uint16_t* qkv,
                                    const int32_t* cu_seqlens, const int32_t* real_rows,
                                    int n_segments, int64_t total_rows, int n_q_heads,
                                    int n_kv_heads, int head_dim, float scale, bool causal,
                                    int num_sms, cudaStream_t s);

// Overwrites dqkv [T, (nq + 2 nkv)*hd] bf16 entirely (rows the forward zeroed get zeros) and the
// scratch dsum f32 [T, nq] = rowwise dout . out, from dout and the forward's out and lse.
// Deterministic: no atomics; every gradient element is summed by one thread in a fixed order.
// dqkv must not alias any input.
void launch_attention_train_backward(uint16_t* dqkv, float* dsum, const uint16_t* dout,
                                     const uint16_t* out, const float* lse, const uint16_t* qkv,
                                     const int32_t* cu_seqlens, const int32_t* real_rows,
                                     int n_segments, int64_t total_rows, int n_q_heads,
                                     int n_kv_heads, int head_dim, float scale, bool causal,
                                     int num_sms, cudaStream_t s);

}  // namespace iris::cuda
