// What every iris command does with its command line, so that all of them fail alike: the last
// of a repeated flag wins (as in llama.cpp), an unknown flag or subcommand is answered with the
// closest known one, and whatever the parser refuses is a UsageError, which the binary reports as
// "iris CMD: error: ..." with exit status 2 (1 is left for a command that fails at its work).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace iris {

// Exit statuses of every iris command.
inline constexpr int kExitFailure = 1;  // the command could not do its work (an iris::Error)
inline constexpr int kExitUsage = 2;    // the command line was wrong (an iris::UsageError)

// The name of `names` that `typed` most likely meant, or "" when none is close enough to be a
// typo: one that `typed` begins (at least `min_prefix` characters: "gen" for "generate"; the
// shortest of several), else the nearest by edit distance within an allowance that grows with
// the length. Dashes in front are ignored and '_' is taken for '-', so names may be flags.
std::string closest_name(const std::string& typed, const std::vector<std::string>& names,
                         size_t min_prefix = 3);

// Every flag of `app` that its help lists (long and short spellings), for suggestions.
std::vector<std::string> flag_names(const CLI::App& app);

// "unknown flag --dryrun; did you mean --dry-run? (iris train --help lists the flags)".
[[noreturn]] void fail_unknown_flag(const std::string& flag, const std::vector<std::string>& names,
                                    const std::string& command);

// Parses `args` (the words after the command's name, in order) into `app` as described above;
// `command` ("iris train") names the command in messages, `extra_flags` are spellings handled
// before parsing that suggestions may offer (-sys), `stray_hint` what to say of a word that is
// neither a flag nor a value. Returns false when --help was asked for and printed (the command
// then exits with 0), true when the command goes on.
bool parse_command_line(CLI::App& app, std::vector<std::string> args, const std::string& command,
                        const std::vector<std::string>& extra_flags = {},
                        const std::string& stray_hint = "");

}  // namespace iris
