#include "training/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "core/safetensors.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kLatest = "latest";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kStateFormat = "iris-trainer-state";
constexpr int kStateVersion = 1;

// Renames and new entries are durable only once their directory is flushed.
void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

bool parse_checkpoint_name(const std::string& name, int64_t& step) {
  static const std::regex re("step_([0-9]{7,})");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return false;
  step = std::stoll(m[1].str());
  return true;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  return s.substr(b);
}

void copy_file_durably(const fs::path& from, const fs::path& to) {
  write_file_atomic(to.string(), read_text_file(from.string()));
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  IRIS_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%07lld", static_cast<long long>(step));
  return buf;
}

std::vector<int64_t> list_checkpoints(const std::string& run_dir) {
  std::vector<int64_t> steps;
  if (!fs::is_directory(run_dir)) return steps;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    int64_t step = 0;
    if (e.is_directory() && parse_checkpoint_name(e.path().filename().string(), step))
      steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string latest_checkpoint(const std::string& run_dir) {
  const fs::path latest = fs::path(run_dir) / kLatest;
  if (!fs::exists(latest)) return "";
  const std::string name = trim(read_text_file(latest.string()));
  int64_t step = 0;
  IRIS_CHECK(parse_checkpoint_name(name, step), latest.string(), " holds '", name,
             "', not a checkpoint name like step_0000100; restore it or delete it to start over");
  const fs::path dir = fs::path(run_dir) / name;
  IRIS_CHECK(fs::is_regular_file(dir / kStateFile), latest.string(), " names ", dir.string(),
             ", which is missing or incomplete (no ", kStateFile,
             "); the run directory was changed by hand: point latest at a complete checkpoint");
  return dir.string();
}

void remove_checkpoint_debris(const std::string& run_dir) {
  if (!fs::is_directory(run_dir)) return;
  std::vector<fs::path> debris;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    const bool tmp_dir = e.is_directory() && name.size() > 4 &&
                         name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                         parse_checkpoint_name(name.substr(0, name.size() - 4), step);
    // write_file_atomic's temporary: latest.tmp.<pid>.
    const bool tmp_latest = !e.is_directory() && name.rfind(std::string(kLatest) + ".tmp.", 0) == 0;
    if (tmp_dir || tmp_latest) debris.push_back(e.path());
  }
  for (const fs::path& p : debris) fs::remove_all(p);
}

std::string commit_checkpoint(const std::string& run_dir, int64_t step, int64_t keep_last,
                              const std::function<void(const std::string& dir)>& fill) {
  IRIS_CHECK(keep_last >= 0, "keep_last must be >= 0, got ", keep_last);
  fs::create_directories(run_dir);
  const std::string name = checkpoint_name(step);
  const fs::path final_dir = fs::path(run_dir) / name;
  const fs::path tmp_dir = fs::path(run_dir) / (name + ".tmp");
  fs::remove_all(tmp_dir);
  fs::create_directory(tmp_dir);
  fill(tmp_dir.string());
  fsync_dir(tmp_dir);

  const std::string latest = latest_checkpoint(run_dir);
  IRIS_CHECK(latest.empty() || fs::path(latest).filename() != name, "checkpoint ", name,
             " is the one `latest` names; a step is saved once");
  // A directory of this step can only come from a run that died between this rename and the
  // `latest` update; it was never named by `latest`, so replacing it loses nothing.
  fs::remove_all(final_dir);
  std::error_code ec;
  fs::rename(tmp_dir, final_dir, ec);
  IRIS_CHECK(!ec, "renaming ", tmp_dir.string(), " to ", final_dir.string(),
             " failed: ", ec.message());
  fsync_dir(run_dir);
  write_file_atomic((fs::path(run_dir) / kLatest).string(), name + "\n");

  // Checkpoints past this step belong to a run that died after saving them but before `latest`
  // named them, and this run has diverged from them (it resumed earlier): drop them, then keep
  // the newest keep_last.
  std::vector<int64_t> steps = list_checkpoints(run_dir);
  std::vector<int64_t> remove;
  std::vector<int64_t> kept;
  for (int64_t s : steps) (s > step ? remove : kept).push_back(s);
  if (keep_last > 0 && static_cast<int64_t>(kept.size()) > keep_last)
    remove.insert(remove.end(), kept.begin(), kept.end() - keep_last);
  for (int64_t s : remove) fs::remove_all(fs::path(run_dir) / checkpoint_name(s));
  return final_dir.string();
}

void save_trainer_state(const std::string& path, const TrainerState& s) {
  const json j = {
      {"format", kStateFormat},
      {"version", kStateVersion},
      {"iteration", s.iteration},
      {"consumed_samples", s.consumed_samples},
      {"consumed_tokens", s.consumed_tokens},
      {"data_position", {{"epoch", s.data_position.epoch}, {"index", s.data_position.index}}},
      {"rng", {{"data_seed", s.data_seed}}},
      {"threads", s.threads}};
  write_file_atomic(path, j.dump(2) + "\n");
}

TrainerState load_trainer_state(const std::string& path) {
  json j;
  try {
    j = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    IRIS_FAIL(path, " is not valid JSON (", e.what(), "); the checkpoint is damaged");
  }
  IRIS_CHECK(j.is_object() && j.value("format", "") == kStateFormat, path,
             " is not an Iris trainer state (format '", kStateFormat, "' expected)");
  IRIS_CHECK(j.value("version", 0) == kStateVersion, path, " has version ", j.value("version", 0),
             "; this build reads version ", kStateVersion);
  TrainerState s;
  try {
    s.iteration = j.at("iteration").get<int64_t>();
    s.consumed_samples = j.at("consumed_samples").get<int64_t>();
    s.consumed_tokens = j.at("consumed_tokens").get<int64_t>();
    s.data_position.epoch = j.at("data_position").at("epoch").get<int64_t>();
    s.data_position.index = j.at("data_position").at("index").get<int64_t>();
    s.data_seed = j.at("rng").at("data_seed").get<uint64_t>();
    s.threads = j.value("threads", 0);
  } catch (const json::exception& e) {
    IRIS_FAIL(path, ": missing or mistyped field (", e.what(), "); the checkpoint is damaged");
  }
  return s;
}

namespace {

// Writes the exported files of checkpoint `src` into the (new, empty) directory `tmp`.
void export_into(const std::string& src, const fs::path& tmp, DType dtype) {
  const std::string config_path = (fs::path(src) / "config.json").string();
  json config = read_json_file(config_path, "checkpoint config");
  IRIS_CHECK(config.is_object(), config_path, " must hold a JSON object");
  const char* dtype_text = dtype == DType::bf16  ? "bfloat16"
                           : dtype == DType::f16 ? "float16"
                                                 : "float32";
  config["dtype"] = dtype_text;
  if (config.contains("torch_dtype")) config["torch_dtype"] = dtype_text;
  write_file_atomic((tmp / "config.json").string(), config.dump(2) + "\n");

  {
    SafetensorsFile weights((fs::path(src) / "model.safetensors").string());
    std::vector<std::vector<uint64_t>> storage;
    std::vector<SafetensorsWriteItem> items;
    storage.reserve(weights.entries().size());
    std::vector<float> f32;
    for (const auto& [name, e] : weights.entries()) {
      int64_t n = 1;
      for (int64_t d : e.shape) n *= d;
      f32.resize(static_cast<size_t>(n));
      convert_to_f32(e, f32.data());
      storage.emplace_back((static_cast<size_t>(n) * dtype_size(dtype) + 7) / 8);
      if (dtype == DType::f32) {
        std::memcpy(storage.back().data(), f32.data(), f32.size() * 4);
      } else {
        auto* dst = reinterpret_cast<uint16_t*>(storage.back().data());
        for (size_t i = 0; i < f32.size(); ++i)
          dst[i] = dtype == DType::bf16 ? f32_to_bf16(f32[i]) : f32_to_f16(f32[i]);
      }
      items.push_back({name, dtype, e.shape, storage.back().data()});
    }
    write_safetensors((tmp / "model.safetensors").string(), items, {{"format", "pt"}});
  }
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                        "preprocessor_config.json", "generation_config.json"})
    if (fs::is_regular_file(fs::path(src) / f)) copy_file_durably(fs::path(src) / f, tmp / f);
  fsync_dir(tmp);
}

}  // namespace

void export_checkpoint(const std::string& checkpoint, const std::string& out_dir, DType dtype) {
  IRIS_CHECK(dtype == DType::bf16 || dtype == DType::f32 || dtype == DType::f16,
             "export dtype must be bf16, f16 or f32");
  std::string src = checkpoint;
  IRIS_CHECK(fs::is_directory(src), "checkpoint ", src, " does not exist");
  if (!fs::exists(fs::path(src) / kStateFile)) {
    // A run directory: take its latest checkpoint.
    const std::string latest = latest_checkpoint(src);
    IRIS_CHECK(!latest.empty(), src,
               " is neither a checkpoint (no trainer_state.json) nor a run directory with a "
               "`latest` checkpoint");
    src = latest;
  }
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    IRIS_CHECK(fs::is_regular_file(fs::path(src) / f), "checkpoint ", src, " lacks ", f,
               "; it was not written by iris train");
  IRIS_CHECK(!out_dir.empty(), "the export directory is empty; name a directory to create");
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" names dir
  IRIS_CHECK(!out.empty() && out.filename() != "." && out.filename() != "..", "export directory '",
             out_dir, "' names no new directory; give a path such as out/hf");
  IRIS_CHECK(!fs::exists(out), "export directory ", out.string(),
             " already exists; remove it or choose another");
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  // A fresh directory beside the target, renamed onto it at the end: nothing the user already
  // had (an "OUT.tmp" of theirs included) is ever written to or removed.
  const fs::path tmp = make_temp_dir_beside(out.string());
  try {
    export_into(src, tmp, dtype);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    IRIS_FAIL("renaming ", tmp.string(), " to ", out.string(), " failed: ", ec.message());
  }
  fsync_dir(out.has_parent_path() ? out.parent_path() : fs::path("."));
}

}  // namespace iris
