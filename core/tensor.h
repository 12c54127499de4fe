// A non-owning, contiguous, row-major tensor view (llm.c/ggml style), and an owning host tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace iris {

enum class Device : uint8_t { cpu, cuda };

constexpr int kMaxDims = 5;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};

  Tensor() = default;
  Tensor(void* data, DType dtype, Device device, std::initializer_list<int64_t> dims);
  Tensor(void* data, DType dtype, Device device, const std::vector<int64_t>& dims);

  bool defined() const { return data != nullptr; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const;  // negative i counts from the end
  int64_t cols() const { return ndim == 0 ? 1 : shape[ndim - 1]; }
  int64_t rows() const { return ndim == 0 ? 1 : numel() / cols(); }
  std::vector<int64_t> dims() const { return {shape, shape + ndim}; }
  std::string shape_str() const;  // e.g. "[2, 3] bf16"

  // Same memory, new shape with the same element count.
  Tensor view(std::initializer_list<int64_t> dims) const;
  Tensor view(const std::vector<int64_t>& dims) const;
  // Rows [begin, end) along dim 0.
  Tensor slice(int64_t begin, int64_t end) const;

  template <typename T>
  T* as() const;
};

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::bf16;
}

template <typename T>
T* Tensor::as() const {
  IRIS_CHECK(dtype == dtype_of<T>() || (sizeof(T) == 2 && dtype_size(dtype) == 2),
             "tensor of dtype ", dtype_name(dtype), " accessed as another type");
  return static_cast<T*>(data);
}

// An owning tensor in host memory. Used for inputs prepared on the host, goldens and tests.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, const std::vector<int64_t>& dims);
  HostTensor(const HostTensor& other) { *this = other; }
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&& other) noexcept = default;
  HostTensor& operator=(HostTensor&& other) noexcept = default;

  const Tensor& tensor() const { return view_; }
  operator const Tensor&() const { return view_; }
  DType dtype() const { return view_.dtype; }
  int64_t numel() const { return view_.numel(); }
  int64_t dim(int i) const { return view_.dim(i); }
  std::vector<int64_t> dims() const { return view_.dims(); }
  template <typename T>
  T* data() const {
    return view_.as<T>();
  }
  // Every element converted to f32 (bf16/f16/i32/i64 too); convenient in tests.
  std::vector<float> to_f32() const;

 private:
  std::vector<uint64_t> storage_;  // 8-byte aligned
  Tensor view_;
};

}  // namespace iris
