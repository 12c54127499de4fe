#include "core/usable_cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace iris {
namespace {

std::string read_small_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) return "";
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

int ceil_ratio(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return 0;
  return std::max(1, static_cast<int>(std::ceil(quota / period)));
}

// The tightest quota of `dir` and the folders above it, up to `root` (0: none).
template <typename Read>
int tightest_up_to(const std::filesystem::path& root, std::filesystem::path dir, Read read) {
  if (dir.filename().empty()) dir = dir.parent_path();  // the root cgroup's "/" leaves a slash
  int best = 0;
  while (true) {
    const int c = read(dir);
    if (c > 0) best = best == 0 ? c : std::min(best, c);
    if (dir == root || !dir.has_parent_path() || dir.parent_path() == dir) break;
    dir = dir.parent_path();
    if (dir.string().size() < root.string().size()) break;
  }
  return best;
}

}  // namespace

int cores_of_cpu_max(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max") return 0;
  try {
    return ceil_ratio(std::stod(quota), period);
  } catch (...) {
    return 0;
  }
}

int cores_of_cfs_quota(const std::string& quota_us, const std::string& period_us) {
  try {
    return ceil_ratio(std::stod(quota_us), std::stod(period_us));
  } catch (...) {
    return 0;
  }
}

std::string cgroup_v2_path(const std::string& proc_self_cgroup) {
  std::istringstream in(proc_self_cgroup);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("0::", 0) == 0) return line.substr(3);
  return "";
}

std::string cgroup_v1_cpu_path(const std::string& proc_self_cgroup) {
  std::istringstream in(proc_self_cgroup);
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::istringstream controllers(line.substr(a + 1, b - a - 1));
    for (std::string c; std::getline(controllers, c, ',');)
      if (c == "cpu") return line.substr(b + 1);
  }
  return "";
}

int usable_cores() {
  namespace fs = std::filesystem;
  int cores = 0;
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cores = CPU_COUNT(&mask);
  if (cores <= 0) cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::string self = read_small_file("/proc/self/cgroup");
  const fs::path v2_root = "/sys/fs/cgroup";
  const std::string v2 = cgroup_v2_path(self);
  int quota = 0;
  if (!v2.empty() && fs::exists(v2_root / "cgroup.controllers"))
    quota = tightest_up_to(v2_root, v2_root / fs::path(v2).relative_path(), [](const fs::path& d) {
      return cores_of_cpu_max(read_small_file(d / "cpu.max"));
    });
  const std::string v1 = cgroup_v1_cpu_path(self);
  const fs::path v1_root =
      fs::exists("/sys/fs/cgroup/cpu") ? "/sys/fs/cgroup/cpu" : "/sys/fs/cgroup/cpu,cpuacct";
  if (quota == 0 && !v1.empty())
    quota = tightest_up_to(v1_root, v1_root / fs::path(v1).relative_path(), [](const fs::path& d) {
      return cores_of_cfs_quota(read_small_file(d / "cpu.cfs_quota_us"),
                                read_small_file(d / "cpu.cfs_period_us"));
    });
  return quota > 0 ? std::min(cores, quota) : cores;
}

}  // namespace iris
