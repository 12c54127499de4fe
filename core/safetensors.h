// Reading (mmap) and writing (atomic) safetensors files, single or sharded.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace iris {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // inside the mapping
  size_t nbytes = 0;
  std::string file;  // for error messages
};

// One mapped file, validated on open as strictly as the reference implementation: dtype known,
// shape consistent with the byte range without overflow, and the ranges tiling the data section
// exactly (no gap, no overlap, no trailing bytes).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& at(const std::string& name) const;
  // A copy converted to f32 (from f32/bf16/f16) or kept as integer (i32/i64).
  HostTensor load(const std::string& name) const;

 private:
  void parse_header();

  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, or model.safetensors.index.json with shards.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& dir);
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const SafetensorsEntry& at(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsEntry*> index_;
  std::string dir_;
};

// Converts an entry's elements to f32 into dst (numel floats). Integer dtypes are rejected.
void convert_to_f32(const SafetensorsEntry& e, float* dst);
// The same into a vector of the entry's element count.
std::vector<float> to_f32(const SafetensorsEntry& e);
// The index of the first NaN or Inf element of a floating-point entry, or -1 when all are
// finite. Reads the raw bits (no conversion) on every thread: a checkpoint in the compute dtype
// is checked at the speed of memory, and its pages are mapped in on the way.
int64_t first_non_finite(const SafetensorsEntry& e);

struct SafetensorsWriteItem {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;  // host memory, dtype elements
};

// Writes under a temporary name in the same directory, fsyncs, then renames into place, so that
// a reader never sees a half-written file.
void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace iris
