#include "bridge/chat_session.h"

#include <algorithm>

#include "bridge/chat_prompt.h"

namespace iris {

ChatSession::ChatSession(Qwen3VLModel& model, const Tokenizer& tokenizer, std::string system,
                         GenerationRequest settings)
    : model_(model),
      tokenizer_(tokenizer),
      system_(std::move(system)),
      settings_(std::move(settings)) {
  IRIS_CHECK(settings_.max_new_tokens >= 0, "the number of tokens to predict must be >= 0");
  settings_.prompt_ids.clear();
  settings_.cached_ids.clear();
  settings_.pixel_values = nullptr;
  settings_.grids.clear();
  reply_end_ = {tokenizer_.token_id("<|im_end|>")};
  for (int32_t id : tokenizer_.encode("\n")) reply_end_.push_back(id);
  clear();
}

void ChatSession::clear() {
  conversation_.clear();
  cached_ = 0;
  turns_ = 0;
  model_.clear_cache();
}

std::vector<int32_t> ChatSession::turn_ids(const std::vector<GridTHW>& grids,
                                           const std::string& text) const {
  const int m = model_.config().vision.spatial_merge_size;
  // The tokenizer splits at special tokens, so encoding the new turn on its own gives the ids
  // that encoding it after the rest of the conversation would.
  const std::vector<int32_t> turn =
      tokenizer_.encode(conversation_.empty() ? render_generation_prompt(grids, text, system_, m)
                                              : render_user_turn(grids, text, m));
  std::vector<int32_t> ids(conversation_.begin() + cached_, conversation_.end());
  ids.insert(ids.end(), turn.begin(), turn.end());
  return ids;
}

ChatReply ChatSession::send(const ChatMessage& message,
                            const std::function<void(int32_t)>& on_token) {
  IRIS_CHECK(model_.n_past() == cached_, "the model's KV cache holds ", model_.n_past(),
             " tokens but the chat put ", cached_,
             " there: it was used outside the chat; /clear starts a new conversation");
  const ModelLimits& limits = model_.limits();
  IRIS_CHECK(static_cast<int>(message.grids.size()) <= limits.max_images, "a message may carry ",
             limits.max_images, " images at most; this one has ", message.grids.size());
  GenerationRequest req = settings_;
  req.prompt_ids = turn_ids(message.grids, message.text);
  const int64_t need = static_cast<int64_t>(req.prompt_ids.size());
  const int64_t room = limits.max_context - cached_;
  const int64_t first_reply_token = settings_.max_new_tokens > 0 ? 1 : 0;
  if (need + first_reply_token > room) {
    IRIS_CHECK(cached_ > 0, "this message needs ", need,
               " tokens with its images and the reply's first, more than the context of ",
               limits.max_context,
               " tokens (raise -c/--ctx-size, or shrink the images with --image-max-tokens)");
    IRIS_FAIL("this message needs ", need, " more tokens but the conversation already fills ",
              cached_, " of the context's ", limits.max_context,
              "; /clear starts a new conversation (or raise -c/--ctx-size)");
  }
  const int64_t patches = count_patches(message.grids);
  IRIS_CHECK(patches <= limits.max_vision_patches, "the message's images have ", patches,
             " patches, more than the ", limits.max_vision_patches,
             " one encoder call was planned for");
  req.max_new_tokens = static_cast<int>(std::min<int64_t>(settings_.max_new_tokens, room - need));
  req.cached_ids.assign(conversation_.begin(), conversation_.begin() + cached_);
  req.pixel_values = message.pixel_values;
  req.grids = message.grids;

  ChatReply reply;
  try {
    reply.result = generate(model_, req, on_token);
  } catch (const Error& e) {
    // The cache may hold part of this turn; a later turn must not build on it.
    clear();
    throw Error(str_cat(e.what(), " (the conversation was cleared)"));
  }
  const GenerationResult& res = reply.result;
  // The turn's ids began with the uncached end of conversation_; the rest is new.
  conversation_.insert(
      conversation_.end(),
      req.prompt_ids.begin() + static_cast<int64_t>(conversation_.size()) - cached_,
      req.prompt_ids.end());
  // The reply's turn is closed as the chat template closes an assistant message, whatever ended
  // it: a stop id other than <|im_end|> (<|endoftext|>) or -n is not what the template writes.
  conversation_.insert(conversation_.end(), res.tokens.begin(),
                       res.tokens.end() - (res.stopped ? 1 : 0));
  conversation_.insert(conversation_.end(), reply_end_.begin(), reply_end_.end());
  // Every generated token but the last was fed, so the cache holds a prefix of conversation_.
  cached_ = model_.n_past();
  ++turns_;
  reply.context_full = !res.stopped && req.max_new_tokens < settings_.max_new_tokens &&
                       static_cast<int64_t>(res.tokens.size()) == req.max_new_tokens;
  return reply;
}

}  // namespace iris
