#include "parallel/communicator.h"

#include <cstdlib>

#include "core/error.h"

namespace iris {

int64_t all_reduce_scratch_elements(int64_t n, int world) {
  return (n + world - 1) / world * world;
}

void Communicator::reduce_scatter(const Tensor& out, const Tensor& in, const Tensor& scratch) {
  const int64_t n = out.numel(), w = size();
  IRIS_CHECK(in.numel() == n * w && scratch.numel() >= n * w && out.dtype == DType::f32 &&
                 in.dtype == DType::f32 && scratch.dtype == DType::f32,
             "reduce_scatter: f32 out [n], in [", w, " * n] and scratch [", w, " * n], got ",
             out.shape_str(), ", ", in.shape_str(), ", ", scratch.shape_str());
  const Tensor pieces = scratch.view({scratch.numel()}).slice(0, n * w);
  all_to_all(pieces, in.view({n * w}));
  sum_pieces(out.view({n}), pieces);
}

void Communicator::all_reduce(const Tensor& buf, const Tensor& scratch) {
  const int64_t n = buf.numel(), w = size();
  IRIS_CHECK(buf.dtype == DType::f32 && scratch.dtype == DType::f32 &&
                 scratch.numel() >= all_reduce_scratch_elements(n, size()),
             "all_reduce: f32 buffer and scratch of at least ",
             all_reduce_scratch_elements(n, size()), " elements, got ", buf.shape_str(), " and ",
             scratch.shape_str());
  const Tensor flat = buf.view({n}), sc = scratch.view({scratch.numel()});
  // The pieces of the reduce-scatter are equal; the last n % w elements, fewer than one per rank,
  // are gathered whole and summed in the same rank order on every rank.
  const int64_t piece = n / w, body = piece * w, tail = n - body;
  if (piece > 0) {
    const Tensor mine = flat.slice(rank() * piece, (rank() + 1) * piece);
    reduce_scatter(mine, flat.slice(0, body), sc);
    all_gather(flat.slice(0, body), mine);
  }
  if (tail > 0) {
    const Tensor pieces = sc.slice(0, tail * w);
    all_gather(pieces, flat.slice(body, n));
    sum_pieces(flat.slice(body, n), pieces);
  }
}

}  // namespace iris

#ifdef IRIS_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace iris {

#ifndef IRIS_WITH_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(Backend&, MpiSession*, int, int) {
  IRIS_FAIL(
      "training on GPUs in several processes needs NCCL, and this iris was built without it "
      "(install NCCL with the CUDA toolkit and rebuild)");
}

bool nccl_available() {
  return false;
}

std::unique_ptr<StallWatchdog> make_stall_watchdog(Backend&, double, int) {
  return nullptr;
}
#endif

int local_cuda_device(const LaunchEnv& env) {
#ifdef IRIS_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return 0;
  // A launcher that gives each process one visible GPU leaves n = 1: device 0 for everyone.
  // Two ranks on one GPU would only meet NCCL's "invalid usage" at its first collective.
  if (n == 1 && env.local_rank > 0 && env.world > 1) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    IRIS_CHECK(visible != nullptr && *visible != '\0', "rank ", env.rank, " is process ",
               env.local_rank + 1,
               " on its host, which has one GPU: start one process per GPU (mpirun -np, srun "
               "--ntasks-per-node), or train on the CPU (train.device=cpu)");
    return 0;
  }
  IRIS_CHECK(env.local_rank < n, "rank ", env.rank, " is process ", env.local_rank + 1,
             " on its host, which has ", n,
             " GPUs: start one process per GPU (mpirun -np, srun --ntasks-per-node), or train on "
             "the CPU (train.device=cpu)");
  return env.local_rank;
#else
  (void)env;
  return 0;
#endif
}

}  // namespace iris
