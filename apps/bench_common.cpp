#include "apps/bench_common.h"

#include <cstdio>
#include <filesystem>

#include "core/error.h"

namespace iris {

nlohmann::json run_peer(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  IRIS_CHECK(p != nullptr, "cannot run the peer command: ", command);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  IRIS_CHECK(rc == 0, "the peer command failed (exit ", rc, "): ", command);
  const size_t at = out.rfind("\n{");
  return nlohmann::json::parse(at == std::string::npos ? out : out.substr(at + 1));
}

std::string find_bench_config(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::is_regular_file(path)) return path;
  std::vector<fs::path> candidates;
  fs::path rel = path;
  if (rel.is_relative()) {
    if (path.find('/') == std::string::npos && rel.extension() != ".json")
      rel = fs::path("bench/configs") / (path + ".json");
    candidates.push_back(rel);
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) candidates.push_back(exe.parent_path().parent_path() / rel);
  }
  std::string looked;
  for (const fs::path& c : candidates) {
    if (fs::is_regular_file(c)) return c.lexically_normal().string();
    looked += (looked.empty() ? "" : ", ") + c.lexically_normal().string();
  }
  IRIS_FAIL("--config ", path, " does not exist",
            looked.empty() ? std::string() : " (looked for " + looked + ")",
            "; give a config.json or the name of one in bench/configs/ (qwen3vl_2b, ...)");
}

}  // namespace iris
