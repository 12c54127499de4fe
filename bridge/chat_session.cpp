#include "bridge/chat_session.h"

#include <algorithm>

namespace iris {

namespace {

constexpr std::string_view kTurnStart = "<|im_start|>";
constexpr std::string_view kImagePad = "<|image_pad|>";

size_t common_prefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

size_t count_in(std::string_view text, std::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string_view::npos;
       at = text.find(what, at + what.size()))
    ++n;
  return n;
}

// The last mark at or before text offset `at`; marks start with {0, 0}.
template <typename Mark>
Mark last_mark_before(const std::vector<Mark>& marks, size_t at) {
  Mark best{};
  for (const Mark& m : marks)
    if (m.text <= at) best = m;
  return best;
}

}  // namespace

ChatSession::ChatSession(Qwen3VLModel& model, const Tokenizer& tokenizer, ChatFormat format,
                         std::string system, GenerationRequest settings)
    : model_(model),
      tokenizer_(tokenizer),
      format_(std::move(format)),
      system_(std::move(system)),
      settings_(std::move(settings)) {
  IRIS_CHECK(settings_.max_new_tokens >= 0, "the number of tokens to predict must be >= 0");
  settings_.prompt_ids.clear();
  settings_.cached_ids.clear();
  settings_.pixel_values = nullptr;
  settings_.grids.clear();
  pad_id_ = tokenizer_.token_id(std::string(kImagePad));
  patch_values_ = model_.config().vision.patch_dim();
  clear();
}

void ChatSession::clear() {
  messages_.clear();
  if (!system_.empty()) messages_.push_back({"system", {ChatPart::make_text(system_)}});
  pixels_.clear();
  grids_.clear();
  conv_ = Ids{};
  conv_.marks = {Mark{}};
  text_.clear();
  cached_ = 0;
  turns_ = 0;
  model_.clear_cache();
}

ChatSession::Ids ChatSession::Ids::prefix(size_t text_from, size_t n) const {
  Ids out;
  out.ids.assign(ids.begin(), ids.begin() + static_cast<int64_t>(n));
  for (const Mark& m : marks)
    if (m.text < text_from || m.text == 0) out.marks.push_back(m);
  for (size_t s : image_starts)
    if (s < n) out.image_starts.push_back(s);
  return out;
}

void ChatSession::append_text(const std::string& text, size_t from,
                              const std::vector<GridTHW>& grids, Ids& out) const {
  const int m = model_.config().vision.spatial_merge_size;
  // Encoded piece by piece, split before each <|im_start|>: the tokenizer splits at added tokens,
  // so the pieces give the ids of the whole, and each split is a mark.
  for (size_t begin = from; begin < text.size();) {
    size_t end = text.find(kTurnStart, begin + 1);
    if (end == std::string::npos) end = text.size();
    const std::string_view piece = std::string_view(text).substr(begin, end - begin);
    if (piece.substr(0, kTurnStart.size()) == kTurnStart && begin > 0)
      out.marks.push_back({begin, out.ids.size()});
    const size_t image = out.image_starts.size();
    const size_t n = count_in(piece, kImagePad);
    IRIS_CHECK(image + n <= grids.size(), "the chat template wrote more images than the ",
               grids.size(), " the conversation has");
    const std::vector<GridTHW> piece_grids(grids.begin() + static_cast<int64_t>(image),
                                           grids.begin() + static_cast<int64_t>(image + n));
    const std::vector<int32_t> piece_ids =
        encode_chat_text(tokenizer_, std::string(piece), piece_grids, m);
    for (size_t i = 0; i < piece_ids.size(); ++i)
      if (piece_ids[i] == pad_id_ && (i == 0 || piece_ids[i - 1] != pad_id_))
        out.image_starts.push_back(out.ids.size() + i);
    out.ids.insert(out.ids.end(), piece_ids.begin(), piece_ids.end());
    begin = end;
  }
  IRIS_CHECK(out.image_starts.size() == grids.size(), "the chat template wrote ",
             out.image_starts.size(), " of the conversation's ", grids.size(),
             " images; it must write each image once");
}

ChatSession::Plan ChatSession::plan(const std::vector<GridTHW>& grids,
                                    const std::string& text) const {
  Plan p;
  p.messages = messages_;
  p.messages.push_back(user_message(text, grids.size()));
  p.text = format_.render(p.messages, true);
  std::vector<GridTHW> all = grids_;
  all.insert(all.end(), grids.begin(), grids.end());
  // Keep the conversation's ids where the new rendering continues its text; where the template
  // rewrote it, keep them up to the last mark before the first change.
  const size_t same = common_prefix(text_, p.text);
  Mark keep{text_.size(), conv_.ids.size()};
  const bool continues =
      same == text_.size() &&
      (text_.empty() || std::string_view(p.text).substr(same, kTurnStart.size()) == kTurnStart);
  if (!continues) keep = last_mark_before(conv_.marks, same);
  p.conv = conv_.prefix(keep.text, keep.ids);
  append_text(p.text, keep.text, all, p.conv);
  p.reuse = std::min<int64_t>(cached_, static_cast<int64_t>(keep.ids));
  for (size_t s : p.conv.image_starts) p.first_image += s < static_cast<size_t>(p.reuse);
  return p;
}

std::vector<int32_t> ChatSession::turn_ids(const std::vector<GridTHW>& grids,
                                           const std::string& text) const {
  const Plan p = plan(grids, text);
  return {p.conv.ids.begin() + p.reuse, p.conv.ids.end()};
}

ChatReply ChatSession::send(const UserMessage& message,
                            const std::function<void(int32_t)>& on_token) {
  IRIS_CHECK(model_.n_past() == cached_, "the model's KV cache holds ", model_.n_past(),
             " tokens but the chat put ", cached_,
             " there: it was used outside the chat; /clear starts a new conversation");
  const ModelLimits& limits = model_.limits();
  IRIS_CHECK(static_cast<int>(message.grids.size()) <= limits.max_images, "a message may carry ",
             limits.max_images, " images at most; this one has ", message.grids.size());
  Plan p = plan(message.grids, message.text);
  std::vector<GridTHW> all = grids_;
  all.insert(all.end(), message.grids.begin(), message.grids.end());
  const std::vector<GridTHW> turn_grids(all.begin() + static_cast<int64_t>(p.first_image),
                                        all.end());
  IRIS_CHECK(static_cast<int>(turn_grids.size()) <= limits.max_images,
             "the chat template rewrote earlier turns that hold images, and this turn would have "
             "to encode ",
             turn_grids.size(), " images, more than the ", limits.max_images,
             " planned; /clear starts a new conversation");

  GenerationRequest req = settings_;
  const std::vector<int32_t>& ids = p.conv.ids;
  req.prompt_ids.assign(ids.begin() + p.reuse, ids.end());
  const int64_t need = static_cast<int64_t>(req.prompt_ids.size());
  const int64_t room = limits.max_context - p.reuse;
  const int64_t first_reply_token = settings_.max_new_tokens > 0 ? 1 : 0;
  if (need + first_reply_token > room) {
    IRIS_CHECK(p.reuse > 0, "this message needs ", need,
               " tokens with its images and the reply's first, more than the context of ",
               limits.max_context,
               " tokens (raise -c/--ctx-size, or shrink the images with --image-max-tokens)");
    IRIS_FAIL("this message needs ", need, " more tokens but the conversation already fills ",
              p.reuse, " of the context's ", limits.max_context,
              "; /clear starts a new conversation (or raise -c/--ctx-size)");
  }
  const int64_t patches = count_patches(turn_grids);
  IRIS_CHECK(patches <= limits.max_vision_patches, "the message's images have ", patches,
             " patches, more than the ", limits.max_vision_patches,
             " one encoder call was planned for");
  req.max_new_tokens = static_cast<int>(std::min<int64_t>(settings_.max_new_tokens, room - need));
  req.cached_ids.assign(ids.begin(), ids.begin() + p.reuse);
  // This message's pixels join the conversation's; the turn encodes those after the cache.
  std::vector<std::vector<float>> pixels = pixels_;
  size_t offset = 0;
  for (const GridTHW& g : message.grids) {
    const auto n = static_cast<size_t>(g[0] * g[1] * g[2] * patch_values_);
    pixels.emplace_back(message.pixel_values + offset, message.pixel_values + offset + n);
    offset += n;
  }
  std::vector<float> turn_pixels;
  for (size_t i = p.first_image; i < pixels.size(); ++i)
    turn_pixels.insert(turn_pixels.end(), pixels[i].begin(), pixels[i].end());
  req.pixel_values = turn_pixels.empty() ? nullptr : turn_pixels.data();
  req.grids = turn_grids;

  ChatReply reply;
  try {
    model_.truncate_cache(p.reuse);
    reply.result = generate(model_, req, on_token);
    const GenerationResult& res = reply.result;
    const std::vector<int32_t> reply_ids(res.tokens.begin(),
                                         res.tokens.end() - (res.stopped ? 1 : 0));
    // The cache holds the turn's prompt and every generated token but the last.
    std::vector<int32_t> in_cache = ids;
    if (!res.tokens.empty())
      in_cache.insert(in_cache.end(), res.tokens.begin(), res.tokens.end() - 1);
    // The conversation now ends with the reply, closed as the template closes it (<|im_end|>\n)
    // whatever ended it: a stop id other than <|im_end|> (<|endoftext|>) or -n is not what the
    // template writes.
    std::vector<ChatMessage> messages = std::move(p.messages);
    const std::string reply_text = tokenizer_.decode(reply_ids);
    messages.push_back({"assistant", {ChatPart::make_text(reply_text)}});
    std::string closed = format_.render(messages, false);
    const std::string written = p.text + reply_text;
    Ids conv;
    if (closed.compare(0, written.size(), written) == 0) {
      conv = std::move(p.conv);
      conv.ids.insert(conv.ids.end(), reply_ids.begin(), reply_ids.end());
      append_text(closed, written.size(), all, conv);
    } else {
      // The template writes the last reply otherwise than it was generated (it normalises a
      // Thinking model's reasoning): the text from the last mark before the change is tokenised.
      const Mark keep = last_mark_before(p.conv.marks, common_prefix(written, closed));
      conv = p.conv.prefix(keep.text, keep.ids);
      append_text(closed, keep.text, all, conv);
    }
    // What of the cache the conversation still begins with stays.
    const auto cached = static_cast<int64_t>(common_prefix(in_cache, conv.ids));
    if (cached < model_.n_past()) model_.truncate_cache(cached);
    messages_ = std::move(messages);
    pixels_ = std::move(pixels);
    grids_ = std::move(all);
    conv_ = std::move(conv);
    text_ = std::move(closed);
    cached_ = cached;
  } catch (const Error& e) {
    // The cache may hold part of this turn; a later turn must not build on it.
    clear();
    throw Error(str_cat(e.what(), " (the conversation was cleared)"));
  }
  const GenerationResult& res = reply.result;
  ++turns_;
  reply.context_full = !res.stopped && req.max_new_tokens < settings_.max_new_tokens &&
                       static_cast<int64_t>(res.tokens.size()) == req.max_new_tokens;
  return reply;
}

}  // namespace iris
