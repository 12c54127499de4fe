// The Qwen3-VL vision tower: patch embedding, interpolated learned position embedding, 2D RoPE
// blocks attending within per-image segments, the patch merger and the DeepStack mergers.
//
// An encoder call is split in two halves so that the second can be captured in a CUDA graph:
// upload() copies the host inputs (the pixel rows and the images' grid sizes, a few ints) into
// static buffers, and run() computes from those buffers only, starting with the call's tables
// (2D RoPE, position-embedding interpolation, cu_seqlens: Backend::vision_tables), so that a
// replay computes the tables of the grids uploaded before it.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/image_patches.h"
#include "core/lora.h"
#include "core/recompute.h"
#include "vision/image.h"
#include "vision/vision_config.h"
#include "vision/vision_tower.h"

namespace iris {

using GridTHW = std::array<int64_t, 3>;

// One grid's pixels for the backend to normalise and patchify (Backend::image_patches): its
// frames at the grid's size, an image's one or a video's grid_t * temporal_patch_size (temporal
// slice k of frames k * Tp .. k * Tp + Tp - 1), and the byte values of its processor.
struct VisionMedia {
  std::vector<const ImageRGB8*> frames;
  const PixelTable* table = nullptr;
};

// The pixels of one vision call, in its grids' order: rows the host normalised and patchified
// (f32 [patches, patch_dim], preprocess_images), or each grid's frames already at its size
// (size_images, a VideoClip's frames), which the backend normalises and patchifies: then one byte
// a pixel crosses to the device and the host does no per-pixel work.
struct VisionPixels {
  const float* rows = nullptr;
  std::vector<VisionMedia> media;

  VisionPixels() = default;
  // Host rows convert implicitly: they are what most callers (training, tests, a chat) hold.
  VisionPixels(const float* host_rows) : rows(host_rows) {}  // NOLINT(google-explicit-constructor)
  // Images sized by size_images, all with one table.
  VisionPixels(const std::vector<ImageRGB8>& sized_images, const PixelTable& table);
  bool from_frames() const { return rows == nullptr && !media.empty(); }
};

// Tensors a family's tower does not have (a norm's bias under RMSNorm) stay undefined.
struct VisionBlockWeights {
  Tensor norm1_w, norm1_b;  // [D]
  Tensor qkv_w, qkv_b;      // [3D, D], [3D]
  Tensor proj_w, proj_b;    // [D, D], [D]
  Tensor norm2_w, norm2_b;  // [D]
  Tensor fc1_w, fc1_b;      // [U, D], [U]: U = VisionTower::mlp_up_width (gate then up if gated)
  Tensor fc2_w, fc2_b;      // [D, I], [D]
  // LoRA adapters (core/lora.h) on attn.qkv, attn.proj and the MLP's two projections (fc1's
  // HF modules, gate and up where they are stacked); empty where not adapted.
  LoraAdapters qkv_lora, proj_lora, fc1_lora, fc2_lora;
};

struct PatchMergerWeights {
  Tensor norm_w, norm_b;  // [D] for the main merger (pre-shuffle), [4D] for DeepStack (post)
  Tensor fc1_w, fc1_b;    // [4D, 4D], [4D]
  Tensor fc2_w, fc2_b;    // [out, 4D], [out]
  LoraAdapters fc1_lora, fc2_lora;  // the main merger's LoRA adapters; empty where not adapted
};

struct VisionWeights {
  Tensor patch_w, patch_b;  // [D, C*Tp*P*P] (the Conv3d kernel flattened), [D] (Qwen3-VL only)
  Tensor pos_embed;         // [G*G, D] (Qwen3-VL only)
  std::vector<VisionBlockWeights> blocks;
  PatchMergerWeights merger;
  std::vector<PatchMergerWeights> deepstack_mergers;
};

// The host's share of one encoder call: the row and segment counts that run() passes to the ops.
// The tables themselves are computed on the device from the grids.
struct VisionCall {
  int64_t n_patches = 0;  // real patches, summed over images
  int64_t rows = 0;       // n_patches plus padding
  int n_segments = 0;     // segments that hold rows (image frames + the padding segment)
  int n_windows = 0;      // with window attention: windows + the padding segment
};

// Checks `grids` (one per image, in order) and counts its rows and segments. `padded_rows` = 0
// means no padding; `segment_capacity` = 0 means no limit on the segments.
VisionCall plan_vision_call(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                            int64_t padded_rows = 0, int segment_capacity = 0);

// `grids` as Backend::vision_tables reads them, into `out` (resized to
// vision_grids_numel(capacity); unused entries zero).
void pack_vision_grids(const std::vector<GridTHW>& grids, int capacity, std::vector<int32_t>& out);

// The tables of an encoder call laid out on the host for `rows` rows (rows >= the real patch
// count when padded for a graph bucket): what Backend::vision_tables writes on the device, by
// the same code as the CPU backend's op (vision_tables_host). The encoder computes them on its
// backend; this host form is the reference tests compare against.
struct VisionInputs {
  int64_t n_patches = 0;  // real patches, summed over images
  int64_t rows = 0;       // n_patches plus padding
  // Segment offsets; padding rows form one extra segment, and the tail up to the buffer's
  // capacity repeats the last offset (zero-length segments).
  std::vector<int32_t> cu_seqlens;
  int n_segments = 0;              // segments that hold rows (real images + the padding segment)
  std::vector<float> cos, sin;     // [rows, head_dim]
  std::vector<int32_t> pos_index;  // [rows, 4]
  std::vector<float> pos_weight;   // [rows, 4]
};

// The tables for `grids` (one per image, in order). `padded_rows` = 0 means no padding;
// `segment_capacity` = 0 means exactly the segments used.
VisionInputs plan_vision_inputs(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                                int64_t padded_rows = 0, int segment_capacity = 0);

int64_t count_patches(const std::vector<GridTHW>& grids);

// Window attention (VisionConfig::window_size): the most window segments a call of `rows` rows
// may have (0 without windows), each merged row's raster index in the window order the tower
// computes in (empty without windows; padding rows map to themselves up to rows / merge unit),
// and pixel rows (whole merged units) copied into that order.
int vision_window_capacity(const VisionConfig& cfg, int64_t rows);
std::vector<int32_t> vision_unit_order(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                                       int64_t rows);
void to_window_order(const VisionConfig& cfg, const std::vector<int32_t>& unit_order,
                     const float* pixels, float* out);

// ---- One definition of the tower's pieces, for inference and training -------------------------
// Inference passes its shared scratch: x_in, x_mid and x_out are one tensor (the residual updated
// in place), ln1 and ln2 one, fc1 and act one where the MLP is not gated (the activation fused
// into fc1's GEMM), and no statistics. fc1 is mlp_up_width wide, act intermediate_size. Training
// passes a buffer for each and the mean/rstd/lse tensors: the forward then saves what the backward
// reads.
struct VisionBlockBuffers {
  Tensor x_in, ln1, mean1, rstd1, qkv, lse, attn, x_mid, ln2, mean2, rstd2, fc1, act, x_out;
  LoraScratch lora;  // where the block has adapters
  bool saves() const { return lse.defined(); }
};
struct VisionSegments {
  Tensor cos, sin;  // f32 [rows, head_dim] 2D RoPE tables
  Tensor cu_seqlens;
  int n_segments = 0;
  Tensor real_rows;  // optional i32 [1]: segments starting at or past it are padding
  // With window attention: the windows' segments, which windowed blocks attend within.
  Tensor window_cu;
  int n_windows = 0;
  // The segments block l attends within (VisionConfig::windowed_block).
  VisionSegments for_block(const VisionConfig& cfg, int l) const;
};
void vision_block_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                          const VisionBlockBuffers& b, const VisionSegments& seg);
// The block's two halves, which per-module training graphs capture separately: the attention
// (x_mid = x_in + attention) and the MLP (x_out = x_mid + MLP).
void vision_attention_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                              const VisionBlockBuffers& b, const VisionSegments& seg);
void vision_mlp_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                        const VisionBlockBuffers& b);
// Before a block's backward: rewrites the activations `mode` did not keep (selective: ln1, ln2,
// act; full: the whole block from x_in, whose b.x_out must then be scratch).
void vision_block_recompute(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                            const VisionBlockBuffers& b, const VisionSegments& seg, Recompute mode);

// A merger over `rows` patch rows of x: the main one normalises each patch before the 2x2
// windows are concatenated (post_shuffle false), a DeepStack one the concatenated window. The
// same sharing rules as VisionBlockBuffers (inference: fc1 and act one tensor, no statistics).
struct MergerBuffers {
  Tensor ln, mean, rstd, fc1, act, out;
  LoraScratch lora;  // where the merger has adapters (the mergers run one at a time)
  bool saves() const { return mean.defined(); }
};
// gemms_beside: the two GEMMs run as side work (Backend::begin_side_work), joined by the next
// merger's start (inference overlaps DeepStack mergers with the layers after their tap).
void merger_forward(Backend& be, const VisionConfig& cfg, const PatchMergerWeights& w,
                    const MergerBuffers& b, const Tensor& x, int64_t rows, bool post_shuffle,
                    bool gemms_beside = false);

// Backward scratch of the tower: dres/dtmp f32, the rest in the compute dtype; dres_c is the
// compute-dtype copy of dres the GEMMs read (dres itself where the compute dtype is f32).
// dfc is the activation's gradient (intermediate_size wide), dup the first projection's
// (mlp_up_width wide; dfc itself where the widths agree).
struct VisionGradScratch {
  Tensor dres, dres_c, dtmp, dfc, dup, dattn, dqkv, dsum, m_da, m_dln;
  LoraScratch lora;
};
// dres holds d(x_out) and becomes d(x_in); g receives the block's weight gradients (+=).
void vision_block_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                           VisionBlockWeights& g, const VisionBlockBuffers& b,
                           const VisionSegments& seg, const VisionGradScratch& s);
// vision_block_backward's halves, in the order it runs them: dres goes from d(x_out) to
// d(x_mid), then to d(x_in).
void vision_mlp_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                         VisionBlockWeights& g, const VisionBlockBuffers& b,
                         const VisionGradScratch& s);
void vision_attention_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                               VisionBlockWeights& g, const VisionBlockBuffers& b,
                               const VisionSegments& seg, const VisionGradScratch& s);
// d(out) -> the merger's weight gradients (g null: frozen) and, when dx is defined,
// dx (f32) += d(x).
void merger_backward(Backend& be, const VisionConfig& cfg, const PatchMergerWeights& w,
                     PatchMergerWeights* g, const MergerBuffers& b, const Tensor& x, int64_t rows,
                     bool post_shuffle, const Tensor& dout, const Tensor& dx,
                     const VisionGradScratch& s);

class VisionEncoder {
 public:
  // Plans and allocates every activation for up to max_rows patch rows and max_segments
  // segments in one arena; nothing is allocated afterwards.
  VisionEncoder(Backend& backend, const VisionConfig& cfg, const VisionWeights& weights,
                int64_t max_rows, int max_segments);

  struct Output {
    Tensor embeds;                  // [rows/4, out_hidden] (a view into the arena)
    std::vector<Tensor> deepstack;  // one [rows/4, out_hidden] per DeepStack tap
  };

  // Checks the call (plan_vision_call with this encoder's segment capacity), writes the grids
  // and pixel_values (host f32 [patches, patch_dim]) and zeroes the padding up to padded_rows
  // (0: no padding). Returns what run() takes.
  VisionCall upload(const VisionPixels& pixels, const std::vector<GridTHW>& grids,
                    int64_t padded_rows = 0);
  // Host milliseconds the last upload() spent writing pixel rows, which is the part of a call's
  // host time that grows with the images (and can wait for the staging buffer): benchmarks
  // report the enqueue time without it.
  double last_pixel_upload_ms() const { return last_pixel_upload_ms_; }
  // Computes from the static buffers for the last upload()'s row count and segments, the tables
  // first. Captures in a CUDA graph as is. Outputs cover all rows/4 merged rows (padding
  // included).
  Output run(int64_t rows, int n_segments);
  // run() in pieces, for per-layer graphs: the steps of vision_tower_order.h on this encoder's
  // buffers (the tables with the patch and position embedding, a block, a DeepStack merger, the
  // main merger), then the outputs. run() overlaps each DeepStack merger with the blocks after it
  // (side work, joined by the next merger's start), which a block captured as a graph of its own
  // cannot leave unjoined: run_deepstack_merger runs in order.
  void run_embed(int64_t rows);
  void run_block(int layer, int64_t rows, int n_segments);
  void run_deepstack_merger(int tap, int64_t rows) { run_deepstack_merger(tap, rows, false); }
  void run_merger(int64_t rows);
  Output output(int64_t rows) const;
  // Convenience: upload + run; the outputs are trimmed to the real merged rows.
  Output encode(const VisionPixels& pixels, const std::vector<GridTHW>& grids);

  int64_t max_rows() const { return max_rows_; }
  int max_segments() const { return max_segments_; }
  const VisionConfig& config() const { return cfg_; }
  const Arena& arena() const { return arena_; }

 private:
  void allocate(Arena& arena);
  void upload_media(const std::vector<VisionMedia>& media, const std::vector<GridTHW>& grids,
                    const std::vector<int32_t>& unit_order, int64_t n_patches);
  void run_deepstack_merger(int tap, int64_t rows, bool beside_layers);
  // beside_layers: the merger's GEMMs run as side work (Backend::begin_side_work), joined by the
  // next merger's start.
  void run_merger(const PatchMergerWeights& m, const Tensor& x, int64_t rows, bool post_shuffle,
                  const Tensor& out, bool beside_layers);

  Backend& backend_;
  VisionConfig cfg_;
  const VisionWeights& w_;
  int64_t max_rows_;
  int max_segments_;
  Arena arena_;
  // Static inputs (what a captured graph reads): the pixels and the grids; with window
  // attention the pixel rows go up in window order, and unit_order_ (i32 [rows / merge unit])
  // gives each merged row's place in raster order, so the outputs are written in raster order.
  Tensor pixels_, grids_, unit_order_;
  // Frames patchified on the backend: their bytes (u8, temporal_patch_size frames of every
  // planned patch), the pixel table and the row of pixels_ each patch goes to (window order where
  // there is one).
  Tensor image_bytes_, pixel_table_, patch_rows_;
  // The tables run() computes from grids_ before the first block.
  Tensor cos_, sin_, pos_index_, pos_weight_, cu_seqlens_, window_cu_;
  Tensor real_rows_;  // i32 [1]: the real patch count; rows past it are padding
  // Activations. act_ is mlp_ itself unless the MLP is gated; windowed_embeds_ holds the merger's
  // output in window order.
  Tensor x_, xn_, qkv_, attn_, mlp_, act_, merged_norm_, merger_hidden_, embeds_, windowed_embeds_;
  std::vector<Tensor> deepstack_;
  LoraScratch lora_, merger_lora_;    // where the blocks, the merger have adapters
  std::vector<float> inv_freq_;       // the 2D RoPE frequencies, a kernel argument of the tables
  std::vector<int32_t> grids_host_;   // staging for grids_, sized once
  std::vector<float> window_pixels_;  // staging for window-ordered pixel rows, sized once
  std::vector<int32_t> patch_rows_host_;
  // The window segments windowed blocks attend over (a host value): an unpadded call's own
  // count; a call padded to a graph bucket the most that bucket can hold (zero-length segments
  // after the real ones), so that one graph serves every image mix of the bucket. The attention
  // kernels pay for each segment, so the count is never the whole buffer's.
  int n_windows_ = 0;
  double last_pixel_upload_ms_ = 0;
};

}  // namespace iris
