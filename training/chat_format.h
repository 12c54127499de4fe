// Qwen3-VL chat token sequences for training and inference (spec sections 2.7, 5 and 6).
//
// A conversation renders as ChatML with no default system prompt:
//   [<|im_start|>system\n{text}<|im_end|>\n]
//   <|im_start|>user\n{content}<|im_end|>\n
//   <|im_start|>assistant\n{content}<|im_end|>\n ...
// where an image part becomes <|vision_start|> + N x <|image_pad|> + <|vision_end|>, with
// N = grid_t * grid_h * grid_w / merge_size^2, and text parts are copied verbatim. Training labels
// follow the official Qwen fine-tuning code: -100 everywhere except assistant turns, which are
// labelled from the token after "<|im_start|>assistant\n" through the closing <|im_end|> and the
// "\n" after it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "language/tokenizer.h"
#include "vision/vision_encoder.h"

namespace iris {

inline constexpr int32_t kIgnoreLabel = -100;

struct ChatPart {
  enum class Kind { text, image };
  Kind kind = Kind::text;
  std::string text;  // text parts only; image parts take the next grid in order

  static ChatPart make_text(std::string t) { return {Kind::text, std::move(t)}; }
  static ChatPart make_image() { return {Kind::image, {}}; }
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::vector<ChatPart> content;
};

struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;  // same length as ids; kIgnoreLabel where nothing is learned
};

// <|image_pad|> tokens one image expands to.
int64_t image_token_count(const GridTHW& grid, int merge_size = 2);

// The whole conversation with labels. `image_grids` holds one grid per image part, in the order
// the parts appear. Throws iris::Error for an unknown role, an image in a non-user turn, a grid
// count that does not match the image parts, or text spelling one of the structural special tokens
// (<|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>), which
// the tokenizer would turn into the real token and so corrupt the turn or image layout.
ChatTokens build_chat_tokens(const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                             const std::vector<GridTHW>& image_grids, int merge_size = 2);

// Inference prompt: the messages followed by the generation prompt "<|im_start|>assistant\n".
// For one user turn of [image..., text] this equals build_generation_prompt (bridge/chat_prompt.h,
// which the CLI uses), so a model fine-tuned on these sequences is prompted the way it was trained.
std::vector<int32_t> build_chat_prompt(const Tokenizer& tok,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<GridTHW>& image_grids, int merge_size = 2);

}  // namespace iris
