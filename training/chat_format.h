// Training sequences of Qwen3-VL chats (spec sections 2.7, 5 and 6), rendered with the chat
// template the checkpoint is prompted with at inference (bridge/chat_prompt.h), so that a model is
// fine-tuned on exactly the layout `iris generate` feeds it.
//
// Training labels follow the official Qwen fine-tuning code: -100 everywhere except assistant
// turns, which are labelled from the token after "<|im_start|>assistant\n" through the closing
// <|im_end|> and the "\n" after it. A Thinking template's reasoning (<think>...</think>) in the
// final reply is part of the reply and so labelled; reasoning it drops from earlier replies is not
// in the sequence at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "language/tokenizer.h"
#include "vision/vision_encoder.h"

namespace iris {

inline constexpr int32_t kIgnoreLabel = -100;

struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;  // same length as ids; kIgnoreLabel where nothing is learned
};

// The whole conversation, rendered by `format` without a generation prompt, with labels.
// `image_grids` holds one grid per image part, in the order the parts appear. Throws iris::Error
// for an unknown role, an image in a non-user turn, a grid count that does not match the image
// parts, text spelling one of the structural special tokens (<|im_start|>, <|im_end|>,
// <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>), which the tokenizer would turn
// into the real token and so corrupt the turn or image layout, and a template that does not write
// assistant turns as <|im_start|>assistant\n...<|im_end|>, which the labels are found by.
ChatTokens build_chat_tokens(const Tokenizer& tok, const ChatFormat& format,
                             const std::vector<ChatMessage>& messages,
                             const std::vector<GridTHW>& image_grids, int merge_size = 2);

// The same with videos: image and video parts take image_grids and videos in order, and the
// sequence is expanded as HF's processor expands it (encode_media_prompt: a video as its family
// writes it). The prompt's runs and media order say how the pixel rows line up.
struct ChatMediaTokens {
  MediaPrompt prompt;
  std::vector<int32_t> labels;  // same length as prompt.ids
};
ChatMediaTokens build_chat_media_tokens(const Tokenizer& tok, const ChatFormat& format,
                                        const std::vector<ChatMessage>& messages,
                                        const ModelConfig& cfg,
                                        const std::vector<GridTHW>& image_grids,
                                        const std::vector<const VideoClip*>& videos);

// Inference prompt: the messages rendered by `format` with the generation prompt. For one user
// turn of [image..., text] this equals build_generation_prompt (bridge/chat_prompt.h, which the
// CLI uses).
std::vector<int32_t> build_chat_prompt(const Tokenizer& tok, const ChatFormat& format,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<GridTHW>& image_grids, int merge_size = 2);

}  // namespace iris
