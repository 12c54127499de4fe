// The memory plan of a training run (training/memory_plan.h) against counts made here from the
// config's fields, against the arena a CPU model really allocates, across data parallelism with
// and without optimizer sharding and pipeline stages, and its refusal with the settings that
// make a run fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "training/memory_plan.h"
#include "training/param_spec.h"
#include "training/recipe.h"
#include "training/train_model.h"
#include "training/train_setup.h"

namespace iris {
namespace {

constexpr int64_t kMiB = int64_t(1) << 20;

Recipe tiny_recipe(const std::vector<std::string>& overrides = {}) {
  const std::string text = "model:\n  init: random\n  config: " + test::fixture_dir() +
                           "/config.json\n  tokenizer: " + test::fixture_dir() +
                           "/tokenizer.json\n"
                           "data:\n  mock: true\n  mock_image_sizes: [[64, 64]]\n"
                           "  mock_text_tokens: 32\n"
                           "train:\n  micro_batch_size: 2\n  global_batch_size: 8\n"
                           "  seq_length: 128\n";
  return load_recipe_text(text, test::fixture_dir() + "/tiny.yaml", overrides);
}

// Parameter counts of the parts, from the config's fields as Qwen3-VL lays its tensors out.
struct Counts {
  int64_t vision_tower = 0, merger = 0, language_model = 0;
  int64_t all() const { return vision_tower + merger + language_model; }
};

Counts count_parameters(const ModelConfig& cfg) {
  const VisionConfig& v = cfg.vision;
  const TextConfig& t = cfg.text;
  const int64_t D = v.hidden_size, I = v.intermediate_size;
  const int64_t M = D * v.spatial_merge_size * v.spatial_merge_size, out = v.out_hidden_size;
  Counts c;
  const int64_t patch =
      D * int64_t(v.in_channels) * v.temporal_patch_size * v.patch_size * v.patch_size + D;
  const int64_t block = 2 * (2 * D) + (3 * D * D + 3 * D) + (D * D + D) + (I * D + I) + (D * I + D);
  c.vision_tower = patch + int64_t(v.num_position_embeddings) * D + v.depth * block;
  auto merger = [&](int64_t norm) { return 2 * norm + (M * M + M) + (out * M + out); };
  c.merger = merger(D) + static_cast<int64_t>(v.deepstack_visual_indexes.size()) * merger(M);
  const int64_t H = t.hidden_size, hd = t.head_dim;
  const int64_t q = int64_t(t.num_attention_heads) * hd, kv = int64_t(t.num_key_value_heads) * hd;
  const int64_t layer = 2 * H + (q + 2 * kv) * H + 2 * hd + q * H + 3 * H * t.intermediate_size;
  c.language_model = int64_t(t.vocab_size) * H * (cfg.tie_word_embeddings ? 1 : 2) +
                     t.num_hidden_layers * layer + H;
  return c;
}

const MemoryItem& item(const StageMemory& s, const std::string& name) {
  for (const MemoryItem& i : s.items)
    if (i.name == name) return i;
  ADD_FAILURE() << "no plan line '" << name << "'";
  static const MemoryItem none;
  return none;
}

TEST(MemoryPlan, ParameterBuffersAreTheConfigsCountsTimesTheirBytes) {
  const Recipe r = tiny_recipe({"train.freeze_vision_tower=true"});
  const Counts c = count_parameters(r.model_config);
  const ParamSpecs specs(r.model_config, recipe_frozen_parts(r), DType::bf16);
  ASSERT_EQ(specs.parameters(), c.all());
  const int64_t trainable = c.merger + c.language_model;
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, 0);
  ASSERT_EQ(plan.per_stage.size(), 1u);
  const StageMemory& s = plan.per_stage[0];
  EXPECT_EQ(item(s, "weights").bytes, c.all() * 2);  // bf16, frozen parts included
  EXPECT_EQ(item(s, "master weights").bytes, trainable * 4);
  EXPECT_EQ(item(s, "gradients").bytes, trainable * 4);
  EXPECT_EQ(item(s, "AdamW moments").bytes, trainable * 8);
  EXPECT_EQ(item(s, "offloaded to host").bytes, 0);
  EXPECT_EQ(item(s, "communication").bytes, 0);  // one rank
  int64_t sum = 0;
  for (const MemoryItem& i : s.items) sum += i.on_host ? 0 : i.bytes;
  EXPECT_EQ(s.total(), sum);
  EXPECT_EQ(plan.peak(), sum);
  // Unknown device memory: no verdict, and the total line says how to give it.
  EXPECT_TRUE(plan.fits());
  EXPECT_NE(plan.describe().find("per-GPU total: "), std::string::npos);
  EXPECT_NE(plan.describe().find("--device-memory"), std::string::npos);
}

TEST(MemoryPlan, ActivationsAndWorkspaceAreWhatTheModelAllocates) {
  // On the CPU the same planner allocates for real: the plan must name its very arena.
  for (const char* recompute : {"none", "full"}) {
    SCOPED_TRACE(recompute);
    const Recipe r = tiny_recipe({"train.device=cpu", str_cat("train.recompute=", recompute)});
    const MemoryPlan plan = plan_training_memory(r, r.model_config, false, 0);
    const std::unique_ptr<Backend> cpu = make_cpu_backend();
    auto params = allocate_weights(*cpu, r.model_config);
    TrainableQwen3VL model(*cpu, r.model_config, *params, recipe_train_limits(r, false));
    const StageMemory& s = plan.per_stage[0];
    EXPECT_EQ(item(s, "activations").bytes, int64_t(model.activation_bytes()));
    EXPECT_EQ(item(s, "workspace").bytes, int64_t(model.arena_bytes() - model.activation_bytes()));
    // The parameter buffers: the tensors' bytes; the arenas add at most 256 B of alignment each.
    const int64_t grads = item(s, "gradients").bytes;
    EXPECT_EQ(grads, count_parameters(r.model_config).all() * 4);
    EXPECT_GE(int64_t(model.grads().arena.capacity()), grads);
    EXPECT_LT(int64_t(model.grads().arena.capacity()),
              grads + 256 * int64_t(model.grads().bindings.size()));
    // The f32 weights are the master weights on the CPU when nothing is frozen.
    EXPECT_EQ(item(s, "master weights").bytes, 0);
    EXPECT_EQ(item(s, "weights").bytes, count_parameters(r.model_config).all() * 4);
  }
  const Recipe none = tiny_recipe({"train.recompute=none"});
  const Recipe full = tiny_recipe({"train.recompute=full"});
  EXPECT_LT(item(plan_training_memory(full, full.model_config, true, 0).per_stage[0], "activations")
                .bytes,
            item(plan_training_memory(none, none.model_config, true, 0).per_stage[0], "activations")
                .bytes);
}

// Activation offload: the device keeps two layers' slots of each offloaded activation and the
// host every layer's; the plan's lines are the CPU model's own allocation, and the host's memory
// is shown but not in the GPU's total.
TEST(MemoryPlan, OffloadedActivationsMoveToTheHostLineAndOutOfTheTotal) {
  const Recipe kept = tiny_recipe({"train.device=cpu", "train.recompute=none"});
  const int64_t kept_total = plan_training_memory(kept, kept.model_config, false, 0).peak();
  const int64_t kept_activations =
      item(plan_training_memory(kept, kept.model_config, false, 0).per_stage[0], "activations")
          .bytes;
  const Recipe r =
      tiny_recipe({"train.device=cpu", "train.recompute=none", "train.offload_activations=all"});
  const MemoryPlan plan = plan_training_memory(r, r.model_config, false, 0);
  const StageMemory& s = plan.per_stage[0];
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  auto params = allocate_weights(*cpu, r.model_config);
  TrainableQwen3VL model(*cpu, r.model_config, *params, recipe_train_limits(r, false));
  EXPECT_EQ(item(s, "activations").bytes, int64_t(model.activation_bytes()));
  EXPECT_EQ(item(s, "offloaded to host").bytes, int64_t(model.offloaded_bytes()));
  EXPECT_TRUE(item(s, "offloaded to host").on_host);
  // The tiny model has 3 layers: two slots hold less than the three layers' tensors.
  const int64_t moved = kept_activations - item(s, "activations").bytes;
  EXPECT_GT(moved, 0);
  EXPECT_GT(item(s, "offloaded to host").bytes, moved);
  EXPECT_EQ(plan.peak(), kept_total - moved);
  EXPECT_NE(item(s, "offloaded to host").how.find("x_in, rms1"), std::string::npos);
}

TEST(MemoryPlan, DataParallelShardsTheMomentsAndMasterWeightsWithTheOptimizerSharding) {
  const Counts c = count_parameters(tiny_recipe().model_config);
  const Recipe whole = tiny_recipe({"parallel.data_parallel_size=4"});
  const Recipe sharded =
      tiny_recipe({"parallel.data_parallel_size=4", "parallel.sharding=optimizer"});
  const MemoryPlan whole_plan = plan_training_memory(whole, whole.model_config, true, 0);
  const MemoryPlan sharded_plan = plan_training_memory(sharded, sharded.model_config, true, 0);
  const StageMemory& w = whole_plan.per_stage[0];
  const StageMemory& s = sharded_plan.per_stage[0];
  EXPECT_EQ(item(w, "AdamW moments").bytes, c.all() * 8);
  // The last rank's shard takes the remainder.
  EXPECT_EQ(item(s, "AdamW moments").bytes, (c.all() / 4 + c.all() % 4) * 8);
  EXPECT_EQ(item(w, "master weights").bytes, c.all() * 4);
  EXPECT_EQ(item(s, "master weights").bytes, (c.all() / 4 + c.all() % 4) * 4);
  EXPECT_EQ(item(s, "gradients").bytes, c.all() * 4);
  // The gradient all-reduce's scratch: one bucket (the whole gradients here), padded to 4 pieces.
  EXPECT_EQ(item(w, "communication").bytes, (c.all() + 3) / 4 * 4 * 4);
  EXPECT_GT(item(s, "communication").bytes, 0);
}

// Gradient sharding (parallel.sharding=optimizer_grads): a rank holds the gradients outside the
// decoder layers, two layers' slots and its shard of the sums, plus one bucket's exchange
// scratch.
TEST(MemoryPlan, GradientShardingHoldsTwoLayerSlotsAndTheShard) {
  const Counts c = count_parameters(tiny_recipe().model_config);
  const Recipe r =
      tiny_recipe({"parallel.data_parallel_size=4", "parallel.sharding=optimizer_grads",
                   "parallel.grad_bucket_elements=1000"});
  const TextConfig& t = r.model_config.text;
  const int64_t H = t.hidden_size, hd = t.head_dim;
  const int64_t q = int64_t(t.num_attention_heads) * hd, kv = int64_t(t.num_key_value_heads) * hd;
  const int64_t layer = 2 * H + (q + 2 * kv) * H + 2 * hd + q * H + 3 * H * t.intermediate_size;
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, 0);
  const StageMemory& s = plan.per_stage[0];
  const int64_t shard = c.all() / 4 + c.all() % 4;
  EXPECT_EQ(item(s, "gradients").bytes,
            (c.all() - t.num_hidden_layers * layer + 2 * layer + shard) * 4);
  EXPECT_EQ(item(s, "AdamW moments").bytes, shard * 8);
  EXPECT_EQ(item(s, "master weights").bytes, shard * 4);
  EXPECT_EQ(item(s, "communication").bytes, 4 * (1000 / 4) * 4);
}

// Weight sharding (training/sharded_weights.h): the bf16 weights outside the decoder layers, two
// layers' slots and the rank's part of the layers, the largest of any rank's: at least a quarter
// of the layers and at most its shard of the optimizer's.
TEST(MemoryPlan, WeightShardingHoldsTwoLayerSlotsAndNoComputeDtypeCopyOfTheLayers) {
  const Counts c = count_parameters(tiny_recipe().model_config);
  const Recipe r =
      tiny_recipe({"parallel.data_parallel_size=4", "parallel.sharding=optimizer_grads_params"});
  const TextConfig& t = r.model_config.text;
  const int64_t H = t.hidden_size, hd = t.head_dim;
  const int64_t q = int64_t(t.num_attention_heads) * hd, kv = int64_t(t.num_key_value_heads) * hd;
  const int64_t layer = 2 * H + (q + 2 * kv) * H + 2 * hd + q * H + 3 * H * t.intermediate_size;
  const int64_t layers = t.num_hidden_layers * layer;
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, 0);
  const StageMemory& s = plan.per_stage[0];
  const int64_t shard = c.all() / 4 + c.all() % 4;
  // The layers' shard is the f32 master weights, which every gather rounds.
  EXPECT_EQ(item(s, "weights").bytes, (c.all() - layers + 2 * layer) * 2);
  EXPECT_EQ(item(s, "master weights").bytes, shard * 4);
  // The gradients are sharded as with optimizer_grads.
  EXPECT_EQ(item(s, "gradients").bytes, (c.all() - layers + 2 * layer + shard) * 4);
  EXPECT_EQ(item(s, "AdamW moments").bytes, shard * 8);
}

// Gradient sharding holds an untied embedding's and lm_head's gradients in one slot: the untied
// model's plan holds no more of them than the tied one's, beside its larger shard of the sums.
TEST(MemoryPlan, GradientShardingHoldsOneVocabularySlotForAnUntiedEmbeddingAndLmHead) {
  const Recipe r =
      tiny_recipe({"parallel.data_parallel_size=4", "parallel.sharding=optimizer_grads"});
  ModelConfig untied = r.model_config;
  ASSERT_TRUE(untied.tie_word_embeddings);
  untied.tie_word_embeddings = false;
  const int64_t vocab = int64_t(untied.text.vocab_size) * untied.text.hidden_size;
  const Counts c = count_parameters(r.model_config);
  const int64_t tied_shard = c.all() / 4 + c.all() % 4;
  const int64_t untied_shard = (c.all() + vocab) / 4 + (c.all() + vocab) % 4;
  const StageMemory tied = plan_training_memory(r, r.model_config, true, 0).per_stage[0];
  const StageMemory plan = plan_training_memory(r, untied, true, 0).per_stage[0];
  EXPECT_EQ(item(plan, "gradients").bytes - item(tied, "gradients").bytes,
            (untied_shard - tied_shard) * 4);
  EXPECT_NE(item(plan, "gradients").how.find("the embedding and lm_head in one slot"),
            std::string::npos);
  EXPECT_EQ(item(tied, "gradients").how.find("in one slot"), std::string::npos);
}

TEST(MemoryPlan, PipelineStagesHoldTheirOwnMomentsAndActivationsInFlight) {
  const Recipe r = tiny_recipe({"parallel.pipeline_parallel_size=2"});
  const Counts c = count_parameters(r.model_config);
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, 0);
  ASSERT_EQ(plan.per_stage.size(), 2u);
  const Recipe one = tiny_recipe();
  const int64_t whole_activations =
      item(plan_training_memory(one, one.model_config, true, 0).per_stage[0], "activations").bytes;
  int64_t moments = 0;
  for (const StageMemory& s : plan.per_stage) {
    EXPECT_EQ(item(s, "weights").bytes, c.all() * 2);
    moments += item(s, "AdamW moments").bytes;
  }
  // The tied embedding is on both stages' spans; the rest of the model on one of them.
  EXPECT_GE(moments, c.all() * 8);
  EXPECT_LT(item(plan.per_stage[0], "AdamW moments").bytes, c.all() * 8);
  // Stage 0 keeps two micro-batches in flight (4 per replica, 2 stages), the last one.
  const std::vector<PipelineStage> stages =
      recipe_pipeline_stages(r, r.model_config, recipe_train_limits(r, true));
  TrainLimits first = recipe_train_limits(r, true);
  first.stage = stages[0];
  const auto arena = TrainableQwen3VL::plan_arena(
      r.model_config, first, DType::bf16,
      [](int64_t rows, int64_t, int64_t vocab) { return size_t(rows * vocab * 6); });
  EXPECT_EQ(item(plan.per_stage[0], "activations").bytes, 2 * int64_t(arena.activation_bytes));
  EXPECT_LT(item(plan.per_stage[1], "activations").bytes, 2 * whole_activations);
}

TEST(MemoryPlan, ARunOverTheDeviceIsRefusedWithTheSettingsThatFit) {
  const Recipe r = tiny_recipe({"train.recompute=none"});
  const int64_t need = plan_training_memory(r, r.model_config, true, 0).peak();
  const int64_t with_full =
      plan_training_memory(tiny_recipe({"train.recompute=full"}), r.model_config, true, 0).peak();
  ASSERT_LT(with_full, need);
  const int64_t device = (need + with_full) / 2;
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, device);
  EXPECT_FALSE(plan.fits());
  const std::string refusal = memory_refusal(r, r.model_config, plan);
  EXPECT_NE(refusal.find("train.recompute=full"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("(does not fit)"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("per-GPU total: "), std::string::npos) << refusal;
  EXPECT_TRUE(plan_training_memory(r, r.model_config, true, need).fits());
  // Far too small for anything: said so, with the bigger levers.
  const MemoryPlan tiny = plan_training_memory(r, r.model_config, true, kMiB);
  EXPECT_NE(memory_refusal(r, r.model_config, tiny).find("no setting makes it fit"),
            std::string::npos);
  // Where only more GPUs fit, the smallest data-parallel count that does is named: the moments
  // shard over it. This recipe has no other setting left to change.
  const std::vector<std::string> lean{"train.recompute=full", "train.micro_batch_size=1",
                                      "train.freeze_vision_tower=true", "train.freeze_merger=true",
                                      "train.offload_activations=all"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = lean;
    all.insert(all.end(), more.begin(), more.end());
    return tiny_recipe(all);
  };
  const Recipe one_gpu = with({});
  const int64_t four_fit =
      plan_training_memory(with({"parallel.data_parallel_size=4", "optimizer.distributed=true"}),
                           r.model_config, true, 0)
          .peak();
  ASSERT_GT(
      plan_training_memory(with({"parallel.data_parallel_size=2", "optimizer.distributed=true"}),
                           r.model_config, true, 0)
          .peak(),
      four_fit);
  const std::string more = memory_refusal(
      one_gpu, r.model_config, plan_training_memory(one_gpu, r.model_config, true, four_fit));
  EXPECT_NE(more.find("with more GPUs: parallel.data_parallel_size=4 parallel.sharding=optimizer"),
            std::string::npos)
      << more;
  // Data parallel with the moments sharded: sharding the gradients too is offered where it fits
  // (a deeper model with a small vocabulary, whose layers outweigh its embedding).
  ModelConfig deep = r.model_config;
  deep.text.num_hidden_layers = 24;
  deep.text.vocab_size = 512;
  const Recipe zero1 = with({"parallel.data_parallel_size=4", "parallel.sharding=optimizer"});
  const Recipe zero2 = with({"parallel.data_parallel_size=4", "parallel.sharding=optimizer_grads"});
  const int64_t zero1_need = plan_training_memory(zero1, deep, true, 0).peak();
  const int64_t zero2_need = plan_training_memory(zero2, deep, true, 0).peak();
  ASSERT_LT(zero2_need, zero1_need);
  const std::string grads =
      memory_refusal(zero1, deep, plan_training_memory(zero1, deep, true, zero2_need));
  EXPECT_NE(grads.find("any of these fits: parallel.sharding=optimizer_grads"), std::string::npos)
      << grads;
  // The recipe key gives the device memory.
  const Recipe keyed = tiny_recipe({"train.device_memory_gib=80"});
  EXPECT_EQ(planned_device_bytes(keyed, 0), int64_t(80) << 30);
  EXPECT_EQ(planned_device_bytes(keyed, int64_t(94) << 30), int64_t(80) << 30);
  EXPECT_EQ(planned_device_bytes(r, int64_t(94) << 30), int64_t(94) << 30);
  EXPECT_THROW(tiny_recipe({"train.device_memory_gib=-1"}), Error);
}

}  // namespace
}  // namespace iris
