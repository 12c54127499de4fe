// A Jinja renderer for Hugging Face chat templates, limited to what the Qwen-VL family's templates
// use, and rendering them exactly as transformers does: jinja2's ImmutableSandboxedEnvironment
// with trim_blocks and lstrip_blocks, the loop controls, transformers' tojson, raise_exception and
// strftime_now.
//
// Supported: text, {{ }}, {% %} and {# #} with whitespace control (-, +); if/elif/else; for with
// an optional if filter, else, loop.index0/index/first/last/length/revindex/revindex0/previtem/
// nextitem, break and continue; set (names, name tuples and namespace attributes); macros with
// positional, keyword and default arguments; namespace(); the operators of Python expressions
// (and/or/not, comparisons, in, + - * / // % ~, a if b else c), subscripts and slices; list,
// tuple and dict literals; the filters length, count, string, trim and tojson; the tests defined,
// undefined, none, string, mapping, sequence, iterable, number, integer, float, boolean, true
// and false; the string methods startswith, endswith, split, strip, lstrip, rstrip and replace and
// the dict methods get, items, keys and values. Values follow Python: undefined variables print
// as nothing and fail when used further, as jinja2's default Undefined does.
//
// Anything else (include, extends, block, call, filter blocks, other filters, tests and methods)
// is an error naming the template and line. A template is untrusted input (it ships with a
// downloaded checkpoint): nesting, macro recursion, rendering steps and output size are bounded,
// so a hostile template fails instead of exhausting the stack, the memory or the time.
#pragma once

#include <cstddef>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace iris::jinja {

// The most bytes a template's source may have: Qwen-VL templates are 1 to 6 KB, the longest of
// other families some tens of KB.
inline constexpr size_t kMaxTemplateBytes = size_t{1} << 20;

class Template {
 public:
  // Parses `source`. `source_name` (a file name, "--chat-template-file x.jinja") is what errors
  // call the template; a syntax error or an unsupported construct throws iris::Error naming it and
  // the line.
  Template(std::string_view source, std::string source_name);
  ~Template();
  Template(const Template&);
  Template& operator=(const Template&);

  // Renders with `context`'s members as the template's variables (messages, add_generation_prompt,
  // ...), JSON values mapped to Python's (null is None). Thread safe. Throws iris::Error naming
  // the template and line when rendering fails, raise_exception() included.
  std::string render(const nlohmann::ordered_json& context) const;

  const std::string& source_name() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace iris::jinja
