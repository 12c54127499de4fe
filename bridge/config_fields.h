// Typed, range-checked reads of config.json fields, shared by the architectures' config readers
// (bridge/arch_<family>.cpp). Every error names the file and the field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "language/text_config.h"
#include "vision/vision_config.h"

namespace iris::config_fields {

// Bounds that no released Qwen-VL comes near (the largest has hidden_size 8192 and 80 layers)
// but that keep every product the loaders form (vocab x hidden, layers x rows) far from
// overflowing; the checkpoint's tensors then pin the exact values.
constexpr int64_t kMaxWidth = int64_t{1} << 20;
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 30;

bool present(const nlohmann::json& j, const char* key);
void read_int(const nlohmann::json& j, const char* key, int& out, const std::string& where,
              int64_t min, int64_t max);
void read_bool(const nlohmann::json& j, const char* key, bool& out, const std::string& where);
void read_string(const nlohmann::json& j, const char* key, std::string& out,
                 const std::string& where);
// A positive, finite float: a zero or negative rope_theta or rms_norm_eps gives NaN outputs.
void read_positive_float(const nlohmann::json& j, const char* key, float& out,
                         const std::string& where, double max);
// A list of integers in [min, max], strictly increasing.
void read_increasing_ints(const nlohmann::json& j, const char* key, std::vector<int>& out,
                          const std::string& where, int64_t min, int64_t max);
// An activation name, which must be `expected`.
void expect_activation(const nlohmann::json& j, const std::string& where, const char* expected);

// The text decoder's fields, the same in every family (nested text_config or the flat layout):
// sizes, heads, norms, rope_theta and rope_scaling / rope_parameters (mrope_section, the
// interleaved flag where the file gives it). tc is the object that holds them.
void read_text_fields(const nlohmann::json& tc, TextConfig& t, const std::string& where);

// Qwen2-VL and Qwen2.5-VL: the hub's flat config.json keeps the text fields at the top level,
// transformers 5.x saves them nested in text_config; either is read, with `where` naming it.
// Also reads the tied head and refuses a sliding window (not implemented).
const nlohmann::json& qwen2_text_fields(const nlohmann::json& j, TextConfig& t, bool& tied,
                                        const std::string& src, std::string& where);

// Qwen2-VL and Qwen2.5-VL: the vision_config object and the fields both families name alike
// (depth, num_heads, in_chans or in_channels, patch_size, spatial_merge_size,
// temporal_patch_size), over HF's class defaults (32 blocks of 16 heads, 14-pixel patches); no
// learned position embedding, no DeepStack, the output as wide as the text model. Returns the
// object with `where` naming it.
const nlohmann::json& qwen2_vision_fields(const nlohmann::json& j, VisionConfig& v, int text_hidden,
                                          const std::string& src, std::string& where);

}  // namespace iris::config_fields
