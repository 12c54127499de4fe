// The Qwen3-VL chat format for inference prompts: an optional system turn, one user turn with the
// images before the text (as HF's processor renders content [image..., text]), and the
// generation prompt. No default system prompt (Qwen3-VL has none).
//
// As in llama-mtmd-cli, the user text may instead place each image with a <__media__> marker:
// image i goes where marker i is (content [text, image, text, ...]). Markers, when present, must
// be exactly one per image.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "language/tokenizer.h"
#include "vision/vision_encoder.h"

namespace iris {

// llama-mtmd-cli's default media marker.
inline constexpr std::string_view kMediaMarker = "<__media__>";

// The prompt text with every image's <|image_pad|> expanded to its merged-token count
// (grid_t * gh * gw / merge^2), as HF's processor expands it before tokenising.
std::string render_generation_prompt(const std::vector<GridTHW>& image_grids,
                                     const std::string& user_text, const std::string& system_text,
                                     int spatial_merge_size);

// The part of a conversation's prompt that one user message adds: its turn and the generation
// prompt ("<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n"); images as above.
// render_generation_prompt is the optional system turn followed by this.
std::string render_user_turn(const std::vector<GridTHW>& image_grids, const std::string& user_text,
                             int spatial_merge_size);

std::vector<int32_t> build_generation_prompt(const Tokenizer& tokenizer,
                                             const std::vector<GridTHW>& image_grids,
                                             const std::string& user_text,
                                             const std::string& system_text,
                                             int spatial_merge_size = 2);

}  // namespace iris
