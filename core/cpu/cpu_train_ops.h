// The CPU backend's training kernels: forward and backward passes of every Qwen3-VL op and the
// optimizer in fp32, written as plain functions over raw row-major arrays (llm.c style). Model
// code reaches them only through the Backend's training ops. The forwards reproduce the math of
// core/cpu/cpu_backend.cpp (the inference oracle) and additionally save what their backward needs
// (normalisation statistics, softmax log-sum-exp).
//
// Gradient conventions, stated again on each function:
//  - "overwrites d<x>": the function writes every element of d<x>.
//  - "accumulates into d<x>": d<x> += contribution; the caller zeroes it when a step starts.
//  - Parameter gradients (dw, db, ...) always accumulate, so a frozen parameter is skipped by
//    passing null, which also skips the weight-gradient GEMM.
// None of these functions allocates memory; parallel loops are OpenMP with static partitions and
// every sum has one owner, so results are bit-identical from run to run on a given thread count.
#pragma once

#include <cstdint>

namespace iris::train {

// The largest head_dim the attention and rotary kernels accept (per-thread stack buffers).
constexpr int kMaxHeadDim = 256;

// ---- Linear: y[M,N] = x[M,K] . w[N,K]^T (+ bias[N]) (+ y when accumulate) ----------------------
void linear_forward(float* y, const float* x, const float* w, const float* bias, int64_t M,
                    int64_t K, int64_t N, bool accumulate);
// dy[M,N] -> overwrites dx[M,K] (or accumulates into it when accumulate_dx); accumulates into
// dw[N,K] and db[N]. Any of dx, dw, db may be null.
void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t M, int64_t K, int64_t N, bool accumulate_dx);

// ---- LayerNorm over the last dim (vision blocks and mergers) -----------------------------------
// y = (x - mean) * rstd * w + b per row; saves mean[R] and rstd[R]. y may alias x only when the
// caller does not need x for the backward (it always does in training).
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t R, int64_t C, float eps);
// Accumulates into dx[R,C], dw[C], db[C]; each may be null.
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                        const float* mean, const float* rstd, const float* w, int64_t R, int64_t C);

// ---- RMSNorm over the last dim (text decoder) --------------------------------------------------
// y = x * rstd * w per row; saves rstd[R].
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                     float eps);
// Accumulates into dx[R,C] and dw[C]; each may be null.
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* rstd,
                      const float* w, int64_t R, int64_t C);

// ---- Per-head q/k RMSNorm followed by rotate-half RoPE ------------------------------------------
// On a fused projection [T, (nq + 2 nkv) hd] (q heads, k heads, v heads): out = rope(norm(in)) for
// the q and k heads, v heads copied. q_norm_w/k_norm_w [hd] may be null (the vision tower has no
// q/k norm), in which case rstd may be null and out may alias in. rstd: [T, nq + nkv].
// cos/sin: [T, hd] tables (text M-RoPE or vision 2D RoPE, both rotate-half).
void qk_norm_rope_forward(float* out, float* rstd, const float* in, const float* q_norm_w,
                          const float* k_norm_w, const float* cos, const float* sin, int64_t T,
                          int nq, int nkv, int hd, float eps);
// Overwrites din[T, width] (v heads get dout as is); din may alias dout. Accumulates into dq_norm
// and dk_norm [hd] (null when frozen or absent). in/rstd are only read when norms are present.
void qk_norm_rope_backward(float* din, float* dq_norm, float* dk_norm, const float* dout,
                           const float* in, const float* rstd, const float* q_norm_w,
                           const float* k_norm_w, const float* cos, const float* sin, int64_t T,
                           int nq, int nkv, int hd);

// ---- Attention over segments of rows, optionally causal, with GQA
// -------------------------------- qkv [T, (nq + 2 nkv) hd]; query head h reads kv head h / (nq /
// nkv). Row i attends to rows j of its own segment [cu[s], cu[s+1]) (and j <= i when causal). Rows
// past cu[n_segments] get zero output. Saves lse[T, nq] (natural-log log-sum-exp of the scaled
// scores). Vision: nq == nkv, non-causal, one segment per image. Text: causal, one segment per
// sequence.
void attention_forward(float* out, float* lse, const float* qkv, int64_t T, int nq, int nkv, int hd,
                       float scale, const int32_t* cu_seqlens, int n_segments, bool causal);
// Overwrites dqkv[T, width] and the scratch dsum[T, nq] (rowwise dout . out).
void attention_backward(float* dqkv, float* dsum, const float* dout, const float* out,
                        const float* lse, const float* qkv, int64_t T, int nq, int nkv, int hd,
                        float scale, const int32_t* cu_seqlens, int n_segments, bool causal);

// Segments up to this many rows run as GEMMs over their [n, n] scores (per-thread scratch of
// 2 n^2 floats); a call with a longer segment runs query row by query row, which needs O(n).
constexpr int64_t kAttentionGemmMaxSegment = 2048;
// The row-by-row forms, for any segment length (the GEMM forms' test oracle).
void attention_forward_by_rows(float* out, float* lse, const float* qkv, int64_t T, int nq, int nkv,
                               int hd, float scale, const int32_t* cu_seqlens, int n_segments,
                               bool causal);
void attention_backward_by_rows(float* dqkv, float* dsum, const float* dout, const float* out,
                                const float* lse, const float* qkv, int64_t T, int nq, int nkv,
                                int hd, float scale, const int32_t* cu_seqlens, int n_segments,
                                bool causal);

// ---- Activations (elementwise over n values) ----------------------------------------------------
// y may alias x in the forwards; dx may alias dy in the backwards (both overwrite dx). x is the
// activation's input (pre-activation), which the backward needs.
void gelu_tanh_forward(float* y, const float* x, int64_t n);
void gelu_tanh_backward(float* dx, const float* dy, const float* x, int64_t n);
void gelu_erf_forward(float* y, const float* x, int64_t n);
void gelu_erf_backward(float* dx, const float* dy, const float* x, int64_t n);
void quick_gelu_backward(float* dx, const float* dy, const float* x, int64_t n);
// y[M,I] = silu(gate_up[:, :I]) * gate_up[:, I:].
void swiglu_forward(float* y, const float* gate_up, int64_t M, int64_t I);
// Overwrites dgate_up[M, 2I].
void swiglu_backward(float* dgate_up, const float* dy, const float* gate_up, int64_t M, int64_t I);

// ---- Rows: embedding, gathers and scatters ------------------------------------------------------
// y[T,H] = table[ids[t]]; ids must lie in [0, V).
void embedding_forward(float* y, const float* table, const int32_t* ids, int64_t T, int64_t H,
                       int64_t V);
// Accumulates dy[t] into dtable[ids[t]] for every t whose id differs from skip_id (rows that the
// vision scatter replaced get no embedding gradient; pass -1 to skip none).
void embedding_backward(float* dtable, const float* dy, const int32_t* ids, int64_t T, int64_t H,
                        int32_t skip_id);
// dst[i] = src[index[i]] (overwrites dst[N,H]).
void gather_rows(float* dst, const float* src, const int32_t* index, int64_t N, int64_t H);
// dst[index[i]] = src[i], or += when accumulate. Indices must be distinct.
void scatter_rows(float* dst, const float* src, const int32_t* index, int64_t N, int64_t H,
                  bool accumulate);

// ---- Bilinearly interpolated learned position embedding (vision) --------------------------------
// y[S,D] += sum_k weight[s,k] * table[index[s,k]] (k < 4; the sum in f32, then added).
void pos_embed_forward(float* y, const float* table, const int32_t* index, const float* weight,
                       int64_t S, int64_t D);
// Scatter-adds: accumulates weight[s,k] * dy[s] into dtable[index[s,k]].
void pos_embed_backward(float* dtable, const float* dy, const int32_t* index, const float* weight,
                        int64_t S, int64_t D);

// ---- lm_head + cross-entropy on labelled rows only ----------------------------------------------
// x[N,H]: the final-norm rows whose next token is labelled; targets[N] in [0, V). Logits
// x . w^T are materialised chunk_rows at a time in scratch (scratch_floats, at least
// lm_head_scratch_floats(chunk_rows, H, V)), never [N, V]. Returns the summed loss (sum over rows
// of logsumexp - logit[target]). When dx is non-null the backward of grad_scale * loss_sum runs
// too: overwrites dx[N,H] and accumulates into dw[V,H] (dw may be null: a frozen lm_head skips its
// weight gradient). On x86-64 CPUs with AVX2 and FMA (and H a multiple of 8, chunk_rows <= 256) two
// fused passes over w replace the three GEMMs; elsewhere the GEMMs run.
int64_t lm_head_scratch_floats(int64_t chunk_rows, int64_t H, int64_t V);
// When dl_out is non-null (and dx too), the rows of d(loss)/d(logits) (grad_scale included) are
// also written to dl_out[N, V], for lm_head_weight_grad to apply later.
double lm_head_cross_entropy(float* dx, float* dw, const float* x, const float* w,
                             const int32_t* targets, int64_t N, int64_t H, int64_t V,
                             float grad_scale, float* scratch, int64_t scratch_floats,
                             int64_t chunk_rows, float* dl_out = nullptr);
// dw[V, H] += dl[N, V]^T x[N, H]: the lm_head weight gradient of rows saved by
// lm_head_cross_entropy's dl_out. Each element accumulates over the rows in order, as the fused
// backward does: deferring the rows of several samples to one call sums the same products in the
// same order (on the AVX2 path) and streams dw once instead of once per sample.
void lm_head_weight_grad(float* dw, const float* dl, const float* x, int64_t N, int64_t H,
                         int64_t V);

// ---- Optimizer ----------------------------------------------------------------------------------
// Sum of squares of p[0, n) in f64, per-thread partials combined in thread order (an OpenMP
// reduction combines in arrival order, and a norm that differs in the last bit between runs would
// break bit-exact resumption: it sets the clipping coefficient).
double sum_of_squares(const float* p, int64_t n);
// One torch.optim.AdamW step (foreach form) of a tensor of n elements: its gradient is scaled by
// clip_coef when that is below 1 (as it is read; g is not written), the learning rate is
// scheduled_lr times lr_scale, weight_decay applies as p *= 1 - lr * wd, and `step` is the tensor's
// step count after this update (for the bias corrections).
void adamw_tensor(float* p, const float* g, float* m, float* v, int64_t n, float scheduled_lr,
                  float lr_scale, float weight_decay, int64_t step, float clip_coef, float beta1,
                  float beta2, float eps);

}  // namespace iris::train
