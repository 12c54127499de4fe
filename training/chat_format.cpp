#include "training/chat_format.h"

#include <array>
#include <string_view>

#include "core/error.h"

namespace iris {

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kImagePad = "<|image_pad|>";
constexpr std::string_view kImageBlock = "<|vision_start|><|image_pad|><|vision_end|>";
constexpr std::array<std::string_view, 6> kReserved = {"<|im_start|>",     "<|im_end|>",
                                                       "<|vision_start|>", "<|vision_end|>",
                                                       "<|image_pad|>",    "<|video_pad|>"};

void check_text(const std::string& text, const std::string& role) {
  for (std::string_view r : kReserved) {
    IRIS_CHECK(text.find(r) == std::string::npos, "the ", role, " text contains the special token ",
               r,
               ", which would break the chat layout (turns or image placement); remove it from the "
               "text (images are given as image parts, not as tokens)");
  }
}

// One turn, "<|im_start|>role\n...<|im_end|>\n", with each image's single pad expanded. Encoding
// turn by turn gives the same ids as encoding the whole conversation: every turn starts with an
// added token, and the tokenizer never merges across added tokens.
void append_turn(const Tokenizer& tok, const ChatMessage& m, const std::vector<GridTHW>& grids,
                 size_t& next_grid, int merge_size, int32_t pad_id, ChatTokens& out,
                 int64_t assistant_header_len) {
  const bool user = m.role == "user";
  IRIS_CHECK(user || m.role == "assistant" || m.role == "system", "unknown chat role '", m.role,
             "'; use system, user or assistant");
  std::string text;
  text += kImStart;
  text += m.role;
  text += '\n';
  size_t images = 0;
  for (const ChatPart& p : m.content) {
    if (p.kind == ChatPart::Kind::image) {
      IRIS_CHECK(user, "an image in a ", m.role,
                 " turn; images may only appear in user turns (the model cannot emit images)");
      text += kImageBlock;
      ++images;
    } else {
      check_text(p.text, m.role);
      text += p.text;
    }
  }
  text += kImEnd;
  text += '\n';
  IRIS_CHECK(next_grid + images <= grids.size(), "the conversation has more image parts than the ",
             grids.size(), " image grids given; pass one grid per image, in order");

  const std::vector<int32_t> ids = tok.encode(text);
  const size_t begin = out.ids.size();
  for (int32_t id : ids) {
    if (id == pad_id) {
      const int64_t n = image_token_count(grids[next_grid++], merge_size);
      out.ids.insert(out.ids.end(), static_cast<size_t>(n), pad_id);
    } else {
      out.ids.push_back(id);
    }
  }
  out.labels.resize(out.ids.size(), kIgnoreLabel);
  if (m.role == "assistant") {
    // Qwen's rule: unmask from two tokens after the "assistant" token (past "assistant\n") to the
    // end of the turn, which takes in <|im_end|> and the "\n" after it.
    for (size_t i = begin + static_cast<size_t>(assistant_header_len); i < out.ids.size(); ++i)
      out.labels[i] = out.ids[i];
  }
}

int64_t header_length(const Tokenizer& tok, const std::string& role) {
  return static_cast<int64_t>(tok.encode(std::string(kImStart) + role + "\n").size());
}

ChatTokens build(const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                 const std::vector<GridTHW>& grids, int merge_size) {
  IRIS_CHECK(merge_size >= 1, "merge_size = ", merge_size, " must be at least 1");
  const int32_t pad_id = tok.token_id(std::string(kImagePad));
  const int64_t header = header_length(tok, "assistant");
  ChatTokens out;
  size_t next_grid = 0;
  for (const ChatMessage& m : messages)
    append_turn(tok, m, grids, next_grid, merge_size, pad_id, out, header);
  IRIS_CHECK(next_grid == grids.size(), "the conversation has ", next_grid, " image parts but ",
             grids.size(), " image grids were given; pass one grid per image, in order");
  return out;
}

}  // namespace

int64_t image_token_count(const GridTHW& grid, int merge_size) {
  const int64_t m2 = int64_t{merge_size} * merge_size;
  const int64_t patches = grid[0] * grid[1] * grid[2];
  IRIS_CHECK(grid[0] >= 1 && grid[1] >= 1 && grid[2] >= 1 && patches % m2 == 0, "image grid [",
             grid[0], ", ", grid[1], ", ", grid[2],
             "] is not a positive grid divisible by merge_size^2 = ", m2,
             "; grids come from preprocess_image");
  return patches / m2;
}

ChatTokens build_chat_tokens(const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                             const std::vector<GridTHW>& image_grids, int merge_size) {
  return build(tok, messages, image_grids, merge_size);
}

std::vector<int32_t> build_chat_prompt(const Tokenizer& tok,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<GridTHW>& image_grids, int merge_size) {
  std::vector<int32_t> ids = build(tok, messages, image_grids, merge_size).ids;
  const std::vector<int32_t> gen = tok.encode(std::string(kImStart) + "assistant\n");
  ids.insert(ids.end(), gen.begin(), gen.end());
  return ids;
}

}  // namespace iris
