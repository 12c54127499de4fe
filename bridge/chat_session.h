// A multi-turn chat over one Qwen3-VL whose KV cache keeps the conversation between turns: a turn
// prefills only what is new (the end of the previous reply's turn, the user's message with its
// images, the generation prompt) and generates from there. Each turn gives the tokens a one-shot
// generate() of the whole conversation would give: the same prompt ids (earlier replies as the ids
// generated, never re-tokenised text), the same M-RoPE positions, the same sampling history and
// a fresh sampler with the same seed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bridge/generator.h"
#include "language/tokenizer.h"

namespace iris {

struct ChatMessage {
  std::string text;  // may place the images with <__media__> markers, as a one-shot prompt
  const float* pixel_values = nullptr;  // the message's images, preprocessed, or null
  std::vector<GridTHW> grids;
};

struct ChatReply {
  GenerationResult result;
  // The reply ended because the context was full (not at a stop id, before -n tokens).
  bool context_full = false;
};

class ChatSession {
 public:
  // `settings` holds what every turn shares (max_new_tokens, stop_ids, sampling, sampleable,
  // keep_prompt_logits: then each turn's logits after its prompt); its prompt, image and cache
  // fields are filled per turn. The session owns the model's KV
  // cache from now on: generating through the model elsewhere in between breaks the chat (it is
  // detected and refused).
  ChatSession(Qwen3VLModel& model, const Tokenizer& tokenizer, std::string system_prompt,
              GenerationRequest settings);

  // The ids the next turn would prefill for a message with these images and text.
  std::vector<int32_t> turn_ids(const std::vector<GridTHW>& grids, const std::string& text) const;

  // Runs one turn: the reply streams through on_token (stop ids are not streamed). A message
  // that does not fit in the context is refused with an iris::Error and the conversation is left
  // as it was; a reply that reaches the end of the context stops there (context_full). Any other
  // failure after the model started clears the conversation (its cache rows are then unknown) and
  // says so.
  ChatReply send(const ChatMessage& message, const std::function<void(int32_t)>& on_token = {});

  // Forgets the conversation and the model's cached rows; the system prompt stays.
  void clear();

  // Every id of the conversation so far, one-shot prompt order: the system turn, each user turn
  // and each reply, a reply closed with <|im_end|>\n (in place of the stop id it ended with, or
  // after its last token when it was cut short).
  const std::vector<int32_t>& conversation() const { return conversation_; }
  // The leading ids of conversation() that are in the KV cache (all but the last reply's last
  // sampled token and its closing, which the next turn feeds).
  int64_t cached_tokens() const { return cached_; }
  int turns() const { return turns_; }

 private:
  Qwen3VLModel& model_;
  Tokenizer tokenizer_;
  std::string system_;
  GenerationRequest settings_;
  std::vector<int32_t> reply_end_;  // <|im_end|>\n
  std::vector<int32_t> conversation_;
  int64_t cached_ = 0;
  int turns_ = 0;
};

}  // namespace iris
