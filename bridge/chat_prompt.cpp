#include "bridge/chat_prompt.h"

#include <algorithm>
#include <filesystem>

#include "bridge/architecture.h"
#include "bridge/model_config.h"
#include "builtin_chat_templates.h"
#include "chat_template/jinja.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"

namespace iris {

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

constexpr std::string_view kImageBlock = "<|vision_start|><|image_pad|><|vision_end|>";
constexpr std::string_view kVideoBlock = "<|vision_start|><|video_pad|><|vision_end|>";
constexpr const char* kTemplateFiles =
    "chat_template.jinja, chat_template.json, tokenizer_config.json";

size_t count_markers(const std::string& text) {
  size_t n = 0;
  for (size_t at = text.find(kMediaMarker); at != std::string::npos;
       at = text.find(kMediaMarker, at + kMediaMarker.size()))
    ++n;
  return n;
}

// The "chat_template" of a chat_template.json or tokenizer_config.json: a string, or a list of
// named templates of which transformers takes "default". Empty when the file has none.
std::string template_in_json(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object() || !j.contains("chat_template") || j["chat_template"].is_null()) return "";
  const nlohmann::json& t = j["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    for (const nlohmann::json& named : t)
      if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
          named["template"].is_string())
        return named["template"].get<std::string>();
    IRIS_FAIL(path, ": chat_template lists named templates but none named \"default\"");
  }
  IRIS_FAIL(path, ": chat_template must be a string, got ", json_excerpt(t));
}

// bos_token, eos_token, pad_token and unk_token of a tokenizer_config.json, as strings (a token
// may be written as {"content": ...}).
ordered_json special_tokens_of(const nlohmann::json& cfg) {
  ordered_json out = ordered_json::object();
  if (!cfg.is_object()) return out;
  for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
    if (!cfg.contains(key)) continue;
    const nlohmann::json& v = cfg[key];
    if (v.is_string()) {
      out[key] = v.get<std::string>();
    } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
      out[key] = v["content"].get<std::string>();
    }
  }
  return out;
}

ordered_json special_tokens_in(const std::vector<std::string>& dirs) {
  for (const std::string& d : dirs) {
    const fs::path cfg = fs::path(d) / "tokenizer_config.json";
    if (fs::exists(cfg)) return special_tokens_of(read_json_file(cfg.string(), "tokenizer config"));
  }
  return ordered_json::object();
}

ordered_json message_json(const ChatMessage& m) {
  ordered_json j;
  j["role"] = m.role;
  bool images = false;
  for (const ChatPart& p : m.content) images = images || p.kind != ChatPart::Kind::text;
  if (!images) {
    std::string text;
    for (const ChatPart& p : m.content) text += p.text;
    j["content"] = text;
    return j;
  }
  ordered_json items = ordered_json::array();
  for (const ChatPart& p : m.content) {
    if (p.kind == ChatPart::Kind::image)
      items.push_back({{"type", "image"}});
    else if (p.kind == ChatPart::Kind::video)
      items.push_back({{"type", "video"}});
    else
      items.push_back({{"type", "text"}, {"text", p.text}});
  }
  j["content"] = std::move(items);
  return j;
}

}  // namespace

void check_vision_token_ids(const Tokenizer& tokenizer, const std::string& tokenizer_name,
                            int32_t image_token_id, int32_t video_token_id,
                            int32_t vision_start_token_id, int32_t vision_end_token_id,
                            const std::string& config_name) {
  const std::pair<const char*, std::pair<const char*, int32_t>> pairs[] = {
      {"<|image_pad|>", {"image_token_id", image_token_id}},
      {"<|video_pad|>", {"video_token_id", video_token_id}},
      {"<|vision_start|>", {"vision_start_token_id", vision_start_token_id}},
      {"<|vision_end|>", {"vision_end_token_id", vision_end_token_id}}};
  for (const auto& [token, field] : pairs) {
    const std::optional<int32_t> id = tokenizer.find_token(token);
    IRIS_CHECK(id.has_value(), tokenizer_name, " has no ", token,
               " token; it is not the tokenizer of a Qwen-VL checkpoint");
    IRIS_CHECK(*id == field.second, config_name, " gives ", field.first, " ", field.second, " but ",
               tokenizer_name, " writes ", token, " as ", *id,
               "; the two files belong to different checkpoints (use the tokenizer that came "
               "with the model, or fix ",
               field.first, ")");
  }
}

ChatMessage user_message(const std::string& text, size_t n_images) {
  return user_message(text, std::vector<ChatPart::Kind>(n_images, ChatPart::Kind::image));
}

ChatMessage user_message(const std::string& text, const std::vector<ChatPart::Kind>& media) {
  const size_t n_images = media.size();
  auto part = [&](size_t i) {
    return media[i] == ChatPart::Kind::video ? ChatPart::make_video() : ChatPart::make_image();
  };
  // These tokens mark where the vision tower's embeddings go: typed in a message they would take
  // an image's place (or none), and the error would surface far from its cause.
  for (const char* token :
       {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"})
    IRIS_CHECK(text.find(token) == std::string::npos, "the message spells ", token,
               ", a token that marks where an image's embeddings go; attach images with --image "
               "or /image (placed at ",
               kMediaMarker, " markers, or before the text) instead of typing it");
  ChatMessage m{"user", {}};
  const size_t markers = count_markers(text);
  if (markers == 0) {
    for (size_t i = 0; i < n_images; ++i) m.content.push_back(part(i));
    m.content.push_back(ChatPart::make_text(text));
    return m;
  }
  const bool videos = std::count(media.begin(), media.end(), ChatPart::Kind::video) > 0;
  const char* items = videos ? (n_images == 1 ? " image or video" : " images and videos")
                             : (n_images == 1 ? " image" : " images");
  IRIS_CHECK(markers == n_images, "the prompt has ", markers, " ", kMediaMarker, " marker",
             markers == 1 ? "" : "s", " but ", n_images, items, n_images == 1 ? " was" : " were",
             " given (--image, --video or /image); write one marker per image or video, or none "
             "to put them before the text");
  size_t pos = 0;
  for (size_t i = 0; i < n_images; ++i) {
    const size_t at = text.find(kMediaMarker, pos);
    if (at > pos) m.content.push_back(ChatPart::make_text(text.substr(pos, at - pos)));
    m.content.push_back(part(i));
    pos = at + kMediaMarker.size();
  }
  if (pos < text.size()) m.content.push_back(ChatPart::make_text(text.substr(pos)));
  return m;
}

int64_t image_token_count(const GridTHW& grid, int merge_size) {
  const int64_t m2 = int64_t{merge_size} * merge_size;
  const int64_t patches = grid[0] * grid[1] * grid[2];
  IRIS_CHECK(merge_size >= 1 && grid[0] >= 1 && grid[1] >= 1 && grid[2] >= 1 && patches % m2 == 0,
             "image grid [", grid[0], ", ", grid[1], ", ", grid[2],
             "] is not a positive grid divisible by merge_size^2 = ", m2,
             "; grids come from preprocess_image");
  return patches / m2;
}

ChatFormat::ChatFormat() = default;
ChatFormat::~ChatFormat() = default;
ChatFormat::ChatFormat(const ChatFormat&) = default;
ChatFormat& ChatFormat::operator=(const ChatFormat&) = default;

ChatFormat ChatFormat::from_dir(const std::string& dir) {
  return from_dirs({dir});
}

ChatFormat ChatFormat::from_dirs(const std::vector<std::string>& dirs) {
  ChatFormat f;
  f.special_tokens_ = special_tokens_in(dirs);
  for (const std::string& d : dirs) {
    if (d.empty()) continue;
    f.searched_ += (f.searched_.empty() ? "" : " or ") + d;
    const fs::path jinja = fs::path(d) / "chat_template.jinja";
    if (fs::exists(jinja)) {
      f.text_ = read_text_file(jinja.string(), "chat template", jinja::kMaxTemplateBytes);
      f.source_ = jinja.string();
    } else {
      for (const char* name : {"chat_template.json", "tokenizer_config.json"}) {
        const fs::path p = fs::path(d) / name;
        if (!fs::exists(p)) continue;
        f.text_ = template_in_json(read_json_file(p.string(), name), p.string());
        if (!f.text_.empty()) {
          f.source_ = p.string();
          break;
        }
      }
    }
    if (!f.text_.empty()) {
      const std::string name =
          f.source_.size() > 5 && f.source_.compare(f.source_.size() - 5, 5, ".json") == 0
              ? f.source_ + " (chat_template)"
              : f.source_;
      f.template_ = std::make_shared<const jinja::Template>(f.text_, name);
      return f;
    }
  }
  return f;
}

ChatFormat ChatFormat::from_file(const std::string& path, const std::string& what,
                                 const std::vector<std::string>& special_tokens_dirs) {
  ChatFormat f;
  f.special_tokens_ = special_tokens_in(special_tokens_dirs);
  // A chat_template.json or tokenizer_config.json, or the template itself.
  const std::string text =
      read_text_file(path, what, std::max(kJsonConfigLimits.max_bytes, jinja::kMaxTemplateBytes));
  std::string name = what + " " + path;
  f.text_ = text;
  // A JSON object is a chat_template.json or tokenizer_config.json; anything else is Jinja.
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{' && path.size() > 5 &&
      path.compare(path.size() - 5, 5, ".json") == 0) {
    f.text_ = template_in_json(parse_json(text, what + " " + path), what + " " + path);
    IRIS_CHECK(!f.text_.empty(), what, " ", path, " has no \"chat_template\"");
    name += " (chat_template)";
  }
  f.source_ = path;
  f.template_ = std::make_shared<const jinja::Template>(f.text_, name);
  return f;
}

ChatFormat ChatFormat::from_text(const std::string& text, const std::string& what,
                                 const std::vector<std::string>& special_tokens_dirs) {
  IRIS_CHECK(text.size() <= jinja::kMaxTemplateBytes, what, " is ", text.size(),
             " bytes of template text, more than the ", jinja::kMaxTemplateBytes, " allowed");
  ChatFormat f;
  f.special_tokens_ = special_tokens_in(special_tokens_dirs);
  f.text_ = text;
  f.source_ = what + " (the text given)";
  f.template_ = std::make_shared<const jinja::Template>(f.text_, what);
  return f;
}

namespace {

struct BuiltinTemplate {
  const char* name;
  std::string_view text;  // empty: the built-in ChatML, rendered without a template
  const char* models;
};

constexpr BuiltinTemplate kBuiltinTemplates[] = {
    {"chatml", {}, "ChatML, as Qwen3-VL Instruct writes plain conversations"},
    {"qwen2-vl", builtin_chat_templates::qwen2_vl, "Qwen2-VL and Qwen2.5-VL Instruct"},
    {"qwen2.5-vl", builtin_chat_templates::qwen2_vl, "the same as qwen2-vl"},
    {"qwen3-vl", builtin_chat_templates::qwen3_vl_instruct, "Qwen3-VL Instruct"},
    {"qwen3-vl-thinking", builtin_chat_templates::qwen3_vl_thinking, "Qwen3-VL Thinking"},
    {"qwen3", builtin_chat_templates::qwen3, "Qwen3, text only, with enable_thinking"},
};

}  // namespace

std::optional<ChatFormat> ChatFormat::builtin(const std::string& name,
                                              const std::vector<std::string>& special_tokens_dirs) {
  for (const BuiltinTemplate& b : kBuiltinTemplates) {
    if (name != b.name) continue;
    ChatFormat f;
    f.special_tokens_ = special_tokens_in(special_tokens_dirs);
    if (b.text.empty()) return f;
    f.text_ = std::string(b.text);
    f.source_ = str_cat("the built-in ", b.name, " (", b.models, ")");
    f.template_ = std::make_shared<const jinja::Template>(f.text_, str_cat("built-in ", b.name));
    return f;
  }
  return std::nullopt;
}

std::vector<std::pair<std::string, std::string>> ChatFormat::builtin_names() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const BuiltinTemplate& b : kBuiltinTemplates) out.emplace_back(b.name, b.models);
  return out;
}

std::string ChatFormat::describe() const {
  if (has_template()) return "chat template: " + source_;
  if (searched_.empty()) return "chat template: the built-in ChatML";
  return str_cat("chat template: none in ", searched_, " (", kTemplateFiles,
                 "); using the built-in ChatML");
}

void ChatFormat::set_kwargs(const ordered_json& kwargs, const std::string& what) {
  IRIS_CHECK(kwargs.is_object(), what,
             " must be a JSON object such as {\"enable_thinking\": false}", ", got ",
             json_excerpt(nlohmann::json::parse(kwargs.dump())));
  for (const auto& [k, v] : kwargs.items()) {
    IRIS_CHECK(k != "messages" && k != "add_generation_prompt" && k != "tools" && k != "documents",
               what, " may not set \"", k, "\": Iris passes the conversation itself");
    kwargs_[k] = v;
  }
}

std::string ChatFormat::render(const std::vector<ChatMessage>& messages,
                               bool add_generation_prompt) const {
  if (!has_template()) {
    std::string s;
    for (const ChatMessage& m : messages) {
      s += "<|im_start|>" + m.role + "\n";
      for (const ChatPart& p : m.content)
        s += p.kind == ChatPart::Kind::image   ? std::string(kImageBlock)
             : p.kind == ChatPart::Kind::video ? std::string(kVideoBlock)
                                               : p.text;
      s += "<|im_end|>\n";
    }
    if (add_generation_prompt) s += "<|im_start|>assistant\n";
    return s;
  }
  ordered_json ctx;
  ordered_json list = ordered_json::array();
  for (const ChatMessage& m : messages) list.push_back(message_json(m));
  ctx["messages"] = std::move(list);
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [k, v] : special_tokens_.items()) ctx[k] = v;
  for (const auto& [k, v] : kwargs_.items()) ctx[k] = v;
  return template_->render(ctx);
}

std::vector<int32_t> encode_chat_text(const Tokenizer& tok, const std::string& text,
                                      const std::vector<GridTHW>& grids, int merge_size) {
  const int32_t pad = tok.token_id("<|image_pad|>");
  const std::vector<int32_t> ids = tok.encode(text);
  const auto pads = static_cast<size_t>(std::count(ids.begin(), ids.end(), pad));
  IRIS_CHECK(pads == grids.size(), "the chat has ", pads, " image placeholder",
             pads == 1 ? "" : "s", " (<|image_pad|>) for ", grids.size(), " image",
             grids.size() == 1 ? "" : "s",
             ": the chat template must write each image once, and text may not spell "
             "<|image_pad|>");
  int64_t total = static_cast<int64_t>(ids.size()) - static_cast<int64_t>(pads);
  for (const GridTHW& g : grids) total += image_token_count(g, merge_size);
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(total));
  size_t next = 0;
  for (int32_t id : ids) {
    if (id != pad) {
      out.push_back(id);
      continue;
    }
    out.insert(out.end(), static_cast<size_t>(image_token_count(grids[next++], merge_size)), pad);
  }
  return out;
}

MediaPrompt encode_media_prompt(const Tokenizer& tok, const std::string& rendered,
                                const ModelConfig& cfg, const std::vector<GridTHW>& image_grids,
                                const std::vector<const VideoClip*>& videos) {
  const Architecture& arch = *cfg.arch;
  // The processor rewrites each video's block in the text before tokenizing, so a family's
  // per-slice text (Qwen3-VL's timestamps) is tokenized with the text around it.
  std::string text;
  size_t from = 0, n_blocks = 0;
  for (size_t at = rendered.find(kVideoBlock); at != std::string::npos;
       at = rendered.find(kVideoBlock, from)) {
    IRIS_CHECK(n_blocks < videos.size(), "the chat has more video blocks (", kVideoBlock,
               ") than the ", videos.size(), " video", videos.size() == 1 ? "" : "s",
               " given: the chat template must write each video once, and text may not spell it");
    text.append(rendered, from, at - from);
    text += arch.video_prompt_text(*videos[n_blocks++]);
    from = at + kVideoBlock.size();
  }
  text.append(rendered, from, std::string::npos);
  IRIS_CHECK(n_blocks == videos.size(), "the chat has ", n_blocks, " video block",
             n_blocks == 1 ? "" : "s", " (", kVideoBlock, ") for ", videos.size(), " video",
             videos.size() == 1 ? "" : "s", ": the chat template must write each video once");

  const int32_t image_pad = tok.token_id("<|image_pad|>"),
                video_pad = tok.token_id("<|video_pad|>");
  const int m = cfg.vision.spatial_merge_size;
  std::vector<std::vector<VisionRun>> video_runs;
  size_t total_video_runs = 0;
  for (const VideoClip* v : videos) {
    video_runs.push_back(arch.video_runs(*v, cfg));
    total_video_runs += video_runs.back().size();
  }
  const std::vector<int32_t> ids = tok.encode(text);
  const auto n_image_pads = static_cast<size_t>(std::count(ids.begin(), ids.end(), image_pad));
  const auto n_video_pads = static_cast<size_t>(std::count(ids.begin(), ids.end(), video_pad));
  IRIS_CHECK(n_image_pads == image_grids.size(), "the chat has ", n_image_pads,
             " image placeholder", n_image_pads == 1 ? "" : "s", " (<|image_pad|>) for ",
             image_grids.size(), " image", image_grids.size() == 1 ? "" : "s",
             ": the chat template must write each image once, and text may not spell "
             "<|image_pad|>");
  IRIS_CHECK(n_video_pads == total_video_runs, "the chat has ", n_video_pads,
             " video placeholders (<|video_pad|>) where its ", videos.size(), " video",
             videos.size() == 1 ? "" : "s", " need ", total_video_runs,
             ": text may not spell <|video_pad|>");
  MediaPrompt out;
  size_t next_image = 0, next_video = 0, next_run = 0;
  for (int32_t id : ids) {
    if (id == image_pad) {
      const VisionRun run = image_runs({image_grids[next_image]}, image_pad, m)[0];
      out.media_order.push_back({false, next_image++});
      out.runs.push_back(run);
      out.ids.insert(out.ids.end(), static_cast<size_t>(run.tokens()), image_pad);
    } else if (id == video_pad) {
      if (next_run == 0) out.media_order.push_back({true, next_video});
      const VisionRun& run = video_runs[next_video][next_run];
      out.runs.push_back(run);
      out.ids.insert(out.ids.end(), static_cast<size_t>(run.tokens()), video_pad);
      if (++next_run == video_runs[next_video].size()) {
        next_run = 0;
        ++next_video;
      }
    } else {
      out.ids.push_back(id);
    }
  }
  return out;
}

std::vector<int32_t> build_generation_prompt(const Tokenizer& tok, const ChatFormat& format,
                                             const std::vector<GridTHW>& grids,
                                             const std::string& user, const std::string& system,
                                             int m) {
  std::vector<ChatMessage> messages;
  if (!system.empty()) messages.push_back({"system", {ChatPart::make_text(system)}});
  messages.push_back(user_message(user, grids.size()));
  return encode_chat_text(tok, format.render(messages, true), grids, m);
}

}  // namespace iris
