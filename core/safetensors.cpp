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
  }
  return "?";
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  IRIS_CHECK(fd >= 0, "cannot open safetensors file ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    IRIS_FAIL("cannot stat ", path, ": ", std::strerror(errno));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    IRIS_FAIL(path, " is truncated: ", size_, " bytes, too short for a safetensors header");
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  IRIS_CHECK(map_ != MAP_FAILED, "cannot mmap ", path, ": ", std::strerror(errno));
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes, 8);
    IRIS_CHECK(header_len <= size_ - 8, path, " is truncated or corrupt: header length ",
               header_len, " exceeds the file size ", size_);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len);
    } catch (const nlohmann::json::exception& e) {
      IRIS_FAIL(path, ": the safetensors header is not valid JSON (", e.what(), ")");
    }
    IRIS_CHECK(header.is_object(), path, ": the safetensors header is not a JSON object");
    const size_t data_begin = 8 + header_len;
    const size_t data_size = size_ - data_begin;
    std::vector<std::pair<size_t, size_t>> ranges;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (it.value().is_object())
          for (auto m = it.value().begin(); m != it.value().end(); ++m)
            if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
        continue;
      }
      const auto& v = it.value();
      IRIS_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                     v.contains("data_offsets") && v["data_offsets"].is_array() &&
                     v["data_offsets"].size() == 2 && v["shape"].is_array(),
                 path, ": header entry for '", it.key(),
                 "' needs dtype, shape and two data_offsets");
      SafetensorsEntry e;
      e.name = it.key();
      e.file = path;
      e.dtype = parse_dtype(v["dtype"].get<std::string>(), path, e.name);
      int64_t numel = 1;
      for (const auto& d : v["shape"]) {
        IRIS_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, path, ": tensor '", e.name,
                   "' has an invalid shape entry");
        e.shape.push_back(d.get<int64_t>());
        numel *= e.shape.back();
      }
      const auto& off = v["data_offsets"];
      IRIS_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(), path, ": tensor '",
                 e.name, "' has non-integer data_offsets");
      const size_t begin = off[0].get<size_t>(), end = off[1].get<size_t>();
      IRIS_CHECK(begin <= end && end <= data_size, path, ": tensor '", e.name,
                 "' has data_offsets [", begin, ", ", end, ") that run past the data section (",
                 data_size, " bytes); the file is truncated or corrupt");
      e.nbytes = end - begin;
      IRIS_CHECK(e.nbytes == static_cast<size_t>(numel) * dtype_size(e.dtype), path, ": tensor '",
                 e.name, "' holds ", e.nbytes, " bytes but its shape and dtype need ",
                 static_cast<size_t>(numel) * dtype_size(e.dtype));
      e.data = bytes + data_begin + begin;
      ranges.emplace_back(begin, end);
      entries_.emplace(e.name, std::move(e));
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      IRIS_CHECK(ranges[i].first >= ranges[i - 1].second, path,
                 ": two tensors' data_offsets overlap; the file is corrupt");
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  auto it = entries_.find(name);
  IRIS_CHECK(it != entries_.end(), path_, ": no tensor named '", name, "'");
  return it->second;
}

void convert_to_f32(const SafetensorsEntry& e, float* dst) {
  const size_t n = e.nbytes / dtype_size(e.dtype);
  switch (e.dtype) {
    case DType::f32:
      std::memcpy(dst, e.data, e.nbytes);
      return;
    case DType::bf16: {
      const auto* s = static_cast<const uint16_t*>(e.data);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::f16: {
      const auto* s = static_cast<const uint16_t*>(e.data);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    default:
      IRIS_FAIL(e.file, ": tensor '", e.name, "' has integer dtype ", dtype_name(e.dtype),
                " where floating point was expected");
  }
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
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text_file(index.string()));
    } catch (const nlohmann::json::exception& e) {
      IRIS_FAIL(index.string(), " is not valid JSON (", e.what(), ")");
    }
    IRIS_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
               " has no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const std::string f = it.value().get<std::string>();
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
      IRIS_CHECK(index_.count(name) == 0, "tensor '", name, "' appears in two shards of ", dir);
      index_[name] = &e;
    }
  }
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
