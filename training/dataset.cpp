#include "training/dataset.h"

#include "bridge/architecture.h"
#include "vision/video.h"
#include "vision/video_decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "core/splitmix.h"
#include "training/chat_format.h"
#include "vision/image.h"

namespace iris {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

uint64_t mix_seed(uint64_t seed, uint64_t salt, uint64_t value) {
  SplitMix64 g(seed ^ (salt * 0xD1B54A32D192ED03ull));
  g.next();
  g.mix(value);
  return g.next();
}

std::vector<int64_t> epoch_permutation(uint64_t seed, int64_t epoch, int64_t n) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
  SplitMix64 rng(mix_seed(seed, 1, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

// ---------------------------------------------------------------------------------------------
// Parsing one JSONL line into chat messages and image paths

// The summary's words for why a line was not trained on (SkippedLine::reason).
constexpr const char* kInvalidRow = "invalid row";
constexpr const char* kMalformedJson = "malformed JSON";
constexpr const char* kVideo = "video not supported";
constexpr const char* kTools = "tools not supported";
constexpr const char* kRemoteImage = "remote image URL";
constexpr const char* kImageUrl = "unsupported image URL";
constexpr const char* kMissingImage = "missing image";
constexpr const char* kBadImage = "bad image";
constexpr const char* kTooLong = "longer than data.seq_length";

// A refusal whose cause the skip summary counts apart; any other iris::Error from a line is an
// invalid row.
class LineRefused : public Error {
 public:
  LineRefused(std::string reason, const std::string& detail)
      : Error(detail), reason_(std::move(reason)) {}
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_;
};

constexpr const char* kMissingVideo = "missing video";
constexpr const char* kBadVideo = "bad video";

[[noreturn]] void refuse_video(const std::string& what) {
  throw LineRefused(kVideo, what +
                                "; this dataset was opened without a model to preprocess videos "
                                "with, so the line is refused rather than trained as text without "
                                "its video");
}

struct ImageRef {
  std::string written;   // as the line gives it, for messages
  std::string resolved;  // the file to open
  bool relative = false;
};

struct ParsedLine {
  std::vector<ChatMessage> messages;
  std::vector<ImageRef> images;  // in order of the image parts
  std::vector<ImageRef> videos;  // in order of the video parts
};

// A field that is there and not null: datasets exported through HF `datasets` give every item
// every key of the column, null where it does not apply ({"type": "text", "text": "hi",
// "image": null}).
const json* present(const json& obj, const char* name) {
  auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

const json& field(const json& obj, const char* name, const char* where) {
  const json* v = present(obj, name);
  IRIS_CHECK(v != nullptr, where, " has no \"", name, "\" field");
  return *v;
}

std::string string_field(const json& obj, const char* name, const char* where) {
  const json& v = field(obj, name, where);
  IRIS_CHECK(v.is_string(), where, ": \"", name, "\" must be a string, got ", v.type_name());
  return v.get<std::string>();
}

// An empty list or string is how tabular exports write "none" (ms-swift's "videos": []).
bool has_content(const json* v) {
  return v != nullptr && !((v->is_array() || v->is_object() || v->is_string()) && v->empty());
}

std::vector<std::string> path_list(const json& v, const char* name) {
  std::vector<std::string> out;
  if (v.is_string()) {
    out.push_back(v.get<std::string>());
  } else {
    IRIS_CHECK(v.is_array(), "\"", name, "\" must be a path or a list of paths, got ",
               v.type_name());
    for (const json& p : v) {
      IRIS_CHECK(p.is_string(), "\"", name, "\" must list paths (strings), found a ",
                 p.type_name());
      out.push_back(p.get<std::string>());
    }
  }
  return out;
}

// Inline data: URIs can be megabytes long.
std::string shortened(const std::string& s) {
  return s.size() <= 80 ? s : s.substr(0, 60) + "...";
}

ImageRef resolve_image(const std::string& written, const fs::path& base,
                       const char* noun = "image") {
  IRIS_CHECK(!written.empty(), "an ", noun, " path is empty");
  if (written.rfind("http://", 0) == 0 || written.rfind("https://", 0) == 0)
    throw LineRefused(kRemoteImage,
                      str_cat(noun, " '", shortened(written),
                              "' is a remote URL; training reads local files only and downloads "
                              "nothing, so download it and give its path"));
  std::string path = written;
  if (written.rfind("file://", 0) == 0) {
    path = written.substr(7);  // as qwen_vl_utils reads it: the rest is the path
  } else if (written.find("://") != std::string::npos || written.rfind("data:", 0) == 0) {
    throw LineRefused(kImageUrl, str_cat(noun, " '", shortened(written),
                                         "' is a URL; give a local path (or file://path)"));
  }
  IRIS_CHECK(!path.empty(), "the image URL '", written, "' has no path");
  const fs::path p(path);
  return {written, (p.is_absolute() ? p : base / p).lexically_normal().string(), !p.is_absolute()};
}

// For messages: a path relative to the working directory says little when the recipe named it.
std::string absolute_path(const fs::path& p) {
  std::error_code ec;
  const fs::path a = fs::absolute(p.empty() ? fs::path(".") : p, ec);
  std::string out = (ec ? p : a).lexically_normal().string();
  if (out.size() > 1 && out.back() == '/') out.pop_back();  // "dir/." normalises to "dir/"
  return out;
}

std::string trim(std::string_view s, bool left, bool right) {
  const char* ws = " \t\r\n";
  size_t b = 0, e = s.size();
  if (left) {
    b = s.find_first_not_of(ws);
    if (b == std::string_view::npos) return {};
  }
  if (right) e = s.find_last_not_of(ws) + 1;
  return b < e ? std::string(s.substr(b, e - b)) : std::string();
}

// One line's turns, in whichever of the accepted shapes (dataset.h), as the HF messages that the
// chat template renders.
class LineParser {
 public:
  LineParser(const json& line, const fs::path& base) : line_(line), base_(base) {}

  ParsedLine parse() {
    refuse_what_cannot_be_trained();
    const json* messages = present(line_, "messages");
    const json* conversations = present(line_, "conversations");
    IRIS_CHECK(!(messages && conversations),
               "both \"messages\" and \"conversations\" are given; keep one of them");
    IRIS_CHECK(messages || conversations,
               "a line needs a \"messages\" list (HF, ms-swift) or a \"conversations\" list "
               "(LLaVA, ShareGPT)");
    const char* key = messages ? "messages" : "conversations";
    const json& turns = messages ? *messages : *conversations;
    IRIS_CHECK(turns.is_array() && !turns.empty(), "\"", key, "\" must be a non-empty array");
    read_listed(kImage, "images", "image");
    read_listed(kVideoKind, "videos", "video");
    const json* system = present(line_, "system");
    const bool top_system = has_content(system);
    if (top_system) {
      IRIS_CHECK(system->is_string(), "\"system\" must be a string, got ", system->type_name());
      out_.messages.push_back({"system", {ChatPart::make_text(system->get<std::string>())}});
    }
    for (const json& t : turns) {
      IRIS_CHECK(t.is_object(), "each entry of \"", key, "\" must be an object, found a ",
                 t.type_name());
      out_.messages.push_back(read_turn(t));
      IRIS_CHECK(!top_system || out_.messages.back().role != "system",
                 "the line has both a top-level \"system\" and a system turn; keep one of them");
    }
    check_listed_used(kImage);
    check_listed_used(kVideoKind);
    return std::move(out_);
  }

 private:
  void refuse_what_cannot_be_trained() const {
    if (has_content(present(line_, "tools")))
      throw LineRefused(kTools,
                        "the line has \"tools\", which Iris does not render into the prompt; the "
                        "line is refused rather than trained without them");
  }

  // The files <image> (<video>) tags and path-less items take in order: a top-level "images"
  // ("videos") list, or LLaVA's single "image" ("video").
  void read_listed(int kind, const char* list_key, const char* single_key) {
    const json* list = present(line_, list_key);
    const json* single = present(line_, single_key);
    IRIS_CHECK(!(list && single), "both \"", single_key, "\" and \"", list_key,
               "\" are given; list the ", list_key, " in one of them");
    if (list || single) {
      listed_key_[kind] = list ? list_key : single_key;
      listed_[kind] = path_list(list ? *list : *single, listed_key_[kind]);
    }
  }

  ChatMessage read_turn(const json& t) {
    ChatMessage cm;
    if (present(t, "role")) {
      cm.role = string_field(t, "role", "a message");
      speaker_ = cm.role;
      user_word_ = "user";
    } else {
      IRIS_CHECK(present(t, "from"), "a message has no \"role\" (or ShareGPT \"from\") field");
      const std::string from = string_field(t, "from", "a conversation turn");
      if (from == "human" || from == "user") {
        cm.role = "user";
      } else if (from == "gpt" || from == "assistant") {
        cm.role = "assistant";
      } else if (from == "system") {
        cm.role = "system";
      } else {
        IRIS_FAIL("unknown \"from\": '", from, "'; use human, gpt or system");
      }
      speaker_ = from;
      user_word_ = "human";
    }
    const char* key = present(t, "content") ? "content" : "value";
    const json* content = present(t, key);
    IRIS_CHECK(content != nullptr, "a ", speaker_,
               " message has no \"content\" (or ShareGPT \"value\") field");
    if (content->is_string()) {
      add_text(cm, content->get<std::string>());
    } else {
      IRIS_CHECK(content->is_array(), "a ", speaker_, " message's \"", key,
                 "\" must be a string or a list of items, got ", content->type_name());
      for (const json& item : *content) add_item(cm, item);
    }
    return cm;
  }

  // Text with <image> and <video> tags: each tag places the next listed image (video).
  void add_text(ChatMessage& cm, std::string_view text) {
    constexpr std::string_view kTags[2] = {"<image>", "<video>"};
    std::string_view rest = text;
    bool after_tag = false;
    for (;;) {
      size_t at = std::string_view::npos;
      int kind = kImage;
      for (int k : {kImage, kVideoKind}) {
        const size_t a = rest.find(kTags[k]);
        if (a < at) {
          at = a;
          kind = k;
        }
      }
      const bool before_tag = at != std::string_view::npos;
      if (!before_tag && !after_tag) {
        cm.content.push_back(ChatPart::make_text(std::string(text)));
        return;
      }
      const std::string piece =
          trim(rest.substr(0, before_tag ? at : rest.size()), after_tag, before_tag);
      if (!piece.empty()) cm.content.push_back(ChatPart::make_text(piece));
      if (!before_tag) break;
      IRIS_CHECK(cm.role == "user", "an ", kTags[kind], " tag in a '", speaker_, "' turn; ",
                 kind == kImage ? "images" : "videos", " may only appear in ", user_word_,
                 " turns");
      ++tags_[kind];
      take_listed(kind, cm);
      rest.remove_prefix(at + kTags[kind].size());
      after_tag = true;
    }
  }

  void add_item(ChatMessage& cm, const json& item) {
    IRIS_CHECK(item.is_object(), "a content item must be an object, found a ", item.type_name());
    std::string type;
    if (present(item, "type")) {
      type = string_field(item, "type", "a content item");
    } else {  // the chat template also keys on the field name alone
      for (const char* k : {"image", "image_url", "video", "video_url", "text"})
        if (present(item, k)) {
          type = k;
          break;
        }
    }
    if (type == "text") {
      add_text(cm, string_field(item, "text", "a text item"));
    } else if (type == "image" || type == "image_url" || type == "video" || type == "video_url") {
      const int kind = type.rfind("image", 0) == 0 ? kImage : kVideoKind;
      if (const std::optional<std::string> path = item_media_path(item, type)) {
        if (kind == kImage) {
          out_.images.push_back(resolve_image(*path, base_));
          cm.content.push_back(ChatPart::make_image());
        } else {
          out_.videos.push_back(resolve_image(*path, base_, "video"));
          cm.content.push_back(ChatPart::make_video());
        }
      } else {
        ++pathless_items_[kind];
        take_listed(kind, cm);
      }
    } else {
      IRIS_FAIL("content item type '", type,
                "' is not supported; use {\"type\": \"image\", \"image\": path}, {\"type\": "
                "\"image_url\", \"image_url\": {\"url\": path}}, {\"type\": \"video\", "
                "\"video\": path} or {\"type\": \"text\", \"text\": ...}");
    }
  }

  // The file an image (video) item names itself; none: the next listed one (TRL's layout).
  static std::optional<std::string> item_media_path(const json& item, const std::string& type) {
    if (type == "image_url" || type == "video_url") {
      const std::string where = "a " + type + " item";
      const json& v = field(item, type.c_str(), where.c_str());
      if (v.is_string()) return v.get<std::string>();
      IRIS_CHECK(v.is_object(), "a ", type, " item's \"", type, "\" must be {\"url\": ...} or a ",
                 "string, got ", v.type_name());
      return string_field(v, "url", (where + "'s \"" + type + "\"").c_str());
    }
    const std::string where = "a " + type + " item";
    for (const char* k : {type.c_str(), "path", "url"})
      if (present(item, k)) return string_field(item, k, where.c_str());
    return std::nullopt;
  }

  void take_listed(int kind, ChatMessage& cm) {
    // A shortfall is reported once all are counted, with the totals.
    if (taken_[kind] < listed_[kind].size()) {
      if (kind == kImage)
        out_.images.push_back(resolve_image(listed_[kind][taken_[kind]], base_));
      else
        out_.videos.push_back(resolve_image(listed_[kind][taken_[kind]], base_, "video"));
    }
    ++taken_[kind];
    cm.content.push_back(kind == kImage ? ChatPart::make_image() : ChatPart::make_video());
  }

  void check_listed_used(int kind) const {
    if (taken_[kind] == listed_[kind].size()) return;
    const char* tag = kind == kImage ? "<image>" : "<video>";
    const char* noun = kind == kImage ? "image" : "video";
    std::string has;
    if (pathless_items_[kind] == 0 || tags_[kind] > 0)
      has = str_cat(tags_[kind], " ", tag, " tags");
    if (pathless_items_[kind] > 0)
      has += str_cat(has.empty() ? "" : " and ", pathless_items_[kind], " ", noun,
                     " items without a path");
    IRIS_FAIL("the conversation has ", has, " but ",
              listed_key_[kind] ? str_cat(listed_[kind].size(), " ", noun, "s are listed in \"",
                                          listed_key_[kind], "\"")
                                : str_cat("the line has no \"", noun, "s\" list"),
              "; each ", tag, " tag and each ", noun, " item without a path takes the next listed ",
              noun, ", so they must match one to one");
  }

  static constexpr int kImage = 0, kVideoKind = 1;
  const json& line_;
  const fs::path& base_;
  ParsedLine out_;
  // Per kind (kImage, kVideoKind): the listed files, their key (null: none listed), and what
  // took from them.
  std::vector<std::string> listed_[2];
  const char* listed_key_[2] = {nullptr, nullptr};
  size_t taken_[2] = {0, 0}, tags_[2] = {0, 0}, pathless_items_[2] = {0, 0};
  std::string speaker_, user_word_;  // of the turn being read, for messages
};

ParsedLine parse_line(const std::string& text, const fs::path& base, bool videos_allowed) {
  json j;
  try {
    j = parse_json(text, "the line", kJsonLineLimits);
  } catch (const Error& e) {
    throw LineRefused(kMalformedJson, str_cat("malformed JSON: ", e.what()));
  }
  IRIS_CHECK(j.is_object(), "a line must be a JSON object, got ", j.type_name());
  ParsedLine out = LineParser(j, base).parse();
  if (!out.videos.empty() && !videos_allowed)
    refuse_video(
        str_cat("the line has ", out.videos.size(), " video", out.videos.size() == 1 ? "" : "s"));
  bool has_assistant = false;
  for (const ChatMessage& m : out.messages) {
    IRIS_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "unknown role '",
               m.role, "'; use system, user or assistant");
    if (m.role != "user") {
      for (const ChatPart& p : m.content)
        IRIS_CHECK(p.kind == ChatPart::Kind::text, "an image or video in a ", m.role,
                   " turn; images and videos may only appear in user turns");
    }
    has_assistant = has_assistant || m.role == "assistant";
  }
  IRIS_CHECK(has_assistant, "no assistant turn, so the sample has nothing to learn");
  return out;
}

GridTHW grid_of(const ImageRGB8& img, const PreprocessorConfig& pp) {
  return image_grid(img.height, img.width, pp);
}

std::string read_line_at(const std::string& path, uint64_t offset, uint32_t length) {
  std::ifstream f(path, std::ios::binary);
  IRIS_CHECK(f.good(), "cannot reopen ", path, "; was it moved or deleted while training?");
  f.seekg(static_cast<std::streamoff>(offset));
  std::string s(length, '\0');
  f.read(s.data(), length);
  IRIS_CHECK(f.gcount() == static_cast<std::streamsize>(length), path,
             " got shorter since it was indexed; do not edit train files during a run");
  return s;
}

}  // namespace

void DataConfig::validate() const {
  IRIS_CHECK(mock || !train_files.empty(),
             "data.train_files is empty; list at least one JSONL file (or enable data.mock)");
  IRIS_CHECK(seq_length >= 1, "data.seq_length = ", seq_length, " must be at least 1");
  IRIS_CHECK(num_workers >= 0 && num_workers <= 256, "data.num_workers = ", num_workers,
             " must be in [0, 256] (0 prepares samples inside next())");
  IRIS_CHECK(prefetch >= 1 && prefetch <= 4096, "data.prefetch = ", prefetch,
             " must be in [1, 4096]");
  IRIS_CHECK(std::isfinite(video_fps) && video_fps <= 1000 && (video_fps >= 0 || video_fps == -1),
             "data.video_fps = ", video_fps,
             " must be between 0 (every frame) and 1000, or -1 (the model's video processor's)");
  IRIS_CHECK(video_max_frames >= 0 && video_max_frames <= (1 << 20),
             "data.video_max_frames = ", video_max_frames, " must be between 0 (the model's) and ",
             1 << 20);
  IRIS_CHECK(max_image_pixels >= 1, "data.max_image_pixels = ", max_image_pixels,
             " must be at least 1");
  if (mock) {
    for (const auto& s : mock_image_sizes)
      IRIS_CHECK(s[0] >= 1 && s[1] >= 1, "data.mock_image_sizes has ", s[0], "x", s[1],
                 "; sizes are {width, height}, both positive");
    IRIS_CHECK(mock_text_tokens >= 2, "data.mock_text_tokens = ", mock_text_tokens,
               " must be at least 2 (half user text, half assistant reply)");
    IRIS_CHECK(mock_samples >= 1, "data.mock_samples = ", mock_samples, " must be at least 1");
  }
}

// ---------------------------------------------------------------------------------------------

struct Dataset::Impl {
  struct Record {
    uint32_t file;
    int64_t line;
    uint64_t offset;
    uint32_t length;
  };
  struct Outcome {
    enum class Kind { ok, too_long, bad, fatal } kind = Kind::ok;
    Sample sample;
    std::string reason;  // SkippedLine::reason
    std::string detail;
    int64_t record = -1;
  };

  DataConfig cfg;
  Tokenizer tok;
  PreprocessorConfig pp;
  ChatFormat format;
  std::vector<Record> records;
  int64_t n = 0;

  // Token ids the mock builds sequences from. Mock samples are random tokens laid out as one
  // ChatML exchange for throughput runs, not conversations, so they skip the chat template.
  std::vector<int32_t> user_header, assistant_header, turn_end;
  int32_t vision_start = 0, vision_end = 0, image_pad = 0;

  // Consumer-side state (only next()/seek() touch these, apart from `consume` under `mu`).
  DataStats stats;
  std::vector<SkippedLine> unreported;  // for take_new_skips
  std::vector<uint8_t> counted;         // per record: already in stats
  int64_t skipped_in_a_row = 0;

  std::mutex mu;
  std::condition_variable work_cv, ready_cv;
  int64_t consume = 0;      // absolute index (epoch * n + index) the consumer takes next
  int64_t next_ticket = 0;  // absolute index the next idle worker takes
  // Bumped by seek(). A result depends only on its absolute index, so an older generation's result
  // is not wrong, but one behind the new position would never be taken and would stay in `ready`.
  uint64_t generation = 0;
  bool stopping = false;
  std::map<int64_t, Outcome> ready;
  std::vector<std::thread> workers;

  std::mutex perm_mu;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> perms;

  Impl(const DataConfig& c, const Tokenizer& t, const PreprocessorConfig& p, const ChatFormat& f)
      : cfg(c), tok(t), pp(p), format(f) {}

  std::string source_of(int64_t rec) const {
    if (cfg.mock) return "mock:" + std::to_string(rec);
    const Record& r = records[static_cast<size_t>(rec)];
    return cfg.train_files[r.file] + ":" + std::to_string(r.line);
  }

  fs::path image_base(uint32_t file) const {
    if (!cfg.image_root.empty()) return fs::path(cfg.image_root);
    return fs::path(cfg.train_files[file]).parent_path();
  }

  // Where a relative path in `file` was looked for, in the terms of the recipe.
  std::string image_base_rule(uint32_t file) const {
    const std::string dir = absolute_path(image_base(file));
    if (!cfg.image_root.empty())
      return str_cat("relative image paths resolve against data.image_root (", dir, ")");
    return str_cat("relative image paths resolve against the JSONL file's folder (", dir,
                   "), or against data.image_root when it is set");
  }

  void record_skip(const std::string& file, int64_t line, std::string reason, std::string detail) {
    SkippedLine skipped{file, line, std::move(reason), std::move(detail)};
    ++stats.skipped_by_reason[skipped.reason];
    if (stats.skipped.size() < kKeptSkippedLines) stats.skipped.push_back(skipped);
    unreported.push_back(std::move(skipped));
  }

  void record_skip(int64_t rec, std::string reason, std::string detail) {
    if (cfg.mock) {
      record_skip("mock", rec, std::move(reason), std::move(detail));
      return;
    }
    const Record& r = records[static_cast<size_t>(rec)];
    record_skip(cfg.train_files[r.file], r.line, std::move(reason), std::move(detail));
  }

  std::string first_skip() const {
    return stats.skipped.empty() ? std::string("-") : stats.skipped[0].describe();
  }

  void index_files() {
    for (uint32_t fi = 0; fi < cfg.train_files.size(); ++fi) {
      const std::string& path = cfg.train_files[fi];
      const std::string what = cfg.files_key == "data.train_files" ? "train file" : "data file";
      try {
        check_regular_file(path, what);
      } catch (const Error& e) {
        IRIS_FAIL(e.what(), "; check ", cfg.files_key,
                  " (relative paths are relative to the working directory)");
      }
      std::ifstream f(path, std::ios::binary);
      IRIS_CHECK(f.good(), "cannot open ", what, " ", path, "; check ", cfg.files_key,
                 " (relative paths are relative to the working directory)");
      std::string line;
      uint64_t offset = 0;
      int64_t line_no = 0;
      while (read_bounded_line(f, line, kMaxJsonlLineBytes, path, line_no + 1)) {
        ++line_no;
        const uint64_t start = offset;
        offset += line.size() + 1;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        ++stats.lines;
        std::string reason, detail;
        try {
          parse_line(line, image_base(fi), cfg.video != nullptr);
        } catch (const LineRefused& e) {
          reason = e.reason();
          detail = e.what();
        } catch (const Error& e) {
          reason = kInvalidRow;
          detail = e.what();
        }
        if (!reason.empty()) {
          if (cfg.on_bad_sample == DataConfig::OnBad::error)
            IRIS_FAIL(path, ":", line_no, ": ", detail,
                      "; fix or remove the line, or set data.on_bad_sample: skip");
          ++stats.bad_samples;
          record_skip(path, line_no, std::move(reason), std::move(detail));
          continue;
        }
        records.push_back({fi, line_no, start, static_cast<uint32_t>(line.size())});
      }
    }
    n = static_cast<int64_t>(records.size());
    IRIS_CHECK(n > 0, "no usable line in data.train_files (", stats.summary(),
               stats.skipped.empty() ? std::string() : "; first: " + first_skip(), ")");
  }

  void init_mock() {
    n = cfg.mock_samples;
    stats.lines = n;
    user_header = tok.encode("<|im_start|>user\n");
    assistant_header = tok.encode("<|im_start|>assistant\n");
    turn_end = tok.encode("<|im_end|>\n");
    vision_start = tok.token_id("<|vision_start|>");
    vision_end = tok.token_id("<|vision_end|>");
    image_pad = tok.token_id("<|image_pad|>");
  }

  int64_t record_at(int64_t abs) {
    const int64_t epoch = abs / n, index = abs % n;
    if (!cfg.shuffle) return index;
    std::shared_ptr<const std::vector<int64_t>> perm;
    {
      std::lock_guard<std::mutex> lock(perm_mu);
      auto it = perms.find(epoch);
      if (it == perms.end()) {
        it = perms
                 .emplace(epoch, std::make_shared<const std::vector<int64_t>>(
                                     epoch_permutation(cfg.seed, epoch, n)))
                 .first;
        // Workers run at most a prefetch window ahead, so two or three epochs are ever in use.
        while (perms.size() > 3) perms.erase(perms.begin());
      }
      perm = it->second;
    }
    return (*perm)[static_cast<size_t>(index)];
  }

  void finish_pixels(const std::vector<ImageRGB8>& images, Sample& s) const {
    if (images.empty()) return;
    const PreprocessedBatch b = preprocess_images(images, pp);
    IRIS_CHECK(b.grid_thw == s.grids,
               "internal: image grids from smart_resize and from "
               "preprocessing differ");
    const float* p = b.pixel_values.data<float>();
    s.pixel_values.assign(p, p + b.pixel_values.numel());
  }

  ImageRGB8 load_line_image(const ImageRef& image, uint32_t file) const {
    std::error_code ec;
    // An error other than absence (a folder without search permission) is load_image's to word.
    if (!fs::exists(image.resolved, ec) && !ec) {
      throw LineRefused(
          kMissingImage,
          image.relative
              ? str_cat("image file not found: ", absolute_path(image.resolved),
                        " (the line gives '", image.written, "'; ", image_base_rule(file), ")")
              : str_cat("image file not found: ", image.resolved));
    }
    try {
      return load_image(image.resolved, cfg.max_image_pixels);
    } catch (const Error& e) {
      throw LineRefused(kBadImage, e.what());
    }
  }

  // A video decoded and preprocessed as iris generate --video does it.
  VideoClip load_line_video(const ImageRef& video, uint32_t file) const {
    std::error_code ec;
    if (!fs::exists(video.resolved, ec) && !ec) {
      throw LineRefused(
          kMissingVideo,
          video.relative
              ? str_cat("video file not found: ", absolute_path(video.resolved),
                        " (the line gives '", video.written, "'; ", image_base_rule(file), ")")
              : str_cat("video file not found: ", video.resolved));
    }
    const DataVideo& v = *cfg.video;
    try {
      return load_model_video(video.resolved, v.model, v.processor);
    } catch (const Error& e) {
      const std::string what = e.what();
      throw LineRefused(kBadVideo, what.find(video.resolved) != std::string::npos
                                       ? what
                                       : str_cat(video.resolved, ": ", what));
    }
  }

  Outcome process_file_record(int64_t rec) const {
    Outcome out;
    const Record& r = records[static_cast<size_t>(rec)];
    const std::string line = read_line_at(cfg.train_files[r.file], r.offset, r.length);
    ParsedLine parsed = parse_line(line, image_base(r.file), cfg.video != nullptr);
    std::vector<ImageRGB8> images;
    images.reserve(parsed.images.size());
    for (const ImageRef& image : parsed.images) images.push_back(load_line_image(image, r.file));
    std::vector<VideoClip> clips;
    for (const ImageRef& video : parsed.videos) clips.push_back(load_line_video(video, r.file));
    Sample s;
    for (const ImageRGB8& img : images) s.grids.push_back(grid_of(img, pp));
    if (!clips.empty()) return finish_with_videos(parsed, images, clips, std::move(s));
    ChatTokens t = build_chat_tokens(tok, format, parsed.messages, s.grids, pp.merge_size);
    s.ids = std::move(t.ids);
    s.labels = std::move(t.labels);
    if (static_cast<int64_t>(s.ids.size()) > cfg.seq_length) {
      out.kind = Outcome::Kind::too_long;
      out.reason = kTooLong;
      out.detail = str_cat(s.ids.size(), " tokens is longer than data.seq_length ", cfg.seq_length,
                           "; the sample is dropped whole, never cut");
      return out;
    }
    finish_pixels(images, s);
    out.sample = std::move(s);
    return out;
  }

  // A sample with videos: ids and labels expanded as the family writes videos, pixel rows and
  // grids in the order the pads come (images and videos interleaved as the messages place them).
  Outcome finish_with_videos(const ParsedLine& parsed, const std::vector<ImageRGB8>& images,
                             const std::vector<VideoClip>& clips, Sample s) const {
    Outcome out;
    std::vector<const VideoClip*> videos;
    for (const VideoClip& c : clips) videos.push_back(&c);
    ChatMediaTokens t =
        build_chat_media_tokens(tok, format, parsed.messages, cfg.video->model, s.grids, videos);
    if (static_cast<int64_t>(t.prompt.ids.size()) > cfg.seq_length) {
      out.kind = Outcome::Kind::too_long;
      out.reason = kTooLong;
      out.detail = str_cat(t.prompt.ids.size(), " tokens is longer than data.seq_length ",
                           cfg.seq_length, "; the sample is dropped whole, never cut");
      return out;
    }
    Sample images_only;
    images_only.grids = s.grids;
    finish_pixels(images, images_only);
    const int64_t cols = int64_t{3} * pp.temporal_patch_size * pp.patch_size * pp.patch_size;
    std::vector<int64_t> image_row(images_only.grids.size() + 1, 0);
    for (size_t i = 0; i < images_only.grids.size(); ++i) {
      const GridTHW& g = images_only.grids[i];
      image_row[i + 1] = image_row[i] + g[0] * g[1] * g[2];
    }
    s.grids.clear();
    for (const MediaPrompt::Item& item : t.prompt.media_order) {
      if (item.video) {
        const VideoClip& c = clips[item.index];
        s.pixel_values.insert(s.pixel_values.end(), c.pixel_values.data<float>(),
                              c.pixel_values.data<float>() + c.pixel_values.numel());
        s.grids.push_back(c.grid_thw);
      } else {
        const float* rows = images_only.pixel_values.data();
        s.pixel_values.insert(s.pixel_values.end(), rows + image_row[item.index] * cols,
                              rows + image_row[item.index + 1] * cols);
        s.grids.push_back(images_only.grids[item.index]);
      }
    }
    s.ids = std::move(t.prompt.ids);
    s.labels = std::move(t.labels);
    s.runs = std::move(t.prompt.runs);
    out.sample = std::move(s);
    return out;
  }

  Outcome process_mock_record(int64_t rec) const {
    Outcome out;
    SplitMix64 rng(mix_seed(cfg.seed, 2, static_cast<uint64_t>(rec)));
    std::vector<ImageRGB8> images;
    Sample s;
    for (const auto& size : cfg.mock_image_sizes) {
      ImageRGB8 img;
      img.width = size[0];
      img.height = size[1];
      img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
      for (size_t i = 0; i < img.pixels.size(); i += 8) {
        uint64_t r = rng.next();
        for (size_t k = i; k < std::min(i + 8, img.pixels.size()); ++k, r >>= 8)
          img.pixels[k] = static_cast<uint8_t>(r);
      }
      s.grids.push_back(grid_of(img, pp));
      images.push_back(std::move(img));
    }
    const int32_t vocab = tok.vocab_size();
    auto random_token = [&] {
      for (;;) {
        const auto id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
        if (!tok.is_added(id)) return id;
      }
    };
    auto push = [&](int32_t id, bool learn) {
      s.ids.push_back(id);
      s.labels.push_back(learn ? id : kIgnoreLabel);
    };
    for (int32_t id : user_header) push(id, false);
    for (const GridTHW& g : s.grids) {
      push(vision_start, false);
      const int64_t pads = image_token_count(g, pp.merge_size);
      for (int64_t i = 0; i < pads; ++i) push(image_pad, false);
      push(vision_end, false);
    }
    const int user_tokens = cfg.mock_text_tokens / 2;
    for (int i = 0; i < user_tokens; ++i) push(random_token(), false);
    for (int32_t id : turn_end) push(id, false);
    for (int32_t id : assistant_header) push(id, false);
    for (int i = user_tokens; i < cfg.mock_text_tokens; ++i) push(random_token(), true);
    for (int32_t id : turn_end) push(id, true);
    if (static_cast<int64_t>(s.ids.size()) > cfg.seq_length) {
      out.kind = Outcome::Kind::too_long;
      out.reason = kTooLong;
      out.detail = str_cat(s.ids.size(), " tokens is longer than data.seq_length ", cfg.seq_length);
      return out;
    }
    finish_pixels(images, s);
    out.sample = std::move(s);
    return out;
  }

  // Never throws: failures become outcomes that the consumer reports in order.
  Outcome process(int64_t abs) {
    Outcome out;
    int64_t rec = -1;
    try {
      rec = record_at(abs);
      out = cfg.mock ? process_mock_record(rec) : process_file_record(rec);
    } catch (const LineRefused& e) {
      out.kind = Outcome::Kind::bad;
      out.reason = e.reason();
      out.detail = e.what();
    } catch (const Error& e) {
      out.kind = Outcome::Kind::bad;
      out.reason = kInvalidRow;
      out.detail = e.what();
    } catch (const std::exception& e) {
      out.kind = Outcome::Kind::fatal;
      out.detail = e.what();
    }
    if (rec >= 0) {
      out.record = rec;
      out.sample.source = source_of(rec);
    }
    return out;
  }

  void worker_loop() {
    // Parallelism comes from the workers; OpenMP teams inside preprocessing would only compete
    // with them and with the training step for cores.
    omp_set_num_threads(1);
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      if (next_ticket >= consume + cfg.prefetch) {
        work_cv.wait(lock);
        continue;
      }
      const int64_t ticket = next_ticket++;
      const uint64_t gen = generation;
      lock.unlock();
      Outcome out = process(ticket);
      lock.lock();
      if (gen == generation) {
        ready.emplace(ticket, std::move(out));
        ready_cv.notify_all();
      }
    }
  }

  void start() {
    for (int i = 0; i < cfg.num_workers; ++i) workers.emplace_back([this] { worker_loop(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    work_cv.notify_all();
    for (std::thread& t : workers) t.join();
    workers.clear();
  }

  Outcome take() {
    if (cfg.num_workers == 0) {
      int64_t abs;
      {
        std::lock_guard<std::mutex> lock(mu);
        abs = consume++;
      }
      return process(abs);
    }
    std::unique_lock<std::mutex> lock(mu);
    ready_cv.wait(lock, [&] { return ready.count(consume) != 0; });
    auto node = ready.extract(consume);
    ++consume;
    lock.unlock();
    work_cv.notify_all();
    return std::move(node.mapped());
  }

  Sample next() {
    for (;;) {
      Outcome out = take();
      const std::string& src = out.sample.source;
      if (out.kind == Outcome::Kind::ok) {
        skipped_in_a_row = 0;
        return std::move(out.sample);
      }
      if (out.kind == Outcome::Kind::fatal)
        IRIS_FAIL("preparing ", src.empty() ? std::string("a sample") : src,
                  " failed: ", out.detail);
      if (out.kind == Outcome::Kind::bad && cfg.on_bad_sample == DataConfig::OnBad::error)
        IRIS_FAIL(src, ": ", out.detail,
                  "; fix or remove the line, or set data.on_bad_sample: skip");
      const int64_t rec = out.record;
      if (rec >= 0 && !counted[static_cast<size_t>(rec)]) {
        counted[static_cast<size_t>(rec)] = 1;
        if (out.kind == Outcome::Kind::too_long) {
          ++stats.dropped_too_long;
        } else {
          ++stats.bad_samples;
        }
        record_skip(rec, std::move(out.reason), std::move(out.detail));
      }
      IRIS_CHECK(++skipped_in_a_row <= n, "a whole epoch of ", n,
                 " samples yielded nothing usable (", stats.summary(), "); first: ", first_skip(),
                 ". Raise data.seq_length, lower the image resolution (max_pixels) or fix the "
                 "data");
    }
  }
};

Dataset::Dataset(const DataConfig& cfg, const Tokenizer& tok, const PreprocessorConfig& pp,
                 const ChatFormat& format)
    : impl_(std::make_unique<Impl>(cfg, tok, pp, format)) {
  cfg.validate();
  pp.validate();
  if (cfg.mock) {
    impl_->init_mock();
  } else {
    impl_->index_files();
  }
  impl_->counted.assign(static_cast<size_t>(impl_->n), 0);
  impl_->start();
}

Dataset::~Dataset() {
  if (impl_) impl_->stop();
}

Sample Dataset::next() {
  return impl_->next();
}

DataPosition Dataset::position() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return {impl_->consume / impl_->n, impl_->consume % impl_->n};
}

void Dataset::seek(const DataPosition& pos) {
  IRIS_CHECK(pos.epoch >= 0 && pos.index >= 0 && pos.index < impl_->n, "data position (epoch ",
             pos.epoch, ", index ", pos.index, ") is outside this dataset of ", impl_->n,
             " samples per epoch; resuming needs the same train files (and mock settings)");
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ++impl_->generation;
    impl_->ready.clear();
    impl_->consume = impl_->next_ticket = pos.epoch * impl_->n + pos.index;
  }
  impl_->skipped_in_a_row = 0;
  impl_->work_cv.notify_all();
}

const DataStats& Dataset::stats() const {
  return impl_->stats;
}

std::vector<SkippedLine> Dataset::take_new_skips() {
  return std::exchange(impl_->unreported, {});
}

std::string SkippedLine::describe() const {
  return str_cat(file, ":", line, " (", reason, "): ", detail);
}

std::string DataStats::summary() const {
  if (skipped_by_reason.empty()) return {};
  int64_t total = 0;
  for (const auto& [reason, count] : skipped_by_reason) total += count;
  std::vector<std::pair<std::string, int64_t>> order(skipped_by_reason.begin(),
                                                     skipped_by_reason.end());
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string text = str_cat("skipped ", total, " of ", lines, " lines: ");
  for (size_t i = 0; i < order.size(); ++i)
    text += str_cat(i ? ", " : "", order[i].second, " ", order[i].first);
  return text;
}

int64_t Dataset::size() const {
  return impl_->n;
}

}  // namespace iris
