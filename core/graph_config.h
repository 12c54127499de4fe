// CUDA graph configuration for the language decoder and the vision encoder: parsing from recipes,
// config files and CLI flags, migration of deprecated Megatron-LM/Bridge inputs, and validation.
//
// This layer holds no CUDA code on purpose: it runs on every backend, the CPU included, so a bad
// combination is rejected with the same message whether or not a GPU is present.
//
// Two steps, because some checks need the model:
//   parse_graph_configs()    syntax, deprecated-input migration, model-independent rejections;
//   finalize_graph_configs() checks that need the model (MoE layers, deepstack, merge size) and
//                            derives the vision maximum and the default buckets.
//
// The two configs are independent (as in Bridge: each layer follows its own config), except that
// the vision engine uses language.warmup_steps, the way Bridge copies cuda_graph_warmup_steps
// into the vision config.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace iris {

// Language decoder graph backend. Deprecated input `transformer_engine` (and the deprecated
// booleans) migrate to `local`: Iris has a single per-layer graph engine.
enum class GraphImpl { none, local, full_iteration };

// Per-layer training coverage; an empty list means the whole layer. The vision encoder accepts
// only attn and mlp.
enum class GraphModule { attn, mlp, moe, moe_router, moe_preprocess };

// Inference granularity of the language graphs. `local` allows layer or block (default layer);
// every other impl allows only none.
enum class InferenceGraphScope { none, layer, block };

enum class VisionGraphImpl { none, local };

// `block` captures the whole encoder, patch mergers included (deepstack and final), so padded
// lengths must then hold whole merge windows.
enum class VisionGraphScope { layer, block };

// What to do with an encoder call whose patch count exceeds the largest bucket.
enum class VisionGraphOverflow { eager, error };

struct LanguageGraphConfig {
  GraphImpl impl = GraphImpl::none;
  std::vector<GraphModule> modules;  // sorted, no duplicates; empty = whole layer
  InferenceGraphScope inference_scope = InferenceGraphScope::none;
  int warmup_steps = 3;  // eager steps before capture; also used by the vision engine
};

struct VisionGraphConfig {
  VisionGraphImpl impl = VisionGraphImpl::none;
  std::vector<GraphModule> modules;  // attn and/or mlp; empty = whole layer
  VisionGraphScope inference_scope = VisionGraphScope::block;
  // Patches before the 2x2 merge, summed over the images of one encoder call (one micro-batch).
  // 0 = derive from the model in finalize_graph_configs().
  int64_t max_seq_length = 0;
  // Padded lengths, strictly ascending, none above max_seq_length. Empty = derive in
  // finalize_graph_configs(): powers of two from 256 below the maximum, then the maximum.
  std::vector<int64_t> buckets;
  VisionGraphOverflow overflow = VisionGraphOverflow::eager;
};

struct GraphConfigs {
  LanguageGraphConfig language;
  VisionGraphConfig vision;
  std::vector<std::string> warnings;  // one per deprecated input, saying what it migrated to
};

// A resolved key's value, typed: a choice or an integer, or a list of either. Front ends write it
// in their own format (a recipe's YAML, a help text); nothing parses a text of this layer back.
using GraphValue =
    std::variant<std::string, int64_t, std::vector<std::string>, std::vector<int64_t>>;

// Raw input from any source, as text: key -> value. Lists are comma-separated, optionally in
// brackets ("attn,mlp", "[attn, mlp]", "" or "[]" = empty). Keys are the snake_case names of
// graph_config_keys(); values are case-insensitive. A key given twice keeps its last value, so a
// caller can append CLI input after recipe input to override it.
using GraphConfigInput = std::vector<std::pair<std::string, std::string>>;

// Syntax, deprecated-input migration and model-independent rejections. Throws iris::Error.
GraphConfigs parse_graph_configs(const GraphConfigInput& input);

// CLI flags as (name, value) pairs. Names may be spelled `--cuda-graph-impl`, `cuda-graph-impl`
// or `cuda_graph_impl`, and may carry their value after '=' (`--cuda-graph-impl=local`). The
// deprecated boolean flags (--enable-cuda-graph, --external-cuda-graph) may come without a value
// and then mean true; every other flag needs one.
GraphConfigInput graph_config_input_from_flags(
    const std::vector<std::pair<std::string, std::string>>& flags);

struct GraphModelTraits {
  bool has_moe = false;       // language decoder has MoE layers
  bool has_dense_mlp = true;  // some decoder layer has a dense MLP (the 'mlp' module's)
  // Training pads every expert to a static capacity (model.moe_expert_capacity_factor and
  // moe_pad_expert_input_to_capacity), which the 'moe' module needs.
  bool moe_static_capacity = false;
  bool has_deepstack = true;   // vision encoder has deepstack mergers (Qwen3-VL: yes, 3.5: no)
  int spatial_merge_size = 2;  // merge window side; padded lengths hold whole windows of size^2
  // Used when the config's max_seq_length is 0, derived by the caller from the model and the
  // preprocessor (e.g. max_pixels per image times images per call). 0 = unknown.
  int64_t max_vision_seq_length = 0;
};

// Model-dependent checks; derives the vision maximum and default buckets. Also re-runs the
// model-independent checks, so a config built in code is held to the same rules as a parsed one.
// Vision values are checked even when vision graphs are off, so that turning them on later cannot
// surface a latent error.
void finalize_graph_configs(GraphConfigs& cfg, const GraphModelTraits& model);

// Every accepted key, new ones first, then the deprecated ones; for wiring CLI flags.
const std::vector<std::string>& graph_config_keys();
bool is_deprecated_graph_config_key(std::string_view key);
// What a key sets, for help texts and the recipe schema.
struct GraphKeyDoc {
  std::string type;           // "one of none|local", "list of attn|mlp", "integer", ...
  std::string doc;            // what it sets
  std::string default_value;  // for reading: "local", "3", "[attn, mlp]"; empty when deprecated
  GraphValue typed_default;   // what an empty input resolves to
};
GraphKeyDoc graph_config_key_doc(std::string_view key);
// One line for a CLI's help: doc, type and default.
std::string graph_config_key_help(std::string_view key);
// "cuda_graph_impl" -> "--cuda-graph-impl".
std::string graph_config_flag_name(std::string_view key);

// Every non-deprecated key of graph_config_keys() with its resolved value, in that order.
std::vector<std::pair<std::string, GraphValue>> graph_config_values(const GraphConfigs& cfg);
// A value as GraphConfigInput text (lists comma-joined, an empty list ""): parsing every pair of
// graph_config_values this way gives back the same configs.
std::string graph_value_text(const GraphValue& v);

// Smallest bucket >= n_patches, or std::nullopt when n_patches exceeds the largest bucket (the
// caller then applies cfg.overflow). Requires finalized buckets and n_patches > 0.
std::optional<int64_t> choose_vision_bucket(const VisionGraphConfig& cfg, int64_t n_patches);

std::string_view to_string(GraphImpl v);
std::string_view to_string(GraphModule v);
std::string_view to_string(InferenceGraphScope v);
std::string_view to_string(VisionGraphImpl v);
std::string_view to_string(VisionGraphScope v);
std::string_view to_string(VisionGraphOverflow v);

}  // namespace iris
