// The iris command line: one binary with subcommands (as git does). Every user-facing failure is
// an iris::Error whose message says what was wrong; it is printed and the exit code is 1, or 2
// for a UsageError (a command line the command cannot take; apps/cli.h).
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/usable_cores.h"
#include "iris_build_info.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* help;
};

const Command kCommands[] = {
    {"generate", iris::run_generate_command, "images + text in, text out (streamed)"},
    {"bench", iris::run_bench_command,
     "inference (or --train) figures against the hardware limits and a peer"},
    {"train", iris::run_train_command,
     "train or fine-tune from a recipe (key.sub=value overrides)"},
    {"export", iris::run_export_command, "write a checkpoint as a Hugging Face model directory"},
    {"data", iris::run_data_command, "make datasets (iris data shapes --out DIR --n N --seed S)"},
    {"report", iris::run_report_command,
     "performance report of a training run, or a table of several (scripts/performance/)"},
};

void print_usage(FILE* out) {
  std::fprintf(out,
               "usage: iris <command> [options]   (iris <command> --help or iris help <command> "
               "for its flags; iris --version)\n\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.help);
  std::fprintf(out, "  %-10s %s\n", "help", "this list, or a command's flags (iris help train)");
}

void print_version() {
  std::printf("iris %s\ncommit %s\n", IRIS_VERSION, IRIS_GIT_COMMIT);
#ifdef IRIS_WITH_CUDA
  std::printf("build: %s, CUDA on (toolkit %s, arch %s), CPU GEMM %s, cuDNN not used\n",
              IRIS_BUILD_TYPE, IRIS_CUDA_TOOLKIT, IRIS_CUDA_ARCHS, IRIS_CPU_GEMM);
#else
  std::printf("build: %s, CUDA off (CPU only), CPU GEMM %s\n", IRIS_BUILD_TYPE, IRIS_CPU_GEMM);
#endif
}

// What a mistyped command most likely meant ("genrate" or "gen" -> "generate"), including the
// top-level flags, or "".
std::string closest_command(const std::string& typed) {
  std::vector<std::string> names{"help", "--help", "--version"};
  for (const Command& c : kCommands) names.push_back(c.name);
  return iris::closest_name(typed, names, /*min_prefix=*/2);
}

const Command* find_command(const std::string& name) {
  for (const Command& c : kCommands)
    if (name == c.name) return &c;
  return nullptr;
}

int unknown_command(const std::string& typed) {
  const std::string best = closest_command(typed);
  const bool flag = !typed.empty() && typed[0] == '-';
  std::fprintf(stderr, "iris: error: unknown %s '%s'%s%s%s (iris help lists the commands)\n",
               flag ? "flag" : "command", typed.c_str(), best.empty() ? "" : "; did you mean '",
               best.c_str(), best.empty() ? "" : "'?");
  return iris::kExitUsage;
}

// Runs a command, turning its errors into their message and exit status.
int run_command(const Command& c, int argc, char** argv) {
  try {
    return c.run(argc, argv);
  } catch (const iris::UsageError& e) {
    std::fprintf(stderr, "iris %s: error: %s\n", c.name, e.what());
    return iris::kExitUsage;
  } catch (const iris::Error& e) {
    std::fprintf(stderr, "iris %s: error: %s\n", c.name, e.what());
    return iris::kExitFailure;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "iris %s: error: out of memory (the model, images or limits asked for more "
                 "than this machine has)\n",
                 c.name);
    return iris::kExitFailure;
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the user gave that the system refused (a symbolic link loop, a permission): the
    // path and the system's reason, not the library's wording.
    std::fprintf(stderr, "iris %s: error: %s%s%s: %s\n", c.name, e.path1().c_str(),
                 e.path2().empty() ? "" : " -> ", e.path2().c_str(), e.code().message().c_str());
    return iris::kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "iris %s: unexpected error: %s\n", c.name, e.what());
    return iris::kExitFailure;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A 4x deeper CUDA launch queue (read by the driver when it starts, so before any CUDA call;
  // a value the user set wins). A step larger than the default queue blocks the host inside its
  // launch until the GPU drains it, and the GPU idles between the pieces the driver hands it: on
  // an H200, 2B training at 896 pixels with the loss read every step, a full_iteration step
  // launched 0.95 s per 1.10 s step and trailed eager by 0.7%; with 4x its host enqueue is 13 ms
  // and it runs as fast as eager. llama.cpp's CUDA backend sets the same for the same reason.
  setenv("CUDA_SCALE_LAUNCH_QUEUES", "4x", /*overwrite=*/0);
  // OpenMP's default team is the affinity mask's CPUs; a container's CPU quota may allow fewer,
  // and threads beyond it only wait for each other's time slices. OMP_NUM_THREADS, when set, is
  // the user's own choice; -t and the trainer's host-thread rule narrow this further.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(iris::usable_cores());
  if (argc < 2) {
    print_usage(stderr);
    return iris::kExitUsage;
  }
  const std::string first = argv[1];
  if (first == "--help" || first == "-h") {
    print_usage(stdout);
    return 0;
  }
  if (first == "--version" || first == "-v") {
    print_version();
    return 0;
  }
  if (first == "help") {
    if (argc == 2) {
      print_usage(stdout);
      return 0;
    }
    // iris help train: the command's own --help.
    const Command* c = find_command(argv[2]);
    if (c == nullptr) return unknown_command(argv[2]);
    char help_flag[] = "--help";
    char* help_argv[] = {argv[2], help_flag, nullptr};
    return run_command(*c, 2, help_argv);
  }
  if (const Command* c = find_command(first)) return run_command(*c, argc - 1, argv + 1);
  return unknown_command(first);
}
