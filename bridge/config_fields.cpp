#include "bridge/config_fields.h"

#include "core/error.h"
#include "core/json_read.h"

namespace iris::config_fields {

using nlohmann::json;

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

void read_positive_float(const json& j, const char* key, float& out, const std::string& where,
                         double max) {
  if (present(j, key))
    out = static_cast<float>(json_real(j[key], where, key, 0.0, max, /*min_exclusive=*/true));
}

void read_increasing_ints(const json& j, const char* key, std::vector<int>& out,
                          const std::string& where, int64_t min, int64_t max) {
  if (!present(j, key)) return;
  const json& list = j[key];
  IRIS_CHECK(list.is_array(), where, ".", key, " must be a list of integers, got ",
             json_excerpt(list));
  out.clear();
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(static_cast<int>(
        json_integer(list[i], where, std::string(key) + "[" + std::to_string(i) + "]", min, max)));
    IRIS_CHECK(i == 0 || out[i] > out[i - 1], where, ".", key,
               " must be strictly increasing (each index at most once, in order), got ",
               json_excerpt(list));
  }
}

void expect_activation(const json& j, const std::string& where, const char* expected) {
  std::string act = expected;
  read_string(j, "hidden_act", act, where);
  IRIS_CHECK(act == expected, where, ".hidden_act '", clip_text(act, 40),
             "' is not supported (expected ", expected, ")");
}

namespace {

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

void read_text_fields(const json& tc, TextConfig& t, const std::string& tw) {
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
  expect_activation(tc, tw, "silu");
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
}

const json& qwen2_text_fields(const json& j, TextConfig& t, bool& tied, const std::string& src,
                              std::string& where) {
  const bool nested = present(j, "text_config");
  if (nested)
    IRIS_CHECK(j["text_config"].is_object(), src, ": text_config must be an object, got ",
               json_excerpt(j["text_config"]));
  const json& tc = nested ? j["text_config"] : j;
  where = nested ? src + ": text_config" : src;
  read_text_fields(tc, t, where);
  // Qwen2's M-RoPE sections are contiguous (T, then H, then W), not interleaved.
  t.mrope_interleaved = false;
  bool sliding = false;
  read_bool(tc, "use_sliding_window", sliding, where);
  IRIS_CHECK(!sliding, where,
             ".use_sliding_window=true is not supported (the released Qwen2-VL and Qwen2.5-VL "
             "checkpoints attend over the whole context; set it to false)");
  tied = false;
  read_bool(tc, "tie_word_embeddings", tied, where);
  read_bool(j, "tie_word_embeddings", tied, src);
  return tc;
}

const json& qwen2_vision_fields(const json& j, VisionConfig& v, int text_hidden,
                                const std::string& src, std::string& where) {
  IRIS_CHECK(present(j, "vision_config") && j["vision_config"].is_object(), src,
             ": missing vision_config");
  const json& vc = j["vision_config"];
  where = src + ": vision_config";
  v.depth = 32;
  v.num_heads = 16;
  v.patch_size = 14;
  v.out_hidden_size = text_hidden;
  v.num_position_embeddings = 0;
  v.deepstack_visual_indexes.clear();
  read_int(vc, "depth", v.depth, where, 1, kMaxLayers);
  read_int(vc, "num_heads", v.num_heads, where, 1, kMaxHeads);
  read_int(vc, "in_chans", v.in_channels, where, 1, 64);
  read_int(vc, "in_channels", v.in_channels, where, 1, 64);
  read_int(vc, "patch_size", v.patch_size, where, 1, 1024);
  read_int(vc, "spatial_merge_size", v.spatial_merge_size, where, 1, 64);
  read_int(vc, "temporal_patch_size", v.temporal_patch_size, where, 1, 64);
  return vc;
}

}  // namespace iris::config_fields
