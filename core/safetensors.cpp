#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "core/json_read.h"

namespace iris {

namespace {

DType parse_dtype(const std::string& s, const std::string& file, const std::string& name) {
  if (s == "F32") return DType::f32;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "I32") return DType::i32;
  if (s == "I64") return DType::i64;
  IRIS_FAIL(file, ": tensor '", name, "' has dtype ", s,
            ", which Iris does not load (supported: F32, BF16, F16, I32, I64)");
}

const char* dtype_tag(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  return "?";
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = open_regular_file(path, "safetensors file");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    IRIS_FAIL("cannot stat ", path, ": ", std::strerror(err));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    IRIS_FAIL(path, " is truncated: ", size_, " bytes, too short for a safetensors header");
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    IRIS_FAIL("cannot mmap ", path, ": ", std::strerror(map_err));
  }
  try {
    parse_header();
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

// The checks of the reference implementation (huggingface/safetensors, Metadata::validate and
// SafeTensors::read_metadata): a header of at most 100 MB that is a JSON object, every tensor's
// byte count equal to its shape's element count times its dtype's size without overflow, and the
// tensors' ranges tiling the data section exactly: sorted by offset they start at 0, each begins
// where the previous ends, and the last ends at the end of the file. A header length that is off
// by even one byte therefore fails instead of shifting every tensor.
void SafetensorsFile::parse_header() {
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  const auto* bytes = static_cast<const unsigned char*>(map_);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);
  IRIS_CHECK(header_len <= kMaxHeaderBytes, path_, ": the safetensors header claims ", header_len,
             " bytes, more than the 100 MB limit; the file is corrupt or not safetensors");
  IRIS_CHECK(header_len <= size_ - 8, path_, " is truncated or corrupt: header length ", header_len,
             " exceeds the file size ", size_);
  IRIS_CHECK(header_len >= 2 && bytes[8] == '{', path_,
             ": the safetensors header does not start with '{'; the file is corrupt or not "
             "safetensors");
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
  const nlohmann::json header =
      parse_json(text, path_ + " (safetensors header)", kJsonSafetensorsHeaderLimits);
  IRIS_CHECK(header.is_object(), path_, ": the safetensors header is not a JSON object");
  const size_t data_begin = 8 + header_len;
  const uint64_t data_size = size_ - data_begin;
  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string where = path_ + ": tensor '" + clip_text(it.key(), 120) + "'";
    if (it.key() == "__metadata__") {
      IRIS_CHECK(it.value().is_object(), path_, ": __metadata__ must be an object of strings, got ",
                 json_excerpt(it.value()));
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        metadata_[m.key()] = json_string(m.value(), path_ + ": __metadata__", m.key());
      continue;
    }
    const auto& v = it.value();
    IRIS_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        where, " needs dtype, shape and data_offsets, got ", json_excerpt(v));
    SafetensorsEntry e;
    e.name = it.key();
    e.file = path_;
    e.dtype = parse_dtype(json_string(v["dtype"], where, "dtype"), path_, e.name);
    const auto& shape = v["shape"];
    IRIS_CHECK(shape.is_array(), where, ": shape must be a list of integers, got ",
               json_excerpt(shape));
    uint64_t numel = 1;
    for (const auto& d : shape) {
      const int64_t n = json_integer(d, where, "shape", 0, INT64_MAX);
      e.shape.push_back(n);
      IRIS_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(n), &numel), where,
                 ": the element count of shape ", json_excerpt(shape), " overflows 64 bits");
    }
    uint64_t nbytes = 0;
    IRIS_CHECK(!__builtin_mul_overflow(numel, uint64_t(dtype_size(e.dtype)), &nbytes), where,
               ": the byte size of shape ", json_excerpt(shape), " overflows 64 bits");
    const auto& off = v["data_offsets"];
    IRIS_CHECK(off.is_array() && off.size() == 2, where,
               ": data_offsets must be a list of two integers, got ", json_excerpt(off));
    const uint64_t begin = json_integer(off[0], where, "data_offsets[0]", 0, INT64_MAX);
    const uint64_t end = json_integer(off[1], where, "data_offsets[1]", 0, INT64_MAX);
    IRIS_CHECK(begin <= end && end <= data_size, where, ": data_offsets [", begin, ", ", end,
               ") run past the data section (", data_size,
               " bytes); the file is truncated or corrupt");
    IRIS_CHECK(end - begin == nbytes, where, ": data_offsets hold ", end - begin,
               " bytes but shape ", json_excerpt(shape), " and dtype ", dtype_tag(e.dtype),
               " need ", nbytes);
    e.nbytes = static_cast<size_t>(nbytes);
    e.data = bytes + data_begin + begin;
    auto placed = entries_.emplace(e.name, std::move(e));
    ranges.push_back({begin, end, &placed.first->first});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const Range& r : ranges) {
    IRIS_CHECK(r.begin >= expected, path_, ": tensor '", clip_text(*r.name, 120),
               "' overlaps the tensor before it (data_offsets start at ", r.begin,
               ", the previous tensor ends at ", expected, "); the file is corrupt");
    IRIS_CHECK(r.begin == expected, path_, ": ", r.begin - expected, " bytes before tensor '",
               clip_text(*r.name, 120),
               "' belong to no tensor (a gap in data_offsets); the file is corrupt");
    expected = r.end;
  }
  IRIS_CHECK(expected == data_size, path_, ": the tensors cover ", expected,
             " bytes of a data section of ", data_size,
             " (bytes past the last tensor, or a header length that is off); the file is "
             "corrupt");
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  auto it = entries_.find(name);
  IRIS_CHECK(it != entries_.end(), path_, ": no tensor named '", name, "'");
  return it->second;
}

std::vector<float> to_f32(const SafetensorsEntry& e) {
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  convert_to_f32(e, v.data());
  return v;
}

void convert_to_f32(const SafetensorsEntry& e, float* dst) {
  const size_t n = e.nbytes / dtype_size(e.dtype);
  switch (e.dtype) {
    case DType::f32:
      std::memcpy(dst, e.data, e.nbytes);
      return;
    // A tensor's offset in the file need not be a multiple of its element size (the header
    // length is any number), so elements are copied out rather than read through a uint16_t*.
    case DType::bf16: {
      const auto* s = static_cast<const unsigned char*>(e.data);
#pragma omp parallel for schedule(static) if (n > (size_t(1) << 20))
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    }
    case DType::f16: {
      const auto* s = static_cast<const unsigned char*>(e.data);
#pragma omp parallel for schedule(static) if (n > (size_t(1) << 20))
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    }
    default:
      IRIS_FAIL(e.file, ": tensor '", e.name, "' has integer dtype ", dtype_name(e.dtype),
                " where floating point was expected");
  }
}

int64_t first_non_finite(const SafetensorsEntry& e) {
  IRIS_CHECK(e.dtype == DType::f32 || e.dtype == DType::bf16 || e.dtype == DType::f16, e.file,
             ": tensor '", e.name, "' has integer dtype ", dtype_name(e.dtype),
             " where floating point was expected");
  return first_non_finite(e.data, e.dtype, static_cast<int64_t>(e.nbytes / dtype_size(e.dtype)));
}

HostTensor SafetensorsFile::load(const std::string& name) const {
  const auto& e = at(name);
  if (e.dtype == DType::i32 || e.dtype == DType::i64) {
    HostTensor t(e.dtype, e.shape);
    std::memcpy(t.tensor().data, e.data, e.nbytes);
    return t;
  }
  HostTensor t(DType::f32, e.shape);
  convert_to_f32(e, t.data<float>());
  return t;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shard_files;
  std::map<std::string, std::string> shard_of;  // tensor name -> shard file, from the index
  if (fs::exists(index)) {
    const nlohmann::json j =
        read_json_file(index.string(), "checkpoint index", kJsonCheckpointIndexLimits);
    IRIS_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
               index.string(), " has no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const std::string f =
          json_string(it.value(), index.string() + ": weight_map", clip_text(it.key(), 120));
      // Shards live in the checkpoint directory; an index must not send the loader elsewhere.
      IRIS_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                 index.string(), ": weight_map names shard '", clip_text(f, 120),
                 "', which is not a file name inside the checkpoint directory");
      shard_of[it.key()] = f;
      if (std::find(shard_files.begin(), shard_files.end(), f) == shard_files.end())
        shard_files.push_back(f);
    }
  } else if (fs::exists(single)) {
    shard_files.push_back("model.safetensors");
  } else {
    IRIS_FAIL("no model.safetensors or model.safetensors.index.json in ", dir,
              " (expected a Hugging Face checkpoint directory)");
  }
  for (const auto& f : shard_files) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / f).string()));
    for (const auto& [name, e] : files_.back()->entries()) {
      IRIS_CHECK(index_.count(name) == 0, "tensor '", clip_text(name, 120),
                 "' appears in two shards of ", dir);
      if (!shard_of.empty()) {
        auto listed = shard_of.find(name);
        IRIS_CHECK(listed != shard_of.end() && listed->second == f, e.file, " holds tensor '",
                   clip_text(name, 120), "', which ", index.string(),
                   listed == shard_of.end() ? " does not list" : " places in another shard",
                   "; the index and its shards disagree");
      }
      index_[name] = &e;
    }
  }
  for (const auto& [name, f] : shard_of)
    IRIS_CHECK(index_.count(name) != 0, index.string(), " lists tensor '", clip_text(name, 120),
               "' in ", f, ", which does not hold it; the index and its shards disagree");
}

const SafetensorsEntry& SafetensorsCheckpoint::at(const std::string& name) const {
  auto it = index_.find(name);
  IRIS_CHECK(it != index_.end(), "checkpoint ", dir_, " has no tensor named '", name, "'");
  return *it->second;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& kv : index_) out.push_back(kv.first);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& it : items) {
    int64_t numel = 1;
    for (auto d : it.shape) numel *= d;
    const size_t nbytes = static_cast<size_t>(numel) * dtype_size(it.dtype);
    header[it.name] = {{"dtype", dtype_tag(it.dtype)},
                       {"shape", it.shape},
                       {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // data section starts 8-byte aligned
  std::string blob;
  blob.reserve(8 + h.size() + offset);
  const uint64_t hl = h.size();
  blob.append(reinterpret_cast<const char*>(&hl), 8);
  blob += h;
  for (const auto& it : items) {
    int64_t numel = 1;
    for (auto d : it.shape) numel *= d;
    blob.append(static_cast<const char*>(it.data),
                static_cast<size_t>(numel) * dtype_size(it.dtype));
  }
  write_file_atomic(path, blob);
}

}  // namespace iris
