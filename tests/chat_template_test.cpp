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
  for (int i = 0; i < 10000; ++i) sum += " + 1";
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
  // Text doubling without end: the string's own bound or the render's byte budget, whichever
  // its copies reach first.
  const std::string doubling = render_error(
      "{% set ns = namespace(s='ab') %}{% for i in messages %}"
      "{% set ns.s = ns.s + ns.s %}{% endfor %}",
      {{"messages", ordered_json::array_t(64, 1)}});
  EXPECT_TRUE(doubling.find("grows past 64 MiB") != std::string::npos ||
              doubling.find("values grow past 256 MiB") != std::string::npos)
      << doubling;
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

// The issue 42 cases, each at a size that fails in well under a second instead of taking
// gigabytes or minutes.
TEST(ChatTemplate, SourceIsBoundedInBytesAndSyntaxElements) {
  // A 53 MB template of {{ 1 }} tags took 5.1 GB while parsing.
  std::string tags;
  for (int i = 0; i < 140000; ++i) tags += "{{ 1 }}";
  std::string msg = render_error(std::string(tags.size() * 2, ' ') + tags);
  EXPECT_NE(msg.find("test.jinja is " + std::to_string(tags.size() * 3) +
                     " bytes, more than the 1 MiB a chat template may be"),
            std::string::npos)
      << msg;
  // Within the byte bound (1 MB), the tags still make too many tokens and nodes to hold.
  ASSERT_LT(tags.size(), size_t{1} << 20);
  msg = render_error(tags);
  EXPECT_NE(msg.find("test.jinja, line 1: the template has more than 200000 tags, names, values "
                     "and operators"),
            std::string::npos)
      << msg;
}

TEST(ChatTemplate, ValuesCreatedInOneRenderAreBounded) {
  const std::string big(size_t{2} << 20, 'x');  // 2 MiB: a budget of 256 + 32 * 2 MiB
  const ordered_json ctx = {{"s", big}};
  // A list literal of 200 references to the string (each read copies it: 400 MiB).
  std::string refs = "{% set l = [s";
  for (int i = 1; i < 200; ++i) refs += ", s";
  refs += "] %}{{ l|length }}";
  std::string msg = render_error(refs, ctx);
  EXPECT_NE(msg.find("test.jinja, line 1: the template's values grow past 320 MiB in one render"),
            std::string::npos)
      << msg;
  // A dict of 200 new strings of 2 MiB each.
  std::string dict = "{% set d = {'k0': s ~ 0";
  for (int i = 1; i < 200; ++i) dict += ", 'k" + std::to_string(i) + "': s ~ " + std::to_string(i);
  dict += "} %}{{ d|length }}";
  msg = render_error(dict, ctx);
  EXPECT_NE(msg.find("values grow past 320 MiB"), std::string::npos) << msg;
  // The same made by a loop, step by step.
  msg = render_error(
      "{% set ns = namespace(l=[]) %}{% for i in n %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}",
      {{"s", big}, {"n", ordered_json::array_t(1000, 0)}});
  EXPECT_NE(msg.find("values grow past 32"), std::string::npos) << msg;  // and n's slots
}

TEST(ChatTemplate, StringMethodsAreLinearAndListsBounded) {
  // split('a') on a string of one letter made a list of as many empty strings (out of memory at
  // 64 MiB); a list past 2^20 items is refused as it grows.
  std::string msg =
      render_error("{{ s.split('a')|length }}", {{"s", std::string((size_t{1} << 20) + 1, 'a')}});
  EXPECT_NE(msg.find("test.jinja, line 1: a list grows past 1048576 items"), std::string::npos)
      << msg;
  // split() copied the rest of the string after every word: 24 s for 2 MiB, quadratic beyond.
  std::string words;
  for (int i = 0; i < 350000; ++i) words += "ab ";
  EXPECT_EQ(jinja::Template("{{ s.split()|length }} {{ s.split(' ')|length }}", "t")
                .render({{"s", words}}),
            "350000 350001");
  // Indexing and slicing walk the string once, without a string per character.
  const std::string mixed = std::string(size_t{4} << 20, 'y') + "\xC3\xA9z";
  EXPECT_EQ(jinja::Template("{{ s[-2] }}{{ s[-3:] }}{{ s[::-1][:3] }}", "t").render({{"s", mixed}}),
            "\xC3\xA9y\xC3\xA9zz\xC3\xA9y");
  EXPECT_EQ(jinja::Template("{{ s.replace('', '-')|length }}", "t").render({{"s", words}}),
            std::to_string(words.size() * 2 + 1));
  // Comparing and searching lists counts every element as a step.
  msg = render_error(
      "{% set a = s.split(',') %}{% set b = s.split(',') %}"
      "{% for i in n %}{% if a == b and 'z' not in a %}{% endif %}{% endfor %}",
      {{"s", std::string(100000, ',')}, {"n", ordered_json::array_t(100, 0)}});
  EXPECT_NE(msg.find("did not finish within 5000000 steps"), std::string::npos) << msg;
}

TEST(ChatTemplate, ManyNamesAndManyLookupsEndAtTheStepBudget) {
  // 24,000 names set, then 5M steps that each look up one that is not there. Names live in a
  // map per scope (jinja_render.cpp's Frame), so a lookup costs a logarithm of the names, not a
  // scan of them (a scan took minutes here, which the suite's timeout would catch); the render
  // ends at the step budget with its error. No wall-clock bound: sanitizers and a loaded CI
  // machine stretch any.
  std::string source;
  for (int i = 0; i < 24000; ++i) source += "{% set a" + std::to_string(i) + " = 1 %}";
  source +=
      "{% for i in l %}{% for j in l %}{% for k in l %}{{ zz }}{% endfor %}{% endfor %}"
      "{% endfor %}";
  const std::string msg = render_error(source, {{"l", ordered_json::array_t(200, 0)}});
  EXPECT_NE(msg.find("did not finish within 5000000 steps"), std::string::npos) << msg;
}

TEST(ChatTemplate, ErrorsQuotingHugeValuesAreClipped) {
  const std::string msg =
      render_error("{{ raise_exception(s) }}", {{"s", std::string(size_t{1} << 20, 'q')}});
  EXPECT_LT(msg.size(), 1100u);
  EXPECT_NE(msg.find("test.jinja, line 1: qqq"), std::string::npos) << msg.substr(0, 100);
  EXPECT_NE(msg.find("... (1048576 bytes)"), std::string::npos) << msg.substr(900);
}

TEST(ChatTemplate, TheBudgetsLeaveLargeConversationsToTheQwenTemplates) {
  // Five messages of 1 MiB each (the thinking template creates about 11 bytes per byte).
  std::string text;
  while (text.size() < (size_t{1} << 20)) text += "word ";
  const ordered_json image = {{"type", "image"}};
  const ordered_json ctx = {
      {"messages",
       {{{"role", "system"}, {"content", text}},
        {{"role", "user"}, {"content", {image, {{"type", "text"}, {"text", text}}}}},
        {{"role", "assistant"}, {"content", "<think>\n" + text + "</think>\n\n" + text}},
        {{"role", "user"}, {"content", text}}}},
      {"tools", nullptr},
      {"add_generation_prompt", true}};
  for (const char* name : {"qwen2_vl", "qwen3_vl_instruct", "qwen3_vl_thinking"}) {
    const std::string path = test::data_dir() + "/chat_templates/" + name + ".jinja";
    const jinja::Template t(read_text_file(path), path);
    EXPECT_GT(t.render(ctx).size(), size_t{4} << 20) << name;
  }
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
