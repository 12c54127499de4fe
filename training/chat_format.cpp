#include "training/chat_format.h"

#include <algorithm>
#include <array>
#include <string_view>

#include "core/error.h"

namespace iris {

namespace {

constexpr std::array<std::string_view, 6> kReserved = {"<|im_start|>",     "<|im_end|>",
                                                       "<|vision_start|>", "<|vision_end|>",
                                                       "<|image_pad|>",    "<|video_pad|>"};

// What the template is not asked to judge: roles, where images may be, the grids, and text that
// would forge the layout.
void check_messages(const std::vector<ChatMessage>& messages, size_t n_grids, size_t n_videos = 0) {
  size_t images = 0, videos = 0;
  for (const ChatMessage& m : messages) {
    IRIS_CHECK(m.role == "user" || m.role == "assistant" || m.role == "system",
               "unknown chat role '", m.role, "'; use system, user or assistant");
    for (const ChatPart& p : m.content) {
      if (p.kind == ChatPart::Kind::image) {
        IRIS_CHECK(m.role == "user", "an image in a ", m.role,
                   " turn; images may only appear in user turns (the model cannot emit images)");
        ++images;
        continue;
      }
      if (p.kind == ChatPart::Kind::video) {
        IRIS_CHECK(m.role == "user", "a video in a ", m.role,
                   " turn; videos may only appear in user turns (the model cannot emit videos)");
        ++videos;
        continue;
      }
      for (std::string_view r : kReserved)
        IRIS_CHECK(p.text.find(r) == std::string::npos, "the ", m.role,
                   " text contains the special token ", r,
                   ", which would break the chat layout (turns or image placement); remove it "
                   "from the text (images are given as image parts, not as tokens)");
    }
  }
  IRIS_CHECK(images == n_grids, "the conversation has ", images, " image parts but ", n_grids,
             " image grids were given; pass one grid per image, in order");
  IRIS_CHECK(videos == n_videos, "the conversation has ", videos, " video parts but ", n_videos,
             " videos were given; pass one per video part, in order");
}

// Qwen's rule: from two tokens after <|im_start|> "assistant" (past its "\n", which may have
// merged with newlines the reply starts with) to the end of the turn, which takes in <|im_end|>
// and the "\n" after it.
std::vector<int32_t> assistant_labels(const Tokenizer& tok, const ChatFormat& format,
                                      const std::vector<ChatMessage>& messages,
                                      const std::vector<int32_t>& ids) {
  std::vector<int32_t> labels(ids.size(), kIgnoreLabel);
  const std::vector<int32_t> role = tok.encode("<|im_start|>assistant");
  const int32_t im_end = tok.token_id("<|im_end|>");
  const std::vector<int32_t> newline = tok.encode("\n");
  const size_t n = ids.size();
  bool labelled = false;
  for (size_t i = 0; i + role.size() < n; ++i) {
    if (!std::equal(role.begin(), role.end(), ids.begin() + static_cast<int64_t>(i))) continue;
    const size_t start = i + role.size() + 1;
    size_t end = start;
    while (end < n && ids[end] != im_end) ++end;
    if (end < n) ++end;  // <|im_end|>
    if (end < n && newline.size() == 1 && ids[end] == newline[0]) ++end;
    for (size_t k = start; k < end; ++k) labels[k] = ids[k];
    labelled = labelled || end > start;
    i = std::max(i, end) - 1;
  }
  bool has_reply = false;
  for (const ChatMessage& m : messages) has_reply = has_reply || m.role == "assistant";
  IRIS_CHECK(!has_reply || labelled, "the chat template ",
             format.has_template() ? "(" + format.source() + ") " : std::string(),
             "does not write assistant turns as <|im_start|>assistant\\n...<|im_end|>, which is "
             "how Iris finds the tokens to learn");
  return labels;
}

}  // namespace

ChatTokens build_chat_tokens(const Tokenizer& tok, const ChatFormat& format,
                             const std::vector<ChatMessage>& messages,
                             const std::vector<GridTHW>& grids, int merge_size) {
  IRIS_CHECK(merge_size >= 1, "merge_size = ", merge_size, " must be at least 1");
  check_messages(messages, grids.size());
  ChatTokens out;
  out.ids = encode_chat_text(tok, format.render(messages, false), grids, merge_size);
  out.labels = assistant_labels(tok, format, messages, out.ids);
  return out;
}

ChatMediaTokens build_chat_media_tokens(const Tokenizer& tok, const ChatFormat& format,
                                        const std::vector<ChatMessage>& messages,
                                        const ModelConfig& cfg,
                                        const std::vector<GridTHW>& image_grids,
                                        const std::vector<const VideoClip*>& videos) {
  check_messages(messages, image_grids.size(), videos.size());
  ChatMediaTokens out;
  out.prompt = encode_media_prompt(tok, format.render(messages, false), cfg, image_grids, videos);
  out.labels = assistant_labels(tok, format, messages, out.prompt.ids);
  return out;
}

std::vector<int32_t> build_chat_prompt(const Tokenizer& tok, const ChatFormat& format,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<GridTHW>& grids, int merge_size) {
  check_messages(messages, grids.size());
  return encode_chat_text(tok, format.render(messages, true), grids, merge_size);
}

}  // namespace iris
