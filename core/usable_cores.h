// How many cores this process may use: the CPUs of its affinity mask (taskset, cpuset, a
// launcher's binding), capped by the CPU quota of its cgroup and the cgroups above it (docker
// --cpus, Kubernetes limits, systemd CPUQuota). OpenMP sizes its default team from the mask
// alone, so in a container with a quota it starts more threads than it may run, and they wait
// on each other's time slices.
#pragma once

#include <string>

namespace iris {

// The cores of the affinity mask capped by every quota found, rounded up; at least 1.
int usable_cores();

// The parts, for tests. A cgroup v2 cpu.max ("max 100000" or "150000 100000"), or a v1 quota and
// period (cpu.cfs_quota_us, -1 for none, and cpu.cfs_period_us): the cores the quota allows,
// rounded up, or 0 when it sets no limit or cannot be read.
int cores_of_cpu_max(const std::string& cpu_max);
int cores_of_cfs_quota(const std::string& quota_us, const std::string& period_us);
// The cgroup paths of /proc/self/cgroup's text: v2's ("0::/a/b") and v1's cpu controller's
// ("N:cpu,cpuacct:/a/b"); "" where there is none.
std::string cgroup_v2_path(const std::string& proc_self_cgroup);
std::string cgroup_v1_cpu_path(const std::string& proc_self_cgroup);

}  // namespace iris
