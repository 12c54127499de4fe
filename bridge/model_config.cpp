#include "bridge/model_config.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"

namespace iris {
namespace {

using nlohmann::json;

// Bounds that no released Qwen-VL comes near (the largest dense one has hidden_size 8192 and 64
// layers) but that keep every product the loaders form (vocab x hidden, layers x rows) far from
// overflowing; the checkpoint's tensors then pin the exact values.
constexpr int64_t kMaxWidth = int64_t{1} << 20;
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 30;

bool present(const json& j, const char* key) {
  return j.contains(key) && !j[key].is_null();
}

void read_int(const json& j, const char* key, int& out, const std::string& where, int64_t min,
              int64_t max) {
  if (present(j, key)) out = static_cast<int>(json_integer(j[key], where, key, min, max));
}

void read_bool(const json& j, const char* key, bool& out, const std::string& where) {
  if (present(j, key)) out = json_boolean(j[key], where, key);
}

void read_string(const json& j, const char* key, std::string& out, const std::string& where) {
  if (present(j, key)) out = json_string(j[key], where, key);
}

// A positive, finite float: a zero or negative rope_theta or rms_norm_eps gives NaN outputs.
void read_positive_float(const json& j, const char* key, float& out, const std::string& where,
                         double max) {
  if (present(j, key))
    out = static_cast<float>(json_real(j[key], where, key, 0.0, max, /*min_exclusive=*/true));
}

void read_rope(const json& tc, TextConfig& t, const std::string& where) {
  // 5.x nests rope settings in rope_parameters; older files use rope_scaling + rope_theta.
  read_positive_float(tc, "rope_theta", t.rope_theta, where, 1e30);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!present(tc, key)) continue;
    const std::string w = where + "." + key;
    IRIS_CHECK(tc[key].is_object(), w, " must be an object, got ", json_excerpt(tc[key]));
    const json& r = tc[key];
    read_positive_float(r, "rope_theta", t.rope_theta, w, 1e30);
    if (present(r, "mrope_section")) {
      const json& sec = r["mrope_section"];
      IRIS_CHECK(sec.is_array() && sec.size() == 3, w,
                 ".mrope_section must be a list of 3 integers, got ", json_excerpt(sec));
      for (size_t i = 0; i < 3; ++i)
        t.mrope_section[i] = static_cast<int>(
            json_integer(sec[i], w, "mrope_section[" + std::to_string(i) + "]", 0, t.head_dim));
    }
    read_bool(r, "mrope_interleaved", t.mrope_interleaved, w);
    std::string type;
    read_string(r, "rope_type", type, w);
    if (type.empty()) read_string(r, "type", type, w);
    IRIS_CHECK(type.empty() || type == "default" || type == "mrope", w, ".rope_type '",
               clip_text(type, 40), "' is not supported (Iris implements the default M-RoPE)");
  }
  // Each section is at most head_dim, so the sum cannot overflow.
  const int64_t sum = int64_t{t.mrope_section[0]} + t.mrope_section[1] + t.mrope_section[2];
  IRIS_CHECK(2 * sum == t.head_dim, where, ": mrope_section [", t.mrope_section[0], ", ",
             t.mrope_section[1], ", ", t.mrope_section[2], "] sums to ", sum,
             " but must be head_dim/2 = ", t.head_dim / 2);
}

}  // namespace

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json_text(read_text_file(path, "model config"), path);
}

ModelConfig ModelConfig::from_json_text(const std::string& text, const std::string& src) {
  const json j = parse_json(text, src);
  IRIS_CHECK(j.is_object(), src, " must hold a JSON object");
  ModelConfig c;
  read_string(j, "model_type", c.model_type, src);
  IRIS_CHECK(c.model_type == "qwen3_vl", src, ": model_type '", clip_text(c.model_type, 40),
             "' is not supported; Iris loads Qwen3-VL checkpoints (model_type \"qwen3_vl\")");
  IRIS_CHECK(j.contains("text_config") && j["text_config"].is_object(), src,
             ": missing text_config (Qwen3-VL configs are nested)");
  IRIS_CHECK(j.contains("vision_config") && j["vision_config"].is_object(), src,
             ": missing vision_config");

  const json& tc = j["text_config"];
  const std::string tw = src + ": text_config";
  TextConfig& t = c.text;
  read_int(tc, "vocab_size", t.vocab_size, tw, 1, kMaxVocab);
  read_int(tc, "hidden_size", t.hidden_size, tw, 1, kMaxWidth);
  read_int(tc, "intermediate_size", t.intermediate_size, tw, 1, kMaxWidth);
  read_int(tc, "num_hidden_layers", t.num_hidden_layers, tw, 1, kMaxLayers);
  read_int(tc, "num_attention_heads", t.num_attention_heads, tw, 1, kMaxHeads);
  t.num_key_value_heads = t.num_attention_heads;
  read_int(tc, "num_key_value_heads", t.num_key_value_heads, tw, 1, kMaxHeads);
  t.head_dim = t.hidden_size / t.num_attention_heads;
  read_int(tc, "head_dim", t.head_dim, tw, 2, 1024);
  read_int(tc, "max_position_embeddings", t.max_position_embeddings, tw, 1, kMaxPositions);
  read_positive_float(tc, "rms_norm_eps", t.rms_norm_eps, tw, 1.0);
  read_bool(tc, "attention_bias", t.attention_bias, tw);
  std::string act = "silu";
  read_string(tc, "hidden_act", act, tw);
  IRIS_CHECK(act == "silu", tw, ".hidden_act '", clip_text(act, 40),
             "' is not supported (expected silu)");
  IRIS_CHECK(!t.attention_bias, tw, ".attention_bias=true is not a Qwen3 layout");
  IRIS_CHECK(t.head_dim >= 2, tw, ".head_dim ", t.head_dim,
             " is too small (without a head_dim key it is hidden_size / num_attention_heads)");
  IRIS_CHECK(t.head_dim % 2 == 0, tw, ".head_dim ", t.head_dim, " must be even (RoPE pairs)");
  IRIS_CHECK(t.num_attention_heads % t.num_key_value_heads == 0, tw, ".num_attention_heads ",
             t.num_attention_heads, " must be a multiple of num_key_value_heads ",
             t.num_key_value_heads);
  IRIS_CHECK(int64_t{t.num_attention_heads} * t.head_dim <= kMaxWidth, tw,
             ".num_attention_heads x head_dim = ", int64_t{t.num_attention_heads} * t.head_dim,
             " is out of range (at most ", kMaxWidth, ")");
  read_rope(tc, t, tw);
  // The top-level flag wins, as in HF; the text_config copy is a fallback.
  c.tie_word_embeddings = false;
  read_bool(tc, "tie_word_embeddings", c.tie_word_embeddings, tw);
  read_bool(j, "tie_word_embeddings", c.tie_word_embeddings, src);
  t.tie_word_embeddings = c.tie_word_embeddings;

  // Special tokens given here index the embedding table. (The defaults are Qwen's ids, which a
  // small test vocabulary may not reach; prefill checks every id it embeds.)
  read_int(j, "image_token_id", c.image_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "video_token_id", c.video_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "vision_start_token_id", c.vision_start_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "vision_end_token_id", c.vision_end_token_id, src, 0, t.vocab_size - 1);

  const json& vc = j["vision_config"];
  const std::string vw = src + ": vision_config";
  VisionConfig& v = c.vision;
  read_int(vc, "depth", v.depth, vw, 1, kMaxLayers);
  read_int(vc, "hidden_size", v.hidden_size, vw, 1, kMaxWidth);
  read_int(vc, "intermediate_size", v.intermediate_size, vw, 1, kMaxWidth);
  read_int(vc, "num_heads", v.num_heads, vw, 1, kMaxHeads);
  read_int(vc, "in_channels", v.in_channels, vw, 1, 64);
  read_int(vc, "patch_size", v.patch_size, vw, 1, 1024);
  read_int(vc, "spatial_merge_size", v.spatial_merge_size, vw, 1, 64);
  read_int(vc, "temporal_patch_size", v.temporal_patch_size, vw, 1, 64);
  read_int(vc, "out_hidden_size", v.out_hidden_size, vw, 1, kMaxWidth);
  read_int(vc, "num_position_embeddings", v.num_position_embeddings, vw, 1, kMaxPositions);
  if (present(vc, "deepstack_visual_indexes")) {
    const json& ds = vc["deepstack_visual_indexes"];
    IRIS_CHECK(ds.is_array(), vw, ".deepstack_visual_indexes must be a list of block indexes, got ",
               json_excerpt(ds));
    v.deepstack_visual_indexes.clear();
    for (size_t i = 0; i < ds.size(); ++i)
      v.deepstack_visual_indexes.push_back(static_cast<int>(json_integer(
          ds[i], vw, "deepstack_visual_indexes[" + std::to_string(i) + "]", 0, v.depth - 1)));
  }
  std::string vact = "gelu_pytorch_tanh";
  read_string(vc, "hidden_act", vact, vw);
  IRIS_CHECK(vact == "gelu_pytorch_tanh", vw, ".hidden_act '", clip_text(vact, 40),
             "' is not supported (expected gelu_pytorch_tanh)");

  // Iris's image preprocessing produces RGB, so the patch embedding must take three channels.
  IRIS_CHECK(v.in_channels == 3, vw, ".in_channels is ", v.in_channels,
             " but images are preprocessed to 3 channels (RGB)");
  IRIS_CHECK(v.hidden_size % v.num_heads == 0 && v.head_dim() % 4 == 0, vw, ".hidden_size ",
             v.hidden_size, " / num_heads ", v.num_heads,
             " must be a whole head size divisible by 4 (2D RoPE)");
  IRIS_CHECK(int64_t{v.hidden_size} * v.spatial_merge_size * v.spatial_merge_size <= kMaxWidth, vw,
             ".hidden_size x spatial_merge_size^2 is out of range (at most ", kMaxWidth, ")");
  IRIS_CHECK(
      int64_t{v.in_channels} * v.temporal_patch_size * v.patch_size * v.patch_size <= kMaxWidth, vw,
      ": in_channels x temporal_patch_size x patch_size^2 is out of range (at most ", kMaxWidth,
      ")");
  IRIS_CHECK(v.out_hidden_size == t.hidden_size, vw, ".out_hidden_size ", v.out_hidden_size,
             " must equal text_config.hidden_size ", t.hidden_size);
  // Deepstack feature k is added after decoder layer k, and the vision tower keeps one buffer per
  // listed block: a repeated or out-of-order index would pair features with the wrong layers.
  for (size_t k = 1; k < v.deepstack_visual_indexes.size(); ++k)
    IRIS_CHECK(v.deepstack_visual_indexes[k] > v.deepstack_visual_indexes[k - 1], vw,
               ".deepstack_visual_indexes must be strictly increasing (each vision block at most "
               "once, in order), got ",
               json_excerpt(vc["deepstack_visual_indexes"]));
  IRIS_CHECK(int(v.deepstack_visual_indexes.size()) <= t.num_hidden_layers, vw, ": ",
             v.deepstack_visual_indexes.size(),
             " deepstack_visual_indexes, more than text_config.num_hidden_layers ",
             t.num_hidden_layers, " (one decoder layer receives each)");
  try {
    v.position_grid_side();
  } catch (const Error& e) {
    IRIS_FAIL(vw, ": ", e.what());
  }
  return c;
}

PreprocessorConfig model_preprocessor(const std::string& model_dir, const ModelConfig& cfg) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(model_dir) / "preprocessor_config.json";
  if (!fs::exists(path)) {
    // Without the file, HF's defaults with the model's own patch geometry.
    PreprocessorConfig pp;
    pp.patch_size = cfg.vision.patch_size;
    pp.temporal_patch_size = cfg.vision.temporal_patch_size;
    pp.merge_size = cfg.vision.spatial_merge_size;
    return pp;
  }
  const PreprocessorConfig pp = PreprocessorConfig::from_file(path.string());
  check_preprocessor_matches(cfg, pp, (fs::path(model_dir) / "config.json").string(),
                             path.string());
  return pp;
}

void check_preprocessor_matches(const ModelConfig& cfg, const PreprocessorConfig& pp,
                                const std::string& config_name,
                                const std::string& preprocessor_name) {
  const VisionConfig& v = cfg.vision;
  auto same = [&](const char* pp_key, int pp_value, const char* cfg_key, int cfg_value) {
    IRIS_CHECK(pp_value == cfg_value, preprocessor_name, ": ", pp_key, " is ", pp_value, " but ",
               config_name, " has vision_config.", cfg_key, " ", cfg_value,
               "; the two files must describe the same patches (fix the one that does not "
               "match the checkpoint)");
  };
  same("patch_size", pp.patch_size, "patch_size", v.patch_size);
  same("temporal_patch_size", pp.temporal_patch_size, "temporal_patch_size", v.temporal_patch_size);
  same("merge_size", pp.merge_size, "spatial_merge_size", v.spatial_merge_size);
}

}  // namespace iris
