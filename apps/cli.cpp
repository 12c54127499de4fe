#include "apps/cli.h"

#include <algorithm>
#include <functional>

#include "core/error.h"
#include "core/text_distance.h"

namespace iris {
namespace {

// A name as compared: without the dashes in front, '_' taken for '-' (--top_k is --top-k).
std::string bare(const std::string& name) {
  const size_t start = name.find_first_not_of('-');
  std::string b = start == std::string::npos ? std::string() : name.substr(start);
  std::replace(b.begin(), b.end(), '_', '-');
  return b;
}

// Every option of `app` and of its subcommands: the parser's conventions hold at each level.
void for_each_app(CLI::App& app, const std::function<void(CLI::App&)>& fn) {
  fn(app);
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) for_each_app(*sub, fn);
}

std::string help_pointer(const std::string& command) {
  return " (" + command + " --help lists the flags)";
}

}  // namespace

std::string closest_name(const std::string& typed, const std::vector<std::string>& names,
                         size_t min_prefix) {
  const std::string want = bare(typed.substr(0, typed.find('=')));
  if (want.empty()) return "";
  // A name the typed word begins: an abbreviation (iris gen).
  std::string best;
  if (want.size() >= min_prefix)
    for (const std::string& n : names)
      if (bare(n).rfind(want, 0) == 0 && (best.empty() || bare(n).size() < bare(best).size()))
        best = n;
  if (!best.empty()) return best;
  // A swap of two letters costs 2. Short names allow fewer edits, or every one-letter flag would
  // be "close" to every other.
  const size_t allowed = want.size() <= 2   ? 0
                         : want.size() == 3 ? 1
                                            : std::max<size_t>(2, want.size() / 3);
  size_t best_d = allowed + 1;
  for (const std::string& n : names) {
    const size_t d = edit_distance(want, bare(n));
    if (d < best_d) best_d = d, best = n;
  }
  return best;
}

std::vector<std::string> flag_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_group().empty()) continue;  // hidden: deprecated spellings
    for (const std::string& l : opt->get_lnames()) names.push_back("--" + l);
    for (const std::string& s : opt->get_snames()) names.push_back("-" + s);
  }
  return names;
}

void fail_unknown_flag(const std::string& flag, const std::vector<std::string>& names,
                       const std::string& command) {
  const std::string best = closest_name(flag, names);
  IRIS_USAGE_FAIL("unknown flag ", flag.substr(0, flag.find('=')),
                  best.empty() ? std::string() : "; did you mean " + best + "?",
                  help_pointer(command));
}

bool parse_command_line(CLI::App& app, std::vector<std::string> args, const std::string& command,
                        const std::vector<std::string>& extra_flags,
                        const std::string& stray_hint) {
  // Unknown arguments are collected instead of failing inside CLI11, so that the error can name
  // what the user probably meant. As in llama.cpp, the last of a repeated flag wins (CLI11 would
  // refuse the repeat); repeatable options (--image, overrides) keep every value.
  for_each_app(app, [](CLI::App& a) {
    a.allow_extras();
    for (CLI::Option* opt : a.get_options())
      if (opt->get_items_expected_max() <= 1)
        opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  });
  // A subcommand is the first word that is not a flag (iris data shapes ...): a mistyped one
  // would otherwise surface as "a subcommand is required".
  const std::vector<CLI::App*> subs = app.get_subcommands([](CLI::App*) { return true; });
  if (!subs.empty()) {
    const auto word = std::find_if(args.begin(), args.end(),
                                   [](const std::string& a) { return a.empty() || a[0] != '-'; });
    if (word != args.end()) {
      std::vector<std::string> names;
      for (CLI::App* s : subs) names.push_back(s->get_name());
      if (std::find(names.begin(), names.end(), *word) == names.end()) {
        const std::string best = closest_name(*word, names, 2);
        std::string list;
        for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
        IRIS_USAGE_FAIL("unknown subcommand '", *word, "'",
                        best.empty() ? std::string() : "; did you mean '" + best + "'?", " (",
                        command, " takes ", list, ")");
      }
    }
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  // What was left over belongs to the deepest subcommand given, whose flags are the ones meant.
  // An unknown flag is reported before what CLI11 found (a required flag missing may be the one
  // mistyped: --outt for --out).
  // Returns the command line's name for that subcommand ("iris data shapes").
  const auto check_leftovers = [&]() {
    const CLI::App* level = &app;
    while (!level->get_subcommands().empty()) level = level->get_subcommands().front();
    const std::string level_name =
        level == &app ? command : command + " " + std::string(level->get_name());
    std::vector<std::string> names = flag_names(*level);
    names.insert(names.end(), extra_flags.begin(), extra_flags.end());
    for (const std::string& extra : app.remaining(/*recurse=*/true)) {
      if (extra.size() > 1 && extra[0] == '-') fail_unknown_flag(extra, names, level_name);
      IRIS_USAGE_FAIL("unexpected argument '", extra, "'",
                      stray_hint.empty() ? help_pointer(level_name) : "; " + stray_hint);
    }
    return level_name;
  };
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    app.exit(e);
    return false;
  } catch (const CLI::CallForAllHelp& e) {
    app.exit(e);
    return false;
  } catch (const CLI::ParseError& e) {
    IRIS_USAGE_FAIL(e.what(), help_pointer(check_leftovers()));
  }
  check_leftovers();
  return true;
}

}  // namespace iris
