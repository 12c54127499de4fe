// Host-side launchers of the attention kernels: inference (attention.cu: vision segments, causal
// prefill and split-K decode against the KV caches, and the cache store) and training
// (attention_train.cu: the forward that saves the log-sum-exp, and its deterministic backward, for
// Backend::attention_train / attention_backward in core/backend.h, "Training ops"). bf16 data
// travels as uint16_t bits; every launcher enqueues on `s` without allocating, synchronising or
// reading device memory on the host, so all can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- inference (attention.cu) ----
// Raises the dynamic shared-memory limit of the attention kernels; called once per device at
// backend creation (it is not a stream operation, so it stays out of captured graphs).
void attention_init();
bool attention_head_dim_supported(int head_dim);
// num_sms picks between the 64-row and the 128-row kernel (launch_attention_causal too).
// real_rows may be null; segments starting at or past *real_rows get zero rows (padding).
void launch_attention_segments(uint16_t* out, const uint16_t* qkv, const int32_t* cu_seqlens,
                               const int32_t* real_rows, int n_segments, int64_t total_rows,
                               int n_heads, int head_dim, float scale, int num_sms, cudaStream_t s);
void launch_kv_store(uint16_t* k_cache, uint16_t* v_cache, const uint16_t* qkv,
                     const int32_t* past_len, int64_t tokens, int64_t max_len, int n_q_heads,
                     int n_kv_heads, int head_dim, cudaStream_t s);

// Split-K decode scratch: per (query head, split) partial outputs, maxima and sums, f32, and
// one ticket counter per kv head, which must be zero before the first decode step.
struct DecodeScratch {
  float* partial_out = nullptr;  // [n_q_heads * max_splits * head_dim]
  float* partial_max = nullptr;  // [n_q_heads * max_splits]
  float* partial_sum = nullptr;  // [n_q_heads * max_splits]
  unsigned* tickets = nullptr;   // [capacity_tickets]
  int64_t capacity_floats = 0;   // size of partial_out
  int64_t capacity_rows = 0;     // size of partial_max and partial_sum
  int capacity_tickets = 0;      // kv heads the decode kernel serves
};
// Causal GQA attention of `tokens` new queries against the caches; past_len lives on the device.
// A single token with a supported shape takes the split-K decode kernel, which reads past_len and
// the cache rows below it before waiting for the kernel just before it (Backend::
// attention_causal states the contract).
void launch_attention_causal(uint16_t* out, const uint16_t* qkv, const uint16_t* k_cache,
                             const uint16_t* v_cache, const int32_t* past_len, int64_t tokens,
                             int64_t max_len, int n_q_heads, int n_kv_heads, int head_dim,
                             float scale, const DecodeScratch& scratch, int num_sms,
                             cudaStream_t s);

// ---- training (attention_train.cu) ----

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

// The forward on Hopper's warpgroup-MMA kernel of the inference path (attention.cu), with the
// contract above; false, with nothing launched, where that kernel does not serve the call (no
// sm_90a code for this device, or not one of: head_dim 64 or 72 non-causal, 128 causal; scale > 0).
bool launch_attention_train_forward_wgmma(uint16_t* out, float* lse, const uint16_t* qkv,
                                          const int32_t* cu_seqlens, const int32_t* real_rows,
                                          int n_segments, int64_t total_rows, int n_q_heads,
                                          int n_kv_heads, int head_dim, float scale, bool causal,
                                          cudaStream_t s);

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
