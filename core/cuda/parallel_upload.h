// Many host-to-device writes at once, checked for NaN and Inf on the way: a checkpoint's weights
// from the page cache. One thread's copy loop into pinned memory ran at about 7 GB/s on an H200
// host, and a thread team per 8 MB block waited at every barrier for whichever thread the
// scheduler had put beside the tokenizer's parse; a few threads that each take whole blocks, copy
// them into pinned buffers of their own and upload them on streams of their own run at the
// host's memory rate (42 GB/s with 16 threads, from a 4.3 GB file in the page cache).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace iris::cuda {

// Backend::write_all_finite for the CUDA backend. The copies start after the work queued on
// `after` so far; every copy is done when it returns. `workers` threads (at least 1).
std::vector<int64_t> upload_all_finite(const std::vector<Backend::HostWrite>& writes,
                                       cudaStream_t after, int workers);

}  // namespace iris::cuda
