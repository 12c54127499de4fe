// What the inference and the training benchmarks share: timing and the hardware limits measured
// in the same run (core/hardware_limits.h), a peer command's JSON result, the bench geometries.
#pragma once

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/hardware_limits.h"

namespace iris {

// Runs a peer benchmark command and returns the JSON object on its last line.
nlohmann::json run_peer(const std::string& command);

// A bench geometry from anywhere: `path` as given, else (relative) from the source tree beside
// the binary's build folder (build/iris -> bench/configs/...); a bare name (qwen3vl_2b) is
// bench/configs/NAME.json. An error says where it looked.
std::string find_bench_config(const std::string& path);

}  // namespace iris
