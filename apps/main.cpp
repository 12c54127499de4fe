// The iris command line: one binary, subcommands as llama.cpp/git do.
#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.h"

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::printf("usage: iris <command> [options]\n\ncommands:\n");
    return argc < 2 ? 1 : 0;
  }
  std::fprintf(stderr, "iris: unknown command '%s' (run iris --help)\n", argv[1]);
  return 1;
}
