#include "apps/bench_common.h"

#include <cstdio>
#include <filesystem>

#include "core/arena.h"
#include "core/error.h"

namespace iris {

HardwareLimits measure_limits(Backend& be, bool quick, int iters) {
  HardwareLimits h;
  const int64_t n = be.device() == Device::cuda ? (quick ? 4096 : 8192) : 512;
  const int64_t copy_bytes = be.device() == Device::cuda ? (int64_t(1) << 30) : (int64_t(1) << 26);
  Arena plan;
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(DType::f32, {copy_bytes / 4});
  plan.alloc(DType::f32, {copy_bytes / 4});
  Arena a(be, plan.used());
  const Tensor x = a.alloc(be.compute_dtype(), {n, n}), w = a.alloc(be.compute_dtype(), {n, n}),
               y = a.alloc(be.compute_dtype(), {n, n});
  const Tensor src = a.alloc(DType::f32, {copy_bytes / 4}),
               dst = a.alloc(DType::f32, {copy_bytes / 4});
  be.fill_zero(x);
  be.fill_zero(w);
  be.fill_zero(src);
  const double tg = time_median(be, iters, [&] { be.linear(y, x, w, Tensor(), false); });
  h.gemm_tflops = 2.0 * double(n) * n * n / tg / 1e12;
  h.gemm_n = n;
  const double tc = time_median(be, iters, [&] { be.copy(dst, src); });
  h.copy_gbps = 2.0 * double(copy_bytes) / tc / 1e9;
  return h;
}

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
