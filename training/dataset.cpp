#include "training/dataset.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

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

constexpr size_t kMaxExamples = 20;

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

struct ParsedLine {
  std::vector<ChatMessage> messages;
  std::vector<std::string> image_paths;  // resolved, in order of the image parts
};

const json& field(const json& obj, const char* name, const char* where) {
  auto it = obj.find(name);
  IRIS_CHECK(it != obj.end(), where, " has no \"", name, "\" field");
  return *it;
}

std::string string_field(const json& obj, const char* name, const char* where) {
  const json& v = field(obj, name, where);
  IRIS_CHECK(v.is_string(), where, ": \"", name, "\" must be a string, got ", v.type_name());
  return v.get<std::string>();
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

std::string resolve_image(const std::string& path, const fs::path& base) {
  IRIS_CHECK(!path.empty(), "an image path is empty");
  IRIS_CHECK(path.find("://") == std::string::npos && path.rfind("data:", 0) != 0, "image '", path,
             "' is a URL; only local files are read, so download it and give its path");
  const fs::path p(path);
  return (p.is_absolute() ? p : base / p).lexically_normal().string();
}

void parse_hf_messages(const json& j, const fs::path& base, ParsedLine& out) {
  const json& msgs = j["messages"];
  IRIS_CHECK(msgs.is_array() && !msgs.empty(), "\"messages\" must be a non-empty array");
  std::vector<std::string> top;
  if (j.contains("images")) top = path_list(j["images"], "images");
  size_t next_top = 0;
  for (const json& m : msgs) {
    IRIS_CHECK(m.is_object(), "each entry of \"messages\" must be an object, found a ",
               m.type_name());
    ChatMessage cm;
    cm.role = string_field(m, "role", "a message");
    const json& content = field(m, "content", "a message");
    if (content.is_string()) {
      cm.content.push_back(ChatPart::make_text(content.get<std::string>()));
    } else {
      IRIS_CHECK(content.is_array(), "a ", cm.role,
                 " message's \"content\" must be a string or a list of items, got ",
                 content.type_name());
      for (const json& item : content) {
        IRIS_CHECK(item.is_object(), "a content item must be an object, found a ",
                   item.type_name());
        std::string type;
        if (item.contains("type")) {
          type = string_field(item, "type", "a content item");
        } else {  // the chat template also keys on the field name alone
          type = item.contains("image") ? "image" : item.contains("text") ? "text" : "";
        }
        if (type == "text") {
          cm.content.push_back(ChatPart::make_text(string_field(item, "text", "a text item")));
        } else if (type == "image") {
          if (item.contains("image")) {
            out.image_paths.push_back(
                resolve_image(string_field(item, "image", "an image item"), base));
          } else {
            IRIS_CHECK(next_top < top.size(),
                       "an image item has no \"image\" path and the top-level \"images\" list has ",
                       top.size(), " entries for more image items");
            out.image_paths.push_back(resolve_image(top[next_top++], base));
          }
          cm.content.push_back(ChatPart::make_image());
        } else {
          IRIS_FAIL("content item type '", type,
                    "' is not supported; use {\"type\": \"image\", \"image\": path} or "
                    "{\"type\": \"text\", \"text\": ...}");
        }
      }
    }
    out.messages.push_back(std::move(cm));
  }
  IRIS_CHECK(next_top == top.size(), "the top-level \"images\" list has ", top.size(),
             " paths but ", next_top, " image items take theirs from it");
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

void parse_llava(const json& j, const fs::path& base, ParsedLine& out) {
  const json& convs = j["conversations"];
  IRIS_CHECK(convs.is_array() && !convs.empty(), "\"conversations\" must be a non-empty array");
  IRIS_CHECK(!(j.contains("image") && j.contains("images")),
             "both \"image\" and \"images\" are given; list the images in one of them");
  std::vector<std::string> images;
  if (j.contains("image")) images = path_list(j["image"], "image");
  if (j.contains("images")) images = path_list(j["images"], "images");
  size_t tags = 0;
  for (const json& t : convs) {
    IRIS_CHECK(t.is_object(), "each entry of \"conversations\" must be an object, found a ",
               t.type_name());
    const std::string from = string_field(t, "from", "a conversation turn");
    const std::string value = string_field(t, "value", "a conversation turn");
    ChatMessage cm;
    if (from == "human" || from == "user") {
      cm.role = "user";
    } else if (from == "gpt" || from == "assistant") {
      cm.role = "assistant";
    } else if (from == "system") {
      cm.role = "system";
    } else {
      IRIS_FAIL("unknown \"from\": '", from, "'; use human, gpt or system");
    }
    constexpr std::string_view kTag = "<image>";
    std::string_view rest(value);
    bool after_tag = false;
    for (;;) {
      const size_t at = rest.find(kTag);
      const bool before_tag = at != std::string_view::npos;
      const std::string text =
          trim(rest.substr(0, before_tag ? at : rest.size()), after_tag, before_tag);
      if (!text.empty()) cm.content.push_back(ChatPart::make_text(text));
      if (!before_tag) break;
      IRIS_CHECK(cm.role == "user", "an <image> tag in a '", from,
                 "' turn; images may only appear in human turns");
      cm.content.push_back(ChatPart::make_image());
      ++tags;
      rest.remove_prefix(at + kTag.size());
      after_tag = true;
    }
    out.messages.push_back(std::move(cm));
  }
  IRIS_CHECK(tags == images.size(), "the conversation has ", tags, " <image> tags but ",
             images.size(), " images are listed; they must match one to one");
  for (const std::string& p : images) out.image_paths.push_back(resolve_image(p, base));
}

ParsedLine parse_line(const std::string& text, const fs::path& base) {
  json j;
  try {
    j = parse_json(text, "the line");
  } catch (const Error& e) {
    IRIS_FAIL("malformed JSON: ", e.what());
  }
  IRIS_CHECK(j.is_object(), "a line must be a JSON object, got ", j.type_name());
  ParsedLine out;
  if (j.contains("messages")) {
    parse_hf_messages(j, base, out);
  } else if (j.contains("conversations")) {
    parse_llava(j, base, out);
  } else {
    IRIS_FAIL("a line needs a \"messages\" list (HF) or a \"conversations\" list (LLaVA)");
  }
  bool has_assistant = false;
  for (const ChatMessage& m : out.messages) {
    IRIS_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "unknown role '",
               m.role, "'; use system, user or assistant");
    if (m.role != "user") {
      for (const ChatPart& p : m.content)
        IRIS_CHECK(p.kind == ChatPart::Kind::text, "an image in a ", m.role,
                   " turn; images may only appear in user turns");
    }
    has_assistant = has_assistant || m.role == "assistant";
  }
  IRIS_CHECK(has_assistant, "no assistant turn, so the sample has nothing to learn");
  return out;
}

GridTHW grid_of(const ImageRGB8& img, const PreprocessorConfig& pp) {
  int h = img.height, w = img.width;
  if (pp.do_resize) {
    const ResizedSize s =
        smart_resize(h, w, pp.patch_size * pp.merge_size, pp.min_pixels, pp.max_pixels);
    h = s.height;
    w = s.width;
  }
  return {1, h / pp.patch_size, w / pp.patch_size};
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
    std::string reason;
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
  std::vector<uint8_t> counted;  // per record: already in stats
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

  void note(std::string example) {
    if (stats.bad_examples.size() < kMaxExamples) stats.bad_examples.push_back(std::move(example));
  }

  void index_files() {
    for (uint32_t fi = 0; fi < cfg.train_files.size(); ++fi) {
      const std::string& path = cfg.train_files[fi];
      try {
        check_regular_file(path, "train file");
      } catch (const Error& e) {
        IRIS_FAIL(e.what(),
                  "; check data.train_files (relative paths are relative to the working "
                  "directory)");
      }
      std::ifstream f(path, std::ios::binary);
      IRIS_CHECK(f.good(), "cannot open train file ", path,
                 "; check data.train_files (relative paths are relative to the working directory)");
      std::string line;
      uint64_t offset = 0;
      int64_t line_no = 0;
      while (read_bounded_line(f, line, kMaxJsonlLineBytes, path, line_no + 1)) {
        ++line_no;
        const uint64_t start = offset;
        offset += line.size() + 1;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        try {
          parse_line(line, image_base(fi));
        } catch (const Error& e) {
          const std::string where = path + ":" + std::to_string(line_no);
          if (cfg.on_bad_sample == DataConfig::OnBad::error)
            IRIS_FAIL(where, ": ", e.what(),
                      "; fix or remove the line, or set data.on_bad_sample: skip");
          ++stats.bad_samples;
          note(where + ": " + e.what());
          continue;
        }
        records.push_back({fi, line_no, start, static_cast<uint32_t>(line.size())});
      }
    }
    n = static_cast<int64_t>(records.size());
    IRIS_CHECK(n > 0, "no usable line in data.train_files (", stats.bad_samples, " bad",
               stats.bad_examples.empty() ? std::string() : ", first: " + stats.bad_examples[0],
               ")");
  }

  void init_mock() {
    n = cfg.mock_samples;
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

  Outcome process_file_record(int64_t rec) const {
    Outcome out;
    const Record& r = records[static_cast<size_t>(rec)];
    const std::string line = read_line_at(cfg.train_files[r.file], r.offset, r.length);
    ParsedLine parsed = parse_line(line, image_base(r.file));
    std::vector<ImageRGB8> images;
    images.reserve(parsed.image_paths.size());
    for (const std::string& p : parsed.image_paths)
      images.push_back(load_image(p, cfg.max_image_pixels));
    Sample s;
    for (const ImageRGB8& img : images) s.grids.push_back(grid_of(img, pp));
    ChatTokens t = build_chat_tokens(tok, format, parsed.messages, s.grids, pp.merge_size);
    s.ids = std::move(t.ids);
    s.labels = std::move(t.labels);
    if (static_cast<int64_t>(s.ids.size()) > cfg.seq_length) {
      out.kind = Outcome::Kind::too_long;
      out.reason = str_cat(s.ids.size(), " tokens is longer than seq_length ", cfg.seq_length);
      return out;
    }
    finish_pixels(images, s);
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
      out.reason = str_cat(s.ids.size(), " tokens is longer than seq_length ", cfg.seq_length);
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
    } catch (const Error& e) {
      out.kind = Outcome::Kind::bad;
      out.reason = e.what();
    } catch (const std::exception& e) {
      out.kind = Outcome::Kind::fatal;
      out.reason = e.what();
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
                  " failed: ", out.reason);
      if (out.kind == Outcome::Kind::bad && cfg.on_bad_sample == DataConfig::OnBad::error)
        IRIS_FAIL(src, ": ", out.reason,
                  "; fix or remove the line, or set data.on_bad_sample: skip");
      const int64_t rec = out.record;
      if (rec >= 0 && !counted[static_cast<size_t>(rec)]) {
        counted[static_cast<size_t>(rec)] = 1;
        if (out.kind == Outcome::Kind::too_long) {
          ++stats.dropped_too_long;
        } else {
          ++stats.bad_samples;
        }
        note(src + ": " + out.reason);
      }
      IRIS_CHECK(
          ++skipped_in_a_row <= n, "a whole epoch of ", n, " samples yielded nothing usable (",
          stats.dropped_too_long, " longer than seq_length ", cfg.seq_length, ", ",
          stats.bad_samples,
          " bad); first: ", stats.bad_examples.empty() ? std::string("-") : stats.bad_examples[0],
          ". Raise data.seq_length, lower the image resolution (max_pixels) or fix the data");
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

int64_t Dataset::size() const {
  return impl_->n;
}

}  // namespace iris
