#include "training/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>

#include "core/backend.h"
#include "core/error.h"
#include "core/loss_workspace.h"
#include "parallel/communicator.h"
#include "parallel/shard_exchange.h"
#include "training/param_spec.h"
#include "training/train_model.h"
#include "training/train_setup.h"

namespace iris {
namespace {

constexpr int64_t kMiB = int64_t(1) << 20;
constexpr double kGiB = double(int64_t(1) << 30);

// The CUDA backend's own buffers (core/cuda/cuda_backend.cu): two cuBLASLt workspaces of 32 MiB
// (main and side stream), 16 MiB of GEMM tuning scratch, the decode kernels' 4.2 MiB and the
// training reductions' scratch (a few MiB), rounded up to 96 MiB.
constexpr int64_t kCudaBackendBuffers = 96 * kMiB;
// What a CUDA context takes before any allocation: about 500 MiB on an H100 or H200 with CUDA 12
// (module images of the kernels, cuBLASLt's handles, the context's local memory).
constexpr int64_t kCudaContext = 512 * kMiB;
// Each instantiated graph's nodes take at least one 2 MiB granule of device memory; Iris' graphs
// allocate nothing else, as their kernels read and write the model's arenas.
constexpr int64_t kGraphGranule = 2 * kMiB;
// The sharded optimizer's exchanges move at most this many elements at a time (trainer.cpp).
constexpr int64_t kShardBucketElements = int64_t(1) << 25;

std::string gib_number(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", double(bytes) / kGiB);
  return buf;
}

std::string gib(int64_t bytes) {
  return gib_number(bytes) + " GiB";
}

std::string count(int64_t n) {
  char buf[32];
  if (n >= 1000000000)
    std::snprintf(buf, sizeof(buf), "%.3f B", double(n) / 1e9);
  else if (n >= 1000000)
    std::snprintf(buf, sizeof(buf), "%.1f M", double(n) / 1e6);
  else
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(n));
  return buf;
}

// The graph sets a model captures per bucket shape, an upper bound: every text bucket with no
// image and with each vision bucket.
int64_t graph_sets(const Recipe& r, const TrainLimits& limits, const PipelineStage& stage,
                   const ModelConfig& cfg) {
  const GraphImpl decoder = r.cuda_graph.language.impl;
  const bool vision = r.cuda_graph.vision.impl == VisionGraphImpl::local && stage.has_vision;
  if (decoder == GraphImpl::none && !vision) return 0;
  const auto text_shapes = static_cast<int64_t>(std::max<size_t>(1, limits.text_buckets.size()));
  const auto vision_shapes = static_cast<int64_t>(limits.vision_buckets.size());
  const int64_t shapes = text_shapes * (vision_shapes + 1);
  if (decoder == GraphImpl::full_iteration) return shapes;
  int64_t per_shape = 0;
  if (decoder == GraphImpl::local) {
    const int64_t halves = r.cuda_graph.language.modules.empty()
                               ? 1
                               : static_cast<int64_t>(r.cuda_graph.language.modules.size());
    per_shape += 2 * halves * stage.n_layers();  // forward and backward
  }
  int64_t sets = shapes * per_shape;
  if (vision) {
    const int64_t halves =
        r.cuda_graph.vision.modules.empty()
            ? 1
            : static_cast<int64_t>(r.cuda_graph.vision.modules.size()) * cfg.vision.depth;
    sets += 2 * halves * vision_shapes;
  }
  return sets;
}

}  // namespace

int64_t StageMemory::total() const {
  int64_t t = 0;
  for (const MemoryItem& i : items)
    if (!i.on_host) t += i.bytes;
  return t;
}

int64_t MemoryPlan::peak() const {
  int64_t p = 0;
  for (const StageMemory& s : per_stage) p = std::max(p, s.total());
  return p;
}

int64_t planned_device_bytes(const Recipe& r, int64_t device_total) {
  if (r.train.device_memory_gib > 0) return static_cast<int64_t>(r.train.device_memory_gib * kGiB);
  return device_total;
}

MemoryPlan plan_training_memory(const Recipe& r, const ModelConfig& cfg, bool on_gpu,
                                int64_t device_bytes) {
  MemoryPlan plan;
  plan.on_gpu = on_gpu;
  plan.stages = static_cast<int>(r.parallel.pipeline_parallel_size);
  plan.replicas = static_cast<int>(r.parallel.data_parallel_size);
  plan.device_bytes = device_bytes;
  const int replicas = plan.replicas;
  const FreezeSpec frozen = recipe_frozen_parts(r);
  const bool any_frozen = frozen.vision_tower || frozen.merger || frozen.language_model;
  const DType compute = on_gpu ? DType::bf16 : DType::f32;
  const int64_t weight_bytes = on_gpu ? 2 : 4;
  const ParamSpecs specs(cfg, frozen, compute);
  const int64_t all = specs.parameters(), trainable = specs.trainable_parameters();
  const bool sharded = r.optimizer.distributed && replicas > 1;
  const bool sharded_weights = sharded && r.parallel.sharding == "optimizer_grads_params";
  const bool sharded_grads =
      sharded && (r.parallel.sharding == "optimizer_grads" || sharded_weights);
  // The decoder layers' elements (trainable: gradient sharding slots those only; weight sharding
  // refuses frozen ones), and the longest layer, which sizes a slot.
  int64_t layer_elements = 0, slot_elements = 0;
  {
    std::vector<int64_t> per_layer(static_cast<size_t>(cfg.text.num_hidden_layers), 0);
    for (const ParamSpec& p : specs.all())
      if (const int l = decoder_layer(p.hf_name); p.trainable && l >= 0) {
        per_layer[static_cast<size_t>(l)] += p.numel();
        layer_elements += p.numel();
      }
    if (!per_layer.empty()) slot_elements = *std::max_element(per_layer.begin(), per_layer.end());
  }

  TrainLimits limits = recipe_train_limits(r, on_gpu);
  const std::vector<PipelineStage> stages = recipe_pipeline_stages(r, cfg, limits);
  const TrainableQwen3VL::LossWorkspaceBytes loss_workspace =
      on_gpu ? TrainableQwen3VL::LossWorkspaceBytes([](int64_t rows, int64_t, int64_t vocab) {
        return cuda_lm_head_loss_workspace_bytes(rows, vocab);
      })
             : TrainableQwen3VL::LossWorkspaceBytes(
                   [cpu = std::shared_ptr<Backend>(make_cpu_backend())](
                       int64_t rows, int64_t hidden, int64_t vocab) {
                     return cpu->lm_head_loss_workspace_bytes(rows, hidden, vocab);
                   });

  for (size_t s = 0; s < stages.size(); ++s) {
    const PipelineStage& st = stages[s];
    const bool pipelined = stages.size() > 1;
    StageMemory sm;
    sm.stage = static_cast<int>(s);
    // Rank = stage x replicas + replica (training/data_parallel.h).
    const size_t first_rank = s * size_t(replicas), last_rank = first_rank + replicas - 1;
    sm.ranks = pipelined ? str_cat(st.describe(), replicas > 1 ? ", ranks " : ", rank ", first_rank,
                                   replicas > 1 ? str_cat("-", last_rank) : std::string())
                         : (replicas > 1 ? str_cat("each of ", replicas, " data-parallel ranks")
                                         : std::string("the one GPU"));
    auto holds = [&](const std::string& name) {
      return !pipelined || stage_holds(st, cfg.tie_word_embeddings, name);
    };
    auto add = [&sm](std::string name, int64_t bytes, std::string how) {
      sm.items.push_back({std::move(name), bytes, std::move(how)});
    };
    // The moments: the trainable tensors from the stage's first to its last in the flat layout
    // (a pipeline stage's span), sharded over the replicas with optimizer.distributed; the last
    // rank's shard takes the remainder.
    int64_t span = 0;
    {
      int64_t first = -1, last = -1;
      const auto& all_specs = specs.all();
      for (size_t i = 0; i < all_specs.size(); ++i)
        if (all_specs[i].trainable && holds(all_specs[i].hf_name)) {
          if (first < 0) first = static_cast<int64_t>(i);
          last = static_cast<int64_t>(i);
        }
      for (int64_t i = first; i >= 0 && i <= last; ++i)
        if (all_specs[size_t(i)].trainable) span += all_specs[size_t(i)].numel();
    }
    const int64_t moment_elements = sharded ? span / replicas + span % replicas : span;
    const int64_t layers = layer_elements, slot = slot_elements;
    if (sharded_weights) {
      // training/sharded_weights.h: the tensors outside the decoder layers whole and two layers'
      // slots; a rank's part of the layers is its f32 master weights, rounded at each gather.
      add("weights", (all - layers + 2 * slot) * weight_bytes,
          str_cat(count(all - layers), " outside the decoder layers + 2 layer slots of ",
                  count(slot), ", x ", weight_bytes, " B (", on_gpu ? "bf16" : "f32",
                  "; parallel.sharding=optimizer_grads_params: the layers' shard is the master "
                  "weights)"));
    } else {
      add("weights", all * weight_bytes,
          str_cat(count(all), " parameters x ", weight_bytes, " B (", on_gpu ? "bf16" : "f32",
                  "); every frozen part keeps these and nothing else",
                  pipelined ? "; every stage holds the whole model's" : ""));
    }
    if (sharded_grads) {
      // training/sharded_gradients.h: the tensors outside the decoder layers whole, two layers'
      // slots and this rank's shard of the sums; an untied embedding and lm_head, both trained,
      // share one slot.
      int64_t embed = 0, head = 0;
      for (const ParamSpec& p : specs.all()) {
        if (!p.trainable) continue;
        if (p.hf_name == "lm_head.weight") head = p.numel();
        if (p.hf_name.ends_with("embed_tokens.weight")) embed = p.numel();
      }
      const int64_t shared = cfg.tie_word_embeddings || embed == 0 || head == 0
                                 ? 0
                                 : embed + head - std::max(embed, head);
      const int64_t held = trainable - layers - shared + 2 * slot + moment_elements;
      add("gradients", held * 4,
          str_cat(count(trainable - layers - shared), " outside the decoder layers",
                  shared > 0 ? " (the embedding and lm_head in one slot)" : "",
                  " + 2 layer slots of ", count(slot), " + this rank's 1/", replicas,
                  " shard of the sums ", count(moment_elements),
                  ", x 4 B (f32; parallel.sharding=", r.parallel.sharding, ")"));
    } else {
      add("gradients", trainable * 4,
          str_cat(count(trainable), " trainable parameters x 4 B (f32)",
                  pipelined ? "; one buffer for all micro-batches in flight" : ""));
    }
    // The f32 master weights: sharded, the optimizer's shard of the span, as the moments; else
    // every trainable parameter (on the CPU with nothing frozen, the weights themselves).
    const bool own_master = on_gpu || any_frozen;
    if (sharded)
      add("master weights", moment_elements * 4,
          str_cat(count(moment_elements), " elements x 4 B (f32), the optimizer's shard, 1/",
                  replicas, " per rank (parallel.sharding=", r.parallel.sharding, ")"));
    else
      add("master weights", own_master ? trainable * 4 : 0,
          own_master ? str_cat(count(trainable), " trainable parameters x 4 B (f32)")
                     : std::string("none: on the CPU the f32 weights are the master weights"));
    add("AdamW moments", moment_elements * 8,
        str_cat(count(moment_elements), " elements x 2 x 4 B",
                pipelined ? str_cat(" (the stage's span of ", count(span), ")") : "",
                sharded        ? str_cat(", 1/", replicas,
                                         " per rank (parallel.sharding=", r.parallel.sharding, ")")
                : replicas > 1 ? ", whole on every rank (parallel.sharding=none)"
                               : ""));

    TrainLimits stage_limits = limits;
    if (pipelined) stage_limits.stage = st;
    const TrainableQwen3VL::ArenaPlan arena =
        TrainableQwen3VL::plan_arena(cfg, stage_limits, compute, loss_workspace);
    const int models = recipe_models_per_rank(r, static_cast<int>(s));
    add("activations", static_cast<int64_t>(arena.activation_bytes) * models,
        str_cat(gib(int64_t(arena.activation_bytes)), " per micro-batch (train.recompute ",
                r.train.recompute, ", ", limits.max_seq_len, " tokens, ", limits.max_patches,
                " patches)", models > 1 ? str_cat(" x ", models, " micro-batches in flight") : ""));
    const std::vector<std::string> offloaded = recipe_offloaded_activations(r);
    std::string offloaded_names;
    for (const std::string& n : offloaded)
      offloaded_names += (offloaded_names.empty() ? "" : ", ") + n;
    sm.items.push_back(
        {"offloaded to host", static_cast<int64_t>(arena.offloaded_bytes) * models,
         offloaded.empty()
             ? std::string("none (train.offload_activations); pinned host memory, not the GPU's")
             : str_cat("pinned host memory, not counted in the GPU's total: every layer's ",
                       offloaded_names,
                       " (train.offload_activations); the GPU keeps two "
                       "layers' of each"),
         true});
    int64_t workspace = static_cast<int64_t>(arena.arena_bytes - arena.activation_bytes) * models;
    std::string workspace_how =
        str_cat("inputs, loss chunk and backward scratch of the planned arena",
                models > 1 ? str_cat(" x ", models) : "");
    const bool full_iteration = r.cuda_graph.language.impl == GraphImpl::full_iteration;
    if (full_iteration && !pipelined) {
      const int64_t micro_batches = r.train.global_batch_size / r.train.micro_batch_size;
      const int64_t slots = (micro_batches + replicas - 1) / replicas;
      if (slots > 1) {
        workspace += (slots - 1) * static_cast<int64_t>(arena.input_bytes);
        workspace_how += str_cat(", ", slots - 1, " more input slots of the step graph");
      }
    }
    if (on_gpu) {
      workspace += kCudaBackendBuffers + kCudaContext;
      workspace_how += str_cat(", CUDA context and backend buffers (estimate ",
                               (kCudaBackendBuffers + kCudaContext) / kMiB, " MiB)");
    }
    add("workspace", workspace, workspace_how);
    const int64_t graphs = on_gpu ? graph_sets(r, limits, st, cfg) * models : 0;
    add("graph pools", graphs * kGraphGranule,
        graphs > 0 ? str_cat("estimate: at most ", graphs, " graphs x ", kGraphGranule / kMiB,
                             " MiB (one allocation granule of nodes each; the graphs run on the "
                             "arenas and allocate nothing else)")
                   : std::string("no graphs"));

    int64_t comm = 0;
    std::string comm_how;
    if (replicas > 1 && !sharded) {
      // GradReducer: one bucket's all-reduce scratch.
      const int64_t held = pipelined ? specs.trainable_parameters(holds) : trainable;
      const int64_t step =
          std::max<int64_t>(replicas, r.parallel.grad_bucket_elements / replicas * replicas);
      comm += all_reduce_scratch_elements(std::min(step, held), replicas) * 4;
      comm_how = "gradient all-reduce scratch of one bucket";
    }
    if (sharded_grads) {
      // ShardSum: one chunk's pieces from every rank.
      // A rank's piece of a chunk lies in its shard.
      const int64_t chunk = std::max<int64_t>(1, r.parallel.grad_bucket_elements / replicas);
      comm += replicas * std::max<int64_t>(1, std::min(chunk, moment_elements)) * 4;
      comm_how = "gradient shards' exchange scratch of one bucket";
    } else if (sharded) {
      // ShardExchange: the reduce-scatter's receive pieces and, with more than one bucket, its
      // send staging.
      const int64_t shard = span / replicas;
      const int64_t chunk = std::min(shard, std::max<int64_t>(1, kShardBucketElements / replicas));
      const int64_t buckets = chunk > 0 ? (shard + chunk - 1) / chunk : 0;
      const int64_t recv = std::max(replicas * chunk, span % replicas > 0 ? replicas : int64_t(0));
      const int64_t send = buckets > 1 ? replicas * chunk : 0;
      comm += (recv + send) * 4;
      comm_how = "sharded optimizer's reduce-scatter and gather scratch";
    }
    if (pipelined && cfg.tie_word_embeddings && !frozen.language_model &&
        (s == 0 || s + 1 == stages.size())) {
      const int64_t embed = int64_t(cfg.text.vocab_size) * cfg.text.hidden_size;
      comm += std::max(embed, all_reduce_scratch_elements(embed, replicas)) * 4;
      comm_how += str_cat(comm_how.empty() ? "" : ", ", "tied-embedding gradient exchange");
    }
    if (comm_how.empty())
      comm_how = pipelined ? "none: no replica shares this stage, and what crosses the stage "
                             "boundary lives in the activation arena"
                           : "none (one rank)";
    else if (on_gpu)
      comm_how += "; NCCL's own channel buffers are not counted";
    add("communication", comm, comm_how);
    plan.per_stage.push_back(std::move(sm));
  }
  return plan;
}

std::string MemoryPlan::describe() const {
  std::string out = str_cat("memory plan per ", on_gpu ? "GPU" : "process (CPU)", ": ", stages,
                            " pipeline stage(s) x ", replicas, " data-parallel replica(s)\n");
  for (const StageMemory& s : per_stage) {
    out += str_cat("  ", s.ranks, ":\n");
    for (const MemoryItem& i : s.items) {
      char line[64];
      std::snprintf(line, sizeof(line), "    %-18s %10s", i.name.c_str(), gib(i.bytes).c_str());
      out += str_cat(line, "  ", i.how, "\n");
    }
    char line[64];
    std::snprintf(line, sizeof(line), "    %-18s %10s", "total", gib(s.total()).c_str());
    out += str_cat(line, "\n");
  }
  out += str_cat(on_gpu ? "per-GPU total: " : "per-process total: ", gib(peak()), " of ",
                 device_bytes > 0 ? gib(device_bytes)
                                  : std::string("? GiB (no GPU here: give --device-memory GiB or "
                                                "train.device_memory_gib)"),
                 device_bytes > 0 && !fits() ? " (does not fit)" : "", "\n");
  return out;
}

std::string memory_refusal(const Recipe& r, const ModelConfig& cfg, const MemoryPlan& plan) {
  // Each candidate is planned as the recipe with that change; those that fit alone are named,
  // else all of them together if that fits.
  struct Change {
    std::string setting;
    std::function<bool(Recipe&)> apply;  // false: not applicable to this recipe
    bool changes_what_trains = false;    // freezing: offered last
  };
  const std::vector<Change> changes{
      {"train.recompute=full",
       [](Recipe& x) {
         if (x.train.recompute == "full") return false;
         x.train.recompute = "full";
         // Full recompute keeps each layer's input only: an offload list keeps that, if named.
         std::vector<std::string>& o = x.train.offload_activations;
         if (o != std::vector<std::string>{"all"}) {
           const bool input = std::find(o.begin(), o.end(), "x_in") != o.end();
           o = {input ? "x_in" : "none"};
         }
         return true;
       }},
      {"train.offload_activations=all",
       [&cfg](Recipe& x) {
         if (x.train.offload_activations == std::vector<std::string>{"all"} ||
             x.cuda_graph.language.impl == GraphImpl::full_iteration || cfg.text.any_sparse_layer())
           return false;
         x.train.offload_activations = {"all"};
         return true;
       }},
      {"parallel.sharding=optimizer",
       [](Recipe& x) {
         if (x.optimizer.distributed || x.parallel.data_parallel_size < 2) return false;
         x.optimizer.distributed = true;
         x.parallel.sharding = "optimizer";
         return true;
       }},
      {"parallel.sharding=optimizer_grads",
       [](Recipe& x) {
         // Gradient sharding runs without full_iteration graphs only.
         if (x.parallel.sharding == "optimizer_grads" || x.parallel.data_parallel_size < 2 ||
             x.cuda_graph.language.impl == GraphImpl::full_iteration)
           return false;
         x.optimizer.distributed = true;
         x.parallel.sharding = "optimizer_grads";
         return true;
       }},
      {"parallel.sharding=optimizer_grads_params",
       [](Recipe& x) {
         // Weight sharding also needs the layers' weights trainable.
         if (x.parallel.sharding == "optimizer_grads_params" || x.parallel.data_parallel_size < 2 ||
             x.cuda_graph.language.impl == GraphImpl::full_iteration ||
             x.train.freeze_language_model || x.peft.lora())
           return false;
         x.optimizer.distributed = true;
         x.parallel.sharding = "optimizer_grads_params";
         return true;
       }},
      {"train.micro_batch_size=1",
       [](Recipe& x) {
         if (x.train.micro_batch_size == 1) return false;
         x.train.micro_batch_size = 1;
         return true;
       }},
      {"train.freeze_vision_tower=true train.freeze_merger=true",
       [](Recipe& x) {
         if (x.train.freeze_vision_tower && x.train.freeze_merger) return false;
         if (x.train.freeze_language_model) return false;  // nothing left to train
         x.train.freeze_vision_tower = x.train.freeze_merger = true;
         return true;
       },
       true},
  };
  auto peak_with = [&](Recipe x) {
    return plan_training_memory(x, cfg, plan.on_gpu, plan.device_bytes).peak();
  };
  std::vector<std::string> alone;
  // Every change together; and those that leave what trains as it is (with more GPUs, these are
  // offered first).
  Recipe together = r, same_training = r;
  std::vector<std::string> together_settings, same_training_settings;
  // The settings, space-separated; but_sharding: without a parallel.sharding one, which the
  // caller replaces.
  auto joined = [](const std::vector<std::string>& settings, bool but_sharding = false) {
    std::string out;
    for (const std::string& s : settings)
      if (!but_sharding || !s.starts_with("parallel.sharding="))
        out += str_cat(out.empty() ? "" : " ", s);
    return out;
  };
  for (const Change& c : changes) {
    Recipe x = r;
    if (!c.apply(x)) continue;
    c.apply(together);
    together_settings.push_back(c.setting);
    if (!c.changes_what_trains) {
      c.apply(same_training);
      same_training_settings.push_back(c.setting);
    }
    const int64_t p = peak_with(x);
    if (p <= plan.device_bytes) alone.push_back(str_cat(c.setting, " (", gib(p), ")"));
  }
  std::string advice;
  if (!alone.empty()) {
    advice = "any of these fits: ";
    for (size_t i = 0; i < alone.size(); ++i) advice += str_cat(i ? "; " : "", alone[i]);
  } else if (!together_settings.empty() && peak_with(together) <= plan.device_bytes) {
    advice =
        str_cat("together these fit (", gib(peak_with(together)), "): ", joined(together_settings));
  } else {
    // More GPUs: data-parallel ranks with the moments sharded over them, with the changes above;
    // the smallest count that fits.
    std::string more_gpus;
    for (const auto& [base, settings] :
         {std::pair{&same_training, &same_training_settings}, {&together, &together_settings}})
      for (int64_t n = std::max<int64_t>(2, r.parallel.data_parallel_size * 2);
           n <= 64 && more_gpus.empty(); n *= 2) {
        // Gradient sharding runs without full_iteration graphs only.
        const bool grads_too = r.cuda_graph.language.impl != GraphImpl::full_iteration;
        const bool params_too =
            grads_too && !base->train.freeze_language_model && !base->peft.lora();
        for (const char* sharding : {"optimizer", "optimizer_grads", "optimizer_grads_params"}) {
          const std::string mode = sharding;
          if (!more_gpus.empty() || (!grads_too && mode == "optimizer_grads") ||
              (!params_too && mode == "optimizer_grads_params"))
            continue;
          Recipe x = *base;
          x.parallel.data_parallel_size = n;
          x.optimizer.distributed = true;
          x.parallel.sharding = sharding;
          const int64_t p = peak_with(x);
          if (p > plan.device_bytes) continue;
          const std::string others = joined(*settings, /*but_sharding=*/true);
          more_gpus = str_cat(others, others.empty() ? "" : " ", "parallel.data_parallel_size=", n,
                              " parallel.sharding=", sharding, " (", gib(p), " per GPU)");
        }
      }
    // What every GPU holds whole today whatever the layout: the weights and gradients of the
    // model.
    int64_t whole = 0;
    for (const MemoryItem& i : plan.per_stage[0].items)
      if (i.name == "weights" || i.name == "gradients") whole += i.bytes;
    advice =
        !more_gpus.empty()
            ? "no setting of this layout makes it fit; with more GPUs: " + more_gpus
            : str_cat("no setting makes it fit: the weights and gradients alone take ", gib(whole),
                      " on every GPU, which no data-parallel or pipeline layout divides; "
                      "freeze parts (train.freeze_vision_tower, train.freeze_merger, "
                      "train.freeze_language_model), shorten train.seq_length or use GPUs "
                      "with more memory");
  }
  return str_cat(plan.describe(), "the plan needs ", gib(plan.peak()), " per GPU but ",
                 r.train.device_memory_gib > 0
                     ? "train.device_memory_gib (or --device-memory) allows "
                     : "the GPU has ",
                 gib(plan.device_bytes), "; ", advice);
}

}  // namespace iris
