// Where this process sits in a multi-process run, as the launcher says: mpirun/mpiexec (OpenMPI's
// OMPI_COMM_WORLD_*) or a Slurm step started by srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS or
// SLURM_NTASKS, SLURM_LOCALID). A process started without a launcher is rank 0 of 1 and never
// touches MPI.
#pragma once

#include <functional>
#include <string>

namespace iris {

struct LaunchEnv {
  int rank = 0;
  int world = 1;
  int local_rank = 0;  // rank among the processes of this host: picks the GPU
  // Processes of this run on this host, which share its cores.
  int local_size = 1;
  // "mpirun", "srun", or "" when no launcher started the process.
  std::string launcher;
  bool launched() const { return !launcher.empty(); }
};

// Reads the launcher's variables through `get` (std::getenv by default). Malformed or
// inconsistent values are an error naming the variable.
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& get = {});

}  // namespace iris
