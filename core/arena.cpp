#include "core/arena.h"

#include <sys/mman.h>

#include <utility>

#include "core/error.h"

namespace iris {

Arena::Arena(Backend& backend, size_t capacity) : backend_(&backend), capacity_(capacity) {
  if (capacity_ > 0) base_ = static_cast<char*>(backend.allocate(capacity_));
}

Arena Arena::addresses_only(Device device, size_t capacity) {
  Arena a;
  a.reserved_ = true;
  a.device_ = device;
  a.capacity_ = capacity;
  if (capacity > 0) {
    void* p =
        mmap(nullptr, capacity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    IRIS_CHECK(p != MAP_FAILED, "could not reserve ", capacity,
               " bytes of address space for a buffer layout");
    a.base_ = static_cast<char*>(p);
  }
  return a;
}

Arena::~Arena() {
  release();
}

Arena::Arena(Arena&& other) noexcept {
  *this = std::move(other);
}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    release();
    backend_ = std::exchange(other.backend_, nullptr);
    reserved_ = std::exchange(other.reserved_, false);
    device_ = other.device_;
    base_ = std::exchange(other.base_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
    used_ = std::exchange(other.used_, 0);
    allocation_count_ = std::exchange(other.allocation_count_, 0);
  }
  return *this;
}

void Arena::release() {
  if (reserved_ && base_) munmap(base_, capacity_);
  if (backend_ && base_) backend_->deallocate(base_);
  base_ = nullptr;
}

Tensor Arena::alloc(DType dtype, const std::vector<int64_t>& dims) {
  Tensor t(nullptr, dtype, backend_ ? backend_->device() : device_, dims);
  const size_t bytes = (t.nbytes() + kAlignment - 1) / kAlignment * kAlignment;
  ++allocation_count_;
  if (!planning()) {
    IRIS_CHECK(used_ + bytes <= capacity_, "arena exhausted: ", used_ + bytes,
               " bytes needed, capacity ", capacity_,
               " (the memory plan is smaller than the request; raise the planned maximum)");
    t.data = base_ + used_;
  }
  used_ += bytes;
  return t;
}

}  // namespace iris
