// Host-side launcher of Backend::image_patches on the device (image_patches.cu): RGB bytes in,
// normalised patch rows out, so that an image travels to the GPU as one byte a pixel and the host
// does no per-pixel work. Enqueues on `s` without synchronising (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/image_patches.h"

namespace iris::cuda {

// frames: 1 or temporal_patch_size frames of g.height x g.width x 3 bytes (n_frames); dst: f32 or
// bf16 (dst_f32) rows of g.row_values(). The row indices are not checked on the device.
void launch_image_patches(void* dst, bool dst_f32, const uint8_t* frames, int n_frames,
                          const float* table, const int32_t* dst_rows, const ImagePatchGeometry& g,
                          cudaStream_t s);

}  // namespace iris::cuda
