// CUDA-specific access to a backend made by make_cuda_backend(), for code that drives CUDA
// directly (graph capture of a decode step, tests).
#pragma once

#include <cuda_runtime.h>

#include "core/backend.h"

namespace iris {

// The stream every op of this CUDA backend is enqueued on. Capturing it (cudaStreamBeginCapture)
// records a sequence of ops as a graph: no op allocates, synchronises or reads device data on
// the host. write()/read()/synchronize() must stay outside a capture. Throws iris::Error when
// `backend` is not a CUDA backend.
cudaStream_t cuda_stream(Backend& backend);

}  // namespace iris
