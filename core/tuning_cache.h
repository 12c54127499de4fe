// The persistent GEMM tuning cache: which cuBLASLt algorithm to run for each GEMM problem, kept
// across processes so that timing the candidates (hundreds of ms for a model's shapes) happens
// once, when asked for (`iris bench --tune`), instead of on the first call of every command.
//
// One JSON file per user, <cache dir>/gemm-tuning-v1.json, whose entries belong to one GPU, driver,
// CUDA runtime and cuBLASLt version as a whole (an algorithm is a cuBLASLt configuration that
// another library version or GPU may not have). A file made for another identity ("foreign"),
// unreadable, or malformed is ignored with one warning and replaced the next time tuning results
// are saved. Writes are atomic (a temporary file beside it, fsync, rename): concurrent processes
// never see a torn file, and the last writer wins.
//
// This file is host-only (no CUDA) so that the format, the validation and the file handling are
// tested on machines without a GPU; core/cuda/gemm/gemm_tuning.h turns cuBLASLt algorithms and the
// device's identity into the values kept here.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>

namespace iris {

// How GEMM algorithms are chosen when a GEMM problem is first planned (Backend::set_gemm_tuning).
enum class GemmTuning {
  // cuBLASLt's first candidate, always; the cache is neither read nor written. The choice then
  // depends only on the GPU, the library and the problem, so another process (a resumed training
  // run) computes the same bits whatever the cache holds.
  heuristic,
  // The default: the cache's algorithm for a problem it holds (validated before use), else
  // cuBLASLt's first candidate at once. Never times candidates on the user's time.
  cached,
  // Times the candidates of each problem once per process (outside CUDA graph capture) and
  // records the fastest in the cache, replacing what it held; Backend::save_gemm_tuning() writes
  // the file. A problem planned during a capture takes the cached or the first candidate.
  tune,
};
std::string_view to_string(GemmTuning mode);

// The GPU and software a tuning result belongs to. Two identities are equal when every field is.
struct GemmTuningIdentity {
  std::string gpu;                 // the device name, e.g. "NVIDIA H100 80GB HBM3"
  std::string compute_capability;  // "9.0"
  int64_t multiprocessors = 0;     // a MIG slice has the name of the whole GPU but fewer SMs
  std::string driver;              // the kernel driver release and the CUDA version it supports
  int64_t cuda_runtime = 0;        // cudaRuntimeGetVersion
  int64_t cublaslt = 0;            // cublasLtGetVersion
  bool operator==(const GemmTuningIdentity&) const = default;
};

// One GEMM problem as a planner keys its plan: the call, its row-major sizes, the output dtype,
// the epilogue, accumulation and the alignments (bytes) of cuBLASLt's A, B and C/D operands. The
// text form is the key in the file.
struct GemmTuningKey {
  std::string op;  // "linear" (inference), "forward_f32", "backward_input", "backward_weight"
  int64_t m = 0, n = 0, k = 0;
  bool out_f32 = false;
  std::string epilogue = "none";  // none, bias, gelu, gelu_bias
  bool accumulate = false;
  int align_a = 0, align_b = 0, align_d = 0;
  std::string text() const;
};

// A chosen algorithm: cublasLtMatmulAlgo_t's eight 64-bit words as cuBLASLt filled them, and the
// best time per call measured when it was picked (for people reading the file; 0 when unknown).
struct GemmTuningEntry {
  std::array<uint64_t, 8> algo{};
  double time_us = 0;
  bool operator==(const GemmTuningEntry&) const = default;
};
using GemmTuningEntries = std::map<std::string, GemmTuningEntry>;

// Where the GEMM plans of a process took their algorithm.
struct GemmPlanCounts {
  int64_t heuristic = 0;  // cuBLASLt's first choice
  int64_t cached = 0;     // the tuning cache's, validated
  int64_t timed = 0;      // the fastest candidate, timed now
  int64_t rejected = 0;   // cache entries that failed validation (and were dropped)
  GemmPlanCounts& operator+=(const GemmPlanCounts& o) {
    heuristic += o.heuristic, cached += o.cached, timed += o.timed, rejected += o.rejected;
    return *this;
  }
};

// For reports (Backend::gemm_tuning_report): the mode, the cache file (empty where there is none:
// no GPU, or no cache directory) and the plans so far.
struct GemmTuningReport {
  GemmTuning mode = GemmTuning::heuristic;
  std::string cache_path;
  GemmPlanCounts plans;
};

inline constexpr int kGemmTuningFormatVersion = 1;
inline constexpr const char* kGemmTuningFileName = "gemm-tuning-v1.json";

// The user's cache directory for Iris, as scripts/fetch_tokenizer.sh finds it: $IRIS_CACHE_DIR,
// else $XDG_CACHE_HOME/iris (an absolute XDG_CACHE_HOME only, as the XDG spec asks), else
// $HOME/.cache/iris. Empty when none of them is set.
std::string iris_cache_dir();
// <iris_cache_dir()>/gemm-tuning-v1.json, or empty when there is no cache directory.
std::string gemm_tuning_cache_path();

// The NVIDIA kernel driver's release ("580.65.06") from the text of /proc/driver/nvidia/version:
// the first dotted number on its "NVRM version" line; empty when there is none.
std::string nvidia_driver_release(std::string_view proc_version_text);

// The file's text for `identity` and `entries` (keys sorted, one entry a line, so that people can
// read and diff it).
std::string serialize_gemm_tuning(const GemmTuningIdentity& identity,
                                  const GemmTuningEntries& entries);

// What a tuning cache file holds for a process of `identity`.
struct GemmTuningFile {
  enum class State {
    missing,  // no file: nothing to say
    usable,   // this identity's entries
    foreign,  // another GPU, driver or library version's (or another format version's)
    corrupt,  // unreadable, not JSON, wrong types, truncated
  };
  State state = State::missing;
  std::string problem;  // for foreign and corrupt: what is wrong, in a user's terms
  GemmTuningEntries entries;
};
// Parses `text` (named `source` in problems); never throws for bad content.
GemmTuningFile parse_gemm_tuning(std::string_view text, const std::string& source,
                                 const GemmTuningIdentity& identity);
GemmTuningFile read_gemm_tuning_file(const std::string& path, const GemmTuningIdentity& identity);

// The cache a process's GEMM planners share (thread-safe). The file is read on the first find(),
// not before: a process that plans no GEMM in cached or tune mode never touches it.
class GemmTuningCache {
 public:
  // Receives each warning, in a user's terms; the default prints "warning: ..." to stderr.
  using WarningSink = std::function<void(const std::string&)>;
  // `path` empty: no file (there is no cache directory); entries recorded are kept in memory only,
  // and save() says once that they cannot be kept.
  GemmTuningCache(std::string path, GemmTuningIdentity identity, WarningSink warn = nullptr);
  GemmTuningCache(const GemmTuningCache&) = delete;
  GemmTuningCache& operator=(const GemmTuningCache&) = delete;

  const std::string& path() const { return path_; }
  const GemmTuningIdentity& identity() const { return identity_; }

  // The entry for `key`: one recorded by this process, else the file's.
  std::optional<GemmTuningEntry> find(const std::string& key);
  // Whether this process recorded `key` (tune mode times a problem once per process).
  bool recorded(const std::string& key);
  void record(const std::string& key, const GemmTuningEntry& entry);
  // Forgets an entry that no longer validates; the file loses it when next saved.
  void drop(const std::string& key);
  // Entries held now (the file's, once read, and this process's).
  size_t size();
  // Whether record() or drop() changed something that save() has not written yet.
  bool has_unsaved_changes();

  // Writes the file when there are unsaved changes: the entries of the file as it is now (if it
  // is this identity's) with this process's records over them and its drops removed, so that
  // processes tuning different shapes at once lose little. Returns whether the file was written;
  // a failure (an unwritable directory, a full disk) is one warning per cache, never an error.
  bool save();

 private:
  void load_locked();
  void warn(const std::string& message) const;

  const std::string path_;
  const GemmTuningIdentity identity_;
  const WarningSink warn_;
  std::mutex mu_;
  bool loaded_ = false;
  bool save_failed_ = false;
  GemmTuningEntries entries_;
  std::set<std::string> recorded_;
  // Changes not yet written: keys recorded and keys dropped since the last save.
  std::set<std::string> unsaved_records_, unsaved_drops_;
};

}  // namespace iris
