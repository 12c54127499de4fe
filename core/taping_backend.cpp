#include "core/taping_backend.h"

#include <memory>
#include <utility>

#include "core/error.h"

namespace iris {

TapingBackend::TapingBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {
  IRIS_CHECK(in_ != nullptr, "TapingBackend needs a backend to run its ops");
}

void TapingBackend::refuse_while_taping(const char* what) const {
  IRIS_CHECK(!taping_ || std::this_thread::get_id() != taping_thread_, what,
             " inside a graph capture: a captured graph cannot contain host traffic, so this "
             "value would be frozen at capture (move it into device memory that the graph reads)");
}

void* TapingBackend::allocate(size_t bytes) {
  refuse_while_taping("allocating memory");
  return in_->allocate(bytes);
}

void TapingBackend::deallocate(void* ptr) {
  refuse_while_taping("freeing memory");
  in_->deallocate(ptr);
}

void TapingBackend::write(const Tensor& dst, const void* host_src, DType src_dtype) {
  refuse_while_taping("a copy from host memory");
  in_->write(dst, host_src, src_dtype);
}

void TapingBackend::read(void* host_dst, DType dst_dtype, const Tensor& src) {
  refuse_while_taping("a copy to host memory");
  in_->read(host_dst, dst_dtype, src);
}

void TapingBackend::synchronize() {
  refuse_while_taping("a device synchronisation");
  in_->synchronize();
}

void TapingBackend::record_timing_mark(int slot) {
  refuse_while_taping("a timing mark");
  in_->record_timing_mark(slot);
}

double TapingBackend::timing_mark_elapsed_ms(int from, int to) {
  refuse_while_taping("reading a timing mark");
  return in_->timing_mark_elapsed_ms(from, to);
}

bool TapingBackend::begin_op_tape() {
  IRIS_CHECK(!taping_, "an op tape is already open on the ", name(), " backend; tapes do not nest");
  taping_ = true;
  taping_thread_ = std::this_thread::get_id();
  ops_.clear();
  return true;
}

std::function<void()> TapingBackend::end_op_tape() {
  IRIS_CHECK(taping_, "end_op_tape without an open tape on the ", name(), " backend");
  taping_ = false;
  auto ops = std::make_shared<std::vector<std::function<void()>>>(std::move(ops_));
  ops_.clear();
  return [ops] {
    for (const auto& op : *ops) op();
  };
}

}  // namespace iris
