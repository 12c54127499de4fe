#!/usr/bin/env python3
"""Render the chat templates of tests/data/chat_templates/ the way Hugging Face does, for
tests/chat_template_test.cpp.

Writes tests/data/chat_templates/golden.json: for every template, each test conversation rendered
by HF transformers' apply_chat_template (tokenize=False), plus small templates ("engine cases")
that pin down one Jinja construct each (scoping, whitespace control, filters, tests, string
methods) and the errors Iris must also raise.

With transformers installed (the GPU machine), run from the repository root:

    python3 tools/make_chat_template_golden.py

It reads tests/data/qwen3vl-tiny/tokenizer.json (scripts/fetch_tokenizer.sh puts it there) and
tokenizer_config.json, and downloads nothing. Without transformers, --jinja-only renders with
jinja2 set up as transformers sets it up (an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, loop controls, transformers' tojson, raise_exception and strftime_now) and says so
in the file ("generator"), so that goldens made that way can be told from the real ones.

--check-model DIR (repeatable) instead compares the saved templates with the chat template of a
local checkpoint directory (chat_template.jinja, chat_template.json or tokenizer_config.json),
reports which saved file, if any, it equals, and writes nothing.
"""
import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE_DIR = os.path.join(ROOT, "tests", "data", "chat_templates")
FIXTURE = os.path.join(ROOT, "tests", "data", "qwen3vl-tiny")

# name -> file; "text_only": the template cannot take list content (Qwen3's text template calls
# content.startswith), so only conversations without images are rendered with it.
TEMPLATES = [
    {"name": "qwen3_vl_instruct", "file": "qwen3_vl_instruct.jinja", "text_only": False},
    {"name": "qwen3_vl_thinking", "file": "qwen3_vl_thinking.jinja", "text_only": False},
    {"name": "qwen2_vl", "file": "qwen2_vl.jinja", "text_only": False},
    {"name": "qwen3", "file": "qwen3.jinja", "text_only": True},
]

IMAGE = {"type": "image"}


def text(t):
    return {"type": "text", "text": t}


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
THOUGHT = "<think>\nThe shape is round and red.\n</think>\n\nA red circle."

# Each: name, messages, add_generation_prompt, extra template kwargs.
CONVERSATIONS = [
    ("system_user_text",
     [SYSTEM, {"role": "user", "content": "Write one sentence about CUDA graphs."}], True, {}),
    ("user_text_only", [{"role": "user", "content": "Hello"}], True, {}),
    ("user_image_text",
     [{"role": "user", "content": [IMAGE, text("What is in this picture?")]}], True, {}),
    ("two_images",
     [{"role": "user", "content": [IMAGE, IMAGE, text("Describe these two pictures.")]}], True, {}),
    ("text_between_images",
     [SYSTEM, {"role": "user", "content": [text("First "), IMAGE, text(", then "), IMAGE,
                                            text(". Which is larger?")]}], True, {}),
    ("multi_turn",
     [SYSTEM,
      {"role": "user", "content": [IMAGE, text("What is this?")]},
      {"role": "assistant", "content": "A red circle."},
      {"role": "user", "content": "And its size?"},
      {"role": "assistant", "content": "Small."},
      {"role": "user", "content": [IMAGE, text("And this one?")]}], True, {}),
    ("multi_turn_closed",
     [{"role": "user", "content": [IMAGE, text("What is this?")]},
      {"role": "assistant", "content": "A red circle."},
      {"role": "user", "content": "And its size?"},
      {"role": "assistant", "content": "Small."}], False, {}),
    ("text_multi_turn",
     [SYSTEM,
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."},
      {"role": "user", "content": "Bye"}], True, {}),
    ("no_generation_prompt", [{"role": "user", "content": "Hi"}], False, {}),
    ("thinking_off", [{"role": "user", "content": "Hi"}], True, {"enable_thinking": False}),
    ("thinking_on", [{"role": "user", "content": "Hi"}], True, {"enable_thinking": True}),
    ("thinking_history",
     [{"role": "user", "content": [IMAGE, text("What shape is it?")]},
      {"role": "assistant", "content": THOUGHT},
      {"role": "user", "content": "And its colour?"}], True, {}),
    ("thinking_history_closed",
     [{"role": "user", "content": [IMAGE, text("What shape is it?")]},
      {"role": "assistant", "content": THOUGHT}], False, {}),
    ("text_thinking_history",
     [{"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
      {"role": "user", "content": "And 3+3?"}], True, {"enable_thinking": False}),
    ("text_thinking_closed",
     [{"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."}], False, {}),
    ("add_vision_id",
     [{"role": "user", "content": [IMAGE, text("Compare with "), IMAGE]},
      {"role": "assistant", "content": "They differ."},
      {"role": "user", "content": [IMAGE, text("And this?")]}], True, {"add_vision_id": True}),
    ("unicode_and_whitespace",
     [{"role": "system", "content": "  Réponds en français.\n"},
      {"role": "user", "content": [IMAGE, text("\n日本語 naïve café — ok?  \n")]}], True, {}),
]

# Small templates for one construct each: (name, template, messages, add_generation_prompt,
# kwargs). An expected error is recorded as such; Iris must fail on it too.
M2 = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
ENGINE_CASES = [
    ("trim_and_lstrip_blocks", "a\n  {% if true %}\n  x\n  {% endif %}\nb\n", M2, False, {}),
    ("minus_strips_newlines", "  {{ 'a' }}\n  {% if true -%}\n  b\n{%- endif %}\n\n", M2, False,
     {}),
    ("plus_keeps_indent", "  {%+ if true %}x{% endif +%}\ny", M2, False, {}),
    ("comments", "{# c #}\n  {# d #}\nx{#- e -#}  y", M2, False, {}),
    ("trailing_newline_dropped", "{{ 'a' }}\n\n", M2, False, {}),
    ("crlf_newlines", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", M2, False, {}),
    ("loop_scoping",
     "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}",
     M2, False, {}),
    ("loop_set_does_not_carry",
     "{% for i in [1, 2] %}{% if i == 2 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}",
     M2, False, {}),
    ("if_set_leaks", "{% if true %}{% set z = 3 %}{% endif %}{{ z }}", M2, False, {}),
    ("namespace",
     "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
     "{% set ns.s = ns.s ~ m.role %}{% endfor %}{{ ns.n }} {{ ns.s }}", M2, False, {}),
    ("loop_fields",
     "{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
     "{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }};{% endfor %}", M2, False, {}),
    ("loop_prev_next",
     "{% for m in ['a', 'b', 'c'] %}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}",
     M2, False, {}),
    ("nested_loops",
     "{% for a in [1, 2] %}{% for b in [3] %}{{ loop.index0 }}{{ a }}{% endfor %}"
     "{{ loop.last }}{% endfor %}", M2, False, {}),
    ("loop_filter_else",
     "{% for m in messages if m.role == 'user' %}{{ loop.length }}{{ m.content }}"
     "{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", M2, False, {}),
    ("loop_controls",
     "{% for i in [1, 2, 3, 4] %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}"
     "{% break %}{% endif %}{{ i }}{% endfor %}", M2, False, {}),
    ("loop_over_dict_and_string",
     "{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}|{% for c in 'xyz' %}{{ c }}.{% endfor %}",
     M2, False, {}),
    ("reversed_slice",
     "{% for m in messages[::-1] %}{{ m.role }}{% endfor %}|{{ 'abc'[::-1] }}|{{ [1, 2, 3][1:] }}"
     "|{{ [1, 2, 3][-1] }}|{{ 'abcdef'[1:5:2] }}|{{ 'abc'[5:] }}|{{ [1, 2, 3][:-1] }}", M2,
     False, {}),
    ("macros",
     "{% macro m(a, b='d') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(b=3, a=4) }}"
     "{{ m() }}", M2, False, {}),
    ("macro_sees_globals_at_call_time",
     "{% set x = 1 %}{% macro m() %}{{ x }}{{ add_generation_prompt }}{% endmacro %}"
     "{% set x = 2 %}{{ m() }}", M2, True, {}),
    ("macro_does_not_see_caller_loop",
     "{% macro m() %}[{{ y }}]{% endmacro %}{% for y in [5] %}{{ m() }}{% endfor %}", M2, False,
     {}),
    ("macro_counter_namespace",
     "{% set c = namespace(v=0) %}{% macro tick() %}{% set c.v = c.v + 1 %}{{ c.v }}"
     "{% endmacro %}{{ tick() }}{{ tick() }}{{ c.v }}", M2, False, {}),
    ("tests",
     "{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}"
     "{{ false is false }}{{ 0 is false }}{{ true is true }}{{ 1 is number }}{{ 1 is integer }}"
     "{{ 1.5 is integer }}{{ true is boolean }}{{ [] is sequence }}{{ 'a' is iterable }}"
     "{{ x is undefined }}{{ 1 is not none }}{{ messages is sequence }}", M2, False, {}),
    ("undefined_tests",
     "{{ x is iterable }}{{ x is sequence }}{{ x is mapping }}{{ x is string }}{{ x is number }}"
     "{{ x is none }}{{ none is defined }}", M2, False, {}),
    ("namespace_from_dict",
     "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns.c }}|{{ ns['a'] }}", M2,
     False, {}),
    ("filters",
     "{{ '  a b \n'|trim }}|{{ 3|string }}|{{ messages|length }}|{{ 'abc'|length }}"
     "|{{ {'a': 1}|count }}|{{ none|string }}|{{ x|length }}|{{ x|string }}|{{ x|trim }}",
     M2, False, {}),
    ("tojson",
     "{{ {'a': [1, 'x\"y', none, true, false], 'b': 1.5, 'c': 'é\\n\\t', 'd': {}}|tojson }}"
     "|{{ messages|tojson }}|{{ 'a'|tojson }}|{{ 10000000000000000.0|tojson }}|{{ 0.1|tojson }}",
     M2, False, {}),
    ("string_methods",
     "{{ 'a</think>b'.split('</think>')[-1] }}|{{ ' a \n'.strip() }}|{{ 'xxaxx'.strip('x') }}"
     "|{{ '\n\na\n'.lstrip('\n') }}|{{ 'a\n\n'.rstrip('\n') }}|{{ 'a b  c'.split() }}"
     "|{{ 'a,b,c'.split(',', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith('bc') }}"
     "|{{ 'abc'.startswith(('x', 'a')) }}|{{ 'aXbX'.replace('X', '-') }}"
     "|{{ 'aXbX'.replace('X', '-', 1) }}|{{ '  '.strip() }}|{{ 'abc'.lstrip() }}"
     "|{{ 'a  b  c  '.split(None, 1) }}|{{ ' a b '.split() }}|{{ 'ab'.replace('', '.') }}"
     "|{{ 'é, ü'.split(', ') }}|{{ 'ééa'.lstrip('é') }}|{{ '..x..'|trim('.') }}", M2, False, {}),
    ("dict_methods",
     "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
     "{{ {'a': 1}.get('a') }}{{ {'a': 1}.get('z') }}{{ {'a': 1}.get('z', 5) }}"
     "{% for k in {'a': 1, 'b': 2}.keys() %}{{ k }}{% endfor %}"
     "{% for v in {'a': 1, 'b': 2}.values() %}{{ v }}{% endfor %}", M2, False, {}),
    ("attribute_and_item_access",
     "{{ messages[0].role }}{{ messages[0]['content'] }}{{ messages[5] }}|{{ messages[0].missing }}"
     "|{{ messages[-1].role }}{{ {'type': 'image'}.type }}{{ 'abc'[1] }}", M2, False, {}),
    ("operators",
     "{{ 1 + 2 }}{{ 7 - 10 }}{{ 2 * 3 }}{{ 7 / 2 }}{{ 7 // 2 }}{{ -7 // 2 }}{{ 7 % 3 }}{{ -7 % 3 }}"
     "{{ 'a' ~ 1 ~ none }}{{ 'a' + 'b' }}{{ [1] + [2] }}{{ not 1 == 2 }}{{ -1 }}{{ - 2 * 3 }}"
     "{{ 1 < 2 < 3 }}{{ 3 > 2 > 5 }}{{ 'a' < 'b' }}{{ 1 == 1.0 }}{{ true == 1 }}{{ x == y }}"
     "{{ 1 != 2 }}{{ 2 >= 2 }}{{ 1 <= 0 }}{{ true + 1 }}{{ 3 / 1 }}", M2, False, {}),
    ("in_operator",
     "{{ 'a' in 'cat' }}{{ 'a' in ['a'] }}{{ 'a' in {'a': 1} }}{{ 'z' not in 'cat' }}{{ 1 in [1.0] }}"
     "{{ 'image' in {'type': 'image'} }}{{ 'a' in x }}", M2, False, {}),
    ("and_or_not",
     "{{ 1 and 2 }}|{{ 0 and 2 }}|{{ 0 or '' }}|{{ 0 or 'b' }}|{{ not '' }}|{{ none or 'n' }}"
     "|{{ x and 1 }}|{{ x or 'u' }}", M2, False, {}),
    ("conditional_expression",
     "{{ 'a' if true else 'b' }}|{{ 'a' if false else 'b' }}|{{ 'a' if false }}|", M2, False, {}),
    ("printing_values",
     "{{ [1, 'a', none, true, {'k': 'v'}] }}|{{ (1, 'b') }}|{{ none }}|{{ 1.0 }}|{{ 1e20 }}"
     "|{{ 0.1 }}|{{ -0.0 }}|{{ 2.5e-7 }}|{{ 123456789.125 }}|{{ 'it\\'s' }}|{{ \"q\\\"\" }}"
     "|{{ ['it\\'s', 'a\"b', 'c\\nd'] }}|{{ 1_000 }}|{{ 0x1F }}", M2, False, {}),
    ("string_escapes", "{{ 'a\\tb\\\\c\\u00e9\\x41' }}|{{ 'x' 'y' }}", M2, False, {}),
    ("literals", "{{ True }}{{ False }}{{ None }}{{ true }}{{ none is none }}", M2, False, {}),
    ("special_tokens_and_kwargs",
     "{{ eos_token }}|{{ pad_token }}|{{ tools }}"
     "|{{ enable_thinking }}|{{ custom }}", M2, True, {"enable_thinking": False, "custom": [1, "z"]}),
    ("whitespace_in_tags",
     "{%-if true-%} a {%-endif-%}\n{{-'b'-}}\n{%- for i in [1,2] %}\n{{ i }}\n{%- endfor %}",
     M2, False, {}),
    ("braces_in_expressions", "{{ {'a': {'b': 1}} }}{{ '}}' }}{{ '%}' }}", M2, False, {}),
    # Errors: the message differs between jinja2 and Iris; only the failure is compared.
    ("error_raise_exception", "{{ raise_exception('no system message allowed') }}", M2, False, {}),
    ("error_undefined_attribute", "{{ x.y }}", M2, False, {}),
    ("error_list_method", "{{ messages.startswith('a') }}", M2, False, {}),
    ("error_str_plus_int", "{{ 'a' + 1 }}", M2, False, {}),
    ("error_macro_arguments", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", M2, False, {}),
    ("error_unclosed_if", "{% if true %}x", M2, False, {}),
    ("error_unknown_tag", "{% frobnicate %}", M2, False, {}),
]


def special_tokens():
    """bos/eos/pad/unk from the fixture's tokenizer_config.json, as the tokenizer passes them."""
    cfg = json.load(open(os.path.join(FIXTURE, "tokenizer_config.json"), encoding="utf-8"))
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def jinja_renderer():
    """jinja2 configured as transformers.utils.chat_template_utils configures it."""
    import jinja2
    import jinja2.ext
    from datetime import datetime
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    tokens = special_tokens()

    def render(template, messages, add_generation_prompt, kwargs):
        return env.from_string(template).render(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **tokens, **kwargs)

    return render, f"jinja2-imitation (jinja2 {jinja2.__version__})"


def transformers_renderer():
    import jinja2
    import transformers
    from transformers import PreTrainedTokenizerFast

    tokenizer_file = os.path.join(FIXTURE, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        sys.exit(f"{tokenizer_file} is missing: run scripts/fetch_tokenizer.sh first")
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **special_tokens())

    def render(template, messages, add_generation_prompt, kwargs):
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kwargs)

    return render, f"transformers {transformers.__version__} (jinja2 {jinja2.__version__})"


def render_case(render, template, messages, add_generation_prompt, kwargs):
    try:
        return {"text": render(template, messages, add_generation_prompt, kwargs)}
    except Exception as e:  # the template's own failure is the expected result
        return {"error": f"{type(e).__name__}: {e}"}


def has_images(messages):
    return any(isinstance(m["content"], list) and any(i.get("type") == "image" for i in
                                                      m["content"]) for m in messages)


def model_template(model_dir):
    """The chat template of a checkpoint directory, in the order Iris looks for it."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        return open(jinja, encoding="utf-8").read()
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            t = json.load(open(path, encoding="utf-8")).get("chat_template")
            if isinstance(t, list):
                t = next((e["template"] for e in t if e.get("name") == "default"), None)
            if isinstance(t, str):
                return t
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jinja-only", action="store_true",
                    help="render with jinja2 set up as transformers does (no transformers needed)")
    ap.add_argument("--out", default=os.path.join(TEMPLATE_DIR, "golden.json"))
    ap.add_argument("--check-model", action="append", default=[], metavar="DIR",
                    help="compare the saved templates with this checkpoint's chat template")
    a = ap.parse_args()

    saved = {}
    for t in TEMPLATES:
        with open(os.path.join(TEMPLATE_DIR, t["file"]), encoding="utf-8", newline="") as f:
            saved[t["name"]] = f.read()
    if a.check_model:
        for d in a.check_model:
            found = model_template(d)
            if found is None:
                print(f"{d}: no chat template")
                continue
            same = [n for n, s in saved.items() if s == found]
            print(f"{d}: " + ("equals " + ", ".join(same) if same else
                              "differs from every saved template"))
        return

    render, generator = jinja_renderer() if a.jinja_only else transformers_renderer()
    out = {"generator": generator, "templates": [], "engine_cases": []}
    for t in TEMPLATES:
        source = saved[t["name"]]
        entry = {"name": t["name"], "file": t["file"],
                 "sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(), "cases": []}
        for name, messages, gen, kwargs in CONVERSATIONS:
            if t["text_only"] and has_images(messages):
                continue
            case = {"name": name, "messages": messages, "add_generation_prompt": gen,
                    "kwargs": kwargs}
            case.update(render_case(render, source, messages, gen, kwargs))
            entry["cases"].append(case)
        out["templates"].append(entry)
    for name, template, messages, gen, kwargs in ENGINE_CASES:
        case = {"name": name, "template": template, "messages": messages,
                "add_generation_prompt": gen, "kwargs": kwargs}
        case.update(render_case(render, template, messages, gen, kwargs))
        out["engine_cases"].append(case)

    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n = sum(len(t["cases"]) for t in out["templates"])
    errors = [c["name"] for c in out["engine_cases"] if "error" in c]
    print(f"wrote {a.out}: {n} conversations over {len(TEMPLATES)} templates and "
          f"{len(out['engine_cases'])} engine cases ({len(errors)} expected errors) with "
          f"{generator}")
    unexpected = [c["name"] for t in out["templates"] for c in t["cases"] if "error" in c]
    unexpected += [e for e in errors if not e.startswith("error_")]
    unexpected += [c["name"] for c in out["engine_cases"]
                   if c["name"].startswith("error_") and "error" not in c]
    if unexpected:
        sys.exit(f"unexpected outcome for: {', '.join(unexpected)}")


if __name__ == "__main__":
    main()
