#include "bridge/model_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"

namespace iris {
namespace {

using nlohmann::json;

template <typename T>
void read_field(const json& j, const char* key, T& out, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return;
  try {
    out = j[key].get<T>();
  } catch (const json::exception&) {
    IRIS_FAIL(where, ": field '", key, "' has the wrong type (", j[key].dump(), ")");
  }
}

void read_rope(const json& tc, TextConfig& t, const std::string& where) {
  // 5.x nests rope settings in rope_parameters; older files use rope_scaling + rope_theta.
  read_field(tc, "rope_theta", t.rope_theta, where);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!tc.contains(key) || !tc[key].is_object()) continue;
    const json& r = tc[key];
    const std::string w = where + "." + key;
    read_field(r, "rope_theta", t.rope_theta, w);
    if (r.contains("mrope_section")) {
      const auto sec = r["mrope_section"];
      IRIS_CHECK(sec.is_array() && sec.size() == 3, w, ".mrope_section must be a list of 3 ints");
      for (int i = 0; i < 3; ++i) t.mrope_section[i] = sec[i].get<int>();
    }
    read_field(r, "mrope_interleaved", t.mrope_interleaved, w);
    std::string type;
    read_field(r, "rope_type", type, w);
    if (type.empty()) read_field(r, "type", type, w);
    IRIS_CHECK(type.empty() || type == "default" || type == "mrope", w, ".rope_type '", type,
               "' is not supported (Iris implements the default M-RoPE)");
  }
  IRIS_CHECK(2 * (t.mrope_section[0] + t.mrope_section[1] + t.mrope_section[2]) == t.head_dim,
             where, ": mrope_section sums to ",
             t.mrope_section[0] + t.mrope_section[1] + t.mrope_section[2],
             " but must be head_dim/2 = ", t.head_dim / 2);
}

}  // namespace

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json_text(read_text_file(path), path);
}

ModelConfig ModelConfig::from_json_text(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    IRIS_FAIL(src, " is not valid JSON (", e.what(), ")");
  }
  IRIS_CHECK(j.is_object(), src, " must hold a JSON object");
  ModelConfig c;
  read_field(j, "model_type", c.model_type, src);
  IRIS_CHECK(c.model_type == "qwen3_vl", src, ": model_type '", c.model_type,
             "' is not supported; Iris loads Qwen3-VL checkpoints (model_type \"qwen3_vl\")");
  IRIS_CHECK(j.contains("text_config") && j["text_config"].is_object(), src,
             ": missing text_config (Qwen3-VL configs are nested)");
  IRIS_CHECK(j.contains("vision_config") && j["vision_config"].is_object(), src,
             ": missing vision_config");
  read_field(j, "image_token_id", c.image_token_id, src);
  read_field(j, "video_token_id", c.video_token_id, src);
  read_field(j, "vision_start_token_id", c.vision_start_token_id, src);
  read_field(j, "vision_end_token_id", c.vision_end_token_id, src);

  const json& tc = j["text_config"];
  const std::string tw = src + ": text_config";
  TextConfig& t = c.text;
  read_field(tc, "vocab_size", t.vocab_size, tw);
  read_field(tc, "hidden_size", t.hidden_size, tw);
  read_field(tc, "intermediate_size", t.intermediate_size, tw);
  read_field(tc, "num_hidden_layers", t.num_hidden_layers, tw);
  read_field(tc, "num_attention_heads", t.num_attention_heads, tw);
  t.num_key_value_heads = t.num_attention_heads;
  read_field(tc, "num_key_value_heads", t.num_key_value_heads, tw);
  t.head_dim = t.hidden_size / std::max(1, t.num_attention_heads);
  read_field(tc, "head_dim", t.head_dim, tw);
  read_field(tc, "max_position_embeddings", t.max_position_embeddings, tw);
  read_field(tc, "rms_norm_eps", t.rms_norm_eps, tw);
  read_field(tc, "attention_bias", t.attention_bias, tw);
  std::string act = "silu";
  read_field(tc, "hidden_act", act, tw);
  IRIS_CHECK(act == "silu", tw, ".hidden_act '", act, "' is not supported (expected silu)");
  IRIS_CHECK(!t.attention_bias, tw, ".attention_bias=true is not a Qwen3 layout");
  read_rope(tc, t, tw);
  // The top-level flag wins, as in HF; the text_config copy is a fallback.
  c.tie_word_embeddings = false;
  read_field(tc, "tie_word_embeddings", c.tie_word_embeddings, tw);
  read_field(j, "tie_word_embeddings", c.tie_word_embeddings, src);
  t.tie_word_embeddings = c.tie_word_embeddings;

  const json& vc = j["vision_config"];
  const std::string vw = src + ": vision_config";
  VisionConfig& v = c.vision;
  read_field(vc, "depth", v.depth, vw);
  read_field(vc, "hidden_size", v.hidden_size, vw);
  read_field(vc, "intermediate_size", v.intermediate_size, vw);
  read_field(vc, "num_heads", v.num_heads, vw);
  read_field(vc, "in_channels", v.in_channels, vw);
  read_field(vc, "patch_size", v.patch_size, vw);
  read_field(vc, "spatial_merge_size", v.spatial_merge_size, vw);
  read_field(vc, "temporal_patch_size", v.temporal_patch_size, vw);
  read_field(vc, "out_hidden_size", v.out_hidden_size, vw);
  read_field(vc, "num_position_embeddings", v.num_position_embeddings, vw);
  read_field(vc, "deepstack_visual_indexes", v.deepstack_visual_indexes, vw);
  std::string vact = "gelu_pytorch_tanh";
  read_field(vc, "hidden_act", vact, vw);
  IRIS_CHECK(vact == "gelu_pytorch_tanh", vw, ".hidden_act '", vact,
             "' is not supported (expected gelu_pytorch_tanh)");

  auto positive = [&](int value, const char* name) {
    IRIS_CHECK(value > 0, src, ": ", name, " must be positive, got ", value);
  };
  positive(t.vocab_size, "text_config.vocab_size");
  positive(t.hidden_size, "text_config.hidden_size");
  positive(t.num_hidden_layers, "text_config.num_hidden_layers");
  positive(t.num_attention_heads, "text_config.num_attention_heads");
  positive(t.num_key_value_heads, "text_config.num_key_value_heads");
  positive(t.head_dim, "text_config.head_dim");
  positive(v.depth, "vision_config.depth");
  positive(v.hidden_size, "vision_config.hidden_size");
  positive(v.num_heads, "vision_config.num_heads");
  IRIS_CHECK(t.num_attention_heads % t.num_key_value_heads == 0, src,
             ": num_attention_heads must be a multiple of num_key_value_heads");
  IRIS_CHECK(t.head_dim % 2 == 0, src, ": text head_dim must be even");
  IRIS_CHECK(v.hidden_size % v.num_heads == 0 && v.head_dim() % 4 == 0, src,
             ": vision hidden_size/num_heads must be a multiple of 4 (2D RoPE)");
  IRIS_CHECK(v.out_hidden_size == t.hidden_size, src, ": vision out_hidden_size ",
             v.out_hidden_size, " must equal text hidden_size ", t.hidden_size);
  for (int k : v.deepstack_visual_indexes)
    IRIS_CHECK(k >= 0 && k < v.depth, src, ": deepstack index ", k, " outside the ", v.depth,
               " vision blocks");
  IRIS_CHECK(int(v.deepstack_visual_indexes.size()) <= t.num_hidden_layers, src,
             ": more deepstack taps than decoder layers");
  v.position_grid_side();
  return c;
}

}  // namespace iris
