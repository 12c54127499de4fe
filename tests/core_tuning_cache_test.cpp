// The persistent GEMM tuning cache (core/tuning_cache.h): its format, what a damaged or foreign
// file does (one warning, then replaced), atomic writes under concurrent writers, the cache
// directory, and on a GPU that a tuned algorithm comes back from the file and computes the same
// bits.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/fs.h"
#include "core/tuning_cache.h"
#include "test_util.h"

#ifdef IRIS_WITH_CUDA
#include <cuda_runtime.h>

#include <random>

#include "core/cuda/gemm/gemm.h"
#include "core/cuda/gemm/gemm_tuning.h"
#endif

namespace iris {
namespace {

namespace fs = std::filesystem;
using test::scratch_dir;

GemmTuningIdentity test_identity() {
  GemmTuningIdentity id;
  id.gpu = "NVIDIA H100 80GB HBM3";
  id.compute_capability = "9.0";
  id.multiprocessors = 132;
  id.driver = "580.65.06, CUDA 13.0";
  id.cuda_runtime = 13000;
  id.cublaslt = 130000;
  return id;
}

GemmTuningEntry entry(uint64_t seed, double us = 12.5) {
  GemmTuningEntry e;
  for (size_t i = 0; i < e.algo.size(); ++i) e.algo[i] = seed * 0x9E3779B97F4A7C15ull + i;
  e.time_us = us;
  return e;
}

// A fresh directory for one test.
std::string fresh_dir(const std::string& name) {
  const fs::path d = scratch_dir() / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A cache whose warnings are collected instead of printed.
struct Collected {
  std::vector<std::string> warnings;
  GemmTuningCache::WarningSink sink() {
    return [this](const std::string& w) { warnings.push_back(w); };
  }
};

TEST(GemmTuningKey, EveryFieldTellsKeysApart) {
  GemmTuningKey base;
  base.op = "linear";
  base.m = 6272, base.n = 1024, base.k = 4096;
  base.epilogue = "bias";
  base.accumulate = true;
  base.align_a = base.align_b = base.align_d = 256;
  EXPECT_EQ(base.text(),
            "linear m=6272 n=1024 k=4096 out=bf16 epilogue=bias accumulate=1 align=256,256,256");
  std::vector<GemmTuningKey> variants(10, base);
  variants[0].op = "backward_input";
  variants[1].m = 6273;
  variants[2].n = 1025;
  variants[3].k = 4097;
  variants[4].out_f32 = true;
  variants[5].epilogue = "gelu_bias";
  variants[6].accumulate = false;
  variants[7].align_a = 128;
  variants[8].align_b = 128;
  variants[9].align_d = 128;
  std::set<std::string> texts = {base.text()};
  for (const GemmTuningKey& v : variants) texts.insert(v.text());
  EXPECT_EQ(texts.size(), variants.size() + 1);
}

TEST(GemmTuningFile, SerializedEntriesParseBackExactly) {
  GemmTuningEntries entries;
  entries["linear m=1 n=2 k=3 out=bf16 epilogue=none accumulate=0 align=2,2,2"] = entry(1);
  GemmTuningEntry extremes;
  extremes.algo = {
      0, 1, std::numeric_limits<uint64_t>::max(), uint64_t{1} << 63, 0x0123456789abcdefull, 42,
      7, 9};
  extremes.time_us = 0;  // unknown: not written
  entries
      ["forward_f32 m=4096 n=151936 k=2048 out=f32 epilogue=none accumulate=0 align=256,256,256"] =
          extremes;
  const std::string text = serialize_gemm_tuning(test_identity(), entries);
  const GemmTuningFile f = parse_gemm_tuning(text, "test", test_identity());
  ASSERT_EQ(f.state, GemmTuningFile::State::usable) << f.problem << "\n" << text;
  EXPECT_EQ(f.entries, entries);
  // One entry a line (and 7 lines around them), so that people can read and diff the file.
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 7 + static_cast<long>(entries.size()))
      << text;
  // No entries at all is a valid file too.
  EXPECT_EQ(
      parse_gemm_tuning(serialize_gemm_tuning(test_identity(), {}), "empty", test_identity()).state,
      GemmTuningFile::State::usable);
}

TEST(GemmTuningCache, RoundTripThroughTheFile) {
  const std::string path = fresh_dir("roundtrip") + "/sub/dir/" + kGemmTuningFileName;
  Collected c;
  {
    GemmTuningCache cache(path, test_identity(), c.sink());
    EXPECT_FALSE(cache.find("k1"));  // no file yet: nothing, and nothing to say
    EXPECT_FALSE(cache.save());      // nothing recorded: nothing written
    EXPECT_FALSE(fs::exists(path));
    cache.record("k1", entry(1));
    cache.record("k2", entry(2, 80.25));
    EXPECT_TRUE(cache.recorded("k1"));
    EXPECT_TRUE(cache.has_unsaved_changes());
    EXPECT_TRUE(cache.save());  // creates the missing directories
    EXPECT_FALSE(cache.has_unsaved_changes());
    EXPECT_FALSE(cache.save());
  }
  GemmTuningCache again(path, test_identity(), c.sink());
  EXPECT_FALSE(again.recorded("k1"));  // the file's entries are not this process's records
  ASSERT_TRUE(again.find("k1"));
  EXPECT_EQ(*again.find("k1"), entry(1));
  EXPECT_EQ(*again.find("k2"), entry(2, 80.25));
  EXPECT_FALSE(again.find("k3"));
  EXPECT_EQ(again.size(), 2u);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
  // No temporary files are left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(path).parent_path()), {}), 1);
}

TEST(GemmTuningCache, SaveKeepsOtherProcessesEntriesAndDropsWhatItDropped) {
  const std::string path = fresh_dir("merge") + "/" + kGemmTuningFileName;
  GemmTuningCache first(path, test_identity());
  first.record("shared", entry(1));
  first.record("stale", entry(2));
  ASSERT_TRUE(first.save());
  GemmTuningCache a(path, test_identity()), b(path, test_identity());
  ASSERT_TRUE(a.find("stale"));  // a reads the file now
  b.record("from_b", entry(3));
  ASSERT_TRUE(b.save());  // after a read the file
  a.record("from_a", entry(4));
  a.drop("stale");  // e.g. cuBLASLt refused it
  EXPECT_FALSE(a.find("stale"));
  ASSERT_TRUE(a.save());
  const GemmTuningFile f = read_gemm_tuning_file(path, test_identity());
  ASSERT_EQ(f.state, GemmTuningFile::State::usable) << f.problem;
  EXPECT_EQ(f.entries.count("from_a"), 1u);
  EXPECT_EQ(f.entries.count("from_b"), 1u);
  EXPECT_EQ(f.entries.count("shared"), 1u);
  EXPECT_EQ(f.entries.count("stale"), 0u);
}

TEST(GemmTuningCache, ADamagedFileIsIgnoredWithOneWarningThenRewritten) {
  const std::string dir = fresh_dir("corrupt");
  GemmTuningEntries good;
  good["k"] = entry(5);
  const std::string valid = serialize_gemm_tuning(test_identity(), good);
  // The valid file with its one algo array replaced, or another piece of text replaced.
  auto replaced = [&valid](const std::string& from, const std::string& to) {
    const size_t at = valid.find(from);
    EXPECT_NE(at, std::string::npos) << from << " is not in\n" << valid;
    return at == std::string::npos ? valid : std::string(valid).replace(at, from.size(), to);
  };
  const size_t algo_at = valid.find("\"algo\":[");
  ASSERT_NE(algo_at, std::string::npos) << valid;
  const std::string algo_text =
      valid.substr(algo_at, valid.find(']', algo_at) + 1 - algo_at);  // "algo":[...]
  auto with_algo = [&](const std::string& words) {
    return replaced(algo_text, "\"algo\":" + words);
  };
  std::string no_entries = serialize_gemm_tuning(test_identity(), {});
  no_entries.replace(no_entries.find("\"entries\": {}"), 14, "\"entries\": []");
  const std::vector<std::pair<std::string, std::string>> damaged = {
      {"empty", ""},
      {"not JSON", "this is not json"},
      {"truncated", valid.substr(0, valid.size() / 2)},
      {"an array", "[1,2,3]"},
      {"another format", R"({"format":"something else","version":1})"},
      {"no device", R"({"format":"iris GEMM tuning cache","version":1,"entries":{}})"},
      {"algo of 7 words", with_algo("[1,2,3,4,5,6,7]")},
      {"algo word a string", with_algo("[1,2,3,4,5,6,7,\"8\"]")},
      {"algo word negative", with_algo("[1,2,3,4,5,6,7,-8]")},
      {"algo word fractional", with_algo("[1,2,3,4,5,6,7,8.5]")},
      {"algo word above 2^64", with_algo("[1,2,3,4,5,6,7,18446744073709551616]")},
      {"no algo", with_algo("\"x\"").replace(valid.find("\"algo\""), 6, "\"olga\"")},
      {"time a string", replaced("\"time_us\":12.5", "\"time_us\":\"12.5\"")},
      {"multiprocessors a string",
       replaced("\"multiprocessors\":132", "\"multiprocessors\":\"132\"")},
      {"gpu missing", replaced("\"gpu\":", "\"gpv\":")},
      {"entries an array", no_entries}};
  for (const auto& [what, text] : damaged) {
    SCOPED_TRACE(what);
    const std::string path = dir + "/" + kGemmTuningFileName;
    write_text(path, text);
    Collected c;
    GemmTuningCache cache(path, test_identity(), c.sink());
    EXPECT_FALSE(cache.find("k"));
    EXPECT_FALSE(cache.find("k"));
    EXPECT_EQ(cache.size(), 0u);
    ASSERT_EQ(c.warnings.size(), 1u);
    EXPECT_NE(c.warnings[0].find(path), std::string::npos) << c.warnings[0];
    EXPECT_NE(c.warnings[0].find("rewritten"), std::string::npos) << c.warnings[0];
    cache.record("new", entry(6));
    ASSERT_TRUE(cache.save());
    EXPECT_EQ(c.warnings.size(), 1u);
    const GemmTuningFile f = read_gemm_tuning_file(path, test_identity());
    ASSERT_EQ(f.state, GemmTuningFile::State::usable) << f.problem;
    EXPECT_EQ(f.entries.size(), 1u);
    EXPECT_EQ(f.entries.at("new"), entry(6));
  }
}

TEST(GemmTuningCache, TheDefaultWarningGoesToStderr) {
  const std::string path = fresh_dir("stderr") + "/" + kGemmTuningFileName;
  write_text(path, "{\"format\":");
  testing::internal::CaptureStderr();
  {
    GemmTuningCache cache(path, test_identity());
    cache.find("k");
    cache.find("k");
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind("warning: ignoring the GEMM tuning cache " + path, 0), 0u) << err;
  EXPECT_EQ(err.find("warning:", 1), std::string::npos) << "one warning only: " << err;
}

TEST(GemmTuningCache, AForeignFileIsIgnoredAndReplaced) {
  const std::string path = fresh_dir("foreign") + "/" + kGemmTuningFileName;
  GemmTuningEntries theirs;
  theirs["k"] = entry(7);
  struct Case {
    const char* what;
    std::function<void(GemmTuningIdentity&)> change;
    const char* named;
  };
  const std::vector<Case> cases = {
      {"another GPU", [](GemmTuningIdentity& id) { id.gpu = "NVIDIA A100-SXM4-80GB"; }, "GPU"},
      {"a MIG slice", [](GemmTuningIdentity& id) { id.multiprocessors = 16; }, "multiprocessor"},
      {"another driver", [](GemmTuningIdentity& id) { id.driver = "570.124.06, CUDA 12.8"; },
       "driver"},
      {"another runtime", [](GemmTuningIdentity& id) { id.cuda_runtime = 12080; }, "CUDA runtime"},
      {"another cuBLASLt", [](GemmTuningIdentity& id) { id.cublaslt = 120804; }, "cuBLASLt"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    GemmTuningIdentity other = test_identity();
    c.change(other);
    write_text(path, serialize_gemm_tuning(other, theirs));
    Collected w;
    GemmTuningCache cache(path, test_identity(), w.sink());
    EXPECT_FALSE(cache.find("k"));
    cache.find("k");
    ASSERT_EQ(w.warnings.size(), 1u);
    EXPECT_NE(w.warnings[0].find(path), std::string::npos) << w.warnings[0];
    EXPECT_NE(w.warnings[0].find(c.named), std::string::npos) << w.warnings[0];
    // The other identity's file still parses: it is foreign, not damaged.
    EXPECT_EQ(read_gemm_tuning_file(path, other).state, GemmTuningFile::State::usable);
    cache.record("mine", entry(8));
    ASSERT_TRUE(cache.save());
    const GemmTuningFile f = read_gemm_tuning_file(path, test_identity());
    ASSERT_EQ(f.state, GemmTuningFile::State::usable) << f.problem;
    EXPECT_EQ(f.entries.count("k"), 0u) << "a foreign entry survived the rewrite";
    EXPECT_EQ(f.entries.count("mine"), 1u);
    EXPECT_EQ(w.warnings.size(), 1u);
  }
  // Another format version is set aside the same way.
  std::string v2 = serialize_gemm_tuning(test_identity(), theirs);
  v2.replace(v2.find("\"version\": 1"), 12, "\"version\": 2");
  write_text(path, v2);
  Collected w;
  GemmTuningCache cache(path, test_identity(), w.sink());
  EXPECT_FALSE(cache.find("k"));
  ASSERT_EQ(w.warnings.size(), 1u);
  EXPECT_NE(w.warnings[0].find("version 2"), std::string::npos) << w.warnings[0];
}

TEST(GemmTuningCache, ConcurrentWritersNeverLeaveATornFile) {
  const std::string path = fresh_dir("concurrent") + "/" + kGemmTuningFileName;
  constexpr int kWriters = 2, kSaves = 100, kPerSave = 10;
  std::vector<pid_t> writers;
  for (int wi = 0; wi < kWriters; ++wi) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // A process of its own, as two commands tuning at once would be. Many entries make each
      // write long enough for a reader to meet one half done, were writes not atomic.
      int failures = 0;
      GemmTuningCache cache(path, test_identity(), [&](const std::string&) { ++failures; });
      for (int s = 0; s < kSaves; ++s) {
        for (int e = 0; e < kPerSave; ++e)
          cache.record("writer" + std::to_string(wi) + " shape " + std::to_string(s * kPerSave + e),
                       entry(static_cast<uint64_t>(wi * 100000 + s * kPerSave + e)));
        if (!cache.save()) ++failures;
      }
      ::_exit(failures == 0 ? 0 : 1);
    }
    writers.push_back(pid);
  }
  // Every read while they write must find a whole file of this identity.
  int reads = 0, torn = 0;
  std::string first_problem;
  std::vector<int> exit_status(writers.size(), -1);
  for (size_t done = 0; done < writers.size();) {
    if (fs::exists(path)) {
      const GemmTuningFile f = read_gemm_tuning_file(path, test_identity());
      ++reads;
      if (f.state != GemmTuningFile::State::usable && torn++ == 0) first_problem = f.problem;
    }
    for (size_t i = 0; i < writers.size(); ++i) {
      int status = 0;
      if (exit_status[i] < 0 && ::waitpid(writers[i], &status, WNOHANG) == writers[i]) {
        exit_status[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        ++done;
      }
    }
  }
  for (size_t i = 0; i < writers.size(); ++i)
    EXPECT_EQ(exit_status[i], 0) << "writer " << i << " failed to save";
  EXPECT_EQ(torn, 0) << "of " << reads << " reads; first: " << first_problem;
  EXPECT_GT(reads, 0);
  // Last writer wins: some entries of the other may be lost, but the file is whole.
  const GemmTuningFile last = read_gemm_tuning_file(path, test_identity());
  ASSERT_EQ(last.state, GemmTuningFile::State::usable) << last.problem;
  EXPECT_GE(last.entries.size(), static_cast<size_t>(kPerSave));
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(path).parent_path()), {}), 1);
}

// Sets an environment variable (or unsets it, for nullopt) for the life of the object.
class EnvVar {
 public:
  EnvVar(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value->c_str(), 1);
    else
      ::unsetenv(name);
  }
  ~EnvVar() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  EnvVar(const EnvVar&) = delete;
  EnvVar& operator=(const EnvVar&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(GemmTuningCache, TheDirectoryFollowsTheEnvironment) {
  {
    EnvVar iris("IRIS_CACHE_DIR", "/tmp/iris-cache"), xdg("XDG_CACHE_HOME", "/xdg"),
        home("HOME", "/home/u");
    EXPECT_EQ(iris_cache_dir(), "/tmp/iris-cache");
    EXPECT_EQ(gemm_tuning_cache_path(), "/tmp/iris-cache/gemm-tuning-v1.json");
  }
  {
    EnvVar iris("IRIS_CACHE_DIR", ""), xdg("XDG_CACHE_HOME", "/xdg"), home("HOME", "/home/u");
    EXPECT_EQ(iris_cache_dir(), "/xdg/iris");
  }
  {
    // The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored.
    EnvVar iris("IRIS_CACHE_DIR", std::nullopt), xdg("XDG_CACHE_HOME", "relative/cache"),
        home("HOME", "/home/u");
    EXPECT_EQ(iris_cache_dir(), "/home/u/.cache/iris");
  }
  {
    EnvVar iris("IRIS_CACHE_DIR", std::nullopt), xdg("XDG_CACHE_HOME", std::nullopt),
        home("HOME", "/home/u");
    EXPECT_EQ(gemm_tuning_cache_path(), "/home/u/.cache/iris/gemm-tuning-v1.json");
  }
  {
    EnvVar iris("IRIS_CACHE_DIR", std::nullopt), xdg("XDG_CACHE_HOME", std::nullopt),
        home("HOME", std::nullopt);
    EXPECT_EQ(iris_cache_dir(), "");
    EXPECT_EQ(gemm_tuning_cache_path(), "");
  }
}

TEST(GemmTuningCache, AnUnwritableDirectoryWarnsOnceAndTheRunGoesOn) {
  // A directory that cannot be created, whoever runs the test (root ignores permissions): its
  // parent is a regular file.
  const std::string dir = fresh_dir("unwritable");
  write_text(dir + "/a_file", "x");
  const std::string path = dir + "/a_file/iris/" + kGemmTuningFileName;
  Collected c;
  GemmTuningCache cache(path, test_identity(), c.sink());
  EXPECT_FALSE(cache.find("k"));
  cache.record("k", entry(9));
  EXPECT_FALSE(cache.save());
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("cannot write the GEMM tuning cache " + path), std::string::npos)
      << c.warnings[0];
  EXPECT_NE(c.warnings[0].find("not kept"), std::string::npos) << c.warnings[0];
  // The run goes on: the entry serves this process, and later saves stay quiet.
  EXPECT_EQ(*cache.find("k"), entry(9));
  cache.record("k2", entry(10));
  EXPECT_FALSE(cache.save());
  EXPECT_EQ(c.warnings.size(), 1u);

  // Without a cache directory at all, the same: one warning, saying how to get one.
  Collected none;
  GemmTuningCache homeless("", test_identity(), none.sink());
  EXPECT_FALSE(homeless.find("k"));
  homeless.record("k", entry(11));
  EXPECT_EQ(*homeless.find("k"), entry(11));
  EXPECT_FALSE(homeless.save());
  EXPECT_FALSE(homeless.save());
  ASSERT_EQ(none.warnings.size(), 1u);
  EXPECT_NE(none.warnings[0].find("IRIS_CACHE_DIR"), std::string::npos) << none.warnings[0];
}

TEST(GemmTuningCache, DirectoryOrFifoAtThePathIsTreatedAsDamaged) {
  const std::string dir = fresh_dir("special");
  const std::string path = dir + "/" + kGemmTuningFileName;
  fs::create_directories(path);
  Collected c;
  GemmTuningCache cache(path, test_identity(), c.sink());
  EXPECT_FALSE(cache.find("k"));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("directory"), std::string::npos) << c.warnings[0];
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  Collected f;
  GemmTuningCache fifo(path, test_identity(), f.sink());
  EXPECT_FALSE(fifo.find("k"));  // an answer, not a wait for a writer
  ASSERT_EQ(f.warnings.size(), 1u);
  EXPECT_NE(f.warnings[0].find("FIFO"), std::string::npos) << f.warnings[0];
}

TEST(GemmTuningIdentity, DriverReleaseFromProc) {
  EXPECT_EQ(nvidia_driver_release("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "
                                  "580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue "
                                  "Jul 22 16:22:43 UTC 2025\nGCC version:  gcc version 12.2.0\n"),
            "580.65.06");
  EXPECT_EQ(nvidia_driver_release("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  "
                                  "Sat Aug 19 01:15:15 UTC 2023\n"),
            "535.104.05");
  EXPECT_EQ(nvidia_driver_release("GCC version: gcc 12.2.0\n"), "");
  EXPECT_EQ(nvidia_driver_release(""), "");
}

TEST(GemmTuningCache, ModesHaveNames) {
  EXPECT_EQ(to_string(GemmTuning::heuristic), "heuristic");
  EXPECT_EQ(to_string(GemmTuning::cached), "cached");
  EXPECT_EQ(to_string(GemmTuning::tune), "tune");
}

#ifdef IRIS_WITH_CUDA

// ---- on a GPU: a tuned algorithm is restored from the file and used ----

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-scale, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) {
    const float f = uni(rng);
    uint32_t bits = 0;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

bool same_algo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(a.data, b.data, sizeof(a.data)) == 0;
}

class GemmTuningGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: the cuBLASLt side is not exercised";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    workspace_ = std::make_unique<DeviceBuffer>(kWorkspace);
    scratch_ = std::make_unique<DeviceBuffer>(kScratch);
    x_ = std::make_unique<DeviceBuffer>(kM * kK * 2);
    w_ = std::make_unique<DeviceBuffer>(kN * kK * 2);
    bias_ = std::make_unique<DeviceBuffer>(kN * 2);
    y_ = std::make_unique<DeviceBuffer>(kM * kN * 2);
    upload(*x_, random_bf16(kM * kK, 1, 1.f));
    upload(*w_, random_bf16(kN * kK, 2, 0.05f));
    upload(*bias_, random_bf16(kN, 3, 1.f));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  void upload(const DeviceBuffer& b, const std::vector<uint16_t>& host) {
    ASSERT_EQ(cudaMemcpy(b.p, host.data(), host.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::unique_ptr<cuda::LtGemm> make_gemm(GemmTuningCache* cache, GemmTuning mode) {
    auto g =
        std::make_unique<cuda::LtGemm>(workspace_->p, kWorkspace, scratch_->p, kScratch, cache);
    g->set_tuning(mode);
    return g;
  }
  // y = x w^T + bias (overwriting y, which holds garbage first); y's bits.
  std::vector<uint16_t> run(cuda::LtGemm& g) {
    EXPECT_EQ(cudaMemsetAsync(y_->p, 0x7f, kM * kN * 2, stream_), cudaSuccess);
    EXPECT_TRUE(g.run(y_->as<uint16_t>(), x_->as<uint16_t>(), w_->as<uint16_t>(),
                      bias_->as<uint16_t>(), kM, kN, kK, false, false, stream_));
    std::vector<uint16_t> out(kM * kN);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), y_->p, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::optional<cuda::LtGemm::PlanInfo> info(const cuda::LtGemm& g) const {
    return g.plan_info(y_->as<uint16_t>(), x_->as<uint16_t>(), w_->as<uint16_t>(),
                       bias_->as<uint16_t>(), kM, kN, kK, false, false);
  }

  // A mid-sized shape, where the heuristic offers several candidates.
  static constexpr int64_t kM = 768, kN = 1024, kK = 2048;
  static constexpr size_t kWorkspace = size_t{32} << 20, kScratch = size_t{16} << 20;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBuffer> workspace_, scratch_, x_, w_, bias_, y_;
};

TEST_F(GemmTuningGpu, ATunedAlgorithmIsRestoredFromTheFileAndComputesTheSameBits) {
  const std::string path = fresh_dir("gpu_restore") + "/" + kGemmTuningFileName;
  const GemmTuningIdentity id = cuda::gemm_tuning_identity(0);
  Collected warnings;

  // Tune, and persist.
  GemmTuningCache tuned_cache(path, id, warnings.sink());
  auto tuner = make_gemm(&tuned_cache, GemmTuning::tune);
  const std::vector<uint16_t> tuned_out = run(*tuner);
  const auto tuned = info(*tuner);
  ASSERT_TRUE(tuned);
  ASSERT_EQ(tuned->source, cuda::LtGemm::Source::timed);
  EXPECT_EQ(tuner->plan_counts().timed, 1);
  ASSERT_TRUE(tuned_cache.save());

  // A new process's view: a fresh cache read from the file, a planner with no plans.
  GemmTuningCache reloaded(path, id, warnings.sink());
  auto user = make_gemm(&reloaded, GemmTuning::cached);
  EXPECT_FALSE(info(*user));
  const std::vector<uint16_t> cached_out = run(*user);
  const auto restored = info(*user);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->source, cuda::LtGemm::Source::cache);
  EXPECT_TRUE(same_algo(restored->algo, tuned->algo));
  // Bits compare only where the algorithm repeats its own bits (a split-K pick that reduces with
  // atomics need not).
  if (run(*tuner) == tuned_out)
    EXPECT_EQ(cached_out, tuned_out) << "the cached algorithm computes other bits";
  else
    std::printf("[ note     ] the tuned algorithm is not bitwise repeatable; bits not compared\n");
  EXPECT_EQ(user->plan_counts().cached, 1);

  // Heuristic mode ignores the cache and takes the first candidate.
  auto first = make_gemm(&reloaded, GemmTuning::heuristic);
  run(*first);
  ASSERT_TRUE(info(*first));
  EXPECT_EQ(info(*first)->source, cuda::LtGemm::Source::heuristic);
  // Tune mode retimes what the file holds (another process recorded it), once.
  auto retuner = make_gemm(&reloaded, GemmTuning::tune);
  run(*retuner);
  EXPECT_EQ(info(*retuner)->source, cuda::LtGemm::Source::timed);
  auto second = make_gemm(&reloaded, GemmTuning::tune);
  run(*second);
  EXPECT_EQ(info(*second)->source, cuda::LtGemm::Source::cache)
      << "a shape this process timed is timed again";
  EXPECT_TRUE(warnings.warnings.empty()) << warnings.warnings.front();
}

TEST_F(GemmTuningGpu, AnEntryCuBlasLtRefusesFallsBackToTheFirstChoiceAndIsDropped) {
  const std::string path = fresh_dir("gpu_refused") + "/" + kGemmTuningFileName;
  const GemmTuningIdentity id = cuda::gemm_tuning_identity(0);
  {
    GemmTuningCache cache(path, id);
    auto tuner = make_gemm(&cache, GemmTuning::tune);
    run(*tuner);
    ASSERT_TRUE(cache.save());
  }
  // The one entry, with words no cuBLASLt configuration has.
  GemmTuningFile f = read_gemm_tuning_file(path, id);
  ASSERT_EQ(f.state, GemmTuningFile::State::usable) << f.problem;
  ASSERT_EQ(f.entries.size(), 1u);
  const std::string key = f.entries.begin()->first;
  f.entries.begin()->second.algo.fill(~uint64_t{0});
  write_file_atomic(path, serialize_gemm_tuning(id, f.entries));

  auto reference = make_gemm(nullptr, GemmTuning::heuristic);
  const std::vector<uint16_t> first_choice = run(*reference);
  GemmTuningCache cache(path, id);
  auto user = make_gemm(&cache, GemmTuning::cached);
  const std::vector<uint16_t> out = run(*user);
  ASSERT_TRUE(info(*user));
  EXPECT_EQ(info(*user)->source, cuda::LtGemm::Source::heuristic);
  EXPECT_TRUE(same_algo(info(*user)->algo, info(*reference)->algo));
  if (run(*reference) == first_choice) EXPECT_EQ(out, first_choice);
  EXPECT_EQ(user->plan_counts().rejected, 1);
  EXPECT_FALSE(cache.find(key)) << "the refused entry was kept";
  EXPECT_TRUE(cache.has_unsaved_changes());
  ASSERT_TRUE(cache.save());
  EXPECT_EQ(read_gemm_tuning_file(path, id).entries.count(key), 0u);
}

TEST_F(GemmTuningGpu, TheBackendTunesIntoTheCacheDirectoryAndReadsItBack) {
  const std::string dir = fresh_dir("gpu_backend");
  EnvVar cache_dir("IRIS_CACHE_DIR", dir);
  const std::string path = dir + "/" + kGemmTuningFileName;
  constexpr int64_t M = 512, N = 768, K = 1024;
  std::vector<float> hx(M * K), hw(N * K);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  for (float& v : hx) v = uni(rng);
  for (float& v : hw) v = 0.05f * uni(rng);
  auto linear_bits = [&](Backend& be) {
    void* px = be.allocate(M * K * 2);
    void* pw = be.allocate(N * K * 2);
    void* py = be.allocate(M * N * 2);
    const Tensor x(px, DType::bf16, Device::cuda, {M, K}), w(pw, DType::bf16, Device::cuda, {N, K}),
        y(py, DType::bf16, Device::cuda, {M, N});
    be.write(x, hx.data(), DType::f32);
    be.write(w, hw.data(), DType::f32);
    be.linear(y, x, w, Tensor(), false);
    std::vector<uint16_t> out(M * N);
    be.read(out.data(), DType::bf16, y);
    be.deallocate(px), be.deallocate(pw), be.deallocate(py);
    return out;
  };
  std::vector<uint16_t> tuned;
  bool repeatable = false;  // whether the tuned algorithm repeats its own bits
  {
    auto be = make_cuda_backend(0);
    EXPECT_EQ(be->gemm_tuning_report().mode, GemmTuning::cached);  // the default
    EXPECT_EQ(be->gemm_tuning_report().cache_path, path);
    be->set_gemm_tuning(GemmTuning::tune);
    tuned = linear_bits(*be);
    repeatable = linear_bits(*be) == tuned;
    EXPECT_EQ(be->gemm_tuning_report().plans.timed, 1);
    EXPECT_FALSE(fs::exists(path)) << "tuning results are written when saved, not before";
    ASSERT_TRUE(be->save_gemm_tuning());
  }
  auto be = make_cuda_backend(0);
  const std::vector<uint16_t> cached = linear_bits(*be);
  if (repeatable) EXPECT_EQ(cached, tuned);
  const GemmTuningReport r = be->gemm_tuning_report();
  EXPECT_EQ(r.plans.cached, 1);
  EXPECT_EQ(r.plans.timed, 0);
  EXPECT_EQ(r.plans.heuristic, 0);
}

#endif  // IRIS_WITH_CUDA

}  // namespace
}  // namespace iris
