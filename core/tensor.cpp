#include "core/tensor.h"

#include <cstring>

namespace iris {

Tensor::Tensor(void* data_, DType dtype_, Device device_, std::initializer_list<int64_t> dims)
    : Tensor(data_, dtype_, device_, std::vector<int64_t>(dims)) {}

Tensor::Tensor(void* data_, DType dtype_, Device device_, const std::vector<int64_t>& dims)
    : data(data_), dtype(dtype_), device(device_), ndim(static_cast<int>(dims.size())) {
  IRIS_CHECK(ndim <= kMaxDims, "tensor rank ", ndim, " exceeds the maximum of ", kMaxDims);
  for (int i = 0; i < ndim; ++i) {
    IRIS_CHECK(dims[i] >= 0, "negative tensor dimension ", dims[i]);
    shape[i] = dims[i];
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

int64_t Tensor::dim(int i) const {
  const int k = i < 0 ? ndim + i : i;
  IRIS_CHECK(k >= 0 && k < ndim, "dimension index ", i, " out of range for ", shape_str());
  return shape[k];
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "] " + dtype_name(dtype);
}

Tensor Tensor::view(std::initializer_list<int64_t> dims) const {
  return view(std::vector<int64_t>(dims));
}

Tensor Tensor::view(const std::vector<int64_t>& dims) const {
  Tensor t(data, dtype, device, dims);
  IRIS_CHECK(t.numel() == numel(), "cannot view ", shape_str(), " as ", t.shape_str());
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  IRIS_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0], "slice [", begin, ", ",
             end, ") out of range for ", shape_str());
  Tensor t = *this;
  const int64_t row_elems = shape[0] == 0 ? 0 : numel() / shape[0];
  t.data = static_cast<char*>(data) + begin * row_elems * static_cast<int64_t>(dtype_size(dtype));
  t.shape[0] = end - begin;
  return t;
}

HostTensor::HostTensor(DType dtype, const std::vector<int64_t>& dims) {
  view_ = Tensor(nullptr, dtype, Device::cpu, dims);
  storage_.assign((view_.nbytes() + 7) / 8 + 1, 0);
  view_.data = storage_.data();
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this == &other) return *this;
  storage_ = other.storage_;
  view_ = other.view_;
  view_.data = storage_.empty() ? nullptr : storage_.data();
  return *this;
}

std::vector<float> HostTensor::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  convert_elements(out.data(), DType::f32, view_.data, view_.dtype, numel());
  return out;
}

}  // namespace iris
