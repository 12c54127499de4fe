// The Jinja renderer against Hugging Face: every test conversation of every saved Qwen-VL chat
// template and every engine case of tests/data/chat_templates/golden.json
// (tools/make_chat_template_golden.py), then the errors a template must give: unsupported
// constructs and hostile templates fail naming the line, never crash or run away.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "chat_template/jinja.h"
#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"

namespace iris {
namespace {

using nlohmann::ordered_json;

const ordered_json& golden() {
  static const ordered_json g = ordered_json::parse(
      read_text_file(test::data_dir() + "/chat_templates/golden.json", "golden.json"));
  return g;
}

// What transformers passes besides the conversation: tools and documents (None), the tokenizer's
// special tokens (the golden's tokenizer was built with the fixture's), and the extra arguments.
ordered_json context_of(const ordered_json& c) {
  ordered_json ctx;
  ctx["messages"] = c["messages"];
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = c["add_generation_prompt"];
  const ordered_json cfg = ordered_json::parse(
      read_text_file(test::fixture_dir() + "/tokenizer_config.json", "tokenizer_config.json"));
  for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token"})
    if (cfg.contains(key) && cfg[key].is_string()) ctx[key] = cfg[key];
  for (const auto& [k, v] : c["kwargs"].items()) ctx[k] = v;
  return ctx;
}

void expect_case(const jinja::Template& t, const ordered_json& c, const std::string& what) {
  if (c.contains("error")) {
    EXPECT_THROW(t.render(context_of(c)), Error) << what << " (HF: " << c["error"] << ")";
    return;
  }
  try {
    EXPECT_EQ(t.render(context_of(c)), c["text"].get<std::string>()) << what;
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

TEST(ChatTemplate, GoldenRecordsItsGenerator) {
  const std::string gen = golden()["generator"];
  EXPECT_TRUE(gen.rfind("transformers ", 0) == 0 || gen.rfind("jinja2-imitation", 0) == 0) << gen;
  EXPECT_EQ(golden()["templates"].size(), 4u);
}

TEST(ChatTemplate, QwenTemplatesRenderEveryConversationAsTransformersDoes) {
  int cases = 0;
  for (const auto& entry : golden()["templates"]) {
    const std::string file = entry["file"];
    const std::string source =
        read_text_file(test::data_dir() + "/chat_templates/" + file, "chat template");
    const jinja::Template t(source, file);
    for (const auto& c : entry["cases"]) {
      expect_case(t, c, file + ": " + c["name"].get<std::string>());
      ++cases;
    }
  }
  EXPECT_GE(cases, 50);
}

TEST(ChatTemplate, EngineCasesRenderAsJinja2Does) {
  for (const auto& c : golden()["engine_cases"]) {
    const std::string name = c["name"];
    if (c.contains("error")) {
      // A syntax error fails when parsing, the others when rendering; either is an Error.
      EXPECT_THROW(jinja::Template(c["template"].get<std::string>(), name).render(context_of(c)),
                   Error)
          << name;
      continue;
    }
    try {
      const jinja::Template t(c["template"].get<std::string>(), name);
      expect_case(t, c, name);
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": " << e.what();
    }
  }
}

std::string render_error(const std::string& source, const ordered_json& ctx = ordered_json{}) {
  try {
    jinja::Template t(source, "test.jinja");
    t.render(ctx.is_null() ? ordered_json::object() : ctx);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for: " << source;
  return "";
}

TEST(ChatTemplate, UnsupportedConstructsNameTheTemplateAndLine) {
  EXPECT_EQ(render_error("a\nb\n{% include 'other.jinja' %}"),
            "test.jinja, line 3: the {% include %} tag is not supported by Iris's chat template "
            "renderer");
  EXPECT_EQ(render_error("{{ 'a' }}\n{{ messages|map(attribute='role')|join }}"),
            "test.jinja, line 2: the filter 'map' is not supported (Iris supports length, count, "
            "string, trim and tojson)");
  EXPECT_EQ(render_error("\n\n\n{% if x is divisibleby 3 %}{% endif %}"),
            "test.jinja, line 4: the test 'is divisibleby' is not supported");
  EXPECT_EQ(render_error("{% for x in [1] %}\n{{ 'a'.upper() }}{% endfor %}"),
            "test.jinja, line 2: the str method 'upper' is not supported by Iris's chat template "
            "renderer");
  EXPECT_EQ(render_error("{% raw %}x{% endraw %}"),
            "test.jinja, line 1: {% raw %} blocks are not supported");
  EXPECT_EQ(render_error("\n{% set x %}a{% endset %}"),
            "test.jinja, line 2: block assignments ({% set x %}...{% endset %}) are not "
            "supported");
  EXPECT_EQ(render_error("{{ range(3) }}"),
            "test.jinja, line 1: the function 'range' is not supported by Iris's chat template "
            "renderer");
  EXPECT_EQ(render_error("{{ 2 ** 3 }}"), "test.jinja, line 1: the ** operator is not supported");
  EXPECT_EQ(render_error("{% frob %}"), "test.jinja, line 1: unknown tag 'frob'");
}

TEST(ChatTemplate, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(render_error("x\n{% if true %}\nno end"),
            "test.jinja, line 2: this block is never closed: the template ends before {% elif %} "
            "or {% else %} or {% endif %}");
  EXPECT_EQ(render_error("{{ 'a' "), "test.jinja, line 1: a {{ tag is never closed with }}");
  EXPECT_EQ(render_error("\n{# open"), "test.jinja, line 2: a {# comment is never closed with #}");
  EXPECT_EQ(render_error("{{ (1 }}"), "test.jinja, line 1: unexpected '}', expected ')'");
  EXPECT_EQ(render_error("{% break %}"), "test.jinja, line 1: {% break %} outside a for loop");
  EXPECT_EQ(render_error("{{ 'a' + }}"), "test.jinja, line 1: expected a value, found }}");
  std::string sum = "{{ 1";
  for (int i = 0; i < 100000; ++i) sum += " + 1";
  EXPECT_NE(render_error(sum + " }}").find("more than 100 levels"), std::string::npos);
  EXPECT_EQ(render_error("{% endif %}"), "test.jinja, line 1: unknown tag 'endif'");
}

TEST(ChatTemplate, RenderErrorsNameTheLineAndSayWhat) {
  const ordered_json list_content = {
      {"messages", {{{"role", "user"}, {"content", {{{"type", "image"}}}}}}}};
  // Qwen3's text-only template on a message with an image, as transformers fails on it too.
  EXPECT_EQ(render_error("{% for m in messages %}\n{{ m.content.startswith('<') }}{% endfor %}",
                         list_content),
            "test.jinja, line 2: 'list object' has no attribute 'startswith'");
  EXPECT_EQ(render_error("\n{{ raise_exception('System message must be first.') }}"),
            "test.jinja, line 2: System message must be first.");
  EXPECT_EQ(render_error("{{ missing.field }}"), "test.jinja, line 1: 'missing' is undefined");
  EXPECT_EQ(render_error("{{ 'a' + 1 }}"),
            "test.jinja, line 1: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(render_error("{% set x = 1 %}{% set x.y = 2 %}"),
            "test.jinja, line 1: cannot assign attribute 'y' of 'x': it is not a namespace()");
  EXPECT_EQ(render_error("{% macro m(a) %}{% endmacro %}{{ m(a=1, b=2) }}"),
            "test.jinja, line 1: macro 'm' takes no keyword argument 'b'");
  EXPECT_EQ(render_error("{{ 1 // 0 }}"), "test.jinja, line 1: integer division or modulo by zero");
  EXPECT_EQ(render_error("{{ 9223372036854775807 + 1 }}"), "test.jinja, line 1: integer overflow");
}

TEST(ChatTemplate, HostileTemplatesFailInsteadOfRunningAway) {
  // Deep nesting: bounded before the parser's recursion could exhaust the stack.
  EXPECT_NE(render_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
                .find("nests blocks or expressions more than"),
            std::string::npos);
  std::string ifs;
  for (int i = 0; i < 500; ++i) ifs += "{% if true %}";
  EXPECT_NE(render_error(ifs).find("more than 100 levels"), std::string::npos);
  // Recursion.
  EXPECT_NE(render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}")
                .find("macros call each other more than 64 levels deep"),
            std::string::npos);
  // Text doubling without end.
  EXPECT_NE(render_error("{% set ns = namespace(s='ab') %}{% for i in messages %}"
                         "{% set ns.s = ns.s + ns.s %}{% endfor %}",
                         {{"messages", ordered_json::array_t(64, 1)}})
                .find("grows past 64 MiB"),
            std::string::npos);
  // Nested loops that would take forever.
  const std::string loops =
      "{% for a in l %}{% for b in l %}{% for c in l %}{% for d in l %}{% for e in l %}"
      "{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}";
  EXPECT_NE(render_error(loops, {{"l", ordered_json::array_t(40, 0)}})
                .find("did not finish within 5000000 steps"),
            std::string::npos);
  // A namespace stored inside itself, then printed.
  EXPECT_NE(render_error("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}")
                .find("nests more than 200 levels"),
            std::string::npos);
  EXPECT_NE(render_error(std::string("{{ 'caf\xC3") + "' }}").find("is not valid UTF-8"),
            std::string::npos);
}

TEST(ChatTemplate, RendersAreIndependentAndRepeatable) {
  // A template object is shared by the dataset's worker threads: state (namespaces, counters)
  // belongs to one render.
  const jinja::Template t(
      "{% set c = namespace(n=0) %}{% for m in messages %}{% set c.n = c.n + 1 %}{% endfor %}"
      "{{ c.n }}",
      "t");
  const ordered_json ctx = {{"messages", {1, 2, 3}}};
  EXPECT_EQ(t.render(ctx), "3");
  EXPECT_EQ(t.render(ctx), "3");
  const jinja::Template copy = t;
  EXPECT_EQ(copy.render(ctx), "3");
  EXPECT_EQ(copy.source_name(), "t");
}

}  // namespace
}  // namespace iris
