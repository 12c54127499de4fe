// Lexing and parsing, following jinja2's lexer (whitespace control, trim_blocks, lstrip_blocks,
// newline normalisation) and its parser's operator precedence.
#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <string>

#include "chat_template/jinja_internal.h"

namespace iris::jinja {

namespace {

struct Token {
  enum class Type {
    data,
    var_begin,
    var_end,
    block_begin,
    block_end,
    name,
    string,
    integer,
    real,
    op
  };
  Type type;
  int line;
  std::string text;  // data text, name, string value, operator
  int64_t integer = 0;
  double real = 0;
};

// jinja2 splits the source at \r\n, \r and \n, joins the lines with \n and drops one trailing
// newline (keep_trailing_newline is off).
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

int count_newlines(std::string_view s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || (c >= '0' && c <= '9');
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

std::string too_many_elements() {
  return "the template has more than " + std::to_string(kMaxSyntaxElements) +
         " tags, names, values and operators; no chat template needs that many";
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the previous tag ended a line (jinja2's lstrip_blocks rule)
    while (pos_ < src_.size()) {
      const size_t start = find_tag(pos_);
      std::string text = src_.substr(pos_, start - pos_);
      if (start == src_.size()) {
        emit_data(text, line_);
        line_ += count_newlines(text);
        break;
      }
      const char kind = src_[start + 1];  // '{', '%' or '#'
      const char sign = start + 2 < src_.size() ? src_[start + 2] : '\0';
      const int text_lines = count_newlines(text);
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: the whitespace between the line's start and a block or comment tag.
        const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((line_start > 0 || line_starting) && line_start < text.size() &&
            lstrip_space_length(std::string_view(text).substr(line_start)) ==
                text.size() - line_start)
          text.resize(line_start);
      }
      emit_data(text, line_);
      line_ += text_lines;
      pos_ = start + 2 + (sign == '-' || sign == '+' ? 1 : 0);
      if (kind == '#') {
        line_starting = skip_comment();
      } else {
        if (kind == '%') check_not_raw();
        line_starting = lex_tag(kind == '{');
      }
    }
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
        return i;
    return src_.size();
  }

  void push(Token t) {
    if (static_cast<int64_t>(tokens_.size()) >= kMaxSyntaxElements)
      fail_at(t.line, too_many_elements());
    tokens_.push_back(std::move(t));
  }

  void emit_data(const std::string& text, int line) {
    if (!text.empty()) push({Token::Type::data, line, text});
  }

  // After a tag's end: "-" strips every following whitespace character, "+" keeps them, and
  // otherwise (trim_blocks) one newline is dropped after a block or comment tag. Returns whether
  // what was consumed ended with a newline.
  bool after_end(char sign, bool block) {
    const size_t before = pos_;
    if (sign == '-') {
      pos_ += lstrip_space_length(std::string_view(src_).substr(pos_));
    } else if (sign != '+' && block && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
    line_ += count_newlines(std::string_view(src_).substr(before, pos_ - before));
    return pos_ > before ? src_[pos_ - 1] == '\n' : false;
  }

  bool skip_comment() {
    const int open_line = line_;
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) fail_at(open_line, "a {# comment is never closed with #}");
    char sign = '\0';
    size_t text_end = end;
    if (end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+')) {
      sign = src_[end - 1];
      text_end = end - 1;
    }
    line_ += count_newlines(std::string_view(src_).substr(pos_, text_end - pos_));
    pos_ = end + 2;
    return after_end(sign, true);
  }

  void check_not_raw() {
    size_t p = pos_;
    while (p < src_.size() && (src_[p] == ' ' || src_[p] == '\t' || src_[p] == '\n')) ++p;
    if (src_.compare(p, 3, "raw") == 0 && (p + 3 == src_.size() || !is_name_char(src_[p + 3])))
      fail_at(line_, "{% raw %} blocks are not supported");
  }

  // The inside of a {{ }} or {% %} tag, through its end. Returns whether the end consumed a
  // newline.
  bool lex_tag(bool variable) {
    const int open_line = line_;
    push({variable ? Token::Type::var_begin : Token::Type::block_begin, line_, ""});
    std::vector<char> open;  // brackets not yet closed: an end marker inside them is an operator
    for (;;) {
      if (pos_ >= src_.size())
        fail_at(open_line, std::string("a ") + (variable ? "{{" : "{%") +
                               " tag is never closed with " + (variable ? "}}" : "%}"));
      if (open.empty()) {
        const char* end = variable ? "}}" : "%}";
        char sign = '\0';
        size_t at = std::string::npos;
        if ((src_[pos_] == '-' || (!variable && src_[pos_] == '+')) &&
            src_.compare(pos_ + 1, 2, end) == 0) {
          sign = src_[pos_];
          at = pos_ + 3;
        } else if (src_.compare(pos_, 2, end) == 0) {
          at = pos_ + 2;
        }
        if (at != std::string::npos) {
          push({variable ? Token::Type::var_end : Token::Type::block_end, line_, ""});
          pos_ = at;
          return after_end(sign, !variable);
        }
      }
      const char c = src_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
        if (c == '\n') ++line_;
        ++pos_;
        continue;
      }
      if (is_digit(c)) {
        lex_number();
        continue;
      }
      if (is_name_start(c)) {
        const size_t b = pos_;
        while (pos_ < src_.size() && is_name_char(src_[pos_])) ++pos_;
        push({Token::Type::name, line_, src_.substr(b, pos_ - b)});
        continue;
      }
      if (c == '\'' || c == '"') {
        lex_string(c);
        continue;
      }
      static constexpr std::array<const char*, 6> kTwo = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* two : kTwo)
        if (src_.compare(pos_, 2, two) == 0) op = two;
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) != nullptr) op = std::string(1, c);
      if (op.empty()) {
        if (static_cast<uint8_t>(c) >= 0x80)
          fail_at(line_, "names may use only ASCII letters, digits and _ here");
        fail_at(line_, std::string("unexpected character '") + c + "' in a tag");
      }
      if (op == "(" || op == "[" || op == "{")
        open.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      if (op == ")" || op == "]" || op == "}") {
        if (open.empty()) fail_at(line_, "unexpected '" + op + "'");
        if (open.back() != op[0])
          fail_at(line_, "unexpected '" + op + "', expected '" + open.back() + "'");
        open.pop_back();
      }
      push({Token::Type::op, line_, op});
      pos_ += op.size();
    }
  }

  // Python integer and float literals as jinja2 reads them (underscores between digits; 0x, 0o
  // and 0b prefixes; exponents).
  void lex_number() {
    const size_t b = pos_;
    auto digits = [&](auto ok) {
      const size_t s = pos_;
      while (pos_ < src_.size() &&
             (ok(src_[pos_]) ||
              (src_[pos_] == '_' && pos_ + 1 < src_.size() && ok(src_[pos_ + 1]) && pos_ > s)))
        ++pos_;
      return pos_ > s;
    };
    auto plain = [&](std::string_view s) {
      std::string out;
      for (char c : s)
        if (c != '_') out += c;
      return out;
    };
    if (src_[pos_] == '0' && pos_ + 1 < src_.size() && std::strchr("xXoObB", src_[pos_ + 1])) {
      const char p = static_cast<char>(src_[pos_ + 1] | 0x20);
      const int base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
      pos_ += 2;
      if (pos_ < src_.size() && src_[pos_] == '_') ++pos_;
      auto ok = [&](char c) {
        const int d = is_digit(c)                              ? c - '0'
                      : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10
                                                               : 99;
        return d < base;
      };
      if (!digits(ok)) fail_at(line_, "a number literal has no digits after its prefix");
      push_integer(plain(std::string_view(src_).substr(b + 2, pos_ - b - 2)), base);
      return;
    }
    digits(is_digit);
    bool real = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
      real = true;
      ++pos_;
      digits(is_digit);
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t p = pos_ + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && is_digit(src_[p])) {
        real = true;
        pos_ = p;
        digits(is_digit);
      }
    }
    const std::string text = plain(std::string_view(src_).substr(b, pos_ - b));
    if (real) {
      push({Token::Type::real, line_, text, 0, std::strtod(text.c_str(), nullptr)});
    } else {
      if (text.size() > 1 && text[0] == '0' && text.find_first_not_of('0') != std::string::npos)
        fail_at(line_, "leading zeros in a decimal integer literal are not permitted");
      push_integer(text, 10);
    }
  }

  void push_integer(const std::string& digits, int base) {
    int64_t v = 0;
    for (char c : digits) {
      const int d = is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
      if (__builtin_mul_overflow(v, base, &v) || __builtin_add_overflow(v, d, &v))
        fail_at(line_, "an integer literal is too large");
    }
    push({Token::Type::integer, line_, digits, v});
  }

  // A quoted string with Python's escapes (jinja2 decodes them with "unicode-escape").
  void lex_string(char quote) {
    const int line = line_;
    std::string value;
    ++pos_;
    for (;;) {
      if (pos_ >= src_.size()) fail_at(line, "a string literal is never closed");
      const char c = src_[pos_++];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (pos_ >= src_.size()) fail_at(line, "a string literal is never closed");
      const char e = src_[pos_++];
      switch (e) {
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'v':
          value += '\v';
          break;
        case '0':
          value += '\0';
          break;
        case '\n':  // a backslash before a newline joins the lines
          ++line_;
          break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            const char h = pos_ < src_.size() ? src_[pos_] : '\0';
            const int d = is_digit(h)                              ? h - '0'
                          : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10
                                                                   : -1;
            if (d < 0) fail_at(line, std::string("truncated \\") + e + " escape in a string");
            cp = cp * 16 + static_cast<uint32_t>(d);
            ++pos_;
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            fail_at(line, "a string escape names no Unicode character");
          append_utf8(value, cp);
          break;
        }
        default:  // unknown escapes stay as written
          value += '\\';
          value += e;
      }
    }
    push({Token::Type::string, line, value});
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------------
// Parser

const char* const kSupportedFilters[] = {"length", "count", "string", "trim", "tojson"};
const char* const kSupportedTests[] = {"defined",  "undefined", "none",   "string",  "mapping",
                                       "sequence", "iterable",  "number", "integer", "float",
                                       "boolean",  "true",      "false"};
// jinja2 statements that exist but are not implemented here, for a clearer message than
// "unknown tag".
const char* const kKnownTags[] = {"include", "import",     "from",  "extends",    "block",
                                  "call",    "filter",     "with",  "autoescape", "do",
                                  "trans",   "generation", "endset"};

bool in_list(std::string_view name, const char* const* list, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (name == list[i]) return true;
  return false;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens)
      : t_(std::move(tokens)), elements_(static_cast<int64_t>(t_.size())) {}

  std::vector<std::unique_ptr<Node>> parse_all() {
    std::string end;
    auto nodes = parse_body({}, end, 0);
    return nodes;
  }

 private:
  using Nodes = std::vector<std::unique_ptr<Node>>;
  using ExprPtr = std::unique_ptr<Expr>;

  const Token* peek(size_t ahead = 0) const {
    return i_ + ahead < t_.size() ? &t_[i_ + ahead] : nullptr;
  }
  int line() const { return i_ < t_.size() ? t_[i_].line : (t_.empty() ? 1 : t_.back().line); }
  bool at_op(const char* op) const {
    return peek() && peek()->type == Token::Type::op && peek()->text == op;
  }
  bool at_name(const char* name, size_t ahead = 0) const {
    return peek(ahead) && peek(ahead)->type == Token::Type::name && peek(ahead)->text == name;
  }
  bool at_block_end() const { return peek() && peek()->type == Token::Type::block_end; }
  void expect_op(const char* op) {
    if (!at_op(op)) fail_at(line(), std::string("expected '") + op + "'" + found());
    ++i_;
  }
  std::string expect_name() {
    if (!peek() || peek()->type != Token::Type::name) fail_at(line(), "expected a name" + found());
    return t_[i_++].text;
  }
  void expect_block_end() {
    if (!at_block_end()) fail_at(line(), "expected the end of the tag (%})" + found());
    ++i_;
  }
  std::string found() const {
    if (!peek()) return ", found the end of the template";
    switch (peek()->type) {
      case Token::Type::name:
      case Token::Type::op:
        return ", found '" + peek()->text + "'";
      case Token::Type::block_end:
        return ", found %}";
      case Token::Type::var_end:
        return ", found }}";
      default:
        return "";
    }
  }
  void nest(int depth) const {
    if (depth > kMaxNesting)
      fail_at(line(), "the template nests blocks or expressions more than " +
                          std::to_string(kMaxNesting) + " levels deep");
  }

  // Nodes until a block tag whose keyword is in `ends` (consumed up to the keyword; `end` is set
  // to it). With no ends, until the end of the template.
  Nodes parse_body(const std::vector<std::string>& ends, std::string& end, int depth,
                   int open_line = 0) {
    nest(depth);
    Nodes nodes;
    for (;;) {
      const Token* tok = peek();
      if (tok == nullptr) {
        if (ends.empty()) return nodes;
        std::string want;
        for (const std::string& e : ends) want += (want.empty() ? "{% " : " or {% ") + e + " %}";
        fail_at(open_line, "this block is never closed: the template ends before " + want);
      }
      if (tok->type == Token::Type::data) {
        count_element();
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::text;
        n->line = tok->line;
        n->text = tok->text;
        nodes.push_back(std::move(n));
        ++i_;
      } else if (tok->type == Token::Type::var_begin) {
        ++i_;
        count_element();
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::output;
        n->line = tok->line;
        n->expr = parse_expression(depth + 1);
        if (!peek() || peek()->type != Token::Type::var_end)
          fail_at(line(), "expected the end of the {{ }} tag" + found());
        ++i_;
        nodes.push_back(std::move(n));
      } else if (tok->type == Token::Type::block_begin) {
        ++i_;
        const int tag_line = line();
        const std::string keyword = expect_name();
        if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
          end = keyword;
          return nodes;
        }
        nodes.push_back(parse_statement(keyword, tag_line, depth + 1));
      } else {
        fail_at(tok->line, "unexpected token outside a tag");
      }
    }
  }

  std::unique_ptr<Node> parse_statement(const std::string& keyword, int tag_line, int depth) {
    count_element();
    auto n = std::make_unique<Node>();
    n->line = tag_line;
    if (keyword == "if") {
      n->kind = Node::Kind::if_;
      ExprPtr cond = parse_expression(depth);
      for (;;) {
        expect_block_end();
        std::string end;
        Nodes body = parse_body({"elif", "else", "endif"}, end, depth, tag_line);
        n->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "endif") break;
        if (end == "elif") {
          cond = parse_expression(depth);
          continue;
        }
        expect_block_end();
        Nodes else_body = parse_body({"endif"}, end, depth, tag_line);
        n->branches.emplace_back(nullptr, std::move(else_body));
        break;
      }
      expect_block_end();
    } else if (keyword == "for") {
      n->kind = Node::Kind::for_;
      n->targets = parse_targets();
      if (!at_name("in")) fail_at(line(), "expected 'in' in the for tag" + found());
      ++i_;
      n->expr = parse_expression(depth, /*allow_condition=*/false);
      if (at_name("if")) {
        ++i_;
        n->filter = parse_expression(depth);
      }
      if (at_name("recursive")) fail_at(line(), "recursive for loops are not supported");
      expect_block_end();
      std::string end;
      ++loops_;
      n->body = parse_body({"else", "endfor"}, end, depth, tag_line);
      --loops_;
      if (end == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, end, depth, tag_line);
      }
      expect_block_end();
    } else if (keyword == "set") {
      const std::string first = expect_name();
      if (at_op(".")) {
        ++i_;
        n->kind = Node::Kind::set_attr;
        n->targets = {first};
        n->attr = expect_name();
      } else {
        n->kind = Node::Kind::set;
        n->targets = {first};
        while (at_op(",")) {
          ++i_;
          n->targets.push_back(expect_name());
        }
      }
      if (!at_op("="))
        fail_at(line(), "block assignments ({% set x %}...{% endset %}) are not supported" +
                            std::string(at_block_end() ? "" : "; expected '='"));
      ++i_;
      n->expr = parse_tuple_or_expression(depth);
      expect_block_end();
    } else if (keyword == "macro") {
      n->kind = Node::Kind::macro;
      n->targets = {expect_name()};
      expect_op("(");
      while (!at_op(")")) {
        if (!n->params.empty()) expect_op(",");
        if (at_op(")")) break;
        std::string param = expect_name();
        ExprPtr def;
        if (at_op("=")) {
          ++i_;
          def = parse_expression(depth);
        } else {
          for (const auto& [p, d] : n->params)
            if (d) fail_at(line(), "a macro argument without a default follows one with a default");
        }
        n->params.emplace_back(std::move(param), std::move(def));
      }
      ++i_;
      expect_block_end();
      std::string end;
      // A loop around the definition is not the loop of the body: break there is an error.
      const int outer_loops = loops_;
      loops_ = 0;
      n->body = parse_body({"endmacro"}, end, depth, tag_line);
      loops_ = outer_loops;
      expect_block_end();
    } else if (keyword == "break" || keyword == "continue") {
      if (loops_ == 0) fail_at(tag_line, "{% " + keyword + " %} outside a for loop");
      n->kind = keyword == "break" ? Node::Kind::break_ : Node::Kind::continue_;
      expect_block_end();
    } else if (in_list(keyword, kKnownTags, std::size(kKnownTags))) {
      fail_at(tag_line, "the {% " + keyword +
                            " %} tag is not supported by Iris's chat template "
                            "renderer");
    } else {
      fail_at(tag_line, "unknown tag '" + keyword + "'");
    }
    return n;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names{expect_name()};
    while (at_op(",")) {
      ++i_;
      names.push_back(expect_name());
    }
    return names;
  }

  // `a, b` without brackets is a tuple (as in {% set x = 1, 2 %}).
  ExprPtr parse_tuple_or_expression(int depth) {
    ExprPtr first = parse_expression(depth);
    if (!at_op(",")) return first;
    auto t = make(Expr::Op::tuple, first->line);
    t->args.push_back(std::move(first));
    while (at_op(",")) {
      ++i_;
      if (at_block_end()) break;
      t->args.push_back(parse_expression(depth));
    }
    return t;
  }

  ExprPtr make(Expr::Op op, int line) {
    count_element();
    auto e = std::make_unique<Expr>();
    e->op = op;
    e->line = line;
    return e;
  }

  ExprPtr parse_expression(int depth, bool allow_condition = true) {
    nest(depth);
    ExprPtr e = parse_or(depth + 1);
    while (allow_condition && at_name("if")) {
      const int l = line();
      ++i_;
      auto c = make(Expr::Op::cond, l);
      ExprPtr cond = parse_or(depth + 1);
      ExprPtr other;
      if (at_name("else")) {
        ++i_;
        other = parse_expression(depth + 1);
      }
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr parse_or(int depth) {
    ExprPtr e = parse_and(depth);
    for (int chain = 1; at_name("or"); ++chain) {
      nest(depth + chain);
      auto n = make(Expr::Op::or_, line());
      ++i_;
      n->args.push_back(std::move(e));
      n->args.push_back(parse_and(depth));
      e = std::move(n);
    }
    return e;
  }

  ExprPtr parse_and(int depth) {
    ExprPtr e = parse_not(depth);
    for (int chain = 1; at_name("and"); ++chain) {
      nest(depth + chain);
      auto n = make(Expr::Op::and_, line());
      ++i_;
      n->args.push_back(std::move(e));
      n->args.push_back(parse_not(depth));
      e = std::move(n);
    }
    return e;
  }

  ExprPtr parse_not(int depth) {
    if (at_name("not")) {
      nest(depth);
      auto n = make(Expr::Op::not_, line());
      ++i_;
      n->args.push_back(parse_not(depth + 1));
      return n;
    }
    return parse_compare(depth);
  }

  ExprPtr parse_compare(int depth) {
    ExprPtr e = parse_math1(depth);
    std::unique_ptr<Expr> cmp;
    for (;;) {
      std::string op;
      if (peek() && peek()->type == Token::Type::op &&
          (peek()->text == "==" || peek()->text == "!=" || peek()->text == "<" ||
           peek()->text == "<=" || peek()->text == ">" || peek()->text == ">=")) {
        op = peek()->text;
        ++i_;
      } else if (at_name("in")) {
        op = "in";
        ++i_;
      } else if (at_name("not") && at_name("in", 1)) {
        op = "notin";
        i_ += 2;
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Op::compare, e->line);
        cmp->args.push_back(std::move(e));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1(depth));
    }
    return cmp ? std::move(cmp) : std::move(e);
  }

  ExprPtr binary_chain(int depth, const std::vector<const char*>& ops,
                       ExprPtr (Parser::*next)(int)) {
    ExprPtr e = (this->*next)(depth);
    for (int chain = 1;; ++chain) {
      const char* op = nullptr;
      for (const char* o : ops)
        if (at_op(o)) op = o;
      if (op == nullptr) return e;
      nest(depth + chain);  // a chain is a tree as deep as it is long
      auto n = make(Expr::Op::binary, line());
      n->name = op;
      ++i_;
      n->args.push_back(std::move(e));
      n->args.push_back((this->*next)(depth));
      e = std::move(n);
    }
  }
  ExprPtr parse_math1(int depth) { return binary_chain(depth, {"+", "-"}, &Parser::parse_concat); }
  ExprPtr parse_concat(int depth) { return binary_chain(depth, {"~"}, &Parser::parse_math2); }
  ExprPtr parse_math2(int depth) {
    return binary_chain(depth, {"*", "/", "//", "%"}, &Parser::parse_pow);
  }
  ExprPtr parse_pow(int depth) {
    ExprPtr e = parse_unary(depth, true);
    if (at_op("**")) fail_at(line(), "the ** operator is not supported");
    return e;
  }

  ExprPtr parse_unary(int depth, bool with_filter) {
    nest(depth);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      e = make(at_op("-") ? Expr::Op::neg : Expr::Op::pos, line());
      ++i_;
      e->args.push_back(parse_unary(depth + 1, false));
    } else {
      e = parse_primary(depth + 1);
    }
    e = parse_postfix(std::move(e), depth + 1);
    if (with_filter) e = parse_filters(std::move(e), depth + 1);
    return e;
  }

  ExprPtr parse_primary(int depth) {
    const Token* tok = peek();
    if (tok == nullptr) fail_at(line(), "the template ends inside an expression");
    const int l = tok->line;
    switch (tok->type) {
      case Token::Type::name: {
        ++i_;
        const std::string& n = tok->text;
        auto lit = make(Expr::Op::literal, l);
        if (n == "true" || n == "True") {
          lit->value = Value::from_bool(true);
        } else if (n == "false" || n == "False") {
          lit->value = Value::from_bool(false);
        } else if (n == "none" || n == "None") {
          lit->value = Value::none();
        } else {
          auto name = make(Expr::Op::name, l);
          name->name = n;
          return name;
        }
        return lit;
      }
      case Token::Type::string: {
        std::string s;
        while (peek() && peek()->type == Token::Type::string) s += t_[i_++].text;
        auto lit = make(Expr::Op::literal, l);
        lit->value = Value::from_string(std::move(s));
        return lit;
      }
      case Token::Type::integer: {
        ++i_;
        auto lit = make(Expr::Op::literal, l);
        lit->value = Value::from_int(tok->integer);
        return lit;
      }
      case Token::Type::real: {
        ++i_;
        auto lit = make(Expr::Op::literal, l);
        lit->value = Value::from_real(tok->real);
        return lit;
      }
      case Token::Type::op:
        if (tok->text == "(") {
          ++i_;
          if (at_op(")")) {
            ++i_;
            return make(Expr::Op::tuple, l);
          }
          ExprPtr first = parse_expression(depth + 1);
          if (at_op(")")) {
            ++i_;
            return first;
          }
          auto t = make(Expr::Op::tuple, l);
          t->args.push_back(std::move(first));
          while (at_op(",")) {
            ++i_;
            if (at_op(")")) break;
            t->args.push_back(parse_expression(depth + 1));
          }
          expect_op(")");
          return t;
        }
        if (tok->text == "[") {
          ++i_;
          auto list = make(Expr::Op::list, l);
          while (!at_op("]")) {
            if (!list->args.empty()) expect_op(",");
            if (at_op("]")) break;
            list->args.push_back(parse_expression(depth + 1));
          }
          ++i_;
          return list;
        }
        if (tok->text == "{") {
          ++i_;
          auto dict = make(Expr::Op::dict, l);
          while (!at_op("}")) {
            if (!dict->args.empty()) expect_op(",");
            if (at_op("}")) break;
            dict->args.push_back(parse_expression(depth + 1));
            expect_op(":");
            dict->args.push_back(parse_expression(depth + 1));
          }
          ++i_;
          return dict;
        }
        break;
      default:
        break;
    }
    fail_at(l, "expected a value" + found());
  }

  ExprPtr parse_postfix(ExprPtr e, int depth) {
    for (int chain = 0;; ++chain) {
      nest(depth + chain);
      if (at_op(".")) {
        const int l = line();
        ++i_;
        if (peek() && peek()->type == Token::Type::integer) {
          auto item = make(Expr::Op::item, l);
          auto index = make(Expr::Op::literal, l);
          index->value = Value::from_int(t_[i_++].integer);
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
          continue;
        }
        auto attr = make(Expr::Op::attr, l);
        attr->name = expect_name();
        attr->args.push_back(std::move(e));
        e = std::move(attr);
      } else if (at_op("[")) {
        e = parse_subscript(std::move(e), depth);
      } else if (at_op("(")) {
        e = parse_call(std::move(e), depth);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr e, int depth) {
    const int l = line();
    expect_op("[");
    ExprPtr parts[3];
    int colons = 0;
    for (;;) {
      if (at_op(":")) {
        if (++colons > 2) fail_at(line(), "a slice has at most two ':'");
        ++i_;
        continue;
      }
      if (at_op("]")) break;
      if (at_op(",")) fail_at(line(), "tuple subscripts are not supported");
      if (parts[colons]) fail_at(line(), "expected ']'" + found());
      parts[colons] = parse_expression(depth + 1);
    }
    ++i_;
    if (colons == 0) {
      if (!parts[0]) fail_at(l, "an empty subscript []");
      auto item = make(Expr::Op::item, l);
      item->args.push_back(std::move(e));
      item->args.push_back(std::move(parts[0]));
      return item;
    }
    auto slice = make(Expr::Op::slice, l);
    slice->args.push_back(std::move(e));
    for (auto& p : parts) slice->args.push_back(std::move(p));
    return slice;
  }

  // Arguments after an opening parenthesis: positional ones, then name=value ones.
  void parse_arguments(Expr& call, int depth) {
    expect_op("(");
    for (bool first = true; !at_op(")"); first = false) {
      if (!first) {
        expect_op(",");
        if (at_op(")")) break;
      }
      if (at_op("*") || at_op("**")) fail_at(line(), "*args and **kwargs calls are not supported");
      if (peek() && peek()->type == Token::Type::name && peek(1) &&
          peek(1)->type == Token::Type::op && peek(1)->text == "=") {
        std::string key = t_[i_].text;
        i_ += 2;
        call.kwargs.emplace_back(std::move(key), parse_expression(depth + 1));
      } else {
        if (!call.kwargs.empty())
          fail_at(line(), "a positional argument follows a keyword argument");
        call.args.push_back(parse_expression(depth + 1));
      }
    }
    ++i_;
  }

  ExprPtr parse_call(ExprPtr callee, int depth) {
    auto call = make(Expr::Op::call, line());
    call->args.push_back(std::move(callee));
    parse_arguments(*call, depth);
    return call;
  }

  ExprPtr parse_filters(ExprPtr e, int depth) {
    for (int chain = 0;; ++chain) {
      nest(depth + chain);
      if (at_op("|")) {
        const int l = line();
        ++i_;
        auto f = make(Expr::Op::filter, l);
        f->name = expect_name();
        if (at_op(".")) fail_at(l, "dotted filter names are not supported");
        if (!is_supported_filter(f->name))
          fail_at(l, "the filter '" + f->name +
                         "' is not supported (Iris supports length, count, string, trim and "
                         "tojson)");
        f->args.push_back(std::move(e));
        if (at_op("(")) {
          auto args = make(Expr::Op::call, l);
          parse_arguments(*args, depth);
          for (auto& a : args->args) f->args.push_back(std::move(a));
          f->kwargs = std::move(args->kwargs);
        }
        e = std::move(f);
      } else if (at_name("is")) {
        const int l = line();
        ++i_;
        auto t = make(Expr::Op::test, l);
        if (at_name("not")) {
          ++i_;
          t->negated = true;
        }
        t->name = expect_name();
        if (!is_supported_test(t->name))
          fail_at(l, "the test 'is " + t->name + "' is not supported");
        t->args.push_back(std::move(e));
        if (at_op("(")) {
          auto args = make(Expr::Op::call, l);
          parse_arguments(*args, depth);
          for (auto& a : args->args) t->args.push_back(std::move(a));
          t->kwargs = std::move(args->kwargs);
        } else if (peek() &&
                   (peek()->type == Token::Type::name || peek()->type == Token::Type::string ||
                    peek()->type == Token::Type::integer || peek()->type == Token::Type::real ||
                    at_op("[") || at_op("{")) &&
                   !at_name("else") && !at_name("or") && !at_name("and")) {
          if (at_name("is")) fail_at(line(), "tests cannot be chained with 'is'");
          // jinja2 reads `x is divisibleby 3`: one argument without parentheses.
          ExprPtr arg = parse_postfix(parse_primary(depth + 1), depth + 1);
          t->args.push_back(std::move(arg));
        }
        e = std::move(t);
      } else if (at_op("(")) {
        e = parse_call(std::move(e), depth);
      } else {
        return e;
      }
    }
  }

  // Counts a node or expression about to be made, with the tokens, against kMaxSyntaxElements.
  void count_element() {
    if (++elements_ > kMaxSyntaxElements) fail_at(line(), too_many_elements());
  }

  std::vector<Token> t_;
  int64_t elements_;
  size_t i_ = 0;
  int loops_ = 0;
};

}  // namespace

bool is_supported_filter(std::string_view name) {
  return in_list(name, kSupportedFilters, std::size(kSupportedFilters));
}

bool is_supported_test(std::string_view name) {
  return in_list(name, kSupportedTests, std::size(kSupportedTests));
}

std::vector<std::unique_ptr<Node>> parse_template(std::string_view source) {
  Parser p(Lexer(source).run());
  return p.parse_all();
}

}  // namespace iris::jinja
