#include "training/pipeline_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "training/data_parallel.h"

namespace iris {

std::vector<PipelineStage> pipeline_split(const ModelConfig& cfg, int n_stages,
                                          const std::vector<double>& layers,
                                          const PipelineCosts& costs) {
  const int n = cfg.text.num_hidden_layers;
  IRIS_CHECK(n_stages >= 1 && n_stages <= n, "parallel.pipeline_parallel_size ", n_stages,
             " is more stages than the model's ", n,
             " decoder layers; every stage holds at least one layer");
  std::vector<int> counts;
  if (!layers.empty()) {
    IRIS_CHECK(static_cast<int>(layers.size()) == n_stages, "parallel.pipeline_layers lists ",
               layers.size(), " stages but parallel.pipeline_parallel_size is ", n_stages);
    int64_t sum = 0;
    std::string list;
    for (double c : layers) {
      IRIS_CHECK(c >= 1 && c == std::floor(c),
                 "parallel.pipeline_layers entries are positive layer counts, got ", c);
      counts.push_back(static_cast<int>(c));
      sum += counts.back();
      list += str_cat(list.empty() ? "" : ", ", counts.back());
    }
    IRIS_CHECK(sum == n, "parallel.pipeline_layers [", list, "] holds ", sum,
               " layers but the model has ", n,
               " decoder layers (text_config.num_hidden_layers); the counts must add up to it");
  } else {
    // best[s][b]: the least possible cost of the most expensive of stages 0..s when they hold
    // layers [0, b); from[s][b] where stage s starts in that split.
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(static_cast<size_t>(n_stages),
                                          std::vector<double>(static_cast<size_t>(n) + 1, inf));
    std::vector<std::vector<int>> from(static_cast<size_t>(n_stages),
                                       std::vector<int>(static_cast<size_t>(n) + 1, 0));
    auto cost = [&](int s, int a, int b) {
      return (b - a) * costs.layer + (s == 0 ? costs.first : 0) +
             (s == n_stages - 1 ? costs.last : 0);
    };
    for (int b = 1; b <= n; ++b) best[0][b] = cost(0, 0, b);
    for (int s = 1; s < n_stages; ++s)
      for (int b = s + 1; b <= n; ++b)
        for (int a = s; a < b; ++a) {
          const double c = std::max(best[s - 1][a], cost(s, a, b));
          if (c < best[s][b]) {
            best[s][b] = c;
            from[s][b] = a;
          }
        }
    counts.assign(static_cast<size_t>(n_stages), 0);
    int b = n;
    for (int s = n_stages - 1; s >= 0; --s) {
      const int a = s == 0 ? 0 : from[s][b];
      counts[s] = b - a;
      b = a;
    }
  }
  std::vector<PipelineStage> out = stages_of_layer_counts(counts);
  for (const PipelineStage& st : out) validate_stage(cfg, st);
  return out;
}

int pipeline_slots(int stage, int stages, int micro_batches) {
  return std::max(1, std::min(stages - stage, micro_batches));
}

int64_t run_pipeline_step(const std::vector<std::unique_ptr<TrainableQwen3VL>>& slots,
                          const std::vector<std::vector<const TrainSample*>>& micro_batches,
                          float grad_scale, DataParallel& dp) {
  const int s = dp.stage(), stages = dp.stages();
  const int m = static_cast<int>(micro_batches.size());
  IRIS_CHECK(static_cast<int>(slots.size()) >= pipeline_slots(s, stages, m), "stage ", s, " has ",
             slots.size(), " models for the ", pipeline_slots(s, stages, m),
             " micro-batches 1F1B keeps in flight");
  auto model = [&](int i) -> TrainableQwen3VL& { return *slots[size_t(i) % slots.size()]; };
  const std::vector<Tensor> none;
  int64_t labelled = 0;
  auto prepare = [&](int i) {
    labelled += model(i).stage_prepare(micro_batches[size_t(i)], grad_scale);
  };
  // The last micro-batch's backward is the step's last into the stage's gradients: the one whose
  // gradients the data-parallel reduction may start on (TrainableQwen3VL::on_gradients_final).
  auto backward = [&](int j) {
    if (model(j).stage_backward_needed()) model(j).stage_backward(j == m - 1);
    model(j).stage_micro_batch_done();
  };
  // What crosses a boundary for micro-batch i; nothing for a micro-batch without a backward.
  auto grads_in = [&](int j) {
    return model(j).stage_backward_needed() ? model(j).backward_inputs() : none;
  };
  auto grads_out = [&](int j) {
    return model(j).stage_backward_needed() ? model(j).backward_outputs() : none;
  };

  // Megatron-LM's 1F1B with paired exchanges: the sends a neighbour posts in one exchange are the
  // receives this stage posts in the matching one, so each pair completes together.
  const int warmup = std::min(stages - s - 1, m), steady = m - warmup;
  for (int i = 0; i < warmup; ++i) {
    prepare(i);
    dp.stage_exchange(none, model(i).forward_inputs(), none, none,
                      "the pipeline's forward receive");
    model(i).stage_forward();
    dp.stage_exchange(none, none, model(i).forward_outputs(), none, "the pipeline's forward send");
  }
  if (steady > 0) {
    prepare(warmup);
    dp.stage_exchange(none, model(warmup).forward_inputs(), none, none,
                      "the pipeline's forward receive");
  }
  for (int j = 0; j < steady; ++j) {
    const int i = warmup + j;
    model(i).stage_forward();
    dp.stage_exchange(none, none, model(i).forward_outputs(), grads_in(j),
                      "the pipeline's forward send and backward receive");
    backward(j);
    // Taken before the next micro-batch is prepared: that may reuse this one's model, whose
    // gradient tensors the send reads (the preparation writes only its inputs).
    const std::vector<Tensor> out = grads_out(j);
    if (j == steady - 1) {
      dp.stage_exchange(out, none, none, none, "the pipeline's backward send");
    } else {
      prepare(i + 1);
      dp.stage_exchange(out, model(i + 1).forward_inputs(), none, none,
                        "the pipeline's backward send and forward receive");
    }
  }
  for (int j = steady; j < m; ++j) {
    dp.stage_exchange(none, none, none, grads_in(j), "the pipeline's backward receive");
    backward(j);
    dp.stage_exchange(grads_out(j), none, none, none, "the pipeline's backward send");
  }
  return labelled;
}

std::string describe_pipeline(const std::vector<PipelineStage>& stages, int replicas,
                              const std::vector<std::string>& graph_sets) {
  std::string text;
  for (const PipelineStage& st : stages) {
    text += str_cat(text.empty() ? "" : "\n", "  stage ", st.index, ": decoder layers ",
                    st.first_layer, "-", st.end_layer - 1);
    if (st.has_vision) text += ", vision encoder and mergers, embedding";
    if (st.has_head) text += ", final norm, lm_head and loss";
    text += "; ranks";
    for (int r = 0; r < replicas; ++r)
      text += str_cat(r == 0 ? " " : ", ", st.index * replicas + r);
    if (static_cast<size_t>(st.index) < graph_sets.size() && !graph_sets[st.index].empty())
      text += "; graphs: " + graph_sets[st.index];
  }
  return text;
}

}  // namespace iris
