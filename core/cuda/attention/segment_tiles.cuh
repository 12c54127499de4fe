// Which varlen segment a query (or key) tile of the attention kernels belongs to.
//
// A graph's vision call runs with the segment capacity of its bucket (up to a window per merge
// unit for Qwen2.5-VL), most of them empty. Numbering tiles segment after segment made every
// block scan the segments before its own: a 1344x1344 Qwen2.5-VL-7B encode through graphs took
// 8x its eager time. Here segment s owns the tiles [T(s), T(s + 1)) with
// T(s) = floor(cu[s] / rows) + s, found by binary search:
//  - T(s + 1) - T(s) = floor(cu[s + 1] / rows) - floor(cu[s] / rows) + 1 >= ceil(len / rows), so
//    every segment gets its tiles, plus at most one spare block that leaves at once;
//  - a zero-length segment costs one spare block, and the trailing empty ones of a padded call
//    come after every real tile in dispatch order;
//  - T(n) plus the tiles of rows past cu[n] is at most ceil(total / rows) + n, the grid's bound.
// The tile a block computes is the same as before; only which block computes it moved, so the
// results are unchanged to the bit.
#pragma once

#include <cstdint>

namespace iris::cuda {

struct SegmentTile {
  int segment;   // in [0, n]; n means past the last segment
  int64_t tile;  // index within the segment's tiles (or, past the last, from cu[n] on)
};

__device__ __forceinline__ int64_t segment_first_tile(const int32_t* cu, int s, int rows) {
  return static_cast<int64_t>(cu[s]) / rows + s;
}

__device__ __forceinline__ SegmentTile find_segment_tile(const int32_t* cu, int n_segments,
                                                         int rows, int64_t block) {
  int lo = 0, hi = n_segments;  // the largest s in [lo, hi] with T(s) <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segment_first_tile(cu, mid, rows) <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  return SegmentTile{lo, block - segment_first_tile(cu, lo, rows)};
}

}  // namespace iris::cuda
