// Image-text training data: JSONL conversations turned into Qwen3-VL token ids, labels and
// preprocessed pixels, decoded on worker threads ahead of the training step.
//
// Each non-blank line of a train file is one JSON object in one of two shapes:
//   HF messages: {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
//                  {"type": "text", "text": "What is this?"}]}, {"role": "assistant",
//                  "content": "A cat."}]}
//     Roles system/user/assistant; content a string or a list of image/text items. An image item
//     without "image" takes the next path of a top-level "images" list (TRL's layout).
//   LLaVA: {"image": "a.png" (or a list, or "images": [...]), "conversations": [{"from": "human",
//            "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]}
//     from human/user, gpt/assistant or system. Each <image> tag places the next image; the tag
//     count must equal the number of images. Whitespace touching a tag is dropped, because LLaVA
//     writes "<image>\n" only to separate the tag, and the messages form puts an image right
//     before its text.
// Relative image paths are resolved against image_root when it is set, otherwise against the
// directory of the JSONL file. Only user turns may hold images, and a sample needs at least one
// assistant turn (it has nothing to learn otherwise).
//
// Order and resumption: epoch e visits every line once in a permutation drawn from (seed, e);
// position() = (epoch, index into that permutation) of the next line to be considered. Lines that
// are dropped (too long, bad) are skipped deterministically, so seek(position()) in a new process
// reproduces the sample sequence exactly.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "language/tokenizer.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/vision_encoder.h"

namespace iris {

// A JSONL line holds one sample's text and image paths; a longer one is an error naming the file
// and line, before the reader holds it all in memory.
inline constexpr size_t kMaxJsonlLineBytes = size_t{64} << 20;

struct DataConfig {
  std::vector<std::string> train_files;  // JSONL
  std::string image_root;                // base of relative image paths; empty: the JSONL's dir
  int64_t seq_length = 2048;             // longer samples are dropped whole, never cut
  uint64_t seed = 1234;
  bool shuffle = true;  // false: file order every epoch (for inspection and tests)
  // Worker threads decoding and preprocessing ahead of next(); 0 does the work inside next().
  int num_workers = 2;
  // Samples being prepared or ready ahead of the consumer (in-progress ones included).
  int prefetch = 4;
  enum class OnBad { skip, error } on_bad_sample = OnBad::skip;
  // Images with more pixels (from the file's header) are bad samples, refused before decoding.
  int64_t max_image_pixels = kDefaultMaxImagePixels;

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
  std::vector<float> pixel_values;  // [sum of patches, 3*Tp*P*P], images in order
  std::vector<GridTHW> grids;
  std::string source;  // "file:line", or "mock:index"
};

struct DataPosition {
  int64_t epoch = 0, index = 0;
  bool operator==(const DataPosition&) const = default;
};

struct DataStats {
  // Each line counts once, however many epochs see it.
  int64_t dropped_too_long = 0, bad_samples = 0;
  // "file:line: reason" for the first few dropped or bad lines.
  std::vector<std::string> bad_examples;
};

class Dataset {
 public:
  // Reads and checks every line of the train files (JSON syntax and structure; images are read
  // later, by the workers). With on_bad_sample = error a bad line throws iris::Error naming
  // file:line; with skip it is counted in stats(). Throws when no line is usable. The
  // conversations are rendered with `format`, the chat template of the model being trained.
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
  int64_t size() const;  // lines per epoch (bad lines found while reading excluded)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace iris
