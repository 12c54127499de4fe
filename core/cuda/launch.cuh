// Kernel launches as programmatic dependents (sm_90+): the kernel may begin while the kernel
// before it on the stream is still running, once every block of that one has called
// pdl_launch_dependents() (device_utils.cuh) or exited. Its blocks must call pdl_wait() before
// they touch anything an earlier kernel writes; what they do before that (index math, loading
// weights) overlaps the previous kernel's tail and hides the launch latency between the many
// small kernels of a decode step. Stream capture records these as programmatic graph edges.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "core/cuda/cuda_check.h"

namespace iris::cuda {

// Cleared when a device without programmatic launches is initialised (set_programmatic_launch).
inline std::atomic<bool> g_programmatic_launch{true};

// Whether the device runs programmatic dependent launches (sm_90+); called once per device: one
// without them turns them off for all.
inline void set_programmatic_launch(bool supported) {
  if (!supported) g_programmatic_launch.store(false, std::memory_order_relaxed);
}

template <typename... KernelArgs, typename... Args>
void launch_programmatic(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (g_programmatic_launch.load(std::memory_order_relaxed)) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  IRIS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace iris::cuda
