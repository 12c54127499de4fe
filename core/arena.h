// One allocation up front, then bump-pointer views. Sizes come from a planning pass over the
// maximum shapes, so a steady-state step never allocates (which is also what makes CUDA graph
// capture possible: every address is fixed).
#pragma once

#include <cstddef>
#include <vector>

#include "core/backend.h"

namespace iris {

class Arena {
 public:
  // A planning arena: alloc() hands out null-data tensors and only counts bytes.
  Arena() = default;
  // A real arena of exactly `capacity` bytes on the backend.
  Arena(Backend& backend, size_t capacity);
  // Addresses only: `capacity` bytes of address space that hold no memory (reserved, never
  // readable), whose tensors say `device`. For the layout of a buffer no rank holds whole (a
  // sharded optimizer's f32 gradients): the offsets of its tensors, with nothing behind them.
  static Arena addresses_only(Device device, size_t capacity);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;

  Tensor alloc(DType dtype, const std::vector<int64_t>& dims);
  bool planning() const { return backend_ == nullptr && !reserved_; }
  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }
  // The first byte of the allocation (null while planning), for flat views over all tensors.
  void* base() const { return base_; }
  // Every alloc() call ever made; a test asserts that it stays flat across decode steps.
  size_t allocation_count() const { return allocation_count_; }

  static constexpr size_t kAlignment = 256;

 private:
  void release();
  Backend* backend_ = nullptr;
  bool reserved_ = false;
  Device device_ = Device::cpu;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t allocation_count_ = 0;
};

}  // namespace iris
