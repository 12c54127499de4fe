// The normalised patch rows of RGB frames (Qwen-VL preprocessing's last step, spec 2.4-2.5), as
// Backend::image_patches computes them: the host reference that the CPU backend and the host
// preprocessing both run, and that the CUDA kernel matches bit for bit.
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"

namespace iris {

// The value of each byte per channel after rescale and normalise: table[c * 256 + v].
using PixelTable = std::array<float, 3 * 256>;

struct ImagePatchGeometry {
  int height = 0, width = 0;  // multiples of patch_size * merge_size
  int patch_size = 16, temporal_patch_size = 2, merge_size = 2;
  int64_t patches() const { return int64_t{height / patch_size} * (width / patch_size); }
  int64_t row_values() const { return int64_t{3} * temporal_patch_size * patch_size * patch_size; }
};

// frames[f] (f < temporal_patch_size): RGB bytes [height, width, 3] of the temporal slice's
// frame f (an image passes the same pointer for every f). Patch i, in merge-window order (merged
// blocks row-major, the merge_size^2 patches of a block row-major inside it), goes to row
// dst_rows[i] of dst (row i where dst_rows is null), dst_cols values apart; within a row: channel,
// frame, pixel row, pixel column (a Conv3d kernel's flattening), each value table[c * 256 + v].
void image_patches_host(float* dst, int64_t dst_cols, const uint8_t* const* frames,
                        const ImagePatchGeometry& g, const float* table, const int32_t* dst_rows);

// Refuses what Backend::image_patches cannot do with these tensors (shapes, dtypes, a geometry
// that is not whole merge windows), naming `op`; dst's dtype and the tensors' device are the
// backend's to check. The row indices are read where they are read (the CPU checks them).
void check_image_patches(const Tensor& dst, const Tensor& frames, const Tensor& table,
                         const Tensor& dst_rows, const ImagePatchGeometry& g, const char* op);

}  // namespace iris
