// Reading JSON that may come from a stranger: a nesting limit checked before nlohmann parses (its
// dump(), copies and comparisons recurse once per level), error text of bounded length, and typed
// field readers whose errors name the file and the key.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace iris {

// Deeper than any Hugging Face or Iris file (config.json nests 3 levels, tokenizer.json 5), far
// below what the recursive parts of nlohmann or our own walkers could overflow the stack with.
inline constexpr int kMaxJsonDepth = 64;

// What one kind of JSON input may hold. A parsed value costs nlohmann tens of bytes (an empty
// object about a hundred), so the byte bound alone lets a file of "{}," take 40 times its size in
// memory; the value count bounds that, and both are far above any genuine file of the kind.
struct JsonLimits {
  size_t max_bytes;
  int64_t max_values;  // arrays, objects, strings, numbers, booleans and nulls (not keys)
};
// config.json, tokenizer_config.json, generation_config.json, preprocessor_config.json, chat
// templates in JSON and Iris's own small files: kilobytes, a few hundred values.
inline constexpr JsonLimits kJsonConfigLimits{size_t{8} << 20, 1'000'000};
// model.safetensors.index.json: about 100 bytes and 2 values per tensor; a large MoE checkpoint
// lists some 40k tensors (4 MB).
inline constexpr JsonLimits kJsonCheckpointIndexLimits{size_t{64} << 20, 2'000'000};
// tokenizer.json: Qwen's is 11 MB with about 600k values (151k vocabulary entries, 151k merges
// of two strings each).
inline constexpr JsonLimits kJsonTokenizerLimits{size_t{64} << 20, 6'000'000};
// A safetensors header: the format's own 100 MB bound; about 10 values per tensor.
inline constexpr JsonLimits kJsonSafetensorsHeaderLimits{100'000'000, 4'000'000};
// One line of a JSONL data file: one sample's conversation and image paths.
inline constexpr JsonLimits kJsonLineLimits{size_t{16} << 20, 1'000'000};

// Parses `text`; errors name `source` ("config.json", "line 3 of train.jsonl") and say what is
// wrong in at most a few hundred characters. Text past `limits` is refused before nlohmann
// allocates anything for it.
nlohmann::json parse_json(std::string_view text, const std::string& source,
                          const JsonLimits& limits = kJsonConfigLimits);
// Reads a regular file and parses it as above; a file larger than `limits.max_bytes` is refused
// before it is read.
nlohmann::json read_json_file(const std::string& path, const std::string& what,
                              const JsonLimits& limits = kJsonConfigLimits);
// The checks parse_json makes before parsing (size, value count, nesting), for readers that
// parse `text` themselves (the tokenizer's SAX reader).
void check_json_bounds(std::string_view text, const std::string& source, const JsonLimits& limits);

// The deepest nesting of arrays and objects in `text` (strings skipped), stopping once past
// `stop_after`. Linear, no recursion.
int json_nesting_depth(std::string_view text, int stop_after);
// How many values `text` holds if it is valid JSON (strings skipped; keys not counted), counted
// in one linear pass without parsing. Invalid text gives some count; the parser rejects it later.
int64_t json_value_count(std::string_view text);

// A short rendering of a value for error messages: at most `max_chars` characters, never a walk of
// more of the value than that.
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 60);
// `text` cut to `max_chars` with an ellipsis (exception texts can quote whole tokens).
std::string clip_text(std::string_view text, size_t max_chars = 200);
// A nlohmann exception's message without its "[json.exception.type_error.302] " code, clipped:
// the part that says something to a user.
std::string json_error_text(const std::exception& e);

// Typed reads of one field. `where` names the file and the enclosing object, e.g.
// "config.json: text_config"; errors read "<where>.<key> must be ..., got <excerpt>".
// Integers must be JSON integers (an integral float such as 64.0 is accepted, 64.9, true and
// "64" are not) within [min, max].
int64_t json_integer(const nlohmann::json& value, const std::string& where, const std::string& key,
                     int64_t min, int64_t max);
// A finite number (not a boolean) within [min, max]; `min_exclusive` makes the lower bound strict.
double json_real(const nlohmann::json& value, const std::string& where, const std::string& key,
                 double min, double max, bool min_exclusive = false);
bool json_boolean(const nlohmann::json& value, const std::string& where, const std::string& key);
std::string json_string(const nlohmann::json& value, const std::string& where,
                        const std::string& key);

}  // namespace iris
