// Text generation over a loaded Qwen3-VL: prefill the prompt (with its images), then sample one
// token at a time, streaming each as it comes. Used by `iris generate` and the shapes demo.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bridge/qwen3vl_model.h"
#include "language/sampler.h"
#include "language/tokenizer.h"

namespace iris {

struct GenerationTimings {
  double vision_ms = 0;
  double prefill_ms = 0;
  double decode_ms = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t image_patches = 0;
  double prefill_tokens_per_s() const;
  double decode_tokens_per_s() const;  // over the steps after the first sampled token
};

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  // The tokens already in the model's KV cache (a chat's earlier turns; model.n_past() of them):
  // prompt_ids continue them instead of starting an empty cache, and the repetition penalty sees
  // them as part of the prompt, as a one-shot run of the whole conversation would. Empty: a new
  // conversation.
  std::vector<int32_t> cached_ids;
  // The grids' pixels: host rows [patches, patch_dim] or images at their grids' sizes.
  VisionPixels pixel_values;
  std::vector<GridTHW> grids;
  // With videos: the prompt's pad runs (MediaPrompt::runs), pixel rows and grids in their order.
  // Empty: every grid is an image, in order.
  std::vector<VisionRun> runs;
  int max_new_tokens = 128;
  std::set<int32_t> stop_ids;  // generation ends after emitting one of these (not streamed)
  SamplingParams sampling;
  // Per output row: may it be sampled (sampleable_ids()); empty lets every row be chosen.
  std::vector<uint8_t> sampleable;
  bool keep_prompt_logits = false;  // return the logits after the prompt (for parity checks)
};

struct GenerationResult {
  // Generated ids, a stop id included if one ended the run. All but the last are in the KV cache
  // after the call (the last was sampled, never fed).
  std::vector<int32_t> tokens;
  bool stopped = false;  // a stop id was produced
  bool halted = false;   // the caller's `stop` ended the reply (generate())
  GenerationTimings timings;
  std::vector<float> prompt_logits;  // [vocab] after the last prompt token, if asked for
};

// on_token is called for every generated token, in order, before the next is computed. `stop`,
// when given, is asked after each token streamed (but the last that max_new_tokens allows, so
// that `halted` means cut short) and ends the reply there when it says so (a Ctrl-C, a reverse
// prompt seen in the text): the reply then ends as one cut short by -n does.
GenerationResult generate(Qwen3VLModel& model, const GenerationRequest& request,
                          const std::function<void(int32_t)>& on_token = nullptr,
                          const std::function<bool()>& stop = nullptr);

// One entry per output row of the model: 1 where the tokenizer has a token of that id. Qwen
// checkpoints have 151,936 rows for 151,669 tokens; the rest are padding, which sampling must
// never choose (no text decodes to them).
std::vector<uint8_t> sampleable_ids(const Tokenizer& tokenizer, int32_t vocab_size);

// The stop ids of a checkpoint directory: generation_config.json eos_token_id (int or list),
// else tokenizer_config.json eos_token resolved through `find_id`, else Qwen's <|im_end|> and
// <|endoftext|>.
std::set<int32_t> default_stop_ids(const std::string& model_dir,
                                   const std::function<int32_t(const std::string&)>& find_id);

// The sampling settings a checkpoint ships in generation_config.json, each unset when the file
// (or the key) is absent; front ends use them as defaults under their own flags. do_sample: false
// means greedy whatever the other keys say, as in transformers.
struct CheckpointSampling {
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int> top_k;
};
CheckpointSampling checkpoint_sampling(const std::string& model_dir);

}  // namespace iris
