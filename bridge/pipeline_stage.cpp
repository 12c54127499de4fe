#include "bridge/pipeline_stage.h"

#include "core/error.h"

namespace iris {

std::string PipelineStage::describe() const {
  std::string s = str_cat("stage ", index, "/", count, " (");
  if (has_vision) s += "vision, ";
  if (has_embed()) s += "embed, ";
  s += str_cat("layers ", first_layer, "-", end_layer - 1);
  if (has_head) s += ", head";
  return s + ")";
}

std::vector<PipelineStage> split_stages(const ModelConfig& cfg, int n_stages) {
  const int n_layers = cfg.text.num_hidden_layers;
  IRIS_CHECK(n_stages >= 1 && n_stages <= n_layers, "cannot split ", n_layers,
             " decoder layers into ", n_stages,
             " pipeline stages: every stage needs at least one layer (use 1 to ", n_layers, ")");
  const int base = n_layers / n_stages, extra = n_layers % n_stages;
  std::vector<int> counts;
  for (int i = 0; i < n_stages; ++i) counts.push_back(base + (i >= n_stages - extra ? 1 : 0));
  return stages_of_layer_counts(counts);
}

std::vector<PipelineStage> stages_of_layer_counts(const std::vector<int>& layer_counts) {
  const int n = static_cast<int>(layer_counts.size());
  std::vector<PipelineStage> out;
  int first = 0;
  for (int i = 0; i < n; ++i) {
    PipelineStage s;
    s.index = i;
    s.count = n;
    s.has_vision = i == 0;
    s.first_layer = first;
    s.end_layer = first + layer_counts[static_cast<size_t>(i)];
    s.has_head = i == n - 1;
    first = s.end_layer;
    out.push_back(s);
  }
  return out;
}

void validate_stage(const ModelConfig& cfg, const PipelineStage& s) {
  const int n_layers = cfg.text.num_hidden_layers;
  IRIS_CHECK(s.count >= 1 && s.index >= 0 && s.index < s.count, "pipeline stage index ", s.index,
             " is outside [0, ", s.count, ")");
  IRIS_CHECK(0 <= s.first_layer && s.first_layer < s.end_layer && s.end_layer <= n_layers,
             "pipeline ", s.describe(), ": layers [", s.first_layer, ", ", s.end_layer,
             ") must be a non-empty range inside the model's ", n_layers, " layers");
  IRIS_CHECK(s.has_embed() == (s.first_layer == 0), "pipeline ", s.describe(),
             ": the embedding belongs to stage 0, which starts at layer 0");
  IRIS_CHECK(s.has_head == (s.index == s.count - 1) && s.has_head == (s.end_layer == n_layers),
             "pipeline ", s.describe(),
             ": the final norm and LM head belong to the last stage, which ends at layer ",
             n_layers);
}

}  // namespace iris
