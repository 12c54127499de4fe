#include "parallel/launch.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace iris {
namespace {

int env_int(const std::function<const char*(const char*)>& get, const char* name, int min) {
  const char* v = get(name);
  IRIS_CHECK(v != nullptr && *v != '\0', "the launcher did not set ", name);
  int out = 0;
  const char* end = v + std::strlen(v);
  const auto [p, ec] = std::from_chars(v, end, out);
  IRIS_CHECK(ec == std::errc() && p == end && out >= min, "the launcher's ", name, "='", v,
             "' is not an integer >= ", min);
  return out;
}

}  // namespace

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& get_or_empty) {
  const std::function<const char*(const char*)> get =
      get_or_empty ? get_or_empty : [](const char* n) -> const char* { return std::getenv(n); };
  LaunchEnv e;
  if (get("OMPI_COMM_WORLD_SIZE") != nullptr) {
    // mpirun inside a Slurm allocation sets both families; OpenMPI's describe the processes.
    e.launcher = "mpirun";
    e.world = env_int(get, "OMPI_COMM_WORLD_SIZE", 1);
    e.rank = env_int(get, "OMPI_COMM_WORLD_RANK", 0);
    e.local_rank =
        get("OMPI_COMM_WORLD_LOCAL_RANK") ? env_int(get, "OMPI_COMM_WORLD_LOCAL_RANK", 0) : 0;
    e.local_size =
        get("OMPI_COMM_WORLD_LOCAL_SIZE") ? env_int(get, "OMPI_COMM_WORLD_LOCAL_SIZE", 1) : 1;
  } else if (get("SLURM_PROCID") != nullptr && get("SLURM_STEP_ID") != nullptr) {
    // An sbatch script itself runs with SLURM_NTASKS set but as a single process; only a step
    // that srun started (SLURM_STEP_ID) has one process per task.
    e.launcher = "srun";
    e.world = get("SLURM_STEP_NUM_TASKS") ? env_int(get, "SLURM_STEP_NUM_TASKS", 1)
                                          : env_int(get, "SLURM_NTASKS", 1);
    e.rank = env_int(get, "SLURM_PROCID", 0);
    e.local_rank = get("SLURM_LOCALID") ? env_int(get, "SLURM_LOCALID", 0) : 0;
    // "4(x2)" or "4,3": tasks per node, compressed; this node's count is not named, so the
    // first node's stands for it (it only sizes the share of cores each process takes).
    if (const char* per_node = get("SLURM_STEP_TASKS_PER_NODE")) {
      int n = 0;
      const char* end = per_node + std::strlen(per_node);
      const auto [p, ec] = std::from_chars(per_node, end, n);
      if (ec == std::errc() && p != per_node && n >= 1) e.local_size = n;
    }
  }
  IRIS_CHECK(e.rank < e.world, "the launcher (", e.launcher, ") gave this process rank ", e.rank,
             " of a world of ", e.world, " (",
             e.launcher == "mpirun" ? "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE"
                                    : "SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS",
             ")");
  return e;
}

}  // namespace iris
