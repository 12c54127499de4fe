#include "training/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "bridge/peft.h"
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

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  return s.substr(b);
}

void copy_file_durably(const fs::path& from, const fs::path& to) {
  write_file_atomic(to.string(), read_text_file(from.string()));
}

// A 64-bit hash of bytes, 8 at a time (fast enough to hash a JSONL file at disk speed); it tells
// changed data apart, it is not meant to resist someone forging a collision.
struct Hasher {
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  uint64_t n = 0;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  void word(uint64_t w) {
    h ^= rotl(w * 0x87c37b91114253d5ULL, 31) * 0x4cf5ad432745937fULL;
    h = rotl(h, 27) * 5 + 0x52dce729;
  }
  void add(const char* p, size_t len) {
    n += len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      word(w);
    }
    if (i < len) {
      uint64_t w = 0;
      std::memcpy(&w, p + i, len - i);
      word(w ^ (uint64_t(len - i) << 56));
    }
  }
  std::string hex() const {
    uint64_t x = h ^ n;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
    return buf;
  }
};

// Reads up to `len` bytes at `offset` (fewer only at the end of the file) and hashes them.
void hash_range(int fd, int64_t offset, int64_t len, Hasher& hasher, const std::string& path) {
  std::vector<char> buf(size_t(1) << 20);
  while (len > 0) {
    const ssize_t n =
        ::pread(fd, buf.data(), static_cast<size_t>(std::min<int64_t>(len, buf.size())), offset);
    if (n < 0 && errno == EINTR) continue;
    IRIS_CHECK(n >= 0, "cannot read training data file ", path, ": ", std::strerror(errno));
    if (n == 0) return;
    hasher.add(buf.data(), static_cast<size_t>(n));
    offset += n;
    len -= n;
  }
}

constexpr const char* kLockFile = "iris.lock";

}  // namespace

bool parse_checkpoint_name(const std::string& name, int64_t& step) {
  constexpr size_t kPrefix = 5;  // "step_"
  if (name.size() < kPrefix + 7 || name.compare(0, kPrefix, "step_") != 0) return false;
  const char* first = name.data() + kPrefix;
  const char* last = name.data() + name.size();
  for (const char* c = first; c != last; ++c)
    if (*c < '0' || *c > '9') return false;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(first, last, value);
  // Out of range, or another spelling of a step (more leading zeros than checkpoint_name writes):
  // not a name this code wrote, so not one it may read or delete.
  if (ec != std::errc() || end != last || checkpoint_name(value) != name) return false;
  step = value;
  return true;
}

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

bool checkpoint_complete(const std::string& dir, std::string* why) {
  auto fail = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  const fs::path state_path = fs::path(dir) / kStateFile;
  if (!fs::is_regular_file(state_path)) return fail(str_cat("it has no ", kStateFile));
  TrainerState state;
  try {
    state = load_trainer_state(state_path.string());
  } catch (const Error& e) {
    return fail(e.what());
  }
  for (const CheckpointFile& f : state.files) {
    const fs::path p = fs::path(dir) / f.name;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) return fail(str_cat("it lacks ", f.name));
    const auto size = fs::file_size(p, ec);
    if (ec || static_cast<int64_t>(size) != f.bytes)
      return fail(str_cat(f.name, " is ", ec ? 0 : size, " bytes, not the ", f.bytes, " written"));
  }
  return true;
}

ResumePoint find_resume_point(const std::string& run_dir) {
  ResumePoint rp;
  const std::vector<int64_t> steps = list_checkpoints(run_dir);
  for (auto s = steps.rbegin(); s != steps.rend(); ++s) {
    const std::string dir = (fs::path(run_dir) / checkpoint_name(*s)).string();
    std::string why;
    if (checkpoint_complete(dir, &why)) {
      rp.dir = dir;
      rp.step = *s;
      break;
    }
    rp.warnings.push_back(str_cat("warning: ", dir, " is not a complete checkpoint (", why,
                                  "); it is skipped and left as it is"));
  }
  // What `latest` says, checked against the choice: only a disagreement is worth a word.
  const fs::path latest = fs::path(run_dir) / kLatest;
  std::string problem;
  if (!fs::exists(latest)) {
    if (!rp.dir.empty()) problem = "does not exist";
  } else {
    std::string name;
    try {
      name = trim(read_text_file(latest.string(), "the latest file", 4096));
    } catch (const Error& e) {
      problem = str_cat("cannot be read (", e.what(), ")");
    }
    int64_t step = 0;
    if (!problem.empty()) {
    } else if (!parse_checkpoint_name(name, step)) {
      problem = str_cat("holds '", name.substr(0, 64), "', not a checkpoint name");
    } else if (!fs::is_directory(fs::path(run_dir) / name)) {
      problem = str_cat("names ", name, ", which does not exist");
    } else if (step != rp.step) {
      problem = step > rp.step ? str_cat("names ", name, ", which is not complete")
                               : str_cat("names ", name, ", but a newer checkpoint is complete");
    }
  }
  if (!problem.empty())
    rp.warnings.push_back(str_cat(
        "warning: ", latest.string(), " ", problem, "; ",
        rp.dir.empty() ? std::string("there is no complete checkpoint, so the run starts afresh")
                       : str_cat("resuming from the newest complete checkpoint, ", rp.dir,
                                 " (to go back to an older one, move the newer step folders "
                                 "out of checkpoint.dir)")));
  return rp;
}

bool is_run_directory_entry(const std::string& name) {
  for (const char* own : {kLatest, kLockFile, "resolved_config.yaml", "run_summary.json",
                          "report.json", "report.txt"})
    if (name == own) return true;
  int64_t step = 0;
  const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
  return parse_checkpoint_name(tmp ? name.substr(0, name.size() - 4) : name, step) ||
         name.rfind(std::string(kLatest) + ".tmp.", 0) == 0 ||
         name.find(".iris-tmp.") != std::string::npos;
}

RunLock::RunLock(const std::string& run_dir)
    : lock_(run_dir, kLockFile, "checkpoint.dir",
            "two runs in one folder overwrite each other's checkpoints and metrics: wait for it "
            "to end, stop it, or set another checkpoint.dir") {}

void remove_checkpoint_debris(const std::string& run_dir) {
  if (!fs::is_directory(run_dir)) return;
  std::vector<fs::path> debris;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    const bool tmp_dir = e.is_directory() && name.size() > 4 &&
                         name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                         parse_checkpoint_name(name.substr(0, name.size() - 4), step);
    // write_file_atomic's temporary of a file the run keeps here: latest.tmp.XXXXXX,
    // resolved_config.yaml.tmp.XXXXXX, ...
    const size_t tmp_at = name.rfind(".tmp.");
    const bool tmp_file = !e.is_directory() && !e.is_symlink() && tmp_at != std::string::npos &&
                          tmp_at > 0 && is_run_directory_entry(name.substr(0, tmp_at));
    if (tmp_dir || tmp_file) debris.push_back(e.path());
  }
  for (const fs::path& p : debris) fs::remove_all(p);
  // What a killed export (or anything else built under an OwnedTempDir) left in the run directory
  // or beside it: removed only where its owner is dead.
  remove_abandoned_temp_dirs(run_dir);
  remove_abandoned_temp_dirs(fs::absolute(run_dir).parent_path().string());
}

std::string commit_checkpoint(const std::string& run_dir, int64_t step,
                              const std::function<void(const std::string& dir)>& fill) {
  fill(begin_checkpoint(run_dir, step));
  return finish_checkpoint(run_dir, step);
}

std::string begin_checkpoint(const std::string& run_dir, int64_t step) {
  make_directories(run_dir, "the run directory (checkpoint.dir)");
  const std::string name = checkpoint_name(step);
  const fs::path final_dir = fs::path(run_dir) / name;
  const fs::path tmp_dir = fs::path(run_dir) / (name + ".tmp");
  IRIS_CHECK(!fs::exists(final_dir), "checkpoint.dir ", run_dir, " already holds ", name,
             ", which this run did not write; a checkpoint is never replaced: move it out of "
             "checkpoint.dir (or set another checkpoint.dir) and restart");
  fs::remove_all(tmp_dir);
  fs::create_directory(tmp_dir);
  return tmp_dir.string();
}

std::string finish_checkpoint(const std::string& run_dir, int64_t step) {
  const std::string name = checkpoint_name(step);
  const fs::path final_dir = fs::path(run_dir) / name;
  const fs::path tmp_dir = fs::path(run_dir) / (name + ".tmp");
  fsync_dir(tmp_dir);
  std::error_code ec;
  fs::rename(tmp_dir, final_dir, ec);
  IRIS_CHECK(!ec, "renaming ", tmp_dir.string(), " to ", final_dir.string(),
             " failed: ", ec.message());
  fsync_dir(run_dir);
  write_file_atomic((fs::path(run_dir) / kLatest).string(), name + "\n");
  return final_dir.string();
}

void prune_checkpoints(const std::string& run_dir, std::vector<int64_t>& owned, int64_t keep_last) {
  IRIS_CHECK(keep_last >= 0, "checkpoint.keep_last must be >= 0, got ", keep_last);
  std::sort(owned.begin(), owned.end());
  owned.erase(std::unique(owned.begin(), owned.end()), owned.end());
  if (keep_last == 0 || static_cast<int64_t>(owned.size()) <= keep_last) return;
  const size_t drop = owned.size() - static_cast<size_t>(keep_last);
  for (size_t i = 0; i < drop; ++i) {
    const fs::path dir = fs::path(run_dir) / checkpoint_name(owned[i]);
    const fs::path doomed = fs::path(run_dir) / (checkpoint_name(owned[i]) + ".tmp");
    // Renamed first, so that a kill half-way through the deletion leaves *.tmp debris (removed
    // by the next run) rather than a step directory that looks like a damaged checkpoint.
    fs::remove_all(doomed);
    std::error_code ec;
    fs::rename(dir, doomed, ec);
    if (ec) continue;  // already gone
    fsync_dir(run_dir);
    fs::remove_all(doomed);
  }
  owned.erase(owned.begin(), owned.begin() + static_cast<std::ptrdiff_t>(drop));
}

DataFileFingerprint fingerprint_data_file(const std::string& path, int64_t whole_limit) {
  const int fd = open_regular_file(path, "training data file");
  struct stat st {};
  ::fstat(fd, &st);
  DataFileFingerprint f;
  f.path = path;
  f.bytes = static_cast<int64_t>(st.st_size);
  f.whole = f.bytes <= whole_limit;
  Hasher h;
  try {
    constexpr int64_t kMiB = int64_t(1) << 20;
    if (f.whole) {
      hash_range(fd, 0, f.bytes, h, path);
    } else {
      hash_range(fd, 0, kMiB, h, path);
      hash_range(fd, f.bytes - kMiB, kMiB, h, path);
      h.n = static_cast<uint64_t>(f.bytes);
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  f.hash = h.hex();
  return f;
}

std::vector<std::string> data_changes(const std::vector<DataFileFingerprint>& recorded,
                                      const std::vector<DataFileFingerprint>& now) {
  std::vector<std::string> out;
  if (recorded.empty()) return out;  // an older checkpoint: nothing to compare with
  if (recorded.size() != now.size()) {
    out.push_back(str_cat("data.train_files lists ", now.size(),
                          " files; the checkpoint was "
                          "trained on ",
                          recorded.size()));
    return out;
  }
  for (size_t i = 0; i < now.size(); ++i) {
    const DataFileFingerprint &a = recorded[i], &b = now[i];
    if (a.bytes != b.bytes)
      out.push_back(str_cat("data.train_files[", i, "] ", b.path, " is ", b.bytes,
                            " bytes; it was ", a.bytes, " when the checkpoint was written"));
    else if (a.hash != b.hash || a.whole != b.whole)
      out.push_back(str_cat("data.train_files[", i, "] ", b.path,
                            " has the same size but other contents than when the checkpoint "
                            "was written"));
  }
  return out;
}

std::vector<CheckpointFile> list_checkpoint_files(const std::string& dir) {
  std::vector<CheckpointFile> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name == kStateFile) continue;
    files.push_back({name, static_cast<int64_t>(e.file_size())});
  }
  std::sort(files.begin(), files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.name < b.name; });
  return files;
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
  json data = json::array();
  for (const DataFileFingerprint& f : s.data_files)
    data.push_back({{"path", f.path},
                    {"bytes", f.bytes},
                    {"hash", f.hash},
                    {"hashed", f.whole ? "whole file" : "first and last MiB"}});
  json files = json::array();
  for (const CheckpointFile& f : s.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}});
  json out = j;
  if (s.has_schedule) {
    const ScheduleSettings& c = s.schedule;
    out["schedule"] = {{"kind", c.kind},
                       {"lr", c.lr},
                       {"min_lr", c.min_lr},
                       {"vision_lr", c.vision_lr},
                       {"merger_lr", c.merger_lr},
                       {"weight_decay", c.weight_decay},
                       {"warmup_iters", c.warmup_iters},
                       {"decay_iters", c.decay_iters},
                       {"train_iters", c.train_iters}};
  }
  out["data_files"] = std::move(data);
  out["files"] = std::move(files);
  write_file_atomic(path, out.dump(2) + "\n");
}

TrainerState load_trainer_state(const std::string& path) {
  json j;
  try {
    j = read_json_file(path, "trainer state");
  } catch (const Error& e) {
    IRIS_FAIL(e.what(), "; the checkpoint is damaged");
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
    if (j.contains("schedule")) {
      const json& c = j.at("schedule");
      s.has_schedule = true;
      s.schedule.kind = c.at("kind").get<std::string>();
      s.schedule.lr = c.at("lr").get<double>();
      s.schedule.min_lr = c.at("min_lr").get<double>();
      s.schedule.vision_lr = c.at("vision_lr").get<double>();
      s.schedule.merger_lr = c.at("merger_lr").get<double>();
      s.schedule.weight_decay = c.at("weight_decay").get<double>();
      s.schedule.warmup_iters = c.at("warmup_iters").get<int64_t>();
      s.schedule.decay_iters = c.at("decay_iters").get<int64_t>();
      s.schedule.train_iters = c.at("train_iters").get<int64_t>();
    }
    if (j.contains("data_files"))
      for (const json& f : j.at("data_files"))
        s.data_files.push_back({f.at("path").get<std::string>(), f.at("bytes").get<int64_t>(),
                                f.at("hash").get<std::string>(),
                                f.at("hashed").get<std::string>() == "whole file"});
    if (j.contains("files"))
      for (const json& f : j.at("files")) {
        CheckpointFile cf{f.at("name").get<std::string>(), f.at("bytes").get<int64_t>()};
        // The name is joined to the checkpoint directory: it must stay inside it.
        IRIS_CHECK(!cf.name.empty() && cf.name.find('/') == std::string::npos && cf.name != "." &&
                       cf.name != "..",
                   path, " lists a file '", cf.name.substr(0, 64),
                   "' that is not a plain file name; the checkpoint is damaged");
        s.files.push_back(std::move(cf));
      }
  } catch (const json::exception& e) {
    IRIS_FAIL(path, ": missing or mistyped field (", e.what(), "); the checkpoint is damaged");
  }
  return s;
}

namespace {

volatile std::sig_atomic_t g_export_signal = 0;
extern "C" void on_export_signal(int sig) {
  g_export_signal = sig;
}

// SIGINT or SIGTERM during an export ends it at its next check with an error, so that its
// temporary is removed on the way out rather than left for the next command. SA_RESETHAND: a
// second signal ends the process at once (the next export or train in that folder removes what
// it leaves). A signal the caller ignores (nohup) stays ignored.
class ExportSignals {
 public:
  ExportSignals() {
    g_export_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_export_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_RESETHAND;  // reads and writes in progress go on
    for (const auto& [sig, old] : {std::pair{SIGINT, &old_int_}, std::pair{SIGTERM, &old_term_}})
      if (::sigaction(sig, nullptr, old) == 0 && old->sa_handler != SIG_IGN)
        ::sigaction(sig, &sa, nullptr);
  }
  ~ExportSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  ExportSignals(const ExportSignals&) = delete;
  ExportSignals& operator=(const ExportSignals&) = delete;

  void check(const std::string& out) const {
    const int sig = g_export_signal;
    if (sig != 0)
      IRIS_FAIL("the export to ", out, " was stopped by ", sig == SIGINT ? "SIGINT" : "SIGTERM",
                " before it was complete, and its partial copy was removed; run it again to "
                "export");
  }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// An export's tensors, each converted to the export's dtype and kept until the file is written.
class ExportTensors {
 public:
  explicit ExportTensors(DType dtype) : dtype_(dtype) {}
  void add(const std::string& name, const std::vector<int64_t>& shape,
           const std::vector<float>& f32) {
    storage_.emplace_back((f32.size() * dtype_size(dtype_) + 7) / 8);
    if (dtype_ == DType::f32) {
      std::memcpy(storage_.back().data(), f32.data(), f32.size() * 4);
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(storage_.back().data());
      for (size_t i = 0; i < f32.size(); ++i)
        dst[i] = dtype_ == DType::bf16 ? f32_to_bf16(f32[i]) : f32_to_f16(f32[i]);
    }
    items_.push_back({name, dtype_, shape, storage_.back().data()});
  }
  void write(const fs::path& path) const {
    write_safetensors(path.string(), items_, {{"format", "pt"}});
  }

 private:
  DType dtype_;
  std::vector<std::vector<uint64_t>> storage_;  // a moved vector keeps its buffer: items_ point in
  std::vector<SafetensorsWriteItem> items_;
};

std::string shape_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// config.json with the export's dtype, and the files beside the weights that HF and iris generate
// read.
void export_model_files(const std::string& src, const fs::path& tmp, DType dtype) {
  const std::string config_path = (fs::path(src) / "config.json").string();
  json config = read_json_file(config_path, "checkpoint config");
  IRIS_CHECK(config.is_object(), config_path, " must hold a JSON object");
  const char* dtype_text = dtype == DType::bf16  ? "bfloat16"
                           : dtype == DType::f16 ? "float16"
                                                 : "float32";
  config["dtype"] = dtype_text;
  if (config.contains("torch_dtype")) config["torch_dtype"] = dtype_text;
  write_file_atomic((tmp / "config.json").string(), config.dump(2) + "\n");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                        "preprocessor_config.json", "generation_config.json"})
    if (fs::is_regular_file(fs::path(src) / f)) copy_file_durably(fs::path(src) / f, tmp / f);
}

// Every tensor as it is (one file, or the shards of a pipelined run with their index: exported as
// one file).
void export_full(const SafetensorsCheckpoint& weights, const fs::path& tmp, DType dtype,
                 const std::function<void()>& check_stop) {
  ExportTensors out(dtype);
  for (const std::string& name : weights.names()) {
    const SafetensorsEntry& e = weights.at(name);
    out.add(name, e.shape, to_f32(e));
    check_stop();
  }
  out.write(tmp / "model.safetensors");
}

// Every base tensor, an adapted module's weight with its adapter merged in; no adapter tensors.
void export_merged(const std::string& src, const SafetensorsCheckpoint& weights,
                   const PeftAdapterConfig& adapter, const fs::path& tmp, DType dtype,
                   const std::function<void()>& check_stop) {
  const float scale = adapter.scale();
  const int64_t r = adapter.rank;
  std::set<std::string> merged;
  ExportTensors out(dtype);
  for (const std::string& name : weights.names()) {
    if (is_lora_tensor(name)) continue;
    const SafetensorsEntry& e = weights.at(name);
    std::vector<float> v = to_f32(e);
    const std::string module = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : "";
    const std::string a = module + ".lora_A.weight", b = module + ".lora_B.weight";
    if (!module.empty() && (weights.contains(a) || weights.contains(b))) {
      IRIS_CHECK(weights.contains(a) && weights.contains(b), "checkpoint ", src, " holds ",
                 weights.contains(a) ? a : b, " without ", weights.contains(a) ? b : a,
                 "; the checkpoint is damaged");
      const SafetensorsEntry &ea = weights.at(a), &eb = weights.at(b);
      const bool fits = e.shape.size() == 2 && ea.shape == std::vector<int64_t>{r, e.shape[1]} &&
                        eb.shape == std::vector<int64_t>{e.shape[0], r};
      IRIS_CHECK(fits, "checkpoint ", src, ": the adapter of ", module, " has lora_A ",
                 shape_string(ea.shape), " and lora_B ", shape_string(eb.shape),
                 ", which do not fit its weight ", shape_string(e.shape), " with r = ", r,
                 " from adapter_config.json; the checkpoint and its adapter_config.json disagree");
      merge_lora_delta(v.data(), to_f32(ea).data(), to_f32(eb).data(), e.shape[0], e.shape[1], r,
                       scale);
      merged.insert(module);
    }
    out.add(name, e.shape, v);
    check_stop();
  }
  for (const std::string& name : weights.names())
    IRIS_CHECK(!is_lora_tensor(name) || merged.count(lora_module(name)), "checkpoint ", src,
               " holds ", name, " but no ", lora_module(name),
               ".weight to merge it into; the checkpoint is damaged");
  out.write(tmp / "model.safetensors");
}

// The adapter as PEFT's save_pretrained writes it: adapter_config.json, and the adapter tensors
// with the tensors of the modules saved whole (modules_to_save), under base_model.model.<name>.
// (PEFT holds its trained copy of such a module as <module>.modules_to_save.default.<param> and
// saves it under <module>.<param>, the name of the tensor it replaces.)
void export_peft(const std::string& src, const SafetensorsCheckpoint& weights,
                 const PeftAdapterConfig& adapter, const fs::path& tmp, DType dtype,
                 const std::function<void()>& check_stop) {
  copy_file_durably(fs::path(src) / "adapter_config.json", tmp / "adapter_config.json");
  ExportTensors out(dtype);
  std::set<std::string> saved;
  for (const std::string& name : weights.names()) {
    const bool whole = in_modules_to_save(name, adapter.modules_to_save);
    if (!is_lora_tensor(name) && !whole) continue;
    for (const std::string& m : adapter.modules_to_save)
      if (in_modules_to_save(name, {m})) saved.insert(m);
    const SafetensorsEntry& e = weights.at(name);
    out.add(peft_key(name), e.shape, to_f32(e));
    check_stop();
  }
  for (const std::string& m : adapter.modules_to_save)
    IRIS_CHECK(saved.count(m), "checkpoint ", src, ": adapter_config.json lists '", m,
               "' in modules_to_save, but no tensor of the checkpoint lies in such a module");
  out.write(tmp / "adapter_model.safetensors");
}

// Writes the exported files of checkpoint `src` into the (new, empty) directory `tmp`.
void export_into(const std::string& src, const SafetensorsCheckpoint& weights,
                 const PeftAdapterConfig& adapter, const fs::path& tmp, DType dtype,
                 ExportKind kind, const std::function<void()>& check_stop) {
  switch (kind) {
    case ExportKind::full:
      export_full(weights, tmp, dtype, check_stop);
      break;
    case ExportKind::merge:
      export_merged(src, weights, adapter, tmp, dtype, check_stop);
      break;
    case ExportKind::peft:
      export_peft(src, weights, adapter, tmp, dtype, check_stop);
      break;
  }
  check_stop();
  if (kind != ExportKind::peft) export_model_files(src, tmp, dtype);
  fsync_dir(tmp);
}

// The LoRA adapters of the checkpoint checked against what the export is asked to make of them,
// before anything is written; for --peft and --merge, their adapter_config.json.
PeftAdapterConfig check_export_kind(const std::string& src, const SafetensorsCheckpoint& weights,
                                    ExportKind kind) {
  int64_t adapters = 0;
  std::string example;
  for (const std::string& name : weights.names())
    if (is_lora_tensor(name) && adapters++ == 0) example = name;
  if (kind == ExportKind::full) {
    IRIS_CHECK(adapters == 0, "checkpoint ", src, " holds LoRA adapters (", adapters,
               " tensors such as ", example,
               "), which a Hugging Face model loader does not know: pass --peft to export the "
               "adapter as PEFT saves it (adapter_config.json and adapter_model.safetensors, for "
               "PeftModel.from_pretrained or iris generate --lora), or --merge to merge it into "
               "the weights of a plain model");
    return {};
  }
  const char* flag = kind == ExportKind::peft ? "--peft" : "--merge";
  IRIS_CHECK(adapters > 0, "checkpoint ", src,
             " holds no LoRA adapters (it was not trained with peft.type: lora); export it "
             "without ",
             flag);
  const fs::path config = fs::path(src) / "adapter_config.json";
  IRIS_CHECK(fs::is_regular_file(config), "checkpoint ", src,
             " holds LoRA adapters but no adapter_config.json, which gives their r and "
             "lora_alpha; it was not written by iris train");
  return read_peft_adapter_config(config.string());
}

}  // namespace

void export_checkpoint(const std::string& checkpoint, const std::string& out_dir, DType dtype,
                       ExportKind kind) {
  IRIS_CHECK(dtype == DType::bf16 || dtype == DType::f32 || dtype == DType::f16,
             "export dtype must be bf16, f16 or f32");
  std::string src = checkpoint;
  IRIS_CHECK(fs::is_directory(src), "checkpoint ", src, " does not exist");
  if (!fs::exists(fs::path(src) / kStateFile)) {
    // A run directory: take what a resume would take, its newest complete checkpoint.
    const std::string newest = find_resume_point(src).dir;
    IRIS_CHECK(!newest.empty(), src,
               " is neither a checkpoint (no trainer_state.json) nor a run directory with a "
               "complete checkpoint");
    src = newest;
  }
  for (const char* f : {"config.json", "tokenizer.json"})
    IRIS_CHECK(fs::is_regular_file(fs::path(src) / f), "checkpoint ", src, " lacks ", f,
               "; it was not written by iris train");
  IRIS_CHECK(fs::is_regular_file(fs::path(src) / "model.safetensors") ||
                 fs::is_regular_file(fs::path(src) / "model.safetensors.index.json"),
             "checkpoint ", src,
             " lacks model.safetensors (or a pipelined run's model.safetensors.index.json); it "
             "was not written by iris train");
  // Opening maps the files and reads their headers only.
  const SafetensorsCheckpoint weights(src);
  const PeftAdapterConfig adapter = check_export_kind(src, weights, kind);
  IRIS_CHECK(!out_dir.empty(), "the export directory is empty; name a directory to create");
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" names dir
  IRIS_CHECK(!out.empty() && out.filename() != "." && out.filename() != "..", "export directory '",
             out_dir, "' names no new directory; give a path such as out/hf");
  std::error_code ec;
  IRIS_CHECK(!fs::exists(fs::symlink_status(out, ec)), "export directory ", out.string(),
             " already exists; remove it or choose another");
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  make_directories(parent.string(), "the export's parent directory");
  // An export killed (SIGKILL, power loss) before its rename left its full-size temporary here;
  // its owner is gone, so it is removed now rather than kept forever.
  remove_abandoned_temp_dirs(parent.string());
  // A fresh directory beside the target, renamed onto it at the end: nothing the user already
  // had is ever written to or removed, and a failure removes the temporary.
  // Before the temporary exists, so that a signal that finds it also finds the handler.
  const ExportSignals signals;
  OwnedTempDir tmp(out.string());
  const auto check_stop = [&] { signals.check(out.string()); };
  export_into(src, weights, adapter, tmp.path(), dtype, kind, check_stop);
  check_stop();
  tmp.commit();
}

}  // namespace iris
