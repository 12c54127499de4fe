// The model's forward FLOPs, 2 per multiply-add, counted once for every report: the trainer's
// throughput and MFU (training/metrics_log.h) and the benchmarks (apps/bench_command.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "language/text_config.h"
#include "vision/vision_encoder.h"

namespace iris {

struct ForwardFlops {
  double gemm = 0;       // products with weights
  double attention = 0;  // QK^T and PV
  double total() const { return gemm + attention; }
};

// The patch embedding and the blocks for these images: each frame attends within itself, or
// within its windows in a windowed block (VisionConfig::windowed_block).
ForwardFlops vision_tower_flops(const VisionConfig& v, const std::vector<GridTHW>& grids);
// The main merger and the DeepStack mergers over `patches` patch rows.
double merger_flops(const VisionConfig& v, int64_t patches);
// The MLP weights a token runs through, over every layer: a dense layer's whole MLP, a sparse
// layer's router and the k experts it picks (active parameters).
double active_mlp_params(const TextConfig& t);
// The decoder for T new tokens after `past` cached ones (causal attention), with the lm_head
// over `logit_rows` rows.
ForwardFlops decoder_flops(const TextConfig& t, double T, double past, double logit_rows);

}  // namespace iris
