// Python semantics of the renderer's values: truth, equality, str(), repr(), json.dumps and the
// UTF-8 string helpers that count code points as Python does.
#include <charconv>
#include <cmath>
#include <cstdio>

#include "chat_template/jinja_internal.h"

namespace iris::jinja {

void fail_at(int line, std::string message) {
  throw TemplateError{line, std::move(message)};
}

namespace {

thread_local RenderBudget* current_budget = nullptr;

}  // namespace

RenderBudgetScope::RenderBudgetScope(RenderBudget& budget) : previous_(current_budget) {
  current_budget = &budget;
}

RenderBudgetScope::~RenderBudgetScope() {
  current_budget = previous_;
}

void charge_steps(int64_t n) {
  RenderBudget* b = current_budget;
  if (b == nullptr) return;
  b->steps += n;
  if (b->steps > kMaxSteps)
    fail_at(b->line, "the template did not finish within " + std::to_string(kMaxSteps) +
                         " steps (a loop or macro that does not end?)");
}

void charge_bytes(size_t n) {
  RenderBudget* b = current_budget;
  if (b == nullptr) return;
  b->bytes += n;
  if (b->bytes > b->max_bytes)
    fail_at(b->line, "the template's values grow past " + std::to_string(b->max_bytes >> 20) +
                         " MiB in one render (it copies or builds text or lists without end?)");
}

Value::Value(const Value& o)
    // Charged before the text is copied, so a refused copy allocates nothing.
    : kind((charge_bytes(o.text.size()), o.kind)),
      boolean(o.boolean),
      integer(o.integer),
      real(o.real),
      text(o.text),
      items(o.items),
      dict(o.dict),
      macro(o.macro),
      closure(o.closure) {}

Value& Value::operator=(const Value& o) {
  if (this != &o) *this = Value(o);
  return *this;
}

Value Value::undefined(std::string what) {
  charge_bytes(what.size());
  Value v;
  v.text = std::move(what);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::none;
  return v;
}
Value Value::from_bool(bool b) {
  Value v;
  v.kind = Kind::boolean;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.kind = Kind::integer;
  v.integer = i;
  return v;
}
Value Value::from_real(double d) {
  Value v;
  v.kind = Kind::real;
  v.real = d;
  return v;
}
Value Value::from_string(std::string s) {
  charge_bytes(s.size());
  Value v;
  v.kind = Kind::string;
  v.text = std::move(s);
  return v;
}
Value Value::list(std::vector<Value> items) {
  charge_bytes(sizeof(Value) * items.size());
  Value v;
  v.kind = Kind::list;
  v.items = std::make_shared<std::vector<Value>>(std::move(items));
  return v;
}
Value Value::tuple(std::vector<Value> items) {
  Value v = list(std::move(items));
  v.kind = Kind::tuple;
  return v;
}
Value Value::new_dict() {
  Value v;
  v.kind = Kind::dict;
  v.dict = std::make_shared<Dict>();
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j, int line) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return from_bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return from_int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        fail_at(line, "an integer in the conversation is too large");
      return from_int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return from_real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return from_string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e, line));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = new_dict();
      // nlohmann keeps one entry per key.
      for (const auto& [k, e] : j.items()) d.dict->add_unique(k, from_json(e, line));
      return d;
    }
    default:
      fail_at(line, "binary data cannot be given to a chat template");
  }
}

const Value* Dict::find(std::string_view key) const {
  charge_steps(static_cast<int64_t>(entries.size()));
  for (const auto& [k, v] : entries)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  charge_steps(static_cast<int64_t>(entries.size()));
  for (auto& [k, old] : entries)
    if (k == key) {
      old = std::move(v);
      return;
    }
  add_unique(key, std::move(v));
}

void Dict::add_unique(std::string key, Value v) {
  charge_bytes(sizeof(entries[0]) + key.size());
  entries.emplace_back(std::move(key), std::move(v));
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return "Undefined";
    case Value::Kind::none:
      return "NoneType";
    case Value::Kind::boolean:
      return "bool";
    case Value::Kind::integer:
      return "int";
    case Value::Kind::real:
      return "float";
    case Value::Kind::string:
      return "str";
    case Value::Kind::list:
      return "list";
    case Value::Kind::tuple:
      return "tuple";
    case Value::Kind::dict:
      return "dict";
    case Value::Kind::ns:
      return "Namespace";
    case Value::Kind::macro:
      return "Macro";
    case Value::Kind::builtin:
    case Value::Kind::method:
      return "builtin_function_or_method";
    case Value::Kind::loop:
      return "LoopContext";
  }
  return "object";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      return false;
    case Value::Kind::boolean:
      return v.boolean;
    case Value::Kind::integer:
      return v.integer != 0;
    case Value::Kind::real:
      return v.real != 0;
    case Value::Kind::string:
      return !v.text.empty();
    case Value::Kind::list:
    case Value::Kind::tuple:
      return !v.items->empty();
    case Value::Kind::dict:
      return !v.dict->entries.empty();
    default:
      return true;
  }
}

namespace {

double as_double(const Value& v) {
  return v.kind == Value::Kind::real      ? v.real
         : v.kind == Value::Kind::integer ? static_cast<double>(v.integer)
                                          : (v.boolean ? 1.0 : 0.0);
}

}  // namespace

bool py_equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.is_number() && b.is_number()) {
    if (a.kind != K::real && b.kind != K::real) {
      const int64_t x = a.kind == K::integer ? a.integer : a.boolean;
      const int64_t y = b.kind == K::integer ? b.integer : b.boolean;
      return x == y;
    }
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::none:
      return true;
    case K::string:
      return a.text == b.text;
    case K::list:
    case K::tuple: {
      if (a.items->size() != b.items->size()) return false;
      charge_steps(static_cast<int64_t>(a.items->size()));
      for (size_t i = 0; i < a.items->size(); ++i)
        if (!py_equal((*a.items)[i], (*b.items)[i])) return false;
      return true;
    }
    case K::dict: {
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      charge_steps(static_cast<int64_t>(a.dict->entries.size()));
      for (const auto& [k, v] : a.dict->entries) {
        const Value* other = b.dict->find(k);
        if (other == nullptr || !py_equal(v, *other)) return false;
      }
      return true;
    }
    case K::ns:
      return a.dict == b.dict;
    case K::macro:
      return a.macro == b.macro;
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------------------------
// UTF-8

namespace {

size_t decode_at(std::string_view s, size_t i, uint32_t& cp) {
  const auto c = static_cast<uint8_t>(s[i]);
  size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  if (i + n > s.size()) n = s.size() - i;
  cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return n;
}

// Start of the code point ending at byte `end` (exclusive).
size_t start_before(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_decode(std::string_view s, size_t i, uint32_t& cp) {
  return decode_at(s, i, cp);
}

bool is_py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::vector<std::string> utf8_chars(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = decode_at(s, i, cp);
    out.emplace_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

size_t utf8_offset(std::string_view s, size_t index) {
  size_t i = 0;
  for (; i < s.size(); ++i)
    if ((static_cast<uint8_t>(s[i]) & 0xC0) != 0x80 && index-- == 0) return i;
  return i;
}

std::string strip_chars(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars != nullptr)
    for (size_t i = 0; i < chars->size();) {
      uint32_t cp;
      i += decode_at(*chars, i, cp);
      set.push_back(cp);
    }
  auto strip = [&](uint32_t cp) {
    if (chars == nullptr) return is_py_space(cp);
    for (uint32_t c : set)
      if (c == cp) return true;
    return false;
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e) {
      uint32_t cp;
      const size_t n = decode_at(s, b, cp);
      if (!strip(cp)) break;
      b += n;
    }
  if (right)
    while (e > b) {
      const size_t at = start_before(s, e);
      uint32_t cp;
      decode_at(s, at, cp);
      if (!strip(cp)) break;
      e = at;
    }
  return std::string(s.substr(b, e - b));
}

std::string rstrip_space(std::string_view s) {
  return strip_chars(s, nullptr, false, true);
}

size_t lstrip_space_length(std::string_view s) {
  // Called once per word by split(): a copy of the rest here made that quadratic.
  size_t b = 0;
  while (b < s.size()) {
    uint32_t cp;
    const size_t n = decode_at(s, b, cp);
    if (!is_py_space(cp)) break;
    b += n;
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// str(), repr(), json.dumps

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // The shortest digits that round-trip, placed as Python's repr places them: positional for
  // decimal exponents -4..15, scientific with a two-digit exponent otherwise.
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  const std::string sci(buf, res.ptr);
  const size_t e_at = sci.find('e');
  std::string mantissa = sci.substr(0, e_at);
  const int exponent = std::stoi(sci.substr(e_at + 1));
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    const int point = exponent + 1;  // digits before the decimal point
    if (point <= 0) {
      out += "0." + std::string(static_cast<size_t>(-point), '0') + digits;
    } else if (static_cast<size_t>(point) >= digits.size()) {
      out += digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(point)) + "." +
             digits.substr(static_cast<size_t>(point));
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char exp[16];
  std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + exp;
}

namespace {

// Characters repr() escapes: the controls, and the separators and format characters that are not
// printable. (Python also escapes unassigned code points, which need the Unicode tables.)
bool repr_escapes(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD || (is_py_space(cp) && cp != ' ') ||
         (cp >= 0x200B && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202E) ||
         (cp >= 0x2060 && cp <= 0x2064) || cp == 0xFEFF || (cp >= 0xE000 && cp <= 0xF8FF);
}

std::string repr_string(const std::string& s) {
  const bool single = s.find('\'') == std::string::npos || s.find('"') != std::string::npos;
  const char quote = single ? '\'' : '"';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = decode_at(s, i, cp);
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (repr_escapes(cp)) {
      char buf[16];
      std::snprintf(buf, sizeof(buf),
                    cp < 0x100     ? "\\x%02x"
                    : cp < 0x10000 ? "\\u%04x"
                                   : "\\U%08x",
                    cp);
      out += buf;
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += quote;
  return out;
}

void check_size(const std::string& s, int line) {
  if (s.size() > kMaxTextBytes) fail_at(line, str_size_message(s.size()));
}

}  // namespace

std::string str_size_message(size_t bytes) {
  return "the rendered text grows past " + std::to_string(kMaxTextBytes >> 20) + " MiB (" +
         std::to_string(bytes >> 20) + " MiB); the template may repeat itself without end";
}

std::string py_str(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return "";
    case Value::Kind::string:
      return v.text;
    default:
      return py_repr(v, line);
  }
}

namespace {

// Values nest only as deep as the template's literals and the conversation's JSON, except that a
// namespace can be stored inside itself.
constexpr int kMaxValueDepth = 200;

std::string repr_at(const Value& v, int line, int depth);

}  // namespace

std::string py_repr(const Value& v, int line) {
  return repr_at(v, line, 0);
}

namespace {

std::string repr_at(const Value& v, int line, int depth) {
  using K = Value::Kind;
  if (depth > kMaxValueDepth)
    fail_at(line, "a value nests more than " + std::to_string(kMaxValueDepth) +
                      " levels deep (a namespace stored inside itself?)");
  switch (v.kind) {
    case K::undefined:
      return "Undefined";
    case K::none:
      return "None";
    case K::boolean:
      return v.boolean ? "True" : "False";
    case K::integer:
      return std::to_string(v.integer);
    case K::real:
      return py_float_repr(v.real);
    case K::string:
      return repr_string(v.text);
    case K::list:
    case K::tuple: {
      std::string out = v.kind == K::list ? "[" : "(";
      for (size_t i = 0; i < v.items->size(); ++i) {
        if (i > 0) out += ", ";
        out += repr_at((*v.items)[i], line, depth + 1);
        check_size(out, line);
      }
      if (v.kind == K::tuple && v.items->size() == 1) out += ",";
      return out + (v.kind == K::list ? "]" : ")");
    }
    case K::dict:
    case K::ns: {
      std::string out = v.kind == K::ns ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, e] : v.dict->entries) {
        if (!first) out += ", ";
        first = false;
        out += repr_string(k) + ": " + repr_at(e, line, depth + 1);
        check_size(out, line);
      }
      return out + (v.kind == K::ns ? "}>" : "}");
    }
    case K::macro:
      return "<Macro '" + v.macro->targets[0] + "'>";
    case K::builtin:
    case K::method:
      return "<built-in function " + v.text + ">";
    case K::loop:
      return "<LoopContext " + std::to_string(v.integer + 1) + "/" +
             std::to_string(v.items->size()) + ">";
  }
  return "";
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<uint8_t>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void json_into(std::string& out, const Value& v, int line, int depth) {
  using K = Value::Kind;
  if (depth > kMaxValueDepth)
    fail_at(line,
            "tojson: a value nests more than " + std::to_string(kMaxValueDepth) + " levels deep");
  switch (v.kind) {
    case K::none:
      out += "null";
      return;
    case K::boolean:
      out += v.boolean ? "true" : "false";
      return;
    case K::integer:
      out += std::to_string(v.integer);
      return;
    case K::real:
      out += std::isnan(v.real)   ? "NaN"
             : std::isinf(v.real) ? (v.real < 0 ? "-Infinity" : "Infinity")
                                  : py_float_repr(v.real);
      return;
    case K::string:
      json_string(out, v.text);
      return;
    case K::list:
    case K::tuple:
      out += '[';
      for (size_t i = 0; i < v.items->size(); ++i) {
        if (i > 0) out += ", ";
        json_into(out, (*v.items)[i], line, depth + 1);
        check_size(out, line);
      }
      out += ']';
      return;
    case K::dict: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.dict->entries) {
        if (!first) out += ", ";
        first = false;
        json_string(out, k);
        out += ": ";
        json_into(out, e, line, depth + 1);
        check_size(out, line);
      }
      out += '}';
      return;
    }
    default:
      fail_at(line, "tojson: object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, int line) {
  std::string out;
  json_into(out, v, line, 0);
  return out;
}

}  // namespace iris::jinja
