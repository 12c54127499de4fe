// Image-text training data: JSONL conversations turned into Qwen3-VL token ids, labels and
// preprocessed pixels, decoded on worker threads ahead of the training step.
//
// Each non-blank line of a train file is one JSON object holding a conversation, in any of the
// shapes fine-tuning tools write (docs/training-data.md has an example of each):
//   HF messages: {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
//                  {"type": "text", "text": "What is this?"}]}, {"role": "assistant",
//                  "content": "A cat."}]}
//     Roles system/user/assistant; content a string or a list of image/text items. An image item
//     names its file by "image" (or "path", "url"); {"type": "image_url", "image_url": {"url":
//     ...}} (or "image_url": "...") is the OpenAI spelling of the same.
//   Placeholders (ms-swift, LLaMA-Factory): "<image>" in message text, the files in a top-level
//     "images" list. Each <image> tag, and each image item without a path (TRL's layout), takes
//     the next listed file; tags plus pathless items must equal the list's length.
//   ShareGPT keys: "from"/"value" in place of "role"/"content" (human/user, gpt/assistant,
//     system), in "messages" or in LLaVA's "conversations", whose files may also be "image"
//     (a path or a list).
//   A top-level "system" string (LLaMA-Factory) becomes the first, system, turn.
// Whitespace touching a tag is dropped, because LLaVA writes "<image>\n" only to separate the tag,
// and the messages form puts an image right before its text: the shapes give the same tokens.
// Relative image paths (and file:// URLs) are resolved against image_root when it is set,
// otherwise against the directory of the JSONL file; http(s) URLs are refused, as nothing is
// downloaded. Only user turns may hold images, and a sample needs at least one assistant turn.
//
// Videos come the same ways: {"type": "video", "video": path} items (or "video_url"), <video> tags
// in text with a top-level "videos" list, LLaVA's "video"; each is decoded and preprocessed with
// the model's family rules and video processor (DataConfig::video).
// A line is used whole or not at all: one with "tools" is refused rather than trained as text
// without them, as is one whose images or videos cannot all be read. Refused and over-long lines
// are skipped and reported (on_bad_sample = skip) or stop the run (error; over-long lines are
// always skipped).
//
// Order and resumption: epoch e visits every line once in a permutation drawn from (seed, e);
// position() = (epoch, index into that permutation) of the next line to be considered. Lines that
// are dropped (too long, bad) are skipped deterministically, so seek(position()) in a new process
// reproduces the sample sequence exactly.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "bridge/model_config.h"
#include "core/json_read.h"
#include "language/tokenizer.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/vision_encoder.h"

namespace iris {

// A JSONL line holds one sample's text and image paths; a longer one is an error naming the file
// and line, before the reader holds it all in memory.
inline constexpr size_t kMaxJsonlLineBytes = kJsonLineLimits.max_bytes;

// What preprocessing videos takes: the model's family rules and its video processor (with
// data.video_fps and data.video_max_frames applied).
struct DataVideo {
  ModelConfig model;
  VideoProcessorConfig processor;
};

struct DataConfig {
  std::vector<std::string> train_files;  // JSONL
  // The recipe key that gave train_files, which errors about the files name: held-out data is
  // read by a Dataset of its own, from data.eval_files.
  std::string files_key = "data.train_files";
  std::string image_root;     // base of relative image paths; empty: the JSONL's dir
  int64_t seq_length = 2048;  // longer samples are dropped whole, never cut
  uint64_t seed = 1234;
  bool shuffle = true;  // false: file order every epoch (for inspection and tests)
  // Worker threads decoding and preprocessing ahead of next(); 0 does the work inside next().
  int num_workers = 2;
  // Samples being prepared or ready ahead of the consumer (in-progress ones included).
  int prefetch = 4;
  enum class OnBad { skip, error } on_bad_sample = OnBad::skip;
  // Images with more pixels (from the file's header) are bad samples, refused before decoding.
  int64_t max_image_pixels = kDefaultMaxImagePixels;
  // data.video_fps (frames kept a second, 0 every frame; < 0: the model's video processor's) and
  // data.video_max_frames (0: the model's), which the trainer applies to `video`.
  double video_fps = -1;
  int video_max_frames = 0;
  // Null: lines with videos are refused (a dataset opened without a model).
  std::shared_ptr<const DataVideo> video;

  // Mock data for benchmarks: no files; every sample holds one random-pixel image per entry of
  // mock_image_sizes ({width, height}), then a user text and an assistant reply of random ordinary
  // tokens, mock_text_tokens in all (half each). Deterministic from the seed and the index.
  bool mock = false;
  std::vector<std::array<int, 2>> mock_image_sizes;
  int mock_text_tokens = 64;
  int64_t mock_samples = 1024;  // the epoch length in mock mode

  // Throws iris::Error naming the field for values out of range.
  void validate() const;
};

struct Sample {
  std::vector<int32_t> ids, labels;
  // [sum of patches, 3*Tp*P*P]: images and videos in the order their pads come in ids, one grid
  // each.
  std::vector<float> pixel_values;
  std::vector<GridTHW> grids;
  // With videos: the pad runs in order (MediaPrompt::runs); empty: every grid is an image.
  std::vector<VisionRun> runs;
  std::string source;  // "file:line", or "mock:index"
};

struct DataPosition {
  int64_t epoch = 0, index = 0;
  bool operator==(const DataPosition&) const = default;
};

// A line that is not trained on, and why.
struct SkippedLine {
  std::string file;
  int64_t line = 0;
  // A few words, the same for every line refused for the same cause, which the summary counts by:
  // "missing image", "bad image", "video not supported", "malformed JSON", "invalid row", ...
  std::string reason;
  std::string detail;  // the whole explanation, with what to do about it

  // "file:line (reason): detail"
  std::string describe() const;
};

// Skipped lines kept in DataStats for inspection; the counts and Dataset::take_new_skips cover
// all of them, this only bounds the memory of a dataset with many unusable lines.
inline constexpr size_t kKeptSkippedLines = 1000;

struct DataStats {
  int64_t lines = 0;  // non-blank lines in the train files
  // Each line counts once, however many epochs see it.
  int64_t dropped_too_long = 0, bad_samples = 0;
  // The first kKeptSkippedLines of the lines counted above, in the order found: lines refused
  // while reading the files first, the rest as the epochs reach them.
  std::vector<SkippedLine> skipped;
  std::map<std::string, int64_t> skipped_by_reason;  // every skipped line

  // "skipped 3 of 5 lines: 2 missing image, 1 video not supported" (largest count first); empty
  // when nothing was skipped.
  std::string summary() const;
};

class Dataset {
 public:
  // Reads and checks every line of the train files (JSON syntax and structure; images are read
  // later, by the workers). With on_bad_sample = error a bad line throws iris::Error naming
  // file:line and the reason; with skip it is recorded in stats(). Throws when no line is usable.
  // The conversations are rendered with `format`, the chat template of the model being trained.
  Dataset(const DataConfig& cfg, const Tokenizer& tok, const PreprocessorConfig& pp,
          const ChatFormat& format);
  ~Dataset();
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;

  // The next usable sample, crossing into the next epoch as needed. Throws iris::Error naming
  // file:line for a bad sample when on_bad_sample = error, and when a whole epoch yields nothing.
  Sample next();
  DataPosition position() const;
  // Restarts at `pos` (from position(), possibly of an earlier run over the same files); samples
  // prepared ahead are discarded.
  void seek(const DataPosition& pos);
  const DataStats& stats() const;
  // The lines skipped since the last call (all of them on the first), each returned once, so
  // that a caller can report every skipped line as it is found.
  std::vector<SkippedLine> take_new_skips();
  int64_t size() const;  // lines per epoch (bad lines found while reading excluded)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace iris
