// Captioning accuracy of a model on the held-out shapes split: greedy captions through the same
// generation path as `iris generate`, scored on colour and shape words.
#pragma once

#include <functional>
#include <string>

#include "training/shapes_data.h"

namespace iris {

struct ShapesEvalOptions {
  std::string device = "cpu";
  int limit = 0;  // 0 = every held-out sample
  int max_new_tokens = 16;
};

// model_dir: an HF-format directory (e.g. from `iris export`); heldout_jsonl: the shapes set's
// heldout.jsonl. on_sample (optional) sees each prediction with its reference.
ShapesScore evaluate_shapes(
    const std::string& model_dir, const std::string& heldout_jsonl, const ShapesEvalOptions& opt,
    const std::function<void(const std::string& predicted, const std::string& reference)>&
        on_sample = nullptr);

}  // namespace iris
