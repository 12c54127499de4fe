// The iris command line: one binary with subcommands (as git does). Every user-facing failure is
// an iris::Error whose message says what was wrong; it is printed and the exit code is 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>
#include <string>

#include "apps/commands.h"
#include "core/error.h"
#include "core/text_distance.h"
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
               "usage: iris <command> [options]   (iris <command> --help for its flags; "
               "iris --version)\n\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.help);
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

// The command a mistyped one most likely meant ("genrate" -> "generate"), or null.
const Command* closest_command(const char* typed) {
  const Command* best = nullptr;
  size_t best_d = std::max<size_t>(2, std::strlen(typed) / 3) + 1;  // a swap costs 2
  for (const Command& c : kCommands) {
    const size_t d = iris::edit_distance(typed, c.name);
    if (d < best_d) best_d = d, best = &c;
  }
  return best;
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
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 1 : 0;
  }
  if (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "-v")) {
    print_version();
    return 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const iris::Error& e) {
      std::fprintf(stderr, "iris %s: error: %s\n", c.name, e.what());
      return 1;
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr,
                   "iris %s: error: out of memory (the model, images or limits asked for more "
                   "than this machine has)\n",
                   c.name);
      return 1;
    } catch (const std::filesystem::filesystem_error& e) {
      // A path the user gave that the system refused (a symbolic link loop, a permission): the
      // path and the system's reason, not the library's wording.
      std::fprintf(stderr, "iris %s: error: %s%s%s: %s\n", c.name, e.path1().c_str(),
                   e.path2().empty() ? "" : " -> ", e.path2().c_str(), e.code().message().c_str());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "iris %s: unexpected error: %s\n", c.name, e.what());
      return 1;
    }
  }
  if (const Command* c = closest_command(argv[1])) {
    std::fprintf(stderr, "iris: unknown command '%s'; did you mean '%s'?\n\n", argv[1], c->name);
  } else {
    std::fprintf(stderr, "iris: unknown command '%s'\n\n", argv[1]);
  }
  print_usage(stderr);
  return 1;
}
