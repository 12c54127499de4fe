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

// Parses `text`; errors name `source` ("config.json", "line 3 of train.jsonl") and say what is
// wrong in at most a few hundred characters.
nlohmann::json parse_json(std::string_view text, const std::string& source,
                          int max_depth = kMaxJsonDepth);
// Reads a regular file and parses it as above.
nlohmann::json read_json_file(const std::string& path, const std::string& what);

// The deepest nesting of arrays and objects in `text` (strings skipped), stopping once past
// `stop_after`. Linear, no recursion.
int json_nesting_depth(std::string_view text, int stop_after);

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
