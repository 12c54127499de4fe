// A multi-turn chat over one Qwen3-VL whose KV cache keeps the conversation between turns. Each
// turn's prompt is the chat template's rendering of the whole conversation (bridge/chat_prompt.h),
// with every earlier reply that the template writes back unchanged kept as the ids generated
// (never re-tokenised text): a turn prefills only what follows the cached tokens and gives the
// tokens of a one-shot generate() over that prompt (the same M-RoPE positions, the same sampling
// history, a fresh sampler with the same seed).
//
// A template may rewrite earlier turns once the conversation goes on (Qwen3-VL Thinking drops the
// reasoning of replies before the last question): the conversation's ids are then kept up to the
// start of the first turn that changed, the rest is tokenised from the new rendering, and the KV
// cache is cut back to what still holds.
//
// A message may carry images and videos: its prompt is expanded as a one-shot prompt with media
// (encode_media_prompt: each video written as its family writes videos, Qwen3-VL's per-slice
// timestamps included), and the turn encodes the media it does not find in the cache in one
// vision call, pixel rows in prompt order. Every image's and video's pixels stay with the
// conversation, so that a template that rewrites an earlier turn can have it encoded again.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "bridge/generator.h"
#include "language/tokenizer.h"
#include "vision/video.h"

namespace iris {

// One message typed into the chat, with its images and videos.
struct UserMessage {
  std::string text;  // may place the media with <__media__> markers, as a one-shot prompt
  const float* pixel_values = nullptr;  // the message's images, preprocessed, or null
  // Or, in a session given pixel tables (send_pixels_as_bytes), the images at their grids' sizes
  // (size_images), which the backend normalises and patchifies.
  std::vector<const ImageRGB8*> images;
  std::vector<GridTHW> grids;
  // The message's videos, preprocessed (preprocess_video, with their frame indices, frame count
  // and frame rate); the session copies what it keeps.
  std::vector<const VideoClip*> videos;
  // The images and videos in the order they were attached (marker i takes media i); empty: the
  // images, then the videos.
  std::vector<ChatPart::Kind> media;
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
  ChatSession(Qwen3VLModel& model, const Tokenizer& tokenizer, ChatFormat format,
              std::string system_prompt, GenerationRequest settings);

  // The ids the next turn would prefill for a message with these images and text (after the
  // cached tokens that still hold).
  std::vector<int32_t> turn_ids(const std::vector<GridTHW>& grids, const std::string& text) const;
  // The same for a message with videos (only their metadata and grids are read).
  std::vector<int32_t> turn_ids(const UserMessage& message) const;

  // Runs one turn: the reply streams through on_token (stop ids are not streamed). A message
  // that does not fit in the context is refused with an iris::Error and the conversation is left
  // as it was; a reply that reaches the end of the context stops there (context_full). Any other
  // failure after the model started clears the conversation (its cache rows are then unknown) and
  // says so.
  // `stop` is generate()'s: asked after each token, it may end the reply there (a Ctrl-C, a
  // reverse prompt), which then stays in the conversation as one cut short by -n does.
  ChatReply send(const UserMessage& message, const std::function<void(int32_t)>& on_token = {},
                 const std::function<bool()>& stop = {});

  // Forgets the conversation and the model's cached rows; the system prompt stays.
  void clear();

  // From now on the media go to the backend as bytes (VisionPixels): messages carry their images
  // in `images`, and videos send their frames (VideoClip::frames), normalised with these tables
  // (the image and the video processor's, pixel_table; without a video table, a message with a
  // video is refused). Call it before the first message.
  void send_pixels_as_bytes(const PixelTable& image_table,
                            const std::optional<PixelTable>& video_table);

  // Every id of the conversation so far, one-shot prompt order: the template's rendering of the
  // messages, each reply as the ids generated (without the stop id it ended with) followed by what
  // the template writes after a reply (<|im_end|>\n).
  const std::vector<int32_t>& conversation() const { return conv_.ids; }
  // The text conversation() stands for, each image written once as <|image_pad|> and each video
  // as <|vision_start|><|video_pad|><|vision_end|>, as the template renders them.
  const std::string& conversation_text() const { return text_; }
  // The leading ids of conversation() that are in the KV cache (all but the last reply's last
  // sampled token and its closing, which the next turn feeds).
  int64_t cached_tokens() const { return cached_; }
  int turns() const { return turns_; }

 private:
  // A point where the conversation's text and ids can be split without changing how the rest
  // tokenises (the start of an added token: <|im_start|>).
  struct Mark {
    size_t text = 0, ids = 0;
  };
  // An image or a video where the prompt holds it: where its first pad is, which of the
  // conversation's images (videos) it is, and its runs of pads (image_runs, the family's
  // video_runs) for M-RoPE.
  struct Media {
    size_t start = 0;
    bool video = false;
    size_t index = 0;
    std::vector<VisionRun> runs;
  };
  // The next turn's prompt: `ids` (the whole conversation), whose first `reuse` are in the KV
  // cache and stay there; media from `first_media` on (in prompt order) are in the rest.
  // Ids with their marks and where each image's and video's pads start (a reply may hold
  // generated pad ids, so media are not counted from the ids).
  struct Ids {
    std::vector<int32_t> ids;
    std::vector<Mark> marks;
    std::vector<Media> media;  // in prompt order
    size_t count(bool video) const;
    // The first `n` ids with their marks and media, and `text` from offset `from` on after them.
    Ids prefix(size_t text_from, size_t n) const;
  };
  struct Plan {
    std::vector<ChatMessage> messages;
    std::string text;
    Ids conv;
    int64_t reuse = 0;
    size_t first_media = 0;
    // The conversation's images and videos with the message's after them.
    std::vector<GridTHW> grids;
    std::vector<const VideoClip*> videos;
  };
  Plan plan(const UserMessage& message) const;
  // Tokenises `text` from offset `from` on after `out` (whose media are the first of `grids` and
  // `videos`).
  void append_text(const std::string& text, size_t from, const std::vector<GridTHW>& grids,
                   const std::vector<const VideoClip*>& videos, Ids& out) const;

  Qwen3VLModel& model_;
  Tokenizer tokenizer_;
  ChatFormat format_;
  std::string system_;
  GenerationRequest settings_;
  int32_t image_pad_ = 0, video_pad_ = 0;
  int64_t patch_values_ = 0;  // floats per patch row
  std::vector<ChatMessage> messages_;
  std::vector<std::vector<float>> pixels_;  // every image of the conversation, in order
  // With pixels sent as bytes: every image of the conversation at its size, and the tables.
  std::vector<ImageRGB8> images_;
  std::optional<PixelTable> image_table_, video_table_;
  std::vector<GridTHW> grids_;
  std::vector<VideoClip> videos_;  // every video of the conversation, in order, with its pixels
  Ids conv_;                       // conversation_ with its marks and images
  std::string text_;
  int64_t cached_ = 0;
  int turns_ = 0;
};

}  // namespace iris
