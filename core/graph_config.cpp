#include "core/graph_config.h"
#include "core/text_distance.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <limits>
#include <map>

#include "core/error.h"

namespace iris {

namespace {

constexpr const char* kPrefix = "CUDA graph config: ";

// Smallest default bucket: one 256x256 image at patch size 16. Smaller calls pad up to it rather
// than each size getting a capture (and a static buffer set) of its own.
constexpr int64_t kFirstDefaultBucket = 256;

struct KeyInfo {
  std::string_view name;
  bool deprecated;
};

constexpr std::array<KeyInfo, 14> kKeys = {{
    {"cuda_graph_impl", false},
    {"cuda_graph_modules", false},
    {"inference_cuda_graph_scope", false},
    {"cuda_graph_warmup_steps", false},
    {"vision_cuda_graph_impl", false},
    {"vision_cuda_graph_modules", false},
    {"vision_inference_cuda_graph_scope", false},
    {"max_vision_cuda_graph_seq_length", false},
    {"vision_cuda_graph_buckets", false},
    {"vision_cuda_graph_overflow", false},
    // Megatron-LM names, before PR #4292.
    {"enable_cuda_graph", true},
    {"external_cuda_graph", true},
    {"cuda_graph_scope", true},
    // Megatron-Bridge's name for the vision module list.
    {"vision_cuda_graph_scope", true},
}};

template <typename E>
struct Choice {
  std::string_view name;
  E value;
};

constexpr std::array<Choice<GraphImpl>, 3> kImpls = {{
    {"none", GraphImpl::none},
    {"local", GraphImpl::local},
    {"full_iteration", GraphImpl::full_iteration},
}};
constexpr std::array<Choice<GraphModule>, 5> kModules = {{
    {"attn", GraphModule::attn},
    {"mlp", GraphModule::mlp},
    {"moe", GraphModule::moe},
    {"moe_router", GraphModule::moe_router},
    {"moe_preprocess", GraphModule::moe_preprocess},
}};
constexpr std::array<Choice<GraphModule>, 2> kVisionModules = {{
    {"attn", GraphModule::attn},
    {"mlp", GraphModule::mlp},
}};
constexpr std::array<Choice<InferenceGraphScope>, 3> kInferenceScopes = {{
    {"none", InferenceGraphScope::none},
    {"layer", InferenceGraphScope::layer},
    {"block", InferenceGraphScope::block},
}};
constexpr std::array<Choice<VisionGraphImpl>, 2> kVisionImpls = {{
    {"none", VisionGraphImpl::none},
    {"local", VisionGraphImpl::local},
}};
constexpr std::array<Choice<VisionGraphScope>, 2> kVisionScopes = {{
    {"layer", VisionGraphScope::layer},
    {"block", VisionGraphScope::block},
}};
constexpr std::array<Choice<VisionGraphOverflow>, 2> kOverflows = {{
    {"eager", VisionGraphOverflow::eager},
    {"error", VisionGraphOverflow::error},
}};

template <typename E, size_t N>
std::string_view name_of(const std::array<Choice<E>, N>& choices, E v) {
  for (const auto& c : choices)
    if (c.value == v) return c.name;
  IRIS_FAIL(kPrefix, "enum value ", static_cast<int>(v), " out of range");
}

template <typename E, size_t N>
std::string valid_list(const std::array<Choice<E>, N>& choices) {
  std::string out;
  for (const auto& c : choices) {
    if (!out.empty()) out += ", ";
    out += c.name;
  }
  return out;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Keys compare case-insensitively and with either separator, so that a recipe key, a config-file
// key and a CLI flag all name the same setting.
std::string normalize_key(std::string_view raw) {
  std::string k = lower(trim(raw));
  if (k.rfind("--", 0) == 0) k.erase(0, 2);
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

const KeyInfo* find_key(std::string_view key) {
  for (const auto& k : kKeys)
    if (k.name == key) return &k;
  return nullptr;
}

std::string all_keys_text() {
  std::string out;
  for (const auto& k : kKeys) {
    if (!out.empty()) out += ", ";
    out += k.name;
    if (k.deprecated) out += " (deprecated)";
  }
  return out;
}

[[noreturn]] void fail_unknown_key(const std::string& raw, const std::string& key) {
  std::string_view best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& k : kKeys) {
    const size_t d = edit_distance(key, k.name);
    if (d < best_d) {
      best_d = d;
      best = k.name;
    }
  }
  IRIS_FAIL(kPrefix, "unknown key '", raw, "'; did you mean '", best, "' (flag ",
            graph_config_flag_name(best), ")? Valid keys: ", all_keys_text());
}

template <typename E, size_t N>
E parse_enum(std::string_view key, const std::string& value,
             const std::array<Choice<E>, N>& choices, std::string_view extra = {}) {
  for (const auto& c : choices)
    if (c.name == value) return c.value;
  if (value.empty())
    IRIS_FAIL(kPrefix, key, " needs a value; valid values: ", valid_list(choices), extra);
  IRIS_FAIL(kPrefix, key, " '", value, "' is not valid; valid values: ", valid_list(choices),
            extra);
}

bool parse_bool(std::string_view key, const std::string& value) {
  if (value == "true" || value == "1" || value == "yes" || value == "on") return true;
  if (value == "false" || value == "0" || value == "no" || value == "off") return false;
  IRIS_FAIL(kPrefix, key, " '", value, "' is not a boolean; valid values: true, false");
}

int64_t parse_int(std::string_view key, const std::string& text, int64_t min_value,
                  std::string_view what) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  IRIS_CHECK(!text.empty() && ec == std::errc() && p == end, kPrefix, key, " '", text,
             "' is not an integer; expected ", what);
  IRIS_CHECK(v >= min_value, kPrefix, key, " ", v, " is out of range; expected ", what);
  return v;
}

// "a,b", "[a, b]", "" and "[]" -> items; an empty entry ("a,,b") is a typo, not an empty list.
std::vector<std::string> split_list(std::string_view key, const std::string& value) {
  std::string body = value;
  if (!body.empty() && body.front() == '[') {
    IRIS_CHECK(body.back() == ']', kPrefix, key, " '", value, "' has an unclosed '['");
    body = trim(std::string_view(body).substr(1, body.size() - 2));
  }
  std::vector<std::string> items;
  if (body.empty()) return items;
  size_t start = 0;
  while (true) {
    const size_t comma = body.find(',', start);
    std::string item = trim(std::string_view(body).substr(
        start, comma == std::string::npos ? std::string::npos : comma - start));
    IRIS_CHECK(!item.empty(), kPrefix, key, " '", value,
               "' has an empty entry; separate values with single commas, e.g. attn,mlp");
    items.push_back(std::move(item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

std::string join_modules(const std::vector<GraphModule>& modules) {
  std::string out = "[";
  for (size_t i = 0; i < modules.size(); ++i) {
    if (i) out += ", ";
    out += to_string(modules[i]);
  }
  return out + "]";
}

std::string join_ints(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(v[i]);
  }
  return out + "]";
}

// The last value of every key, normalized; unknown keys rejected here so that later code can
// assume the key set.
class Values {
 public:
  explicit Values(const GraphConfigInput& input) {
    for (const auto& [raw_key, raw_value] : input) {
      const std::string key = normalize_key(raw_key);
      if (!find_key(key)) fail_unknown_key(raw_key, key);
      values_[key] = lower(trim(raw_value));
    }
  }
  bool has(std::string_view key) const { return values_.count(std::string(key)) != 0; }
  const std::string& at(std::string_view key) const { return values_.at(std::string(key)); }

 private:
  std::map<std::string, std::string> values_;
};

// Deprecated values of the module lists (Megatron-LM's CudaGraphScope) that set other fields.
enum class LegacyScope { none, full_iteration, full_iteration_inference };

struct ParsedModules {
  std::vector<GraphModule> modules;
  bool full = false;  // deprecated "full": whole layer
  LegacyScope legacy = LegacyScope::none;
};

// Hint for a scope value typed into a module list: the two "scope" keys are easy to confuse.
std::string scope_hint(const std::string& item, std::string_view inference_key) {
  if (item == "none" || item == "layer" || item == "block")
    return str_cat(" ('", item, "' is a value of ", inference_key, ")");
  return {};
}

template <size_t N>
ParsedModules parse_modules(std::string_view key, const std::string& value,
                            const std::array<Choice<GraphModule>, N>& choices, bool vision) {
  const std::vector<std::string> items = split_list(key, value);
  ParsedModules out;
  const std::string valid = valid_list(choices);
  for (const std::string& item : items) {
    if (item == "full") {
      IRIS_CHECK(items.size() == 1, kPrefix, key, " '", value,
                 "': 'full' cannot be combined with other values; 'full' (deprecated) means the "
                 "whole layer, which is an empty list: use [] alone, or list only ",
                 valid);
      out.full = true;
      continue;
    }
    if (item == "full_iteration" || item == "full_iteration_inference") {
      IRIS_CHECK(!vision, kPrefix, key, " '", item,
                 "' is not supported for the vision encoder; valid values: ", valid,
                 " (vision_cuda_graph_impl allows none, local)");
      const LegacyScope legacy = item == "full_iteration" ? LegacyScope::full_iteration
                                                          : LegacyScope::full_iteration_inference;
      IRIS_CHECK(out.legacy == LegacyScope::none || out.legacy == legacy, kPrefix, key, " '", value,
                 "' holds two deprecated values at once (full_iteration and "
                 "full_iteration_inference); keep one, or better, set cuda_graph_impl: "
                 "full_iteration or inference_cuda_graph_scope: block directly");
      IRIS_CHECK(out.legacy == LegacyScope::none, kPrefix, key, " '", value, "' lists '", item,
                 "' twice");
      out.legacy = legacy;
      continue;
    }
    if (item == "mamba")
      IRIS_FAIL(kPrefix, key, " 'mamba' is not supported: Qwen3-VL models have no Mamba layers; ",
                "valid values: ", valid);
    if (vision && (item == "moe" || item == "moe_router" || item == "moe_preprocess"))
      IRIS_FAIL(kPrefix, key, " '", item, "' is not valid: the vision encoder has no MoE layers; ",
                "valid values: ", valid);
    const GraphModule m =
        parse_enum(key, item, choices,
                   str_cat(" (an empty list means the whole layer)",
                           scope_hint(item, vision ? "vision_inference_cuda_graph_scope"
                                                   : "inference_cuda_graph_scope")));
    IRIS_CHECK(std::find(out.modules.begin(), out.modules.end(), m) == out.modules.end(), kPrefix,
               key, " '", value, "' lists '", item, "' twice");
    out.modules.push_back(m);
  }
  std::sort(out.modules.begin(), out.modules.end());
  return out;
}

bool contains(const std::vector<GraphModule>& v, GraphModule m) {
  return std::find(v.begin(), v.end(), m) != v.end();
}

void check_modules_sorted_unique(std::string_view key, const std::vector<GraphModule>& modules) {
  for (size_t i = 1; i < modules.size(); ++i)
    IRIS_CHECK(modules[i - 1] < modules[i], kPrefix, key, " ", join_modules(modules),
               " must be sorted and without duplicates");
}

// Rules that do not depend on the model; run by parse and again by finalize.
void validate_language(const LanguageGraphConfig& c) {
  const auto& m = c.modules;
  check_modules_sorted_unique("cuda_graph_modules", m);
  IRIS_CHECK(c.impl != GraphImpl::full_iteration || m.empty(), kPrefix,
             "cuda_graph_impl full_iteration captures the whole training step, so "
             "cuda_graph_modules must be empty, got ",
             join_modules(m), "; drop cuda_graph_modules or use cuda_graph_impl: local");
  IRIS_CHECK(!(contains(m, GraphModule::moe) && contains(m, GraphModule::moe_router)), kPrefix,
             "cuda_graph_modules ", join_modules(m),
             " holds both 'moe' and 'moe_router': 'moe' already graphs the whole MoE block "
             "including its router; keep one");
  IRIS_CHECK(!contains(m, GraphModule::moe_preprocess) || contains(m, GraphModule::moe_router),
             kPrefix, "cuda_graph_modules ", join_modules(m),
             " holds 'moe_preprocess' without 'moe_router': the preprocess graph consumes the "
             "router graph's outputs; add moe_router");
  const bool local = c.impl == GraphImpl::local;
  if (local)
    IRIS_CHECK(c.inference_scope != InferenceGraphScope::none, kPrefix,
               "inference_cuda_graph_scope 'none' is not allowed with cuda_graph_impl 'local'; "
               "valid values with local: layer, block (iris train's default is layer, iris "
               "generate's block)");
  else
    IRIS_CHECK(c.inference_scope == InferenceGraphScope::none, kPrefix,
               "inference_cuda_graph_scope '", to_string(c.inference_scope),
               "' is not allowed with cuda_graph_impl '", to_string(c.impl),
               "'; the only valid value with it is none (layer and block need cuda_graph_impl "
               "local)");
  IRIS_CHECK(c.warmup_steps >= 0, kPrefix, "cuda_graph_warmup_steps ", c.warmup_steps,
             " is negative; expected an integer >= 0 (default 3)");
}

void validate_vision(const VisionGraphConfig& c) {
  check_modules_sorted_unique("vision_cuda_graph_modules", c.modules);
  for (GraphModule m : c.modules)
    IRIS_CHECK(m == GraphModule::attn || m == GraphModule::mlp, kPrefix,
               "vision_cuda_graph_modules '", to_string(m),
               "' is not valid: the vision encoder has no MoE layers; valid values: ",
               valid_list(kVisionModules));
  IRIS_CHECK(c.max_seq_length >= 0, kPrefix, "max_vision_cuda_graph_seq_length ", c.max_seq_length,
             " is negative; expected patches per encoder call, or 0 to derive");
  for (size_t i = 0; i < c.buckets.size(); ++i) {
    IRIS_CHECK(c.buckets[i] > 0, kPrefix, "vision_cuda_graph_buckets ", join_ints(c.buckets),
               ": entry ", c.buckets[i], " is not positive; buckets are padded patch counts");
    if (i == 0) continue;
    IRIS_CHECK(c.buckets[i] != c.buckets[i - 1], kPrefix, "vision_cuda_graph_buckets ",
               join_ints(c.buckets), " lists ", c.buckets[i], " twice");
    IRIS_CHECK(c.buckets[i] > c.buckets[i - 1], kPrefix, "vision_cuda_graph_buckets ",
               join_ints(c.buckets), " is not ascending (", c.buckets[i - 1], " before ",
               c.buckets[i], "); list them smallest first");
  }
}

LanguageGraphConfig parse_language(const Values& v, std::vector<std::string>& warnings) {
  LanguageGraphConfig c;
  constexpr std::string_view impl_valid =
      " (transformer_engine is accepted as a deprecated alias of local)";

  // Legacy booleans first: they decide the impl that the scope migration below sees.
  std::optional<bool> enable, external;
  if (v.has("enable_cuda_graph"))
    enable = parse_bool("enable_cuda_graph", v.at("enable_cuda_graph"));
  if (v.has("external_cuda_graph"))
    external = parse_bool("external_cuda_graph", v.at("external_cuda_graph"));
  IRIS_CHECK(!(enable.value_or(false) && external.value_or(false)), kPrefix,
             "enable_cuda_graph and external_cuda_graph are both true; both are deprecated and "
             "mutually exclusive: remove them and set cuda_graph_impl (none, local, "
             "full_iteration)");
  for (const char* legacy : {"enable_cuda_graph", "external_cuda_graph"}) {
    if (!v.has(legacy) || !parse_bool(legacy, v.at(legacy))) continue;
    IRIS_CHECK(!v.has("cuda_graph_impl"), kPrefix, legacy,
               ": true is deprecated and cannot be combined with an explicit cuda_graph_impl ('",
               v.at("cuda_graph_impl"), "'); remove ", legacy, " and keep cuda_graph_impl");
  }

  // Megatron-LM rejects full_iteration graphs with the TE engine; the alias keeps that rule.
  bool from_te = false;
  if (v.has("cuda_graph_impl")) {
    const std::string& s = v.at("cuda_graph_impl");
    if (s == "transformer_engine") {
      c.impl = GraphImpl::local;
      from_te = true;
      warnings.push_back(
          "cuda_graph_impl 'transformer_engine' is deprecated: migrated to cuda_graph_impl: "
          "local (Iris has one per-layer graph engine)");
    } else {
      c.impl = parse_enum("cuda_graph_impl", s, kImpls, impl_valid);
    }
  }
  if (enable) {
    if (*enable) c.impl = GraphImpl::local;
    warnings.push_back(*enable ? "enable_cuda_graph: true is deprecated: migrated to "
                                 "cuda_graph_impl: local"
                               : "enable_cuda_graph: false is deprecated and has no effect; "
                                 "remove it (use cuda_graph_impl: none | local | "
                                 "full_iteration)");
  }
  if (external) {
    if (*external) {
      c.impl = GraphImpl::local;
      from_te = true;
    }
    warnings.push_back(*external ? "external_cuda_graph: true is deprecated: migrated to "
                                   "cuda_graph_impl: local (Iris has one per-layer graph "
                                   "engine)"
                                 : "external_cuda_graph: false is deprecated and has no "
                                   "effect; remove it (use cuda_graph_impl: none | local | "
                                   "full_iteration)");
  }

  IRIS_CHECK(!(v.has("cuda_graph_scope") && v.has("cuda_graph_modules")), kPrefix,
             "cuda_graph_scope ('", v.at("cuda_graph_scope"), "') and cuda_graph_modules ('",
             v.at("cuda_graph_modules"),
             "') are both set; cuda_graph_scope is the deprecated name of cuda_graph_modules: "
             "keep only cuda_graph_modules");
  const bool old_key = v.has("cuda_graph_scope");
  const std::string modules_key = old_key ? "cuda_graph_scope" : "cuda_graph_modules";
  ParsedModules pm;
  if (v.has(modules_key)) pm = parse_modules(modules_key, v.at(modules_key), kModules, false);
  c.modules = pm.modules;

  std::optional<InferenceGraphScope> scope;
  if (v.has("inference_cuda_graph_scope"))
    scope = parse_enum("inference_cuda_graph_scope", v.at("inference_cuda_graph_scope"),
                       kInferenceScopes);

  std::string migrated;  // what the deprecated module values turned into, for the warning
  if (pm.full) migrated = "'full' migrated to an empty list (whole layer)";
  if (pm.legacy == LegacyScope::full_iteration) {
    IRIS_CHECK(!from_te, kPrefix, modules_key,
               " 'full_iteration' cannot be combined with cuda_graph_impl transformer_engine or "
               "external_cuda_graph (as in Megatron-LM); set cuda_graph_impl: full_iteration "
               "instead");
    IRIS_CHECK(!scope || *scope == InferenceGraphScope::none, kPrefix, modules_key,
               " 'full_iteration' cannot be combined with inference_cuda_graph_scope '",
               to_string(*scope),
               "': full_iteration has no inference graphs; remove "
               "inference_cuda_graph_scope (or set it to none)");
    c.impl = GraphImpl::full_iteration;
    migrated = "'full_iteration' migrated to cuda_graph_impl: full_iteration";
  } else if (pm.legacy == LegacyScope::full_iteration_inference) {
    IRIS_CHECK(!from_te && c.impl != GraphImpl::full_iteration, kPrefix, modules_key,
               " 'full_iteration_inference' cannot be combined with cuda_graph_impl ",
               from_te ? "transformer_engine (or external_cuda_graph)" : to_string(c.impl),
               "; valid impls with it: none, local. Prefer cuda_graph_impl: local with "
               "inference_cuda_graph_scope: block");
    IRIS_CHECK(!scope || *scope == InferenceGraphScope::block, kPrefix, modules_key,
               " 'full_iteration_inference' means inference_cuda_graph_scope block and cannot "
               "be combined with inference_cuda_graph_scope '",
               to_string(*scope), "'; remove one of them");
    if (c.impl == GraphImpl::local) {
      scope = InferenceGraphScope::block;
      migrated =
          "'full_iteration_inference' migrated to cuda_graph_impl: local, "
          "inference_cuda_graph_scope: block";
    } else {
      // Megatron-LM warns and ignores it without an impl that has inference graphs.
      migrated = "'full_iteration_inference' has no effect because cuda_graph_impl is none";
    }
  }
  if (old_key)
    warnings.push_back(str_cat("cuda_graph_scope is deprecated: migrated to cuda_graph_modules: ",
                               join_modules(c.modules), migrated.empty() ? "" : "; ", migrated));
  else if (!migrated.empty())
    warnings.push_back(str_cat("cuda_graph_modules value is deprecated: ", migrated));

  c.inference_scope = scope.value_or(c.impl == GraphImpl::local ? InferenceGraphScope::layer
                                                                : InferenceGraphScope::none);
  if (v.has("cuda_graph_warmup_steps"))
    c.warmup_steps =
        static_cast<int>(parse_int("cuda_graph_warmup_steps", v.at("cuda_graph_warmup_steps"), 0,
                                   "an integer >= 0 (default 3)"));
  validate_language(c);
  return c;
}

VisionGraphConfig parse_vision(const Values& v, std::vector<std::string>& warnings) {
  VisionGraphConfig c;
  if (v.has("vision_cuda_graph_impl")) {
    const std::string& s = v.at("vision_cuda_graph_impl");
    if (s == "transformer_engine") {
      c.impl = VisionGraphImpl::local;
      warnings.push_back(
          "vision_cuda_graph_impl 'transformer_engine' (Megatron-Bridge spelling) is "
          "deprecated: migrated to vision_cuda_graph_impl: local");
    } else {
      c.impl = parse_enum("vision_cuda_graph_impl", s, kVisionImpls,
                          " (transformer_engine is accepted as a deprecated alias of local)");
    }
  }

  IRIS_CHECK(!(v.has("vision_cuda_graph_scope") && v.has("vision_cuda_graph_modules")), kPrefix,
             "vision_cuda_graph_scope ('", v.at("vision_cuda_graph_scope"),
             "') and vision_cuda_graph_modules ('", v.at("vision_cuda_graph_modules"),
             "') are both set; vision_cuda_graph_scope is Megatron-Bridge's (deprecated) name of "
             "vision_cuda_graph_modules: keep only vision_cuda_graph_modules");
  const bool old_key = v.has("vision_cuda_graph_scope");
  const std::string modules_key = old_key ? "vision_cuda_graph_scope" : "vision_cuda_graph_modules";
  if (v.has(modules_key)) {
    const ParsedModules pm = parse_modules(modules_key, v.at(modules_key), kVisionModules, true);
    c.modules = pm.modules;
    const char* full_note = pm.full ? "; 'full' migrated to an empty list (whole layer)" : "";
    if (old_key)
      warnings.push_back(
          str_cat("vision_cuda_graph_scope is deprecated: migrated to "
                  "vision_cuda_graph_modules: ",
                  join_modules(c.modules), full_note));
    else if (pm.full)
      warnings.push_back(
          "vision_cuda_graph_modules value 'full' is deprecated: migrated to an empty list "
          "(whole layer)");
  }

  if (v.has("vision_inference_cuda_graph_scope"))
    c.inference_scope =
        parse_enum("vision_inference_cuda_graph_scope", v.at("vision_inference_cuda_graph_scope"),
                   kVisionScopes, " (block = the whole encoder including the patch mergers)");
  if (v.has("max_vision_cuda_graph_seq_length"))
    c.max_seq_length =
        parse_int("max_vision_cuda_graph_seq_length", v.at("max_vision_cuda_graph_seq_length"), 0,
                  "patches before the 2x2 merge per encoder call, or 0 to derive from the model");
  if (v.has("vision_cuda_graph_buckets"))
    for (const std::string& item :
         split_list("vision_cuda_graph_buckets", v.at("vision_cuda_graph_buckets")))
      c.buckets.push_back(parse_int("vision_cuda_graph_buckets", item,
                                    std::numeric_limits<int64_t>::min(),
                                    "ascending padded patch counts, e.g. 256,512,1024"));
  if (v.has("vision_cuda_graph_overflow"))
    c.overflow = parse_enum("vision_cuda_graph_overflow", v.at("vision_cuda_graph_overflow"),
                            kOverflows, " (eager = run an oversized call without graphs)");
  validate_vision(c);
  return c;
}

std::vector<int64_t> default_buckets(int64_t max) {
  std::vector<int64_t> out;
  // Doubling stops at max / 2 so that b never overflows, whatever max is.
  for (int64_t b = kFirstDefaultBucket; b < max; b *= 2) {
    out.push_back(b);
    if (b > max / 2) break;
  }
  out.push_back(max);
  return out;
}

}  // namespace

std::string_view to_string(GraphImpl v) {
  return name_of(kImpls, v);
}
std::string_view to_string(GraphModule v) {
  return name_of(kModules, v);
}
std::string_view to_string(InferenceGraphScope v) {
  return name_of(kInferenceScopes, v);
}
std::string_view to_string(VisionGraphImpl v) {
  return name_of(kVisionImpls, v);
}
std::string_view to_string(VisionGraphScope v) {
  return name_of(kVisionScopes, v);
}
std::string_view to_string(VisionGraphOverflow v) {
  return name_of(kOverflows, v);
}

const std::vector<std::string>& graph_config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> out;
    for (const auto& k : kKeys) out.emplace_back(k.name);
    return out;
  }();
  return keys;
}

bool is_deprecated_graph_config_key(std::string_view key) {
  const KeyInfo* k = find_key(normalize_key(key));
  IRIS_CHECK(k, kPrefix, "unknown key '", key, "'; valid keys: ", all_keys_text());
  return k->deprecated;
}

GraphKeyDoc graph_config_key_doc(std::string_view key) {
  const std::string k = normalize_key(key);
  IRIS_CHECK(find_key(k), kPrefix, "unknown key '", key, "'; valid keys: ", all_keys_text());
  auto names = [](const auto& choices) {
    std::string out;
    for (const auto& c : choices) out += (out.empty() ? "" : "|") + std::string(c.name);
    return out;
  };
  auto one_of = [&](const auto& choices) { return "one of " + names(choices); };
  auto list_of = [&](const auto& choices) { return "list of " + names(choices); };
  GraphKeyDoc d;
  if (k == "cuda_graph_impl") {
    d = {one_of(kImpls),
         "language decoder graphs (deprecated transformer_engine migrates to local)"};
  } else if (k == "cuda_graph_modules") {
    d = {list_of(kModules),
         "parts of each decoder layer a training graph captures; empty: the whole layer (checked "
         "now; inference graphs take whole layers)"};
  } else if (k == "inference_cuda_graph_scope") {
    d = {one_of(kInferenceScopes),
         "decode-step graphs: block = one graph per step, layer = one per decoder layer; impl "
         "local allows layer (a recipe's default; iris generate's is block) or block, other "
         "impls only none"};
  } else if (k == "cuda_graph_warmup_steps") {
    d = {"integer", "eager calls before a graph is captured (the vision graphs use it too)"};
  } else if (k == "vision_cuda_graph_impl") {
    d = {one_of(kVisionImpls), "vision encoder graphs"};
  } else if (k == "vision_cuda_graph_modules") {
    d = {list_of(kVisionModules),
         "parts of each vision block a training graph captures; empty: the whole block (checked "
         "now; inference graphs take whole blocks)"};
  } else if (k == "vision_inference_cuda_graph_scope") {
    d = {one_of(kVisionScopes),
         "block = one graph for the whole encoder, mergers included; layer = one per block"};
  } else if (k == "max_vision_cuda_graph_seq_length") {
    d = {"integer",
         "most patches of one encoder call (summed over its images) that the graphs hold; 0: "
         "derived from the model and its inputs"};
  } else if (k == "vision_cuda_graph_buckets") {
    d = {"list of integers", str_cat("padded lengths, ascending; empty: powers of two from ",
                                     kFirstDefaultBucket, ", then the maximum")};
  } else if (k == "vision_cuda_graph_overflow") {
    d = {one_of(kOverflows),
         "a call above the largest bucket: eager runs it without a graph (with a warning), "
         "error refuses it"};
  } else if (k == "enable_cuda_graph" || k == "external_cuda_graph") {
    d = {"boolean", "deprecated: true migrates to cuda_graph_impl local"};
  } else if (k == "cuda_graph_scope") {
    d = {"list",
         "deprecated name of cuda_graph_modules; full_iteration, full_iteration_inference and "
         "full migrate to impl and scope settings"};
  } else if (k == "vision_cuda_graph_scope") {
    d = {"list", "deprecated (Megatron-Bridge) name of vision_cuda_graph_modules"};
  } else {
    IRIS_FAIL(kPrefix, "key '", k, "' has no documentation; add it to graph_config_key_doc");
  }
  if (!find_key(k)->deprecated) {
    // The default is what an empty input resolves to, so that the doc cannot drift from it.
    for (auto& [name, value] : graph_config_values(parse_graph_configs({})))
      if (name == k) {
        d.typed_default = value;
        const bool list = std::holds_alternative<std::vector<std::string>>(value) ||
                          std::holds_alternative<std::vector<int64_t>>(value);
        std::string text = graph_value_text(value);
        if (list) {
          for (size_t at = text.find(','); at != std::string::npos; at = text.find(',', at + 2))
            text.replace(at, 1, ", ");
          text = "[" + text + "]";
        }
        d.default_value = text;
      }
    IRIS_CHECK(!d.default_value.empty(), kPrefix, "graph_config_values has no key '", k, "'");
  }
  return d;
}

std::string graph_config_key_help(std::string_view key) {
  const GraphKeyDoc d = graph_config_key_doc(key);
  if (is_deprecated_graph_config_key(key)) return str_cat(d.doc, " (", d.type, ")");
  return str_cat(d.doc, " (", d.type, ", default ", d.default_value, ")");
}

std::string graph_config_flag_name(std::string_view key) {
  std::string flag = "--" + normalize_key(key);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

GraphConfigs parse_graph_configs(const GraphConfigInput& input) {
  const Values v(input);
  GraphConfigs cfg;
  cfg.language = parse_language(v, cfg.warnings);
  cfg.vision = parse_vision(v, cfg.warnings);
  return cfg;
}

GraphConfigInput graph_config_input_from_flags(
    const std::vector<std::pair<std::string, std::string>>& flags) {
  GraphConfigInput out;
  for (const auto& [raw_name, raw_value] : flags) {
    std::string name = raw_name;
    std::string value = raw_value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      IRIS_CHECK(trim(value).empty(), kPrefix, "flag '", raw_name, "' carries a value after '=' ",
                 "and another one ('", raw_value, "'); give it once");
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    const std::string key = normalize_key(name);
    if (!find_key(key)) fail_unknown_key(raw_name, key);
    if (trim(value).empty()) {
      IRIS_CHECK(key == "enable_cuda_graph" || key == "external_cuda_graph", kPrefix, "flag ",
                 graph_config_flag_name(key),
                 " needs a value; only the deprecated boolean flags --enable-cuda-graph and "
                 "--external-cuda-graph may be given alone");
      value = "true";
    }
    out.emplace_back(key, value);
  }
  return out;
}

void finalize_graph_configs(GraphConfigs& cfg, const GraphModelTraits& model) {
  validate_language(cfg.language);
  validate_vision(cfg.vision);

  if (!model.has_moe)
    for (GraphModule m : cfg.language.modules)
      IRIS_CHECK(
          m != GraphModule::moe && m != GraphModule::moe_router && m != GraphModule::moe_preprocess,
          kPrefix, "cuda_graph_modules '", to_string(m),
          "' needs MoE layers, but this model has none; valid values for it: attn, mlp "
          "(or an empty list for the whole layer)");

  const auto& lm = cfg.language.modules;
  IRIS_CHECK(!contains(lm, GraphModule::mlp) || model.has_dense_mlp, kPrefix,
             "cuda_graph_modules 'mlp' graphs dense MLPs, but every decoder layer of this model "
             "is MoE; use moe (with a static capacity) or moe_router,moe_preprocess");
  IRIS_CHECK(!contains(lm, GraphModule::moe) || !model.has_moe || model.moe_static_capacity,
             kPrefix,
             "cuda_graph_modules 'moe' graphs the whole MoE layer, which needs static per-expert "
             "shapes: set model.moe_expert_capacity_factor (e.g. 1.0) and "
             "model.moe_pad_expert_input_to_capacity=true (Megatron's drop-and-pad), or graph "
             "moe_router,moe_preprocess instead (dropless)");

  IRIS_CHECK(model.spatial_merge_size >= 1, kPrefix, "model spatial_merge_size ",
             model.spatial_merge_size, " must be >= 1");
  IRIS_CHECK(model.max_vision_seq_length >= 0, kPrefix, "model max_vision_seq_length ",
             model.max_vision_seq_length, " must be >= 0 (0 = unknown)");

  VisionGraphConfig& v = cfg.vision;
  const bool derived = v.max_seq_length == 0;
  const int64_t max = derived ? model.max_vision_seq_length : v.max_seq_length;
  IRIS_CHECK(v.impl == VisionGraphImpl::none || max > 0, kPrefix,
             "vision_cuda_graph_impl is local but max_vision_cuda_graph_seq_length is 0 and the "
             "model gives no maximum to derive it from; set max_vision_cuda_graph_seq_length "
             "(patches before the 2x2 merge, summed over the images of one encoder call)");

  // Padding rows must form whole merge windows wherever a merger runs inside the graph: the
  // deepstack mergers sit between encoder layers, and a block graph also holds the final merger.
  const int64_t unit = int64_t(model.spatial_merge_size) * model.spatial_merge_size;
  const bool need_whole_windows =
      model.has_deepstack || v.inference_scope == VisionGraphScope::block;
  const std::string why =
      model.has_deepstack ? "the model has deepstack mergers inside the encoder"
                          : "vision_inference_cuda_graph_scope is block (the graph includes the "
                            "patch merger)";
  if (need_whole_windows && max > 0)
    IRIS_CHECK(max % unit == 0, kPrefix, "max_vision_cuda_graph_seq_length ", max,
               derived ? " (derived from the model)" : "", " is not divisible by ", unit,
               " (spatial_merge_size ", model.spatial_merge_size, " squared), required because ",
               why, "; use ", max / unit * unit, " or ", (max / unit + 1) * unit,
               derived ? " explicitly" : "");
  for (int64_t b : v.buckets) {
    IRIS_CHECK(max == 0 || b <= max, kPrefix, "vision_cuda_graph_buckets ", join_ints(v.buckets),
               ": entry ", b, " is above max_vision_cuda_graph_seq_length ", max,
               "; drop it or raise the maximum");
    IRIS_CHECK(!need_whole_windows || b % unit == 0, kPrefix, "vision_cuda_graph_buckets ",
               join_ints(v.buckets), ": entry ", b, " is not divisible by ", unit,
               " (spatial_merge_size ", model.spatial_merge_size, " squared), required because ",
               why);
  }
  v.max_seq_length = max;
  if (v.buckets.empty() && max > 0) v.buckets = default_buckets(max);
}

std::vector<std::pair<std::string, GraphValue>> graph_config_values(const GraphConfigs& cfg) {
  const auto& l = cfg.language;
  const auto& v = cfg.vision;
  auto names = [](const std::vector<GraphModule>& modules) {
    std::vector<std::string> out;
    for (GraphModule m : modules) out.emplace_back(to_string(m));
    return out;
  };
  return {{"cuda_graph_impl", std::string(to_string(l.impl))},
          {"cuda_graph_modules", names(l.modules)},
          {"inference_cuda_graph_scope", std::string(to_string(l.inference_scope))},
          {"cuda_graph_warmup_steps", int64_t{l.warmup_steps}},
          {"vision_cuda_graph_impl", std::string(to_string(v.impl))},
          {"vision_cuda_graph_modules", names(v.modules)},
          {"vision_inference_cuda_graph_scope", std::string(to_string(v.inference_scope))},
          {"max_vision_cuda_graph_seq_length", v.max_seq_length},
          {"vision_cuda_graph_buckets", v.buckets},
          {"vision_cuda_graph_overflow", std::string(to_string(v.overflow))}};
}

std::string graph_value_text(const GraphValue& value) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return x;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(x);
        } else {
          std::string out;
          for (const auto& item : x) {
            if (!out.empty()) out += ",";
            if constexpr (std::is_same_v<std::decay_t<decltype(item)>, std::string>) {
              out += item;
            } else {
              out += std::to_string(item);
            }
          }
          return out;
        }
      },
      value);
}

std::optional<int64_t> choose_vision_bucket(const VisionGraphConfig& cfg, int64_t n_patches) {
  IRIS_CHECK(!cfg.buckets.empty(), kPrefix,
             "no vision buckets: call finalize_graph_configs() first (it derives them from "
             "max_vision_cuda_graph_seq_length)");
  IRIS_CHECK(n_patches > 0, kPrefix, "choose_vision_bucket needs a positive patch count, got ",
             n_patches);
  const auto it = std::lower_bound(cfg.buckets.begin(), cfg.buckets.end(), n_patches);
  if (it == cfg.buckets.end()) return std::nullopt;
  return *it;
}

}  // namespace iris
