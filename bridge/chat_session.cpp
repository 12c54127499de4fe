#include "bridge/chat_session.h"

#include <algorithm>

#include "bridge/architecture.h"
#include "bridge/model_config.h"

namespace iris {

namespace {

constexpr std::string_view kTurnStart = "<|im_start|>";
constexpr std::string_view kImagePad = "<|image_pad|>";
constexpr std::string_view kVideoBlock = "<|vision_start|><|video_pad|><|vision_end|>";

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

// Attention segments of a vision call: one per image, one per frame pair of a video.
int64_t segments_of(const std::vector<GridTHW>& grids) {
  int64_t n = 0;
  for (const GridTHW& g : grids) n += g[0];
  return n;
}

// The message's images and videos in the order they were attached.
std::vector<ChatPart::Kind> media_kinds(const UserMessage& m) {
  if (m.media.empty()) {
    std::vector<ChatPart::Kind> kinds(m.grids.size(), ChatPart::Kind::image);
    kinds.insert(kinds.end(), m.videos.size(), ChatPart::Kind::video);
    return kinds;
  }
  const auto videos =
      static_cast<size_t>(std::count(m.media.begin(), m.media.end(), ChatPart::Kind::video));
  IRIS_CHECK(videos == m.videos.size() && m.media.size() - videos == m.grids.size(),
             "the message lists ", m.media.size() - videos, " images and ", videos,
             " videos in its media order but carries ", m.grids.size(), " and ", m.videos.size());
  return m.media;
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
  settings_.pixel_values = VisionPixels();
  settings_.grids.clear();
  image_pad_ = tokenizer_.token_id(std::string(kImagePad));
  video_pad_ = tokenizer_.token_id("<|video_pad|>");
  patch_values_ = model_.config().vision.patch_dim();
  clear();
}

void ChatSession::clear() {
  messages_.clear();
  if (!system_.empty()) messages_.push_back({"system", {ChatPart::make_text(system_)}});
  pixels_.clear();
  images_.clear();
  grids_.clear();
  videos_.clear();
  conv_ = Ids{};
  conv_.marks = {Mark{}};
  text_.clear();
  cached_ = 0;
  turns_ = 0;
  model_.clear_cache();
}

void ChatSession::send_pixels_as_bytes(const PixelTable& image_table,
                                       const std::optional<PixelTable>& video_table) {
  IRIS_CHECK(grids_.empty() && videos_.empty(),
             "send_pixels_as_bytes: the conversation already holds images or videos as rows");
  image_table_ = image_table;
  video_table_ = video_table;
}

size_t ChatSession::Ids::count(bool video) const {
  return static_cast<size_t>(
      std::count_if(media.begin(), media.end(), [&](const Media& m) { return m.video == video; }));
}

ChatSession::Ids ChatSession::Ids::prefix(size_t text_from, size_t n) const {
  Ids out;
  out.ids.assign(ids.begin(), ids.begin() + static_cast<int64_t>(n));
  for (const Mark& m : marks)
    if (m.text < text_from || m.text == 0) out.marks.push_back(m);
  for (const Media& m : media)
    if (m.start < n) out.media.push_back(m);
  return out;
}

void ChatSession::append_text(const std::string& text, size_t from,
                              const std::vector<GridTHW>& grids,
                              const std::vector<const VideoClip*>& videos, Ids& out) const {
  const ModelConfig& cfg = model_.config();
  // Encoded piece by piece, split before each <|im_start|>: the tokenizer splits at added tokens,
  // so the pieces give the ids of the whole, and each split is a mark.
  for (size_t begin = from; begin < text.size();) {
    size_t end = text.find(kTurnStart, begin + 1);
    if (end == std::string::npos) end = text.size();
    const std::string_view piece = std::string_view(text).substr(begin, end - begin);
    if (piece.substr(0, kTurnStart.size()) == kTurnStart && begin > 0)
      out.marks.push_back({begin, out.ids.size()});
    const size_t image = out.count(false), video = out.count(true);
    const size_t n_images = count_in(piece, kImagePad), n_videos = count_in(piece, kVideoBlock);
    IRIS_CHECK(image + n_images <= grids.size(), "the chat template wrote more images than the ",
               grids.size(), " the conversation has");
    IRIS_CHECK(video + n_videos <= videos.size(), "the chat template wrote more videos than the ",
               videos.size(), " the conversation has");
    const std::vector<GridTHW> piece_grids(grids.begin() + static_cast<int64_t>(image),
                                           grids.begin() + static_cast<int64_t>(image + n_images));
    const std::vector<const VideoClip*> piece_videos(
        videos.begin() + static_cast<int64_t>(video),
        videos.begin() + static_cast<int64_t>(video + n_videos));
    const MediaPrompt mp =
        encode_media_prompt(tokenizer_, std::string(piece), cfg, piece_grids, piece_videos);
    // Each pad the text held became one run of pads, in order.
    std::vector<size_t> run_starts;
    for (size_t i = 0; i < mp.ids.size();) {
      if ((mp.ids[i] == image_pad_ || mp.ids[i] == video_pad_) &&
          run_starts.size() < mp.runs.size()) {
        run_starts.push_back(i);
        i += static_cast<size_t>(mp.runs[run_starts.size() - 1].tokens());
      } else {
        ++i;
      }
    }
    size_t run = 0;
    for (const MediaPrompt::Item& item : mp.media_order) {
      const size_t n_runs =
          item.video ? cfg.arch->video_runs(*piece_videos[item.index], cfg).size() : 1;
      IRIS_CHECK(run + n_runs <= run_starts.size(), "the chat's vision runs are out of step");
      Media m;
      m.start = out.ids.size() + run_starts[run];
      m.video = item.video;
      m.index = item.index + (item.video ? video : image);
      m.runs.assign(mp.runs.begin() + static_cast<int64_t>(run),
                    mp.runs.begin() + static_cast<int64_t>(run + n_runs));
      out.media.push_back(std::move(m));
      run += n_runs;
    }
    out.ids.insert(out.ids.end(), mp.ids.begin(), mp.ids.end());
    begin = end;
  }
  IRIS_CHECK(out.count(false) == grids.size(), "the chat template wrote ", out.count(false),
             " of the conversation's ", grids.size(), " images; it must write each image once");
  IRIS_CHECK(out.count(true) == videos.size(), "the chat template wrote ", out.count(true),
             " of the conversation's ", videos.size(), " videos; it must write each video once");
}

ChatSession::Plan ChatSession::plan(const UserMessage& message) const {
  Plan p;
  p.messages = messages_;
  p.messages.push_back(user_message(message.text, media_kinds(message)));
  p.text = format_.render(p.messages, true);
  p.grids = grids_;
  p.grids.insert(p.grids.end(), message.grids.begin(), message.grids.end());
  for (const VideoClip& v : videos_) p.videos.push_back(&v);
  p.videos.insert(p.videos.end(), message.videos.begin(), message.videos.end());
  // Keep the conversation's ids where the new rendering continues its text; where the template
  // rewrote it, keep them up to the last mark before the first change.
  const size_t same = common_prefix(text_, p.text);
  Mark keep{text_.size(), conv_.ids.size()};
  const bool continues =
      same == text_.size() &&
      (text_.empty() || std::string_view(p.text).substr(same, kTurnStart.size()) == kTurnStart);
  if (!continues) keep = last_mark_before(conv_.marks, same);
  p.conv = conv_.prefix(keep.text, keep.ids);
  append_text(p.text, keep.text, p.grids, p.videos, p.conv);
  p.reuse = std::min<int64_t>(cached_, static_cast<int64_t>(keep.ids));
  for (const Media& m : p.conv.media) p.first_media += m.start < static_cast<size_t>(p.reuse);
  return p;
}

std::vector<int32_t> ChatSession::turn_ids(const std::vector<GridTHW>& grids,
                                           const std::string& text) const {
  UserMessage message;
  message.text = text;
  message.grids = grids;
  return turn_ids(message);
}

std::vector<int32_t> ChatSession::turn_ids(const UserMessage& message) const {
  const Plan p = plan(message);
  return {p.conv.ids.begin() + p.reuse, p.conv.ids.end()};
}

ChatReply ChatSession::send(const UserMessage& message,
                            const std::function<void(int32_t)>& on_token,
                            const std::function<bool()>& stop) {
  IRIS_CHECK(model_.n_past() == cached_, "the model's KV cache holds ", model_.n_past(),
             " tokens but the chat put ", cached_,
             " there: it was used outside the chat; /clear starts a new conversation");
  const ModelLimits& limits = model_.limits();
  const bool videos = !message.videos.empty();
  std::vector<GridTHW> message_grids = message.grids;
  const bool bytes = image_table_.has_value();
  IRIS_CHECK(bytes
                 ? message.pixel_values == nullptr && message.images.size() == message.grids.size()
                 : message.images.empty(),
             bytes ? "a message to a session that sends pixels as bytes carries its images in "
                     "`images`, one per grid"
                   : "a message carries images as bytes but the session was not given pixel tables "
                     "(send_pixels_as_bytes)");
  const int64_t tp = model_.config().vision.temporal_patch_size;
  for (const VideoClip* v : message.videos) {
    IRIS_CHECK(v != nullptr, "a message's video is missing");
    const auto& g = v->grid_thw;
    if (bytes)
      IRIS_CHECK(video_table_.has_value(),
                 "a message carries a video but the session was given no video pixel table");
    if (bytes)
      IRIS_CHECK(static_cast<int64_t>(v->frames.size()) == g[0] * tp, "a message's video holds ",
                 v->frames.size(), " frames for its grid [", g[0], ", ", g[1], ", ", g[2],
                 "]; videos come from preprocess_video");
    else
      IRIS_CHECK(v->pixel_values.numel() == g[0] * g[1] * g[2] * patch_values_,
                 "a message's video holds ", v->pixel_values.numel(),
                 " pixel values for its grid [", g[0], ", ", g[1], ", ", g[2],
                 "]; videos come from preprocess_video");
    message_grids.push_back(g);
  }
  const int64_t message_segments = segments_of(message_grids);
  if (videos)
    IRIS_CHECK(message_segments <= limits.max_images, "a message may carry ", limits.max_images,
               " images and video frame pairs at most (each pair of a video's frames is encoded "
               "as an image is); this one has ",
               message_segments,
               " (lower --video-fps or --video-max-frames, or attach fewer videos)");
  else
    IRIS_CHECK(message_segments <= limits.max_images, "a message may carry ", limits.max_images,
               " images at most; this one has ", message.grids.size());
  Plan p = plan(message);
  // The media the turn encodes, those after the cached tokens, in prompt order.
  std::vector<GridTHW> turn_grids;
  std::vector<VisionRun> turn_runs;
  for (size_t i = p.first_media; i < p.conv.media.size(); ++i) {
    const Media& m = p.conv.media[i];
    turn_grids.push_back(m.video ? p.videos[m.index]->grid_thw : p.grids[m.index]);
    turn_runs.insert(turn_runs.end(), m.runs.begin(), m.runs.end());
  }
  const int64_t turn_segments = segments_of(turn_grids);
  IRIS_CHECK(turn_segments <= limits.max_images,
             "the chat template rewrote earlier turns that hold images or videos, and this turn "
             "would have to encode ",
             turn_segments, " images and video frame pairs, more than the ", limits.max_images,
             " planned; /clear starts a new conversation");

  GenerationRequest req = settings_;
  const std::vector<int32_t>& ids = p.conv.ids;
  req.prompt_ids.assign(ids.begin() + p.reuse, ids.end());
  const int64_t need = static_cast<int64_t>(req.prompt_ids.size());
  const int64_t room = limits.max_context - p.reuse;
  const int64_t first_reply_token = settings_.max_new_tokens > 0 ? 1 : 0;
  if (need + first_reply_token > room) {
    IRIS_CHECK(p.reuse > 0, "this message needs ", need, " tokens with its ",
               videos ? "images and videos" : "images", " and the reply's first, more than the ",
               "context of ", limits.max_context,
               videos ? " tokens (raise -c/--ctx-size, or shrink the videos with --video-fps or "
                        "--video-max-frames and the images with --image-max-tokens)"
                      : " tokens (raise -c/--ctx-size, or shrink the images with "
                        "--image-max-tokens)");
    IRIS_FAIL("this message needs ", need, " more tokens but the conversation already fills ",
              p.reuse, " of the context's ", limits.max_context,
              "; /clear starts a new conversation (or raise -c/--ctx-size)");
  }
  const int64_t patches = count_patches(turn_grids);
  IRIS_CHECK(patches <= limits.max_vision_patches, "the message's ",
             videos ? "images and videos" : "images", " have ", patches, " patches, more than the ",
             limits.max_vision_patches, " one encoder call was planned for");
  req.max_new_tokens = static_cast<int>(std::min<int64_t>(settings_.max_new_tokens, room - need));
  req.cached_ids.assign(ids.begin(), ids.begin() + p.reuse);
  // This message's images join the conversation's (their pixels are kept, as the videos'); the
  // turn encodes the media after the cache, in prompt order: as bytes, or as pixel rows.
  std::vector<ImageRGB8> new_images;
  for (const ImageRGB8* im : message.images) new_images.push_back(*im);
  VisionPixels turn_media;
  if (bytes)
    for (size_t i = p.first_media; i < p.conv.media.size(); ++i) {
      const Media& m = p.conv.media[i];
      VisionMedia media;
      if (m.video) {
        for (const ImageRGB8& f : p.videos[m.index]->frames) media.frames.push_back(&f);
        media.table = &*video_table_;
      } else {
        media.frames = {m.index < images_.size() ? &images_[m.index]
                                                 : &new_images[m.index - images_.size()]};
        media.table = &*image_table_;
      }
      turn_media.media.push_back(std::move(media));
    }
  std::vector<std::vector<float>> new_pixels;
  size_t offset = 0;
  for (const GridTHW& g : bytes ? std::vector<GridTHW>{} : message.grids) {
    const auto n = static_cast<size_t>(g[0] * g[1] * g[2] * patch_values_);
    new_pixels.emplace_back(message.pixel_values + offset, message.pixel_values + offset + n);
    offset += n;
  }
  std::vector<float> turn_pixels;
  for (size_t i = p.first_media; i < p.conv.media.size() && !bytes; ++i) {
    const Media& m = p.conv.media[i];
    if (m.video) {
      const HostTensor& px = p.videos[m.index]->pixel_values;
      turn_pixels.insert(turn_pixels.end(), px.data<float>(), px.data<float>() + px.numel());
    } else {
      const std::vector<float>& px =
          m.index < pixels_.size() ? pixels_[m.index] : new_pixels[m.index - pixels_.size()];
      turn_pixels.insert(turn_pixels.end(), px.begin(), px.end());
    }
  }
  if (bytes)
    req.pixel_values = std::move(turn_media);
  else
    req.pixel_values = turn_pixels.empty() ? nullptr : turn_pixels.data();
  req.grids = turn_grids;
  req.runs = turn_runs;
  std::vector<VideoClip> new_videos;
  for (const VideoClip* v : message.videos) new_videos.push_back(*v);

  ChatReply reply;
  try {
    model_.truncate_cache(p.reuse);
    reply.result = generate(model_, req, on_token, stop);
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
      append_text(closed, written.size(), p.grids, p.videos, conv);
    } else {
      // The template writes the last reply otherwise than it was generated (it normalises a
      // Thinking model's reasoning): the text from the last mark before the change is tokenised.
      const Mark keep = last_mark_before(p.conv.marks, common_prefix(written, closed));
      conv = p.conv.prefix(keep.text, keep.ids);
      append_text(closed, keep.text, p.grids, p.videos, conv);
    }
    // What of the cache the conversation still begins with stays.
    const auto cached = static_cast<int64_t>(common_prefix(in_cache, conv.ids));
    if (cached < model_.n_past()) model_.truncate_cache(cached);
    messages_ = std::move(messages);
    for (std::vector<float>& px : new_pixels) pixels_.push_back(std::move(px));
    for (ImageRGB8& im : new_images) images_.push_back(std::move(im));
    grids_ = std::move(p.grids);
    for (VideoClip& v : new_videos) videos_.push_back(std::move(v));
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
  reply.context_full = !res.stopped && !res.halted &&
                       req.max_new_tokens < settings_.max_new_tokens &&
                       static_cast<int64_t>(res.tokens.size()) == req.max_new_tokens;
  return reply;
}

}  // namespace iris
