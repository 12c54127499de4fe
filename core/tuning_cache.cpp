#include "core/tuning_cache.h"

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"

namespace iris {

using nlohmann::json;

namespace {

constexpr const char* kFormatName = "iris GEMM tuning cache";
// Far above any real cache (an entry is about 250 bytes): a larger file is not ours.
constexpr size_t kMaxFileBytes = size_t{64} << 20;

json identity_json(const GemmTuningIdentity& id) {
  return json{{"gpu", id.gpu},
              {"compute_capability", id.compute_capability},
              {"multiprocessors", id.multiprocessors},
              {"driver", id.driver},
              {"cuda_runtime", id.cuda_runtime},
              {"cublaslt", id.cublaslt}};
}

// Where two identities differ, e.g. "cuBLASLt 120804 (this machine: 130000)".
std::string identity_difference(const GemmTuningIdentity& file, const GemmTuningIdentity& here) {
  std::string out;
  auto add = [&out](const std::string& what, const std::string& theirs, const std::string& ours) {
    if (theirs == ours) return;
    if (!out.empty()) out += ", ";
    out += str_cat(what, " ", theirs, " (this machine: ", ours, ")");
  };
  auto quoted = [](const std::string& s) { return "'" + s + "'"; };
  add("GPU", quoted(file.gpu), quoted(here.gpu));
  add("compute capability", file.compute_capability, here.compute_capability);
  add("multiprocessor count", std::to_string(file.multiprocessors),
      std::to_string(here.multiprocessors));
  add("driver", quoted(file.driver), quoted(here.driver));
  add("CUDA runtime", std::to_string(file.cuda_runtime), std::to_string(here.cuda_runtime));
  add("cuBLASLt", std::to_string(file.cublaslt), std::to_string(here.cublaslt));
  return out;
}

GemmTuningIdentity parse_identity(const json& j, const std::string& where) {
  IRIS_CHECK(j.is_object(), where, " must be an object, got ", json_excerpt(j));
  auto field = [&](const char* key) -> const json& {
    IRIS_CHECK(j.contains(key), where, " has no \"", key, "\"");
    return j.at(key);
  };
  GemmTuningIdentity id;
  id.gpu = json_string(field("gpu"), where, "gpu");
  id.compute_capability = json_string(field("compute_capability"), where, "compute_capability");
  id.multiprocessors = json_integer(field("multiprocessors"), where, "multiprocessors", 0, 1 << 20);
  id.driver = json_string(field("driver"), where, "driver");
  id.cuda_runtime = json_integer(field("cuda_runtime"), where, "cuda_runtime", 0, INT64_MAX);
  id.cublaslt = json_integer(field("cublaslt"), where, "cublaslt", 0, INT64_MAX);
  return id;
}

GemmTuningEntry parse_entry(const json& j, const std::string& where) {
  IRIS_CHECK(j.is_object(), where, " must be an object, got ", json_excerpt(j));
  IRIS_CHECK(j.contains("algo"), where, " has no \"algo\"");
  const json& algo = j.at("algo");
  IRIS_CHECK(algo.is_array() && algo.size() == 8, where,
             ".algo must be an array of 8 unsigned 64-bit integers, got ", json_excerpt(algo));
  GemmTuningEntry e;
  for (size_t i = 0; i < 8; ++i) {
    // nlohmann reads every non-negative integer literal up to 2^64 - 1 as unsigned; a negative,
    // fractional or larger number, or anything else, is not one of cuBLASLt's words.
    IRIS_CHECK(algo[i].is_number_unsigned(), where, ".algo[", i,
               "] must be an unsigned 64-bit integer, got ", json_excerpt(algo[i]));
    e.algo[i] = algo[i].get<uint64_t>();
  }
  if (j.contains("time_us")) e.time_us = json_real(j.at("time_us"), where, "time_us", 0, 1e12);
  return e;
}

}  // namespace

std::string_view to_string(GemmTuning mode) {
  switch (mode) {
    case GemmTuning::heuristic:
      return "heuristic";
    case GemmTuning::cached:
      return "cached";
    case GemmTuning::tune:
      return "tune";
  }
  return "unknown";
}

std::string GemmTuningKey::text() const {
  return str_cat(op, " m=", m, " n=", n, " k=", k, " out=", out_f32 ? "f32" : "bf16",
                 " epilogue=", epilogue, " accumulate=", accumulate ? 1 : 0, " align=", align_a,
                 ",", align_b, ",", align_d);
}

std::string iris_cache_dir() {
  const char* iris = std::getenv("IRIS_CACHE_DIR");
  if (iris != nullptr && iris[0] != '\0') return iris;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/iris";
  const char* home = std::getenv("HOME");
  if (home != nullptr && home[0] != '\0') return std::string(home) + "/.cache/iris";
  return "";
}

std::string gemm_tuning_cache_path() {
  const std::string dir = iris_cache_dir();
  return dir.empty() ? std::string() : (std::filesystem::path(dir) / kGemmTuningFileName).string();
}

std::string nvidia_driver_release(std::string_view text) {
  const size_t start = text.find("NVRM version:");
  if (start == std::string_view::npos) return "";
  std::string_view line = text.substr(start);
  line = line.substr(0, line.find('\n'));
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
    size_t end = i;
    while (end < line.size() && !std::isspace(static_cast<unsigned char>(line[end]))) ++end;
    const std::string_view word = line.substr(i, end - i);
    const bool dotted_number = word.size() >= 3 &&
                               std::isdigit(static_cast<unsigned char>(word.front())) &&
                               std::isdigit(static_cast<unsigned char>(word.back())) &&
                               word.find('.') != std::string_view::npos &&
                               word.find_first_not_of("0123456789.") == std::string_view::npos;
    if (dotted_number) return std::string(word);
    i = end;
  }
  return "";
}

std::string serialize_gemm_tuning(const GemmTuningIdentity& identity,
                                  const GemmTuningEntries& entries) {
  // Written by hand around nlohmann's dumps so that each entry takes one line.
  std::string out = "{\n";
  out += str_cat("  \"format\": ", json(kFormatName).dump(), ",\n");
  out += str_cat("  \"version\": ", kGemmTuningFormatVersion, ",\n");
  out += str_cat("  \"device\": ", identity_json(identity).dump(), ",\n");
  out += "  \"entries\": {";
  bool first = true;
  for (const auto& [key, e] : entries) {
    json j{{"algo", e.algo}};
    if (e.time_us > 0) j["time_us"] = std::round(e.time_us * 1000) / 1000;
    out += first ? "\n    " : ",\n    ";
    out += json(key).dump() + ": " + j.dump();
    first = false;
  }
  out += first ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

GemmTuningFile parse_gemm_tuning(std::string_view text, const std::string& source,
                                 const GemmTuningIdentity& identity) {
  GemmTuningFile f;
  try {
    const json j = parse_json(text, source, JsonLimits{kMaxFileBytes, 4'000'000});
    IRIS_CHECK(j.is_object(), source, " is not a JSON object");
    IRIS_CHECK(j.contains("format") && j.at("format") == kFormatName, source,
               " is not an Iris GEMM tuning cache (its \"format\" is not \"", kFormatName, "\")");
    IRIS_CHECK(j.contains("version"), source, " has no \"version\"");
    const int64_t version = json_integer(j.at("version"), source, "version", 0, INT64_MAX);
    if (version != kGemmTuningFormatVersion) {
      f.state = GemmTuningFile::State::foreign;
      f.problem = str_cat("it is in format version ", version, ", this Iris writes version ",
                          kGemmTuningFormatVersion);
      return f;
    }
    IRIS_CHECK(j.contains("device"), source, " has no \"device\"");
    const GemmTuningIdentity file_id = parse_identity(j.at("device"), source + ": device");
    IRIS_CHECK(j.contains("entries") && j.at("entries").is_object(), source,
               " has no \"entries\" object");
    GemmTuningEntries entries;
    for (const auto& [key, value] : j.at("entries").items())
      entries.emplace(key, parse_entry(value, str_cat(source, ": entry \"", clip_text(key), "\"")));
    if (!(file_id == identity)) {
      f.state = GemmTuningFile::State::foreign;
      f.problem =
          "it was made for another GPU or software: " + identity_difference(file_id, identity);
      return f;
    }
    f.state = GemmTuningFile::State::usable;
    f.entries = std::move(entries);
  } catch (const std::exception& e) {
    f.state = GemmTuningFile::State::corrupt;
    f.problem = e.what();
  }
  return f;
}

GemmTuningFile read_gemm_tuning_file(const std::string& path, const GemmTuningIdentity& identity) {
  // A path through a regular file (ENOTDIR) cannot hold a file either: nothing to say until a
  // save fails there.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && (errno == ENOENT || errno == ENOTDIR)) return {};
  try {
    return parse_gemm_tuning(read_text_file(path, "GEMM tuning cache", kMaxFileBytes), path,
                             identity);
  } catch (const std::exception& e) {
    GemmTuningFile f;
    f.state = GemmTuningFile::State::corrupt;
    f.problem = e.what();
    return f;
  }
}

GemmTuningCache::GemmTuningCache(std::string path, GemmTuningIdentity identity, WarningSink warn)
    : path_(std::move(path)), identity_(std::move(identity)), warn_(std::move(warn)) {}

void GemmTuningCache::warn(const std::string& message) const {
  if (warn_) {
    warn_(message);
  } else {
    std::fprintf(stderr, "warning: %s\n", message.c_str());
  }
}

void GemmTuningCache::load_locked() {
  if (loaded_) return;
  loaded_ = true;
  if (path_.empty()) return;
  GemmTuningFile f = read_gemm_tuning_file(path_, identity_);
  switch (f.state) {
    case GemmTuningFile::State::missing:
      return;
    case GemmTuningFile::State::usable:
      // Records made before the file was read (none in practice: find() reads it first) win.
      for (auto& [key, e] : f.entries) entries_.emplace(key, e);
      return;
    case GemmTuningFile::State::foreign:
      warn(str_cat("ignoring the GEMM tuning cache ", path_, ": ", f.problem,
                   ". GEMMs use cuBLASLt's first choice; the file is replaced the next time "
                   "tuning results are saved (iris bench --tune)"));
      return;
    case GemmTuningFile::State::corrupt:
      warn(str_cat("ignoring the GEMM tuning cache ", path_, ", which is damaged: ", f.problem,
                   ". GEMMs use cuBLASLt's first choice; the file will be rewritten the next time "
                   "tuning results are saved (iris bench --tune), and deleting it is safe"));
      return;
  }
}

std::optional<GemmTuningEntry> GemmTuningCache::find(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();
  const auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

bool GemmTuningCache::recorded(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_.count(key) != 0;
}

void GemmTuningCache::record(const std::string& key, const GemmTuningEntry& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();
  entries_[key] = entry;
  recorded_.insert(key);
  unsaved_records_.insert(key);
  unsaved_drops_.erase(key);
}

void GemmTuningCache::drop(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();
  if (entries_.erase(key) == 0) return;
  recorded_.erase(key);
  unsaved_records_.erase(key);
  unsaved_drops_.insert(key);
}

size_t GemmTuningCache::size() {
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();
  return entries_.size();
}

bool GemmTuningCache::has_unsaved_changes() {
  std::lock_guard<std::mutex> lock(mu_);
  return !unsaved_records_.empty() || !unsaved_drops_.empty();
}

bool GemmTuningCache::save() {
  std::lock_guard<std::mutex> lock(mu_);
  if (unsaved_records_.empty() && unsaved_drops_.empty()) return false;
  if (save_failed_) return false;  // warned already; a second attempt would fail the same way
  if (path_.empty()) {
    save_failed_ = true;
    warn(
        "GEMM tuning results are not kept: there is no cache directory (set IRIS_CACHE_DIR, "
        "XDG_CACHE_HOME or HOME)");
    return false;
  }
  try {
    const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    // What other processes wrote since this one read the file stays, unless this one retuned or
    // dropped it; a foreign or damaged file is replaced whole.
    GemmTuningFile now = read_gemm_tuning_file(path_, identity_);
    GemmTuningEntries merged;
    if (now.state == GemmTuningFile::State::usable) merged = std::move(now.entries);
    for (const std::string& key : unsaved_drops_) merged.erase(key);
    for (const std::string& key : unsaved_records_) merged[key] = entries_.at(key);
    write_file_atomic(path_, serialize_gemm_tuning(identity_, merged));
    for (auto& [key, e] : merged) entries_.emplace(key, e);
  } catch (const std::exception& e) {
    save_failed_ = true;
    warn(str_cat("cannot write the GEMM tuning cache ", path_, ": ", e.what(),
                 "; this run's tuning results are not kept"));
    return false;
  }
  unsaved_records_.clear();
  unsaved_drops_.clear();
  return true;
}

}  // namespace iris
