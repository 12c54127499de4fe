// The pieces of the Jinja renderer (chat_template/jinja.h) shared by its parser, its values and
// its evaluator. Not an interface for other code.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace iris::jinja {

// A failure inside the template, at `line`; Template turns it into an iris::Error that names the
// template.
struct TemplateError {
  int line = 0;
  std::string message;
};
[[noreturn]] void fail_at(int line, std::string message);

// Bounds that keep a hostile template from exhausting the stack, memory or time.
inline constexpr int kMaxNesting = 100;    // nested blocks and expressions while parsing
inline constexpr int kMaxMacroDepth = 64;  // macro calls inside macro calls
// Tokens, nodes and expressions made while parsing, each some tens to hundreds of bytes: the
// Qwen3-VL templates make about 1,300.
inline constexpr int64_t kMaxSyntaxElements = 200000;
// Nodes, expressions, loop iterations and elements compared or searched per render: a Qwen
// template spends about a hundred per message.
inline constexpr int64_t kMaxSteps = 5000000;
inline constexpr size_t kMaxTextBytes = size_t{64} << 20;  // any string, the output included
inline constexpr size_t kMaxListItems = size_t{1} << 20;
// Bytes of values one render may create: the text of every string made or copied (a string is
// copied, not shared, whenever a variable is read), the slots of every list and dict entry made.
// A scalar's copy is not counted, nor is a list's, which shares its items: the steps bound those.
// The budget is a fixed allowance, and more per byte of the variables for templates that build
// their prompt from the conversation piece by piece: the Qwen templates create 2 (Qwen2-VL,
// Qwen3-VL instruct) to 11 (Qwen3-VL thinking) bytes per byte of conversation.
inline constexpr size_t kRenderBytesAllowance = size_t{256} << 20;
inline constexpr size_t kRenderBytesPerContextByte = 32;

// The budget of the render running on this thread (see Renderer), charged by value creation and
// element walks wherever they happen; without a render running nothing is counted.
struct RenderBudget {
  int64_t steps = 0;
  size_t bytes = 0, max_bytes = kRenderBytesAllowance;
  int line = 0;  // where the render is, for errors raised below the evaluator
};
// Counts `n` steps; past kMaxSteps throws TemplateError at the budget's line.
void charge_steps(int64_t n);
// Counts `n` bytes of values created; past the budget throws TemplateError at its line.
void charge_bytes(size_t n);
// Makes `budget` the current thread's for the object's lifetime.
class RenderBudgetScope {
 public:
  explicit RenderBudgetScope(RenderBudget& budget);
  ~RenderBudgetScope();
  RenderBudgetScope(const RenderBudgetScope&) = delete;
  RenderBudgetScope& operator=(const RenderBudgetScope&) = delete;

 private:
  RenderBudget* previous_;
};

struct Node;
struct Dict;

// A Python value as jinja2 sees it. Lists, tuples, dicts and namespaces are shared (Python's
// reference semantics: a namespace updated inside a macro is the caller's namespace).
struct Value {
  enum class Kind {
    undefined,  // `text` says what was missing, for the error when it is used
    none,
    boolean,
    integer,
    real,
    string,
    list,
    tuple,
    dict,
    ns,       // namespace(): attributes assignable with {% set ns.x = ... %}
    macro,    // `macro` is its definition, `closure` the frame it was defined in
    builtin,  // a global function, named by `text`
    method,   // `text` bound to the object in items[0]
    loop,     // a for loop's `loop`: iteration `integer` over `items`
  };
  Value() = default;
  // A copy is charged its text to the render's byte budget before the text is copied; moves are
  // free.
  Value(const Value& other);
  Value(Value&&) noexcept = default;
  Value& operator=(const Value& other);
  Value& operator=(Value&&) noexcept = default;
  ~Value() = default;

  Kind kind = Kind::undefined;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;
  std::shared_ptr<std::vector<Value>> items;  // list, tuple, method
  std::shared_ptr<Dict> dict;                 // dict, ns
  const Node* macro = nullptr;
  std::shared_ptr<struct Frame> closure;

  static Value undefined(std::string what);
  static Value none();
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_real(double d);
  static Value from_string(std::string s);
  static Value list(std::vector<Value> v);
  static Value tuple(std::vector<Value> v);
  static Value new_dict();
  static Value from_json(const nlohmann::ordered_json& j, int line);

  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_string() const { return kind == Kind::string; }
  bool is_number() const {
    return kind == Kind::boolean || kind == Kind::integer || kind == Kind::real;
  }
  bool is_sequence() const { return kind == Kind::list || kind == Kind::tuple; }
};

// Insertion-ordered string keys, as Python dicts and JSON objects from transformers keep them.
// Lookups are linear, as the dicts of chat messages are small; each entry looked at is a render
// step, so a hostile dict of many keys costs steps rather than unbounded time.
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
  // For keys known to differ from every key already there (a JSON object's).
  void add_unique(std::string key, Value v);
};

// Python's type name of a value ("str", "list", "dict object" forms are built from it).
std::string type_name(const Value& v);
bool truthy(const Value& v);
bool py_equal(const Value& a, const Value& b);
// Python's str() and repr(); str() of undefined is "".
std::string py_str(const Value& v, int line);
std::string py_repr(const Value& v, int line);
std::string py_float_repr(double d);
// transformers' tojson: json.dumps(value, ensure_ascii=False).
std::string to_json(const Value& v, int line);

// Python string helpers on UTF-8 text (code points, not bytes, where Python counts characters).
// Decodes the code point at byte i of valid UTF-8 (templates are checked when parsed, the
// conversation by the tokenizer); returns its length in bytes.
size_t utf8_decode(std::string_view s, size_t i, uint32_t& code_point);
bool is_py_space(uint32_t code_point);
void append_utf8(std::string& out, uint32_t code_point);
// The error for text past kMaxTextBytes.
std::string str_size_message(size_t bytes);
std::vector<std::string> utf8_chars(std::string_view s);
size_t utf8_length(std::string_view s);
// Byte offset of code point `index` (0 <= index <= utf8_length(s)), by a walk from the start.
size_t utf8_offset(std::string_view s, size_t index);
std::string strip_chars(std::string_view s, const std::string* chars, bool left, bool right);
std::string rstrip_space(std::string_view s);
size_t lstrip_space_length(std::string_view s);  // bytes of leading whitespace

// ---------------------------------------------------------------------------------------------
// Syntax tree

struct Expr {
  enum class Op {
    literal,
    name,
    list,
    tuple,
    dict,     // args: key, value, key, value, ...
    attr,     // args[0].name
    item,     // args[0][args[1]]
    slice,    // args[0][args[1]:args[2]:args[3]], absent parts as null
    call,     // args[0](args[1..], kwargs)
    filter,   // name: filter; args[0] the value, then arguments
    test,     // name: test; args[0] the value, then arguments; negated
    not_,     // not args[0]
    neg,      // -args[0]
    pos,      // +args[0]
    binary,   // name: + - * / // % ~
    compare,  // args[0] ops[0] args[1] ops[1] args[2] ...: == != < <= > >= in notin
    and_,
    or_,
    cond,  // args[1] if args[0] else args[2] (args[2] may be null)
  };
  Op op = Op::literal;
  int line = 0;
  Value value;       // literal
  std::string name;  // name, attr, filter, test, binary operator
  bool negated = false;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<std::string> ops;  // compare
};

struct Node {
  enum class Kind { text, output, if_, for_, set, set_attr, macro, break_, continue_ };
  Kind kind = Kind::text;
  int line = 0;
  std::string text;                  // text
  std::unique_ptr<Expr> expr;        // output, set and set_attr value, for iterable
  std::vector<std::string> targets;  // set and for names; set_attr: object name; macro name
  std::string attr;                  // set_attr
  std::unique_ptr<Expr> filter;      // for ... if filter
  // if: (condition, body) per if/elif, then a null condition for else
  std::vector<std::pair<std::unique_ptr<Expr>, std::vector<std::unique_ptr<Node>>>> branches;
  std::vector<std::unique_ptr<Node>> body, else_body;                 // for, macro
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> params;  // macro; default or null
};

// Parses a whole template: the top-level nodes. Throws TemplateError.
std::vector<std::unique_ptr<Node>> parse_template(std::string_view source);

// Names of the supported filters and tests, checked when parsing.
bool is_supported_filter(std::string_view name);
bool is_supported_test(std::string_view name);

}  // namespace iris::jinja
