// Evaluation: jinja2's scoping (a for loop's iteration is a scope of its own, if blocks are not,
// a macro sees the scope it was defined in), its Undefined, and Python's operators and methods.
#include <time.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "chat_template/jinja.h"
#include "chat_template/jinja_internal.h"
#include "core/error.h"

namespace iris::jinja {

struct Frame {
  std::shared_ptr<Frame> parent;
  // A map, not a list: a template can set tens of thousands of names, and every name read looks
  // here.
  std::map<std::string, Value, std::less<>> vars;

  Value* find_here(std::string_view name) {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : &it->second;
  }
  const Value* lookup(std::string_view name) {
    for (Frame* f = this; f != nullptr; f = f->parent.get())
      if (const Value* v = f->find_here(name)) return v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    if (Value* old = find_here(name)) {
      *old = std::move(v);
      return;
    }
    vars.emplace(name, std::move(v));
  }
};

struct Template::Impl {
  std::string name;
  std::vector<std::unique_ptr<Node>> nodes;
};

namespace {

using Nodes = std::vector<std::unique_ptr<Node>>;
using FramePtr = std::shared_ptr<Frame>;

bool valid_utf8(std::string_view s, size_t& bad_at) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      n = 1;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4, min = 0x10000;
    } else {
      bad_at = i;
      return false;
    }
    if (i + n > s.size()) {
      bad_at = i;
      return false;
    }
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) {
        bad_at = i;
        return false;
      }
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      bad_at = i;
      return false;
    }
    i += n;
  }
  return true;
}

const std::set<std::string, std::less<>> kStrMethods = {
    "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
    "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
    "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
    "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
    "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
    "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
    "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
    "swapcase",     "title",       "translate", "upper",      "zfill"};
const std::set<std::string, std::less<>> kDictMethods = {
    "clear", "copy",    "fromkeys",   "get",    "items", "keys",
    "pop",   "popitem", "setdefault", "update", "values"};
const std::set<std::string, std::less<>> kListMethods = {"append", "clear",   "copy",   "count",
                                                         "extend", "index",   "insert", "pop",
                                                         "remove", "reverse", "sort"};
const std::set<std::string, std::less<>> kBuiltins = {"namespace", "raise_exception",
                                                      "strftime_now"};
// jinja2's other globals: present there, so a template using them gets "not supported" rather
// than "undefined".
const std::set<std::string, std::less<>> kUnsupportedGlobals = {"range", "dict", "lipsum", "cycler",
                                                                "joiner"};

// "'dict object'" as jinja2 names the owner of a missing attribute.
std::string owner(const Value& v) {
  if (v.kind == Value::Kind::none) return "'None'";
  return "'" + type_name(v) + " object'";
}

// Binds by moving: a string's method called on a fresh value must not copy the string again.
Value method(Value self, const std::string& name) {
  Value m;
  m.kind = Value::Kind::method;
  m.text = name;
  m.items = std::make_shared<std::vector<Value>>();
  m.items->push_back(std::move(self));
  return m;
}

int64_t as_int(const Value& v, int line, const char* what) {
  if (v.kind == Value::Kind::integer) return v.integer;
  if (v.kind == Value::Kind::boolean) return v.boolean;
  fail_at(line, std::string(what) + " must be an integer, not " + type_name(v));
}

double as_real(const Value& v) {
  return v.kind == Value::Kind::real      ? v.real
         : v.kind == Value::Kind::integer ? static_cast<double>(v.integer)
                                          : (v.boolean ? 1.0 : 0.0);
}

// Python's slice.indices(length): the walk from `begin` by `step` while before `end`.
struct SliceWalk {
  int64_t begin, end, step;
  bool more(int64_t i) const { return step > 0 ? i < end : i > end; }
  int64_t count() const {
    if (!more(begin)) return 0;
    return step > 0 ? (end - begin + step - 1) / step : (begin - end - step - 1) / -step;
  }
};

SliceWalk slice_walk(int64_t length, const Value& start, const Value& stop, const Value& step_v,
                     int line) {
  const int64_t step = step_v.kind == Value::Kind::none ? 1 : as_int(step_v, line, "a slice step");
  if (step == 0) fail_at(line, "slice step cannot be zero");
  auto bound = [&](const Value& v, int64_t dflt) {
    if (v.kind == Value::Kind::none) return dflt;
    int64_t i = as_int(v, line, "a slice index");
    if (i < 0) {
      i += length;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= length) {
      i = step < 0 ? length - 1 : length;
    }
    return i;
  };
  return {bound(start, step < 0 ? length - 1 : 0), bound(stop, step < 0 ? -1 : length), step};
}

// Walks the string once, without a copy per character (a 16 MiB string once became 16 million
// strings here).
Value string_char_at(const std::string& s, int64_t index) {
  const auto n = static_cast<int64_t>(utf8_length(s));
  const int64_t i = index < 0 ? index + n : index;
  if (i < 0 || i >= n) return Value::undefined("string index out of range");
  const size_t at = utf8_offset(s, static_cast<size_t>(i));
  uint32_t cp;
  return Value::from_string(s.substr(at, utf8_decode(s, at, cp)));
}

class Renderer {
 public:
  explicit Renderer(const Template::Impl& t) : t_(t) {}
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;
  // Values are shared, and two things can hold themselves: a frame holding a macro whose closure is
  // that frame, and a namespace assigned into itself (or a value holding it). Emptying every
  // frame a macro closed over and every namespace when the render ends breaks such cycles.
  ~Renderer() {
    for (const std::weak_ptr<Frame>& w : closures_)
      if (FramePtr f = w.lock()) {
        f->vars.clear();
        f->parent.reset();
      }
    for (const std::weak_ptr<Dict>& w : namespaces_)
      if (std::shared_ptr<Dict> d = w.lock()) d->entries.clear();
  }

  std::string run(const nlohmann::ordered_json& context) {
    const RenderBudgetScope scope(budget_);
    auto root = std::make_shared<Frame>();
    if (!context.is_object()) fail_at(1, "the template's variables must be a JSON object");
    // The variables are the caller's, bounded where they were read; what they take sets how much
    // more the template may make.
    budget_.max_bytes = SIZE_MAX;
    for (const auto& [k, v] : context.items()) root->set(k, Value::from_json(v, 1));
    budget_.max_bytes = kRenderBytesAllowance + kRenderBytesPerContextByte * budget_.bytes;
    budget_.bytes = 0;
    std::string out;
    render(t_.nodes, root, out);
    return out;
  }

 private:
  enum class Flow { normal, break_loop, continue_loop };

  void step(int line) {
    budget_.line = line;
    charge_steps(1);
  }

  static void append(std::string& out, const std::string& s, int line) {
    if (out.size() + s.size() > kMaxTextBytes)
      fail_at(line, str_size_message(out.size() + s.size()));
    out += s;
  }

  Flow render(const Nodes& nodes, const FramePtr& frame, std::string& out) {
    for (const auto& n : nodes) {
      step(n->line);
      switch (n->kind) {
        case Node::Kind::text:
          append(out, n->text, n->line);
          break;
        case Node::Kind::output:
          append(out, py_str(eval(*n->expr, frame), n->line), n->line);
          break;
        case Node::Kind::if_:
          for (const auto& [cond, body] : n->branches)
            if (!cond || truthy(eval(*cond, frame))) {
              const Flow f = render(body, frame, out);
              if (f != Flow::normal) return f;
              break;
            }
          break;
        case Node::Kind::for_: {
          const Flow f = render_for(*n, frame, out);
          if (f != Flow::normal) return f;
          break;
        }
        case Node::Kind::set:
          assign(n->targets, eval(*n->expr, frame), *frame, n->line);
          break;
        case Node::Kind::set_attr: {
          const Value* target = frame->lookup(n->targets[0]);
          if (target == nullptr || target->kind != Value::Kind::ns)
            fail_at(n->line, "cannot assign attribute '" + n->attr + "' of '" + n->targets[0] +
                                 "': it is not a namespace()");
          target->dict->set(n->attr, eval(*n->expr, frame));
          break;
        }
        case Node::Kind::macro: {
          Value m;
          m.kind = Value::Kind::macro;
          m.macro = n.get();
          m.closure = frame;
          if (closures_.empty() || closures_.back().lock() != frame) closures_.push_back(frame);
          frame->set(n->targets[0], std::move(m));
          break;
        }
        case Node::Kind::break_:
          return Flow::break_loop;
        case Node::Kind::continue_:
          return Flow::continue_loop;
      }
    }
    return Flow::normal;
  }

  static void assign(const std::vector<std::string>& targets, Value v, Frame& frame, int line) {
    if (targets.size() == 1) {
      frame.set(targets[0], std::move(v));
      return;
    }
    if (!v.is_sequence() && !v.is_string())
      fail_at(line, "cannot unpack a " + type_name(v) + " into " + std::to_string(targets.size()) +
                        " names");
    const size_t count = v.is_string() ? utf8_length(v.text) : v.items->size();
    if (count != targets.size())
      fail_at(line, "cannot unpack " + std::to_string(count) + " values into " +
                        std::to_string(targets.size()) + " names");
    std::vector<Value> parts;
    if (v.is_sequence()) {
      parts = *v.items;
    } else {
      for (std::string& c : utf8_chars(v.text)) parts.push_back(Value::from_string(std::move(c)));
    }
    for (size_t i = 0; i < targets.size(); ++i) frame.set(targets[i], std::move(parts[i]));
  }

  // The items a for loop walks. A list or tuple is walked in place (a template cannot change
  // one), not copied.
  static std::shared_ptr<std::vector<Value>> iterate(const Value& v, int line) {
    auto items = std::make_shared<std::vector<Value>>();
    switch (v.kind) {
      case Value::Kind::undefined:
        return items;
      case Value::Kind::list:
      case Value::Kind::tuple:
        return v.items;
      case Value::Kind::dict:
        charge_bytes(sizeof(Value) * v.dict->entries.size());
        for (const auto& [k, e] : v.dict->entries) items->push_back(Value::from_string(k));
        return items;
      case Value::Kind::string: {
        const size_t length = utf8_length(v.text);
        if (length > kMaxListItems)
          fail_at(line, "a loop over the characters of a string of more than " +
                            std::to_string(kMaxListItems) + " characters");
        charge_bytes(sizeof(Value) * length);
        for (std::string& c : utf8_chars(v.text))
          items->push_back(Value::from_string(std::move(c)));
        return items;
      }
      default:
        fail_at(line, "'" + type_name(v) + "' object is not iterable");
    }
  }

  Flow render_for(const Node& n, const FramePtr& frame, std::string& out) {
    std::shared_ptr<std::vector<Value>> items = iterate(eval(*n.expr, frame), n.line);
    if (n.filter) {
      auto kept = std::make_shared<std::vector<Value>>();
      for (const Value& item : *items) {
        step(n.line);
        auto scope = std::make_shared<Frame>();
        scope->parent = frame;
        assign(n.targets, item, *scope, n.line);
        if (truthy(eval(*n.filter, scope))) kept->push_back(item);
      }
      items = std::move(kept);
    }
    if (items->empty()) return render(n.else_body, frame, out);
    Value loop;
    loop.kind = Value::Kind::loop;
    loop.items = std::move(items);
    const auto length = static_cast<int64_t>(loop.items->size());
    for (int64_t i = 0; i < length; ++i) {
      step(n.line);
      auto scope = std::make_shared<Frame>();
      scope->parent = frame;
      assign(n.targets, (*loop.items)[static_cast<size_t>(i)], *scope, n.line);
      loop.integer = i;
      scope->set("loop", loop);
      const Flow f = render(n.body, scope, out);
      if (f == Flow::break_loop) break;
    }
    return Flow::normal;
  }

  // ---------------------------------------------------------------------------------------------
  // Expressions

  Value eval(const Expr& e, const FramePtr& frame) {
    step(e.line);
    switch (e.op) {
      case Expr::Op::literal:
        return e.value;
      case Expr::Op::name: {
        if (const Value* v = frame->lookup(e.name)) return *v;
        if (kBuiltins.count(e.name) || kUnsupportedGlobals.count(e.name)) {
          Value b;
          b.kind = Value::Kind::builtin;
          b.text = e.name;
          return b;
        }
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case Expr::Op::list:
      case Expr::Op::tuple: {
        std::vector<Value> items;
        for (const auto& a : e.args) items.push_back(eval(*a, frame));
        return e.op == Expr::Op::list ? Value::list(std::move(items))
                                      : Value::tuple(std::move(items));
      }
      case Expr::Op::dict: {
        Value d = Value::new_dict();
        for (size_t i = 0; i < e.args.size(); i += 2) {
          const Value k = eval(*e.args[i], frame);
          if (!k.is_string()) fail_at(e.line, "dict keys must be strings here");
          d.dict->set(k.text, eval(*e.args[i + 1], frame));
        }
        return d;
      }
      case Expr::Op::attr:
        return get_attr(eval(*e.args[0], frame), e.name, e.line);
      case Expr::Op::item:
        return get_item(eval(*e.args[0], frame), eval(*e.args[1], frame), e.line);
      case Expr::Op::slice: {
        const Value obj = eval(*e.args[0], frame);
        Value parts[3];
        for (int k = 0; k < 3; ++k)
          parts[k] = e.args[k + 1] ? eval(*e.args[k + 1], frame) : Value::none();
        return slice(obj, parts[0], parts[1], parts[2], e.line);
      }
      case Expr::Op::call:
        return call(e, frame);
      case Expr::Op::filter:
        return filter(e, frame);
      case Expr::Op::test: {
        const bool r = test(e, frame);
        return Value::from_bool(e.negated ? !r : r);
      }
      case Expr::Op::not_:
        return Value::from_bool(!truthy(eval(*e.args[0], frame)));
      case Expr::Op::neg:
      case Expr::Op::pos:
        return unary(e.op == Expr::Op::neg, eval(*e.args[0], frame), e.line);
      case Expr::Op::binary:
        return binary(e.name, eval(*e.args[0], frame), eval(*e.args[1], frame), e.line);
      case Expr::Op::compare: {
        Value left = eval(*e.args[0], frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], frame);
          if (!compare(e.ops[i], left, right, e.line)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case Expr::Op::and_: {
        Value a = eval(*e.args[0], frame);
        return truthy(a) ? eval(*e.args[1], frame) : a;
      }
      case Expr::Op::or_: {
        Value a = eval(*e.args[0], frame);
        return truthy(a) ? a : eval(*e.args[1], frame);
      }
      case Expr::Op::cond:
        if (truthy(eval(*e.args[0], frame))) return eval(*e.args[1], frame);
        if (e.args[2]) return eval(*e.args[2], frame);
        return Value::undefined(
            "the inline if-expression evaluated to false and no else section was defined");
    }
    fail_at(e.line, "internal: unknown expression");
  }

  // jinja2's sandboxed getattr: a Python attribute (a method) first, then the item.
  static Value get_attr(Value obj, const std::string& name, int line) {
    switch (obj.kind) {
      case Value::Kind::undefined:
        fail_at(line, obj.text);
      case Value::Kind::string:
        if (kStrMethods.count(name)) return method(std::move(obj), name);
        break;
      case Value::Kind::dict:
        if (kDictMethods.count(name)) return method(std::move(obj), name);
        if (const Value* v = obj.dict->find(name)) return *v;
        break;
      case Value::Kind::ns:
        if (const Value* v = obj.dict->find(name)) return *v;
        break;
      case Value::Kind::list:
        if (kListMethods.count(name)) return method(std::move(obj), name);
        break;
      case Value::Kind::tuple:
        if (name == "count" || name == "index") return method(std::move(obj), name);
        break;
      case Value::Kind::loop:
        return loop_attr(obj, name, line);
      default:
        break;
    }
    return Value::undefined(owner(obj) + " has no attribute '" + name + "'");
  }

  static Value loop_attr(const Value& loop, const std::string& name, int line) {
    const int64_t i = loop.integer;
    const auto n = static_cast<int64_t>(loop.items->size());
    if (name == "index0") return Value::from_int(i);
    if (name == "index") return Value::from_int(i + 1);
    if (name == "revindex0") return Value::from_int(n - i - 1);
    if (name == "revindex") return Value::from_int(n - i);
    if (name == "first") return Value::from_bool(i == 0);
    if (name == "last") return Value::from_bool(i == n - 1);
    if (name == "length") return Value::from_int(n);
    if (name == "depth") return Value::from_int(1);
    if (name == "depth0") return Value::from_int(0);
    if (name == "previtem")
      return i > 0 ? (*loop.items)[static_cast<size_t>(i - 1)]
                   : Value::undefined("there is no previous item");
    if (name == "nextitem")
      return i + 1 < n ? (*loop.items)[static_cast<size_t>(i + 1)]
                       : Value::undefined("there is no next item");
    if (name == "cycle" || name == "changed")
      fail_at(line, "loop." + name + "() is not supported by Iris's chat template renderer");
    return Value::undefined("'LoopContext object' has no attribute '" + name + "'");
  }

  // jinja2's sandboxed getitem: the item first, then (for a string key) the attribute.
  static Value get_item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) fail_at(line, obj.text);
    const bool int_key = key.kind == Value::Kind::integer || key.kind == Value::Kind::boolean;
    if (int_key && obj.is_sequence()) {
      const auto n = static_cast<int64_t>(obj.items->size());
      int64_t i = key.kind == Value::Kind::integer ? key.integer : key.boolean;
      if (i < 0) i += n;
      if (i >= 0 && i < n) return (*obj.items)[static_cast<size_t>(i)];
      return Value::undefined(owner(obj) + " has no element " + py_str(key, line));
    }
    if (int_key && obj.is_string()) return string_char_at(obj.text, as_int(key, line, "an index"));
    if (key.is_string() && (obj.kind == Value::Kind::dict || obj.kind == Value::Kind::ns))
      if (const Value* v = obj.dict->find(key.text)) return *v;
    if (key.is_string()) {
      Value attr = get_attr(obj, key.text, line);
      if (!attr.is_undefined()) return attr;
    }
    return Value::undefined(owner(obj) + " has no attribute " + py_repr(key, line));
  }

  static Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step,
                     int line) {
    if (obj.is_undefined()) fail_at(line, obj.text);
    if (obj.is_string()) {
      const std::string& s = obj.text;
      const size_t length = utf8_length(s);
      const SliceWalk w = slice_walk(static_cast<int64_t>(length), start, stop, step, line);
      std::string out;
      if (length == s.size()) {  // ASCII: characters are bytes
        for (int64_t i = w.begin; w.more(i); i += w.step) out += s[static_cast<size_t>(i)];
        return Value::from_string(std::move(out));
      }
      // Where each character starts, once, rather than a string per character.
      charge_bytes(sizeof(uint32_t) * (length + 1));
      std::vector<uint32_t> starts;
      starts.reserve(length + 1);
      for (size_t i = 0; i < s.size(); ++i)
        if ((static_cast<uint8_t>(s[i]) & 0xC0) != 0x80) starts.push_back(static_cast<uint32_t>(i));
      starts.push_back(static_cast<uint32_t>(s.size()));
      for (int64_t i = w.begin; w.more(i); i += w.step) {
        const auto k = static_cast<size_t>(i);
        out.append(s, starts[k], starts[k + 1] - starts[k]);
      }
      return Value::from_string(std::move(out));
    }
    if (obj.is_sequence()) {
      const SliceWalk w =
          slice_walk(static_cast<int64_t>(obj.items->size()), start, stop, step, line);
      std::vector<Value> out;
      out.reserve(static_cast<size_t>(w.count()));
      for (int64_t i = w.begin; w.more(i); i += w.step)
        out.push_back((*obj.items)[static_cast<size_t>(i)]);
      return obj.kind == Value::Kind::list ? Value::list(std::move(out))
                                           : Value::tuple(std::move(out));
    }
    fail_at(line, "'" + type_name(obj) + "' object is not subscriptable");
  }

  // ---------------------------------------------------------------------------------------------
  // Calls

  struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;
  };

  Args eval_args(const Expr& e, size_t first, const FramePtr& frame) {
    Args a;
    for (size_t i = first; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i], frame));
    for (const auto& [k, v] : e.kwargs) a.keyword.emplace_back(k, eval(*v, frame));
    return a;
  }

  // The arguments of a Python function with parameters `names` (the first `required` of them
  // without defaults): each given one in its slot, absent ones as undefined.
  static std::vector<Value> bind(const std::string& fn, const std::vector<std::string>& names,
                                 size_t required, Args a, int line) {
    if (a.positional.size() > names.size())
      fail_at(line, fn + "() takes at most " + std::to_string(names.size()) + " argument" +
                        (names.size() == 1 ? "" : "s") + " (" +
                        std::to_string(a.positional.size()) + " given)");
    std::vector<Value> out(names.size(), Value::undefined("not given"));
    std::vector<bool> given(names.size(), false);
    for (size_t i = 0; i < a.positional.size(); ++i) {
      out[i] = std::move(a.positional[i]);
      given[i] = true;
    }
    for (auto& [k, v] : a.keyword) {
      const auto it = std::find(names.begin(), names.end(), k);
      if (it == names.end())
        fail_at(line, fn + "() got an unexpected keyword argument '" + k + "'");
      const auto i = static_cast<size_t>(it - names.begin());
      if (given[i]) fail_at(line, fn + "() got multiple values for argument '" + k + "'");
      out[i] = std::move(v);
      given[i] = true;
    }
    for (size_t i = 0; i < required; ++i)
      if (!given[i]) fail_at(line, fn + "() is missing the argument '" + names[i] + "'");
    return out;
  }

  Value call(const Expr& e, const FramePtr& frame) {
    const Value callee = eval(*e.args[0], frame);
    Args a = eval_args(e, 1, frame);
    switch (callee.kind) {
      case Value::Kind::undefined:
        fail_at(e.line, callee.text);
      case Value::Kind::macro:
        return call_macro(callee, std::move(a), e.line);
      case Value::Kind::builtin:
        return call_builtin(callee.text, std::move(a), e.line);
      case Value::Kind::method:
        return call_method((*callee.items)[0], callee.text, std::move(a), e.line);
      default:
        fail_at(e.line, "'" + type_name(callee) + "' object is not callable");
    }
  }

  Value call_macro(const Value& m, Args a, int line) {
    const Node& def = *m.macro;
    const std::string& name = def.targets[0];
    if (a.positional.size() > def.params.size())
      fail_at(line, "macro '" + name + "' takes not more than " +
                        std::to_string(def.params.size()) + " argument(s)");
    if (++macro_depth_ > kMaxMacroDepth)
      fail_at(line, "macros call each other more than " + std::to_string(kMaxMacroDepth) +
                        " levels deep (a recursion that does not end?)");
    auto scope = std::make_shared<Frame>();
    scope->parent = m.closure;
    std::vector<bool> given(def.params.size(), false);
    for (size_t i = 0; i < a.positional.size(); ++i) {
      scope->set(def.params[i].first, std::move(a.positional[i]));
      given[i] = true;
    }
    for (auto& [k, v] : a.keyword) {
      size_t i = 0;
      while (i < def.params.size() && def.params[i].first != k) ++i;
      if (i == def.params.size())
        fail_at(line, "macro '" + name + "' takes no keyword argument '" + k + "'");
      if (given[i])
        fail_at(line, "macro '" + name + "' got multiple values for argument '" + k + "'");
      scope->set(k, std::move(v));
      given[i] = true;
    }
    for (size_t i = 0; i < def.params.size(); ++i) {
      if (given[i]) continue;
      const auto& [param, dflt] = def.params[i];
      scope->set(param, dflt ? eval(*dflt, scope)
                             : Value::undefined("parameter '" + param + "' was not provided"));
    }
    std::string out;
    render(def.body, scope, out);
    --macro_depth_;
    return Value::from_string(std::move(out));
  }

  Value call_builtin(const std::string& name, Args a, int line) {
    if (name == "namespace") {
      Value ns;
      ns.kind = Value::Kind::ns;
      ns.dict = std::make_shared<Dict>();
      namespaces_.push_back(ns.dict);
      if (a.positional.size() > 1)
        fail_at(line, "namespace() takes at most one positional argument");
      if (!a.positional.empty()) {
        const Value& init = a.positional[0];
        if (init.kind != Value::Kind::dict)
          fail_at(line, "namespace() takes a dict as its positional argument");
        for (const auto& [k, v] : init.dict->entries) ns.dict->set(k, v);
      }
      for (auto& [k, v] : a.keyword) ns.dict->set(k, std::move(v));
      return ns;
    }
    if (name == "raise_exception") {
      const std::vector<Value> v = bind(name, {"message"}, 1, std::move(a), line);
      fail_at(line, py_str(v[0], line));
    }
    if (name == "strftime_now") {
      const std::vector<Value> v = bind(name, {"format"}, 1, std::move(a), line);
      if (!v[0].is_string()) fail_at(line, "strftime_now() takes a format string");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      const size_t n = std::strftime(buf, sizeof(buf), v[0].text.c_str(), &tm);
      if (n == 0 && !v[0].text.empty())
        fail_at(line, "strftime_now(): the format gives no text or more than 511 bytes");
      return Value::from_string(std::string(buf, n));
    }
    fail_at(line, "the function '" + name + "' is not supported by Iris's chat template renderer");
  }

  static Value call_method(const Value& self, const std::string& name, Args a, int line) {
    if (self.is_string()) return string_method(self.text, name, std::move(a), line);
    if (self.kind == Value::Kind::dict) {
      const Dict& d = *self.dict;
      if (name == "get") {
        std::vector<Value> v = bind("get", {"key", "default"}, 1, std::move(a), line);
        if (v[0].is_string())
          if (const Value* found = d.find(v[0].text)) return *found;
        return v[1].is_undefined() ? Value::none() : v[1];
      }
      if (name == "items" || name == "keys" || name == "values") {
        bind(name, {}, 0, std::move(a), line);
        std::vector<Value> out;
        for (const auto& [k, v] : d.entries)
          out.push_back(name == "keys"     ? Value::from_string(k)
                        : name == "values" ? v
                                           : Value::tuple({Value::from_string(k), v}));
        return Value::list(std::move(out));
      }
    }
    fail_at(line, "the " + type_name(self) + " method '" + name +
                      "' is not supported by Iris's chat template renderer");
  }

  static Value string_method(const std::string& s, const std::string& name, Args a, int line) {
    auto string_arg = [&](const Value& v, const char* what) -> const std::string& {
      if (!v.is_string())
        fail_at(line, name + "() " + what + " must be a string, not " + type_name(v));
      return v.text;
    };
    if (name == "startswith" || name == "endswith") {
      const std::vector<Value> v = bind(name, {"prefix"}, 1, std::move(a), line);
      std::vector<std::string> options;
      if (v[0].kind == Value::Kind::tuple) {
        for (const Value& o : *v[0].items) options.push_back(string_arg(o, "arguments"));
      } else {
        options.push_back(string_arg(v[0], "argument"));
      }
      for (const std::string& o : options) {
        const bool hit = o.size() <= s.size() &&
                         (name == "startswith" ? s.compare(0, o.size(), o) == 0
                                               : s.compare(s.size() - o.size(), o.size(), o) == 0);
        if (hit) return Value::from_bool(true);
      }
      return Value::from_bool(false);
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const std::vector<Value> v = bind(name, {"chars"}, 0, std::move(a), line);
      const bool given = !v[0].is_undefined() && v[0].kind != Value::Kind::none;
      const std::string* chars = given ? &string_arg(v[0], "argument") : nullptr;
      return Value::from_string(strip_chars(s, chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "split") {
      const std::vector<Value> v = bind(name, {"sep", "maxsplit"}, 0, std::move(a), line);
      const bool by_space = v[0].is_undefined() || v[0].kind == Value::Kind::none;
      int64_t maxsplit = v[1].is_undefined() ? -1 : as_int(v[1], line, "split()'s maxsplit");
      std::vector<Value> parts;
      if (by_space) {
        // Runs of whitespace separate words; with maxsplit reached, the rest is the last word,
        // its trailing whitespace kept (Python's rule).
        size_t i = lstrip_space_length(s);
        while (i < s.size()) {
          if (maxsplit == 0) {
            parts.push_back(Value::from_string(s.substr(i)));
            break;
          }
          size_t end = i;
          while (end < s.size()) {
            uint32_t cp;
            const size_t n = utf8_decode(s, end, cp);
            if (is_py_space(cp)) break;
            end += n;
          }
          parts.push_back(Value::from_string(s.substr(i, end - i)));
          check_list_size(parts.size(), line);
          if (maxsplit > 0) --maxsplit;
          i = end + lstrip_space_length(std::string_view(s).substr(end));
        }
      } else {
        const std::string& sep = string_arg(v[0], "separator");
        if (sep.empty()) fail_at(line, "split(): empty separator");
        size_t i = 0;
        for (;;) {
          const size_t at = maxsplit == 0 ? std::string::npos : s.find(sep, i);
          if (at == std::string::npos) {
            parts.push_back(Value::from_string(s.substr(i)));
            break;
          }
          parts.push_back(Value::from_string(s.substr(i, at - i)));
          check_list_size(parts.size(), line);
          i = at + sep.size();
          if (maxsplit > 0) --maxsplit;
        }
      }
      return Value::list(std::move(parts));
    }
    if (name == "replace") {
      const std::vector<Value> v = bind(name, {"old", "new", "count"}, 2, std::move(a), line);
      const std::string& from = string_arg(v[0], "argument");
      const std::string& to = string_arg(v[1], "argument");
      int64_t count = v[2].is_undefined() ? -1 : as_int(v[2], line, "replace()'s count");
      std::string out;
      if (from.empty()) {
        // Python inserts `to` before every character and at the end.
        for (size_t i = 0; i < s.size();) {
          if (count != 0) {
            out += to;
            if (count > 0) --count;
          }
          uint32_t cp;
          const size_t n = utf8_decode(s, i, cp);
          out.append(s, i, n);
          i += n;
          if (out.size() > kMaxTextBytes) fail_at(line, str_size_message(out.size()));
        }
        if (count != 0) out += to;
        return Value::from_string(std::move(out));
      }
      size_t i = 0;
      for (;;) {
        const size_t at = count == 0 ? std::string::npos : s.find(from, i);
        if (at == std::string::npos) break;
        out.append(s, i, at - i);
        out += to;
        if (out.size() > kMaxTextBytes) fail_at(line, str_size_message(out.size()));
        i = at + from.size();
        if (count > 0) --count;
      }
      out.append(s, i, std::string::npos);
      return Value::from_string(std::move(out));
    }
    fail_at(line,
            "the str method '" + name + "' is not supported by Iris's chat template renderer");
  }

  // ---------------------------------------------------------------------------------------------
  // Filters and tests

  Value filter(const Expr& e, const FramePtr& frame) {
    Value v = eval(*e.args[0], frame);
    Args a = eval_args(e, 1, frame);
    const std::string& f = e.name;
    if (f == "length" || f == "count") {
      bind(f, {}, 0, std::move(a), e.line);
      switch (v.kind) {
        case Value::Kind::undefined:
          return Value::from_int(0);
        case Value::Kind::string:
          return Value::from_int(static_cast<int64_t>(utf8_length(v.text)));
        case Value::Kind::list:
        case Value::Kind::tuple:
          return Value::from_int(static_cast<int64_t>(v.items->size()));
        case Value::Kind::dict:
          return Value::from_int(static_cast<int64_t>(v.dict->entries.size()));
        default:
          fail_at(e.line, "object of type '" + type_name(v) + "' has no len()");
      }
    }
    if (f == "string") {
      bind(f, {}, 0, std::move(a), e.line);
      return Value::from_string(py_str(v, e.line));
    }
    if (f == "trim") {
      const std::vector<Value> c = bind(f, {"chars"}, 0, std::move(a), e.line);
      const bool given = !c[0].is_undefined() && c[0].kind != Value::Kind::none;
      if (given && !c[0].is_string()) fail_at(e.line, "trim(): chars must be a string");
      return Value::from_string(
          strip_chars(py_str(v, e.line), given ? &c[0].text : nullptr, true, true));
    }
    if (f == "tojson") {
      if (!a.positional.empty() || !a.keyword.empty())
        fail_at(e.line, "tojson's arguments (indent, separators, ...) are not supported");
      if (v.is_undefined()) fail_at(e.line, "tojson: " + v.text);
      return Value::from_string(to_json(v, e.line));
    }
    fail_at(e.line, "the filter '" + f + "' is not supported");
  }

  bool test(const Expr& e, const FramePtr& frame) {
    const Value v = eval(*e.args[0], frame);
    if (e.args.size() > 1 || !e.kwargs.empty())
      fail_at(e.line, "the test 'is " + e.name + "' takes no arguments");
    using K = Value::Kind;
    const std::string& t = e.name;
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.kind == K::none;
    if (t == "string") return v.is_string();
    if (t == "mapping") return v.kind == K::dict;
    // jinja2's Undefined has a length and an item lookup (that fails), so it is a sequence too.
    if (t == "sequence")
      return v.is_string() || v.is_sequence() || v.kind == K::dict || v.is_undefined();
    if (t == "iterable")
      return v.is_string() || v.is_sequence() || v.kind == K::dict || v.is_undefined();
    if (t == "number") return v.is_number();
    if (t == "integer") return v.kind == K::integer;
    if (t == "float") return v.kind == K::real;
    if (t == "boolean") return v.kind == K::boolean;
    if (t == "true") return v.kind == K::boolean && v.boolean;
    if (t == "false") return v.kind == K::boolean && !v.boolean;
    fail_at(e.line, "the test 'is " + t + "' is not supported");
  }

  // ---------------------------------------------------------------------------------------------
  // Operators

  static void check_list_size(size_t items, int line) {
    if (items > kMaxListItems)
      fail_at(line, "a list grows past " + std::to_string(kMaxListItems) + " items");
  }

  static Value unary(bool negate, const Value& v, int line) {
    if (v.is_undefined()) fail_at(line, v.text);
    if (v.kind == Value::Kind::real) return Value::from_real(negate ? -v.real : v.real);
    if (v.kind == Value::Kind::integer || v.kind == Value::Kind::boolean) {
      const int64_t i = v.kind == Value::Kind::integer ? v.integer : v.boolean;
      if (negate && i == INT64_MIN) fail_at(line, "integer overflow");
      return Value::from_int(negate ? -i : i);
    }
    fail_at(line, std::string("bad operand type for unary ") + (negate ? "-" : "+") + ": '" +
                      type_name(v) + "'");
  }

  static Value binary(const std::string& op, const Value& a, const Value& b, int line) {
    using K = Value::Kind;
    if (op == "~") {
      std::string s = py_str(a, line);
      s += py_str(b, line);
      if (s.size() > kMaxTextBytes) fail_at(line, str_size_message(s.size()));
      return Value::from_string(std::move(s));
    }
    if (a.is_undefined()) fail_at(line, a.text);
    if (b.is_undefined()) fail_at(line, b.text);
    const bool ints = (a.kind == K::integer || a.kind == K::boolean) &&
                      (b.kind == K::integer || b.kind == K::boolean);
    const int64_t x = a.kind == K::integer ? a.integer : a.boolean;
    const int64_t y = b.kind == K::integer ? b.integer : b.boolean;
    const auto unsupported = [&]() {
      fail_at(line, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                        type_name(b) + "'");
    };
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        if (a.text.size() + b.text.size() > kMaxTextBytes)
          fail_at(line, str_size_message(a.text.size() + b.text.size()));
        return Value::from_string(a.text + b.text);
      }
      if (a.is_string() || a.kind == K::list || a.kind == K::tuple) {
        if (a.kind == b.kind) {
          if (a.items->size() + b.items->size() > kMaxListItems)
            fail_at(line, "a list grows past " + std::to_string(kMaxListItems) + " items");
          std::vector<Value> items = *a.items;
          items.insert(items.end(), b.items->begin(), b.items->end());
          return a.kind == K::list ? Value::list(std::move(items)) : Value::tuple(std::move(items));
        }
        fail_at(line, "can only concatenate " + type_name(a) + " (not \"" + type_name(b) +
                          "\") to " + type_name(a));
      }
      if (!a.is_number() || !b.is_number()) unsupported();
      if (ints) {
        int64_t r;
        if (__builtin_add_overflow(x, y, &r)) fail_at(line, "integer overflow");
        return Value::from_int(r);
      }
      return Value::from_real(as_real(a) + as_real(b));
    }
    if (a.is_string() && (op == "%" || op == "*"))
      fail_at(line, "string " + std::string(op == "%" ? "formatting with %" : "repetition with *") +
                        " is not supported by Iris's chat template renderer");
    if (!a.is_number() || !b.is_number()) unsupported();
    if (op == "-" || op == "*") {
      if (ints) {
        int64_t r;
        const bool overflow =
            op == "-" ? __builtin_sub_overflow(x, y, &r) : __builtin_mul_overflow(x, y, &r);
        if (overflow) fail_at(line, "integer overflow");
        return Value::from_int(r);
      }
      return Value::from_real(op == "-" ? as_real(a) - as_real(b) : as_real(a) * as_real(b));
    }
    if ((ints && y == 0) || (!ints && as_real(b) == 0))
      fail_at(line, op == "/" ? "division by zero" : "integer division or modulo by zero");
    if (op == "/") return Value::from_real(as_real(a) / as_real(b));
    if (op == "//") {
      if (ints) {
        if (x == INT64_MIN && y == -1) fail_at(line, "integer overflow");
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value::from_int(q);
      }
      return Value::from_real(std::floor(as_real(a) / as_real(b)));
    }
    if (op == "%") {
      if (ints) {
        if (y == -1) return Value::from_int(0);
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value::from_int(r);
      }
      double r = std::fmod(as_real(a), as_real(b));
      if (r != 0 && ((r < 0) != (as_real(b) < 0))) r += as_real(b);
      return Value::from_real(r);
    }
    unsupported();
    return Value();
  }

  static bool less(const Value& a, const Value& b, int line) {
    if (a.is_undefined()) fail_at(line, a.text);
    if (b.is_undefined()) fail_at(line, b.text);
    if (a.is_number() && b.is_number()) {
      if (a.kind != Value::Kind::real && b.kind != Value::Kind::real)
        return (a.kind == Value::Kind::integer ? a.integer : a.boolean) <
               (b.kind == Value::Kind::integer ? b.integer : b.boolean);
      return as_real(a) < as_real(b);
    }
    if (a.is_string() && b.is_string()) return a.text < b.text;  // UTF-8 keeps code point order
    if (a.kind == b.kind && a.is_sequence()) {
      const size_t n = std::min(a.items->size(), b.items->size());
      charge_steps(static_cast<int64_t>(n));
      for (size_t i = 0; i < n; ++i)
        if (!py_equal((*a.items)[i], (*b.items)[i]))
          return less((*a.items)[i], (*b.items)[i], line);
      return a.items->size() < b.items->size();
    }
    fail_at(line, "'<' not supported between instances of '" + type_name(a) + "' and '" +
                      type_name(b) + "'");
  }

  static bool contains(const Value& container, const Value& item, int line) {
    switch (container.kind) {
      case Value::Kind::undefined:
        return false;
      case Value::Kind::string:
        if (!item.is_string())
          fail_at(line, "'in <string>' requires string as left operand, not " + type_name(item));
        return container.text.find(item.text) != std::string::npos;
      case Value::Kind::list:
      case Value::Kind::tuple:
        charge_steps(static_cast<int64_t>(container.items->size()));
        for (const Value& v : *container.items)
          if (py_equal(v, item)) return true;
        return false;
      case Value::Kind::dict:
        if (item.kind == Value::Kind::list || item.kind == Value::Kind::dict)
          fail_at(line, "unhashable type: '" + type_name(item) + "'");
        return item.is_string() && container.dict->find(item.text) != nullptr;
      default:
        fail_at(line, "argument of type '" + type_name(container) + "' is not iterable");
    }
  }

  static bool compare(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return py_equal(a, b);
    if (op == "!=") return !py_equal(a, b);
    if (op == "<") return less(a, b, line);
    if (op == ">") return less(b, a, line);
    if (op == "<=") return !less(b, a, line);
    if (op == ">=") return !less(a, b, line);
    if (op == "in") return contains(b, a, line);
    return !contains(b, a, line);  // notin
  }

  const Template::Impl& t_;
  RenderBudget budget_;
  int macro_depth_ = 0;
  std::vector<std::weak_ptr<Frame>> closures_;
  std::vector<std::weak_ptr<Dict>> namespaces_;
};

[[noreturn]] void throw_named(const std::string& name, const TemplateError& e) {
  // raise_exception() and the undefined-value messages quote the template's own values, which
  // can be megabytes: an error is for reading.
  constexpr size_t kMaxMessage = 1000;
  std::string message = e.message;
  if (message.size() > kMaxMessage) {
    size_t cut = kMaxMessage;
    while (cut > 0 && (static_cast<uint8_t>(message[cut]) & 0xC0) == 0x80) --cut;  // whole chars
    message = message.substr(0, cut) + "... (" + std::to_string(message.size()) + " bytes)";
  }
  throw Error(str_cat(name, ", line ", e.line, ": ", message));
}

}  // namespace

Template::Template(std::string_view source, std::string source_name) {
  auto impl = std::make_shared<Impl>();
  impl->name = std::move(source_name);
  if (source.size() > kMaxTemplateBytes)
    throw Error(str_cat(impl->name, " is ", source.size(), " bytes, more than the ",
                        kMaxTemplateBytes >> 20,
                        " MiB a chat template may be (Qwen-VL's are under 10 KB); it is corrupt "
                        "or not a chat template"));
  size_t bad_at = 0;
  if (!valid_utf8(source, bad_at))
    throw Error(str_cat(impl->name, " is not valid UTF-8 (byte ", bad_at, ")"));
  try {
    impl->nodes = parse_template(source);
  } catch (const TemplateError& e) {
    throw_named(impl->name, e);
  }
  impl_ = std::move(impl);
}

Template::~Template() = default;
Template::Template(const Template&) = default;
Template& Template::operator=(const Template&) = default;

const std::string& Template::source_name() const {
  return impl_->name;
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  try {
    return Renderer(*impl_).run(context);
  } catch (const TemplateError& e) {
    throw_named(impl_->name, e);
  }
}

}  // namespace iris::jinja
