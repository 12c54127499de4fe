#include "core/json_read.h"

#include <cmath>

#include "core/error.h"
#include "core/fs.h"

namespace iris {

using nlohmann::json;

int json_nesting_depth(std::string_view text, int stop_after) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) {
        deepest = depth;
        if (deepest > stop_after) return deepest;
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

int64_t json_value_count(std::string_view text) {
  // Every value is the root or a member of an array or object, and a container with k members
  // holds k - 1 commas: values = 1 + commas + containers that are not empty.
  int64_t commas = 0, non_empty = 0;
  bool in_string = false, escaped = false, just_opened = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (just_opened && c != ']' && c != '}') ++non_empty;
    just_opened = c == '[' || c == '{';
    if (c == '"')
      in_string = true;
    else if (c == ',')
      ++commas;
  }
  return text.find_first_not_of(" \t\n\r") == std::string_view::npos ? 0 : 1 + commas + non_empty;
}

void check_json_bounds(std::string_view text, const std::string& source, const JsonLimits& limits) {
  IRIS_CHECK(text.size() <= limits.max_bytes, source, " is ", text.size(), " bytes, more than the ",
             limits.max_bytes,
             " a file of this kind may hold; no valid one is that large, so it "
             "is corrupt or hostile");
  const int64_t values = json_value_count(text);
  IRIS_CHECK(values <= limits.max_values, source, " holds ", values,
             " JSON values (arrays, objects, strings, numbers), more than the ", limits.max_values,
             " a file of this kind may hold; no valid one has that many, so it is corrupt or "
             "hostile");
  const int depth = json_nesting_depth(text, kMaxJsonDepth);
  IRIS_CHECK(depth <= kMaxJsonDepth, source, " nests arrays and objects more than ", kMaxJsonDepth,
             " levels deep; no valid file of this kind does, so it is corrupt or hostile");
}

std::string clip_text(std::string_view text, size_t max_chars) {
  if (text.size() <= max_chars) return std::string(text);
  return std::string(text.substr(0, max_chars)) + "...";
}

std::string json_error_text(const std::exception& e) {
  std::string_view text = e.what();
  if (text.rfind("[json.exception.", 0) == 0) {
    const size_t end = text.find("] ");
    if (end != std::string_view::npos) text.remove_prefix(end + 2);
  }
  return clip_text(text);
}

json parse_json(std::string_view text, const std::string& source, const JsonLimits& limits) {
  check_json_bounds(text, source, limits);
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    IRIS_FAIL(source, " is not valid JSON (", json_error_text(e), ")");
  }
}

json read_json_file(const std::string& path, const std::string& what, const JsonLimits& limits) {
  return parse_json(read_text_file(path, what, limits.max_bytes), path, limits);
}

namespace {

// Appends to `out` until it holds `limit` characters; the walk stops there, and below a fixed
// depth, so its cost is bounded by the limit whatever the value.
void excerpt_into(const json& v, std::string& out, size_t limit, int depth) {
  if (out.size() >= limit) return;
  if (v.is_object() || v.is_array()) {
    if (depth >= 4) {
      out += v.is_object() ? "{...}" : "[...]";
      return;
    }
    out += v.is_object() ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (out.size() >= limit) return;
      if (!first) out += ", ";
      first = false;
      if (v.is_object())
        out +=
            json(clip_text(it.key(), limit)).dump(-1, ' ', false, json::error_handler_t::replace) +
            ": ";
      excerpt_into(it.value(), out, limit, depth + 1);
    }
    out += v.is_object() ? '}' : ']';
    return;
  }
  if (v.is_string()) {
    // A string's dump is linear in its length; clip first.
    const auto& s = v.get_ref<const std::string&>();
    out += json(s.size() > limit ? s.substr(0, limit) : s)
               .dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  out += v.dump();
}

}  // namespace

std::string json_excerpt(const json& value, size_t max_chars) {
  std::string out;
  excerpt_into(value, out, max_chars, 0);
  return clip_text(out, max_chars);
}

int64_t json_integer(const json& v, const std::string& where, const std::string& key, int64_t min,
                     int64_t max) {
  int64_t x = 0;
  bool ok = false;
  if (v.is_number_integer()) {
    // An unsigned value above INT64_MAX is out of every range we accept.
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) {
      IRIS_FAIL(where, ".", key, " = ", v.dump(), " is out of range: it must be between ", min,
                " and ", max);
    }
    x = v.get<int64_t>();
    ok = true;
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    // Some exporters write integers as 3136.0; a fraction is a mistake, not something to round.
    if (std::isfinite(d) && d == std::floor(d)) {
      IRIS_CHECK(d >= double(min) && d <= double(max), where, ".", key, " = ", json_excerpt(v),
                 " is out of range: it must be an integer between ", min, " and ", max);
      x = static_cast<int64_t>(d);
      ok = true;
    }
  }
  IRIS_CHECK(ok, where, ".", key, " must be an integer, got ", json_excerpt(v));
  IRIS_CHECK(x >= min && x <= max, where, ".", key, " = ", x,
             " is out of range: it must be between ", min, " and ", max);
  return x;
}

double json_real(const json& v, const std::string& where, const std::string& key, double min,
                 double max, bool min_exclusive) {
  IRIS_CHECK(v.is_number(), where, ".", key, " must be a number, got ", json_excerpt(v));
  const double d = v.get<double>();
  IRIS_CHECK(std::isfinite(d), where, ".", key, " must be finite, got ", json_excerpt(v));
  const bool above = min_exclusive ? d > min : d >= min;
  IRIS_CHECK(above && d <= max, where, ".", key, " = ", json_excerpt(v),
             " is out of range: it must be ", min_exclusive ? "greater than " : "at least ", min,
             " and at most ", max);
  return d;
}

bool json_boolean(const json& v, const std::string& where, const std::string& key) {
  IRIS_CHECK(v.is_boolean(), where, ".", key, " must be true or false, got ", json_excerpt(v));
  return v.get<bool>();
}

std::string json_string(const json& v, const std::string& where, const std::string& key) {
  IRIS_CHECK(v.is_string(), where, ".", key, " must be a string, got ", json_excerpt(v));
  return v.get<std::string>();
}

}  // namespace iris
