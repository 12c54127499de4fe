#include "training/recipe.h"
#include "core/text_distance.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>
#include <variant>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "training/checkpoint.h"
#include "training/lr_schedule.h"
#include "training/pipeline_costs.h"
#include "training/pipeline_parallel.h"
#include "training/train_model.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using ImageSizes = std::vector<std::array<int, 2>>;
using FieldRef =
    std::variant<bool*, int*, int64_t*, double*, std::string*, std::vector<std::string>*,
                 std::vector<double>*, ImageSizes*, DataConfig::OnBad*>;

struct Field {
  std::string key;
  FieldRef ref;
  std::string doc;
  std::vector<std::string> choices;  // for strings with a fixed set of values
  bool path = false;                 // made absolute in the resolved config
};

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> s{"model",      "data",     "train",      "peft",
                                          "optimizer",  "schedule", "checkpoint", "logging",
                                          "cuda_graph", "parallel"};
  return s;
}

// The typed schema, bound to the fields of `r`; a default-constructed Recipe holds the defaults.
// model.config and cuda_graph.* are handled apart: the first is a path or a map, the second
// belongs to core/graph_config.
std::vector<Field> fields(Recipe& r) {
  ModelRecipe& m = r.model;
  DataRecipe& d = r.data;
  TrainRecipe& t = r.train;
  OptimizerRecipe& o = r.optimizer;
  ScheduleRecipe& s = r.schedule;
  CheckpointRecipe& c = r.checkpoint;
  LoggingRecipe& l = r.logging;
  ParallelRecipe& p = r.parallel;
  PeftRecipe& pe = r.peft;
  return {
      {"model.init",
       &m.init,
       "random: initialise from model.config with model.init_seed; pretrained: load "
       "model.hf_dir",
       {"random", "pretrained"}},
      {"model.hf_dir",
       &m.hf_dir,
       "Hugging Face checkpoint directory (config.json + safetensors) to start from (in a recipe "
       "file, relative to it)",
       {},
       true},
      {"model.tokenizer",
       &m.tokenizer,
       "tokenizer.json (in a recipe file, relative to it); empty: <model.hf_dir>/tokenizer.json",
       {},
       true},
      {"model.init_seed", &m.init_seed, "seed of the random initialisation"},
      {"model.moe_expert_capacity_factor", &m.moe_expert_capacity_factor,
       "MoE models: in training each expert takes at most ceil(tokens x experts_per_token / "
       "experts x factor) slots of a micro-batch (tokens: the micro-batch's rows, padding "
       "included) and drops the rest as Megatron does, counted in the log and metrics.jsonl; "
       "0: dropless, as HF (iris generate never drops)"},
      {"model.moe_pad_expert_input_to_capacity", &m.moe_pad_expert_input_to_capacity,
       "with model.moe_expert_capacity_factor: every expert computes exactly its capacity's rows "
       "(zeros past its tokens), the static shapes the 'moe' graph module needs"},
      {"model.moe_token_drop_policy",
       &m.moe_token_drop_policy,
       "with model.moe_expert_capacity_factor, which slots over an expert's capacity drop: "
       "probs (those of the lowest routing weights) or position (the micro-batch's last)",
       {"probs", "position"}},
      {"data.train_files",
       &d.config.train_files,
       "training JSONL files: HF messages, ms-swift/LLaMA-Factory, ShareGPT or LLaVA lines "
       "(docs/training-data.md); in a recipe file, relative to it; on the command line, to the "
       "working directory",
       {},
       true},
      {"data.eval_files", &d.eval_files, "held-out JSONL files for train.eval_interval", {}, true},
      {"data.image_root",
       &d.config.image_root,
       "base of relative image paths; empty: each JSONL file's directory",
       {},
       true},
      {"data.shuffle", &d.config.shuffle,
       "visit lines in a seeded permutation per epoch (false: file order)"},
      {"data.num_workers", &d.config.num_workers,
       "threads decoding images ahead of the step; 0 decodes inside the step"},
      {"data.prefetch", &d.config.prefetch, "samples prepared ahead of the step"},
      {"data.on_bad_sample",
       &d.config.on_bad_sample,
       "skip: skip lines that cannot be trained whole (each reported with its file, line and "
       "reason, and counted by reason at the end); error: stop at the first one",
       {"skip", "error"}},
      {"data.min_pixels", &d.min_pixels,
       "smallest image area after resizing; 0: the preprocessor config's value"},
      {"data.max_pixels", &d.max_pixels,
       "largest image area after resizing; 0: the preprocessor config's value"},
      {"data.max_image_pixels", &d.config.max_image_pixels,
       "images with more pixels (read from the file's header) are bad samples, refused before "
       "decoding"},
      {"data.video_fps", &d.config.video_fps,
       "video frames kept a second (0: every frame); -1: the model's video processor's"},
      {"data.video_max_frames", &d.config.video_max_frames,
       "most frames kept of a video; 0: the model's video processor's"},
      {"data.chat_template",
       &d.chat_template,
       "Jinja chat template file (or a JSON file with \"chat_template\") for the conversations; "
       "empty: the model's own (model.hf_dir's, else the one beside model.tokenizer)",
       {},
       true},
      {"data.enable_thinking",
       &d.enable_thinking,
       "enable_thinking passed to the chat template; auto: not passed (the template's default)",
       {"auto", "true", "false"}},
      {"data.mock", &d.config.mock,
       "generate random samples instead of reading files (performance runs)"},
      {"data.mock_image_sizes", &d.config.mock_image_sizes,
       "mock mode: one random image per [width, height] entry in every sample"},
      {"data.mock_text_tokens", &d.config.mock_text_tokens,
       "mock mode: text tokens per sample (half user, half assistant)"},
      {"data.mock_samples", &d.config.mock_samples, "mock mode: samples per epoch"},
      {"train.micro_batch_size", &t.micro_batch_size, "samples per forward/backward call group"},
      {"train.global_batch_size", &t.global_batch_size,
       "samples per optimizer step = micro_batch_size x accumulation steps x "
       "data_parallel_size"},
      {"train.train_iters", &t.train_iters, "optimizer steps of the whole run"},
      {"train.seq_length", &t.seq_length,
       "longest sample in tokens (image pads included); longer samples are skipped"},
      {"train.seed", &t.seed, "seed of the data order"},
      {"train.freeze_vision_tower", &t.freeze_vision_tower,
       "keep the vision blocks and patch embedding fixed"},
      {"train.freeze_merger", &t.freeze_merger,
       "keep the patch merger and DeepStack mergers fixed"},
      {"train.freeze_language_model", &t.freeze_language_model, "keep the text decoder fixed"},
      {"train.eval_interval", &t.eval_interval,
       "steps between evaluations on data.eval_files; 0: never"},
      {"train.eval_iters", &t.eval_iters, "global batches per evaluation"},
      {"train.max_vision_patches", &t.max_vision_patches,
       "vision patches of one sample the activation memory is planned for (samples above it are "
       "skipped); 0: mock data's exact count, else seq_length x 4 (the most a sample can hold)"},
      {"train.offload_activations", &t.offload_activations,
       "decoder-layer activations kept in pinned host memory between the forward and the "
       "backward instead of the GPU's: none, all, or a list of names the recompute mode keeps "
       "per layer (none: x_in, rms1, rstd1, qkv_lin, qk_rstd, qkv, attn, lse, x_mid, rms2, "
       "rstd2, gate_up, act; selective: x_in, rstd1, qkv_lin, qk_rstd, attn, lse, x_mid, rstd2, "
       "gate_up; full: x_in)"},
      {"train.recompute",
       &t.recompute,
       "what the backward recomputes instead of keeping: none, selective (norm outputs, "
       "normed q/k/v and MLP activations: ~40% less activation memory for elementwise work) or "
       "full (keep each layer's input only: most memory saved, a third more compute)",
       {"none", "selective", "full"}},
      {"train.device",
       &t.device,
       "where training runs: cuda (bf16 with fp32 master weights), cpu (fp32), or auto (cuda "
       "when a GPU is present)",
       {"auto", "cpu", "cuda"}},
      {"train.device_memory_gib", &t.device_memory_gib,
       "GiB of memory per GPU the run's memory plan must fit (iris train --dry-run prints the "
       "plan; a run whose plan exceeds it is refused before anything is allocated); 0: the GPU's "
       "own memory"},
      {"peft.type",
       &pe.type,
       "none: train the unfrozen parts in full; lora: freeze the whole base model (no f32 state "
       "for it) and train low-rank adapters on peft.target_modules",
       {"none", "lora"}},
      {"peft.rank", &pe.rank, "LoRA rank r (PEFT's r)"},
      {"peft.alpha", &pe.alpha, "LoRA alpha: the adapters' output is scaled by alpha / rank"},
      {"peft.dropout", &pe.dropout,
       "dropout on each adapter's input in training (PEFT's lora_dropout): its masks follow "
       "train.seed, the step and the micro-batch, so a resumed run repeats them"},
      {"peft.use_rslora", &pe.use_rslora, "scale by alpha / sqrt(rank) (rsLoRA)"},
      {"peft.target_modules", &pe.target_modules,
       "modules that get adapters: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
       "(language model) and attn.qkv, attn.proj (vision blocks)"},
      {"peft.modules_to_save", &pe.modules_to_save,
       "modules trained in full beside the adapters, named as PEFT names them (merger, lm_head, "
       "embed_tokens, or a module path)"},
      {"optimizer.lr", &o.lr, "peak learning rate"},
      {"optimizer.min_lr", &o.min_lr, "learning rate at the end of the cosine decay"},
      {"optimizer.vision_lr", &o.vision_lr,
       "peak learning rate of the vision blocks and patch embedding; 0: optimizer.lr"},
      {"optimizer.merger_lr", &o.merger_lr,
       "peak learning rate of the patch merger and DeepStack mergers; 0: optimizer.lr"},
      {"optimizer.betas", &o.betas, "AdamW [beta1, beta2]"},
      {"optimizer.eps", &o.eps, "AdamW epsilon"},
      {"optimizer.weight_decay", &o.weight_decay, "decoupled weight decay"},
      {"optimizer.clip_grad", &o.clip_grad, "clip the global gradient L2 norm to this; 0: off"},
      {"optimizer.distributed", &o.distributed,
       "shard the AdamW moments and f32 master weights over the data-parallel ranks (ZeRO-1; "
       "the same as parallel.sharding=optimizer)"},
      {"schedule.kind", &s.kind, "learning-rate schedule after warmup", {"constant", "cosine"}},
      {"schedule.warmup_iters", &s.warmup_iters, "linear warmup steps from 0 to optimizer.lr"},
      {"schedule.decay_iters", &s.decay_iters,
       "steps over which the cosine decays to optimizer.min_lr; 0: train.train_iters"},
      {"schedule.override_on_resume", &s.override_on_resume,
       "resume with this recipe's schedule where it differs from the checkpoint's (optimizer.lr, "
       "min_lr, vision_lr, merger_lr, weight_decay, schedule.kind, warmup_iters, decay_iters, or "
       "train.train_iters where it ends the cosine); false: such a resume is refused, naming "
       "the keys"},
      {"checkpoint.dir",
       &c.dir,
       "run directory (checkpoints, metrics, plot, resolved config), relative to the working "
       "directory; empty: runs/<recipe name>",
       {},
       true},
      {"checkpoint.save_interval", &c.save_interval,
       "steps between checkpoints; 0: none (SIGTERM or Ctrl-C still saves one before stopping)"},
      {"checkpoint.save_final", &c.save_final, "save a checkpoint after the last step"},
      {"checkpoint.keep_last", &c.keep_last,
       "checkpoints of this run (and of the run it resumed) kept on disk; 0: all"},
      {"checkpoint.resume", &c.resume,
       "auto: continue from the newest complete checkpoint in <dir> if there is one; never: "
       "refuse a directory that holds "
       "checkpoints; or the path of a step_NNNNNNN directory to start from (until <dir> has "
       "checkpoints of its own, which a restart then continues)"},
      {"logging.log_interval", &l.log_interval, "steps between log lines and metrics records"},
      {"logging.host_probe_steps", &l.host_probe_steps,
       "the run's last N steps are each queued while the GPU is held (after a synchronisation), "
       "so that their host enqueue time is the host's own work, not time blocked behind a busy "
       "device; reported apart from the steady state (run_summary.json host_probe, report.txt); "
       "0: off"},
      {"logging.op_profile_step", &l.op_profile_step,
       "the iteration to run op by op and log where its device time goes by op family, each "
       "against its floor (as iris bench --train --profile); that step runs slower; needs graphs "
       "off; 0: none"},
      {"logging.metrics_file", &l.metrics_file,
       "JSONL metrics, a file inside the run directory (a relative path without '..'); empty: off"},
      {"logging.plot", &l.plot,
       "SVG of loss and learning rate, a file inside the run directory (a relative path without "
       "'..'); empty: off"},
      {"logging.progress",
       &l.progress,
       "progress bar with ETA between log lines: auto (when stdout is a terminal that no "
       "launcher gave the process: not under mpirun or srun), on, or off",
       {"auto", "on", "off"}},
      {"parallel.tensor_parallel_size", &p.tensor_parallel_size, "tensor-parallel ranks"},
      {"parallel.pipeline_parallel_size", &p.pipeline_parallel_size,
       "pipeline stages (processes = pipeline_parallel_size x data_parallel_size)"},
      {"parallel.pipeline_layers", &p.pipeline_layers,
       "decoder layers per pipeline stage, e.g. [10, 18]; empty: balanced by training FLOPs "
       "(the vision encoder on stage 0, the lm_head on the last)"},
      {"parallel.pipeline_costs",
       &p.pipeline_costs,
       "pipeline_costs.json of a run with logging.op_profile_step (written in its run "
       "directory): the automatic split balances its measured times instead of training FLOPs; "
       "empty: FLOPs",
       {},
       true},
      {"parallel.data_parallel_size", &p.data_parallel_size,
       "data-parallel processes: the launcher's process count (mpirun -np N, srun) divided by "
       "pipeline_parallel_size"},
      {"parallel.timeout_seconds", &p.timeout_seconds,
       "seconds a rank waits for the others in one exchange before the whole job is aborted"},
      {"parallel.overlap_grad_reduce", &p.overlap_grad_reduce,
       "start each gradient bucket's fixed-order all-reduce during the backward of the step's "
       "last micro-batch, as soon as the bucket's gradients are final (eager and local graphs; "
       "with full_iteration graphs it runs after the step); the same bits either way"},
      {"parallel.grad_bucket_elements", &p.grad_bucket_elements,
       "f32 elements per gradient all-reduce bucket (the scratch is one bucket)"},
      {"parallel.sharding",
       &p.sharding,
       "what the data-parallel ranks shard (Megatron-FSDP's names): none; optimizer (ZeRO-1: "
       "each rank keeps and updates 1/data_parallel_size of the AdamW moments and f32 master "
       "weights, the same losses as unsharded); optimizer_grads (ZeRO-2: also the f32 "
       "gradients, each decoder layer's summed into its owners' shards as the backward writes "
       "it); optimizer_grads_params (ZeRO-3, FSDP: also the bf16 weights of the decoder "
       "layers, each gathered into one of two slots before its forward and its backward)",
       {"none", "optimizer", "optimizer_grads", "optimizer_grads_params"}},
  };
}

constexpr const char* kModelConfigDoc =
    "config.json for random initialisation (relative to the recipe file), or an inline map of its "
    "fields; with model.init=pretrained, an optional geometry check of model.hf_dir";

std::string type_name(const Field& f) {
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) return "boolean";
        if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) return "integer";
        if constexpr (std::is_same_v<T, double>) return "number";
        if constexpr (std::is_same_v<T, std::string>) {
          if (f.choices.empty()) return f.path ? "path" : "string";
          std::string s = "one of ";
          for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? "|" : "") + f.choices[i];
          return s;
        }
        if constexpr (std::is_same_v<T, std::vector<std::string>>)
          return f.path ? "list of paths" : "list of strings";
        if constexpr (std::is_same_v<T, std::vector<double>>) return "list of numbers";
        if constexpr (std::is_same_v<T, ImageSizes>) return "list of [width, height] pairs";
        if constexpr (std::is_same_v<T, DataConfig::OnBad>) return "one of skip|error";
      },
      f.ref);
}

std::string a_type(const std::string& type) {
  if (type.rfind("one of", 0) == 0) return type;
  return (type == "integer" ? "an " : "a ") + type;
}

std::vector<std::string> all_keys() {
  Recipe r;
  std::vector<std::string> keys;
  for (const Field& f : fields(r)) keys.push_back(f.key);
  keys.push_back("model.config");
  for (const std::string& k : graph_config_keys())
    if (!is_deprecated_graph_config_key(k)) keys.push_back("cuda_graph." + k);
  return keys;
}

// The words of a dotted key: "checkpoint.save_interval" -> checkpoint, save, interval.
std::vector<std::string> key_words(const std::string& key) {
  std::vector<std::string> words;
  std::string w;
  for (char c : key + ".") {
    if (c == '.' || c == '_') {
      if (!w.empty()) words.push_back(w);
      w.clear();
    } else {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  return words;
}

// How many of a's words some word of b matches: equal, one a prefix of the other (iter, iters),
// or one typo apart when both are long enough for that to mean something.
int shared_words(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  int n = 0;
  for (const std::string& x : a)
    for (const std::string& y : b) {
      const bool prefix =
          x.size() >= 3 && y.size() >= 3 && (x.rfind(y, 0) == 0 || y.rfind(x, 0) == 0);
      if (x == y || prefix || (x.size() >= 5 && y.size() >= 5 && edit_distance(x, y) <= 1)) {
        ++n;
        break;
      }
    }
  return n;
}

// How a key's last dotted part answers the typed key's: 2 the same (train.lr, optimizer.lr), 1
// holding it (schedule.warmup, schedule.warmup_iters; three letters at least, or every key with
// an "a" would do), 0 neither.
int last_part_match(const std::string& typed, const std::string& key) {
  const std::string want = typed.substr(typed.rfind('.') + 1);
  const std::string have = key.substr(key.rfind('.') + 1);
  if (want == have) return 2;
  return want.size() >= 3 && have.find(want) != std::string::npos ? 1 : 0;
}

// The valid key a mistyped one most likely meant. The setting a user names is the key's last part
// and the section is the likelier slip, so a key whose last part is the one typed comes first
// (train.lr finds optimizer.lr, not the nearer-by-letters train.seed), then one whose last part
// holds it, then the most words in common (checkpoint.save finds checkpoint.save_interval), then
// the fewest edits. Empty when nothing matches by part or word and no key is a near spelling.
std::string closest_key(const std::string& key) {
  const std::vector<std::string> words = key_words(key);
  std::string best;
  int best_part = 0, best_shared = 0;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& k : all_keys()) {
    const int part = last_part_match(key, k);
    const int shared = shared_words(words, key_words(k));
    const size_t d = edit_distance(key, k);
    const bool better = part != best_part       ? part > best_part
                        : shared != best_shared ? shared > best_shared
                                                : d < best_d;
    if (better) {
      best_part = part;
      best_shared = shared;
      best_d = d;
      best = k;
    }
  }
  if (best_part == 0 && best_shared == 0 && best_d > 3) return "";
  return best;
}

// Keys that Megatron-Bridge (and HF Trainer) users type, with where Iris keeps the setting or
// why it has none.
struct ForeignKey {
  const char* key;
  const char* answer;
};
constexpr ForeignKey kForeignKeys[] = {
    {"model.tensor_model_parallel_size", "use parallel.tensor_parallel_size"},
    {"model.pipeline_model_parallel_size", "use parallel.pipeline_parallel_size"},
    {"model.context_parallel_size", "not supported: Iris has no context parallelism"},
    {"model.sequence_parallel", "not supported: Iris has no tensor parallelism to go with it"},
    {"model.seq_length", "use train.seq_length"},
    {"model.recompute_granularity", "use train.recompute (none, selective or full)"},
    {"model.recompute_method", "use train.recompute (none, selective or full)"},
    {"model.recompute_num_layers", "use train.recompute (none, selective or full)"},
    {"model.freeze_language_model", "use train.freeze_language_model"},
    {"model.freeze_vision_model", "use train.freeze_vision_tower"},
    {"model.freeze_vision_projection", "use train.freeze_merger"},
    {"model.bf16", "not a setting: train.device=cuda trains in bf16 with fp32 master weights"},
    {"mixed_precision", "not a setting: train.device=cuda trains in bf16 with fp32 master weights"},
    {"checkpoint.pretrained_checkpoint", "use model.hf_dir with model.init=pretrained"},
    {"checkpoint.save", "use checkpoint.dir (where checkpoints are written)"},
    {"checkpoint.load", "use checkpoint.resume (auto, never or a checkpoint directory)"},
    {"checkpoint.save_optim", "not a setting: checkpoints always hold the optimizer state"},
    {"logger.log_interval", "use logging.log_interval"},
    {"logger.wandb_project",
     "not supported: metrics go to metrics.jsonl and an SVG plot in the run directory "
     "(logging.metrics_file, logging.plot)"},
    {"logger.tensorboard_dir",
     "not supported: metrics go to metrics.jsonl and an SVG plot in the run directory "
     "(logging.metrics_file, logging.plot)"},
    {"scheduler.lr_warmup_iters", "use schedule.warmup_iters"},
    {"scheduler.lr_decay_iters", "use schedule.decay_iters"},
    {"scheduler.lr_decay_style", "use schedule.kind (constant or cosine)"},
    {"scheduler.override_opt_param_scheduler", "use schedule.override_on_resume"},
    {"scheduler.use_checkpoint_opt_param_scheduler",
     "not a setting: a resume keeps the checkpoint's schedule unless the recipe changes it, "
     "which is refused without schedule.override_on_resume=true"},
    {"optimizer.adam_beta1", "use optimizer.betas: [beta1, beta2]"},
    {"optimizer.adam_beta2", "use optimizer.betas: [beta1, beta2]"},
    {"optimizer.adam_eps", "use optimizer.eps"},
    {"optimizer.use_distributed_optimizer", "use optimizer.distributed (true or false)"},
    {"dataset.seq_length", "use train.seq_length"},
    {"rng.seed", "use train.seed"},
};

// config.json fields Iris reads, and fields of Qwen-VL configs it knows and ignores. An inline
// model.config key outside both lists but within two edits of one is taken for a typo: it would
// otherwise be ignored and the field it meant left at its default or missing. Keys far from all
// of them pass, because HF configs carry many fields Iris has no use for.
constexpr const char* kConfigFields[] = {
    "attention_bias", "deepstack_visual_indexes", "depth", "head_dim", "hidden_act", "hidden_size",
    "image_token_id", "in_channels", "intermediate_size", "max_position_embeddings", "merge_size",
    "model_type", "mrope_interleaved", "mrope_section", "num_attention_heads", "num_heads",
    "num_hidden_layers", "num_key_value_heads", "num_position_embeddings", "out_hidden_size",
    "patch_size", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "rope_type",
    "spatial_merge_size", "temporal_patch_size", "text_config", "tie_word_embeddings", "type",
    "video_token_id", "vision_config", "vision_end_token_id", "vision_start_token_id", "vocab_size",
    "embed_dim", "mlp_ratio", "in_chans", "fullatt_block_indexes", "window_size",
    "tokens_per_second", "use_sliding_window",
    // Read by HF, not by Iris.
    "vision_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "attention_dropout", "max_window_layers", "sliding_window", "layer_types", "hidden_dropout",
    "num_channels", "spatial_patch_size"};

void check_config_keys(const json& j, const std::string& path) {
  if (!j.is_object()) return;
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    std::string near;
    size_t near_d = 3;
    for (const char* f : kConfigFields) {
      if (key == f) known = true;
      const size_t d = edit_distance(key, f);
      if (d < near_d) near_d = d, near = f;
    }
    IRIS_CHECK(known || near.empty() || key.size() < 5, "recipe: ", path, ".", key,
               " is not a config.json field; did you mean '", near, "'?");
    if (key == "text_config" || key == "vision_config") check_config_keys(value, path + "." + key);
  }
}

// An override's origin, as messages name it: "override 'train.lr=1e-3'".
std::string override_origin(const std::string& key, const std::string& text) {
  return "override '" + key + "=" + text + "'";
}

// A problem with an override is one of the command line's (a UsageError: the command exits with
// 2), one with the recipe file is the recipe's (an Error).
bool is_override_origin(const std::string& where) {
  return where.rfind("override '", 0) == 0;
}

[[noreturn]] void fail_recipe(bool usage, const std::string& message) {
  if (usage) throw_usage_error(__FILE__, __LINE__, message);
  throw_error(__FILE__, __LINE__, message);
}

// `where` is the key's origin, which says whether it came from an override.
[[noreturn]] void fail_unknown(const std::string& key, const std::string& where) {
  const bool usage = is_override_origin(where);
  const std::string at = usage ? " in " + where : " (" + where + ")";
  for (const ForeignKey& f : kForeignKeys)
    if (key == f.key)
      fail_recipe(usage,
                  str_cat("recipe: '", key, "'", at, " is a Megatron-Bridge key; ", f.answer));
  const std::string near = closest_key(key);
  fail_recipe(usage, str_cat("recipe: unknown key '", key, "'", at,
                             near.empty() ? std::string("; no key is close to it")
                                          : "; did you mean '" + near + "'?",
                             " (iris train --list-keys prints every key)"));
}

// Where a value came from, for messages: "recipes/x.yaml line 12" or "override 'a.b=c'".
class Origins {
 public:
  void set(const std::string& key, const std::string& where) { map_[key] = where; }
  bool overridden(const std::string& key) const { return map_.count(key) > 0; }
  std::string of(const std::string& key, const YAML::Node& node, const std::string& file) const {
    auto it = map_.find(key);
    if (it != map_.end()) return it->second;
    if (node.Mark().line >= 0) return str_cat(file, " line ", node.Mark().line + 1);
    return file;
  }

 private:
  std::map<std::string, std::string> map_;
};

// Recipes are YAML a user may have been sent. Before a document becomes a node tree, one pass over
// its events refuses aliases (`*name`: a node that contains itself recurses forever, and a
// "billion laughs" chain of them expands exponentially) and nesting deeper than any recipe needs.
// yaml-cpp's own parser stops at 2000 levels; this limit keeps our walkers far below that.
constexpr int kMaxYamlDepth = 64;

class YamlGuard : public YAML::EventHandler {
 public:
  explicit YamlGuard(std::string source) : source_(std::move(source)) {}
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override {
    IRIS_FAIL("recipe: ", source_, where(mark),
              " uses a YAML alias (*name); recipes do not allow aliases, so write the value out");
  }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    enter(mark);
  }
  void OnSequenceEnd() override { --depth_; }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    enter(mark);
  }
  void OnMapEnd() override { --depth_; }

 private:
  static std::string where(const YAML::Mark& mark) {
    return mark.line >= 0 ? str_cat(" line ", mark.line + 1) : std::string();
  }
  void enter(const YAML::Mark& mark) {
    IRIS_CHECK(++depth_ <= kMaxYamlDepth, "recipe: ", source_, where(mark), " nests more than ",
               kMaxYamlDepth, " levels of lists and maps; no recipe needs that many");
  }
  std::string source_;
  int depth_ = 0;
};

// YAML::Load after the guard above; YAML syntax errors propagate as YAML::Exception.
YAML::Node load_yaml(const std::string& text, const std::string& source) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  YamlGuard guard(source);
  parser.HandleNextDocument(guard);
  return YAML::Load(text);
}

std::string node_text(const YAML::Node& n) {
  if (n.IsScalar()) return n.Scalar();
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

[[noreturn]] void fail_type(const std::string& key, const std::string& type, const YAML::Node& n,
                            const std::string& where) {
  fail_recipe(is_override_origin(where),
              str_cat("recipe: ", key, " expects ", a_type(type), ", got '",
                      clip_text(node_text(n), 80), "' (", where, ")"));
}

bool parse_int64(const std::string& s, int64_t& out) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+') ++b;
  const auto [p, ec] = std::from_chars(b, e, out);
  return b != e && ec == std::errc() && p == e;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

bool parse_bool(const std::string& s, bool& out) {
  static const std::array<const char*, 4> yes{"true", "True", "TRUE", "yes"};
  static const std::array<const char*, 4> no{"false", "False", "FALSE", "no"};
  for (const char* y : yes)
    if (s == y) return out = true, true;
  for (const char* n : no)
    if (s == n) return out = false, true;
  return false;
}

void assign(const Field& f, const YAML::Node& n, const std::string& where) {
  const std::string type = type_name(f);
  auto fail = [&]() { fail_type(f.key, type, n, where); };
  auto scalar = [&]() -> const std::string& {
    if (!n.IsScalar()) fail();
    return n.Scalar();
  };
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (!parse_bool(scalar(), *p)) fail();
        } else if constexpr (std::is_same_v<T, int>) {
          int64_t v = 0;
          if (!parse_int64(scalar(), v)) fail();
          IRIS_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
                     "recipe: ", f.key, " value ", v, " is out of range (", where, ")");
          *p = static_cast<int>(v);
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!parse_int64(scalar(), *p)) fail();
        } else if constexpr (std::is_same_v<T, double>) {
          if (!parse_double(scalar(), *p)) fail();
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = scalar();
          if (!f.choices.empty() &&
              std::find(f.choices.begin(), f.choices.end(), *p) == f.choices.end())
            fail();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          p->clear();
          // A single value stands for a list of one, the way train_files: a.jsonl reads.
          if (n.IsScalar()) {
            p->push_back(n.Scalar());
            return;
          }
          if (!n.IsSequence()) fail();
          for (const auto& item : n) {
            if (!item.IsScalar()) fail();
            p->push_back(item.Scalar());
          }
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          if (!n.IsSequence()) fail();
          p->clear();
          for (const auto& item : n) {
            double v = 0;
            if (!item.IsScalar() || !parse_double(item.Scalar(), v)) fail();
            p->push_back(v);
          }
        } else if constexpr (std::is_same_v<T, ImageSizes>) {
          if (!n.IsSequence()) fail();
          p->clear();
          for (const auto& item : n) {
            if (!item.IsSequence() || item.size() != 2) fail();
            std::array<int, 2> wh{};
            for (int i = 0; i < 2; ++i) {
              int64_t v = 0;
              if (!item[i].IsScalar() || !parse_int64(item[i].Scalar(), v) || v <= 0 || v > 1 << 16)
                fail();
              wh[static_cast<size_t>(i)] = static_cast<int>(v);
            }
            p->push_back(wh);
          }
        } else if constexpr (std::is_same_v<T, DataConfig::OnBad>) {
          const std::string& s = scalar();
          if (s == "skip")
            *p = DataConfig::OnBad::skip;
          else if (s == "error")
            *p = DataConfig::OnBad::error;
          else
            fail();
        }
      },
      f.ref);
}

// Shortest text that reads back to the same double, with a '.' or an exponent so that YAML
// readers take it for a float ("1" would read as an integer).
std::string double_text(double v) {
  char buf[64];
  for (int prec = 6; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

YAML::Node value_node(const Field& f) {
  return std::visit(
      [&](auto* p) -> YAML::Node {
        using T = std::remove_pointer_t<decltype(p)>;
        YAML::Node n;
        if constexpr (std::is_same_v<T, DataConfig::OnBad>) {
          n = *p == DataConfig::OnBad::skip ? "skip" : "error";
        } else if constexpr (std::is_same_v<T, ImageSizes>) {
          n = YAML::Node(YAML::NodeType::Sequence);
          for (const auto& wh : *p) {
            YAML::Node pair(YAML::NodeType::Sequence);
            pair.push_back(wh[0]);
            pair.push_back(wh[1]);
            pair.SetStyle(YAML::EmitterStyle::Flow);
            n.push_back(pair);
          }
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          n = YAML::Node(YAML::NodeType::Sequence);
          for (const auto& v : *p) n.push_back(v);
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          n = YAML::Node(YAML::NodeType::Sequence);
          for (double v : *p) n.push_back(double_text(v));
        } else if constexpr (std::is_same_v<T, double>) {
          n = double_text(*p);
        } else {
          n = *p;
        }
        if (n.IsSequence()) n.SetStyle(YAML::EmitterStyle::Flow);
        return n;
      },
      f.ref);
}

std::string absolute_path(const std::string& p) {
  if (p.empty()) return p;
  return fs::absolute(fs::path(p)).lexically_normal().string();
}

YAML::Node json_to_yaml(const json& j) {
  YAML::Node n;
  if (j.is_object()) {
    n = YAML::Node(YAML::NodeType::Map);
    for (auto it = j.begin(); it != j.end(); ++it) n[it.key()] = json_to_yaml(it.value());
  } else if (j.is_array()) {
    n = YAML::Node(YAML::NodeType::Sequence);
    for (const auto& v : j) n.push_back(json_to_yaml(v));
    if (!j.empty() && !j.front().is_structured()) n.SetStyle(YAML::EmitterStyle::Flow);
  } else if (j.is_null()) {
    n = YAML::Node(YAML::NodeType::Null);
  } else if (j.is_string()) {
    n = j.get<std::string>();
  } else {
    n = j.dump();  // numbers and booleans in JSON spelling, which YAML reads back the same
  }
  return n;
}

// YAML scalars carry no type; JSON needs one. Quoted scalars are strings; plain ones are read as
// null, boolean, integer or float when they look like one.
json yaml_to_json(const YAML::Node& n, const std::string& where) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nullptr;
    case YAML::NodeType::Map: {
      json j = json::object();
      for (const auto& kv : n) j[kv.first.Scalar()] = yaml_to_json(kv.second, where);
      return j;
    }
    case YAML::NodeType::Sequence: {
      json j = json::array();
      for (const auto& v : n) j.push_back(yaml_to_json(v, where));
      return j;
    }
    case YAML::NodeType::Scalar: {
      const std::string& s = n.Scalar();
      if (n.Tag() == "!") return s;  // quoted
      if (s == "null" || s == "~") return nullptr;
      bool b = false;
      if (parse_bool(s, b)) return b;
      int64_t i = 0;
      if (parse_int64(s, i)) return i;
      double d = 0;
      if (parse_double(s, d)) return d;
      return s;
    }
  }
  IRIS_FAIL("recipe: unreadable value in ", where);
}

struct Parsed {
  YAML::Node root;
  Origins origins;
};

void apply_override(Parsed& p, const std::string& key, const std::string& text) {
  const std::string where = override_origin(key, text);
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string part; std::getline(ss, part, '.');) {
    IRIS_USAGE_CHECK(!part.empty(), "recipe: ", where,
                     " has an empty key part; write section.key=value");
    parts.push_back(part);
  }
  IRIS_USAGE_CHECK(parts.size() >= 2, "recipe: ", where,
                   " must name a key inside a section, e.g. train.train_iters=100");
  const std::string& section = parts[0];
  const bool known_section =
      std::find(section_names().begin(), section_names().end(), section) != section_names().end();
  if (!known_section) fail_unknown(key, where);
  YAML::Node value;
  try {
    value = load_yaml(text, where);
  } catch (const YAML::Exception&) {
    value = YAML::Node(text);  // not YAML on its own (e.g. "a: b: c"): take it as text
  }
  if (!p.root[section].IsDefined() || p.root[section].IsNull())
    p.root[section] = YAML::Node(YAML::NodeType::Map);
  IRIS_CHECK(p.root[section].IsMap(), "recipe: section '", section,
             "' must be a map of key: value");
  if (section == "model" && parts[1] == "config" && parts.size() > 2) {
    // Deep keys edit an inline config, e.g. model.config.text_config.num_hidden_layers=2.
    YAML::Node node = p.root["model"]["config"];
    IRIS_CHECK(node.IsMap(), "recipe: ", where,
               " edits a field of an inline model.config, but model.config is ",
               node.IsDefined() && !node.IsNull() ? "a path" : "not set",
               "; give the whole config instead (model.config=path/to/config.json)");
    for (size_t i = 2; i + 1 < parts.size(); ++i) {
      if (!node[parts[i]].IsDefined() || !node[parts[i]].IsMap())
        node[parts[i]] = YAML::Node(YAML::NodeType::Map);
      node.reset(node[parts[i]]);  // operator= would overwrite the parent's content
    }
    node[parts.back()] = value;
    p.origins.set("model.config", where);
    return;
  }
  if (section != "cuda_graph") {
    const std::vector<std::string> keys = all_keys();
    if (parts.size() != 2 || std::find(keys.begin(), keys.end(), key) == keys.end())
      fail_unknown(key, where);
  } else {
    IRIS_USAGE_CHECK(parts.size() == 2, "recipe: ", where, " must be cuda_graph.<key>=value");
  }
  p.root[section][parts[1]] = value;
  p.origins.set(key, where);
}

// The recipe's cuda_graph map as the graph layer's key/value input: scalars as text, sequences of
// scalars joined with commas, null values skipped (they mean "default", like Bridge's None).
GraphConfigInput graph_input_from_yaml(const YAML::Node& section) {
  GraphConfigInput out;
  if (!section.IsDefined() || section.IsNull()) return out;
  IRIS_CHECK(section.IsMap(),
             "recipe: section cuda_graph must be a map of key: value, e.g. "
             "'cuda_graph_impl: local'");
  for (const auto& kv : section) {
    const std::string key = kv.first.Scalar();
    const YAML::Node& value = kv.second;
    if (value.IsNull()) continue;
    if (value.IsScalar()) {
      out.emplace_back(key, value.Scalar());
      continue;
    }
    IRIS_CHECK(value.IsSequence(), "recipe: cuda_graph.", key,
               " must be a value or a list of values, got a map; e.g. "
               "cuda_graph_modules: [attn, mlp]");
    std::string joined;
    for (const auto& item : value) {
      IRIS_CHECK(item.IsScalar(), "recipe: cuda_graph.", key,
                 " must be a list of values; nested lists and maps are not valid");
      if (!joined.empty()) joined += ",";
      joined += item.Scalar();
    }
    out.emplace_back(key, joined);
  }
  return out;
}

// A resolved graph value as a YAML node (lists in flow style, as the recipes write them).
YAML::Node graph_value_node(const GraphValue& value) {
  return std::visit(
      [](const auto& x) {
        YAML::Node n;
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, int64_t>) {
          n = x;
        } else {
          n = YAML::Node(YAML::NodeType::Sequence);
          for (const auto& item : x) n.push_back(item);
          n.SetStyle(YAML::EmitterStyle::Flow);
        }
        return n;
      },
      value);
}

// A path field's relative values joined to `dir` (empty strings stay empty: "not set").
void relative_to(const fs::path& dir, const FieldRef& ref) {
  auto join = [&](std::string& v) {
    if (!v.empty() && fs::path(v).is_relative()) v = (dir / v).lexically_normal().string();
  };
  if (auto* s = std::get_if<std::string*>(&ref)) join(**s);
  if (auto* l = std::get_if<std::vector<std::string>*>(&ref))
    for (std::string& v : **l) join(v);
}

void resolve(Recipe& r, const Parsed& p, const std::string& source) {
  const YAML::Node& root = p.root;
  IRIS_CHECK(root.IsMap() || root.IsNull(), "recipe: ", source,
             " must be a YAML map of sections (model:, data:, train:, ...)");
  const fs::path recipe_dir = fs::path(source).parent_path();
  std::vector<Field> fs_ = fields(r);
  std::map<std::string, const Field*> by_key;
  for (const Field& f : fs_) by_key[f.key] = &f;
  YAML::Node graph_section;
  YAML::Node model_config;
  std::string model_config_where;
  for (const auto& sec : root) {
    const std::string section = sec.first.Scalar();
    if (std::find(section_names().begin(), section_names().end(), section) ==
        section_names().end()) {
      // A Megatron-Bridge section (logger, scheduler, ...): name its first key's Iris home.
      if (sec.second.IsMap())
        for (const auto& kv : sec.second)
          for (const ForeignKey& f : kForeignKeys)
            if (section + "." + kv.first.Scalar() == f.key)
              fail_unknown(f.key, str_cat(source, " line ", kv.first.Mark().line + 1));
      std::string best;
      size_t best_d = std::numeric_limits<size_t>::max();
      for (const std::string& s : section_names())
        if (edit_distance(section, s) < best_d) best_d = edit_distance(section, s), best = s;
      IRIS_FAIL("recipe: unknown section '", section, "' (", source, " line ",
                sec.first.Mark().line + 1, "); did you mean '", best,
                "'? Sections: model, data, train, optimizer, schedule, checkpoint, logging, "
                "cuda_graph, parallel");
    }
    if (sec.second.IsNull()) continue;
    IRIS_CHECK(sec.second.IsMap(), "recipe: section '", section, "' (", source, " line ",
               sec.second.Mark().line + 1, ") must be a map of key: value");
    if (section == "cuda_graph") {
      graph_section = sec.second;
      continue;
    }
    for (const auto& kv : sec.second) {
      const std::string key = section + "." + kv.first.Scalar();
      const std::string where = p.origins.of(key, kv.second, source);
      if (key == "model.config") {
        model_config = kv.second;
        model_config_where = p.origins.of(key, kv.second, source);
        continue;
      }
      auto it = by_key.find(key);
      if (it == by_key.end()) fail_unknown(key, where);
      if (kv.second.IsNull()) continue;  // null: keep the default
      assign(*it->second, kv.second, where);
      // Input paths written in a recipe file are relative to that file, so that a recipe and its
      // files move together; an override's are relative to where the command runs, as the user
      // typed them. The run directory is an output and stays relative to the working directory.
      if (it->second->path && key != "checkpoint.dir" && !p.origins.overridden(key))
        relative_to(recipe_dir, it->second->ref);
    }
  }

  try {
    r.cuda_graph = parse_graph_configs(graph_input_from_yaml(graph_section));
  } catch (const Error& e) {
    IRIS_FAIL("recipe: section cuda_graph: ", e.what());
  }

  if (model_config.IsDefined() && !model_config.IsNull()) {
    if (model_config.IsScalar()) {
      // As every input path: relative to the recipe written in it, to the working directory
      // given as an override.
      fs::path cp = model_config.Scalar();
      if (cp.is_relative() && !p.origins.overridden("model.config")) cp = recipe_dir / cp;
      r.model.config_path = cp.lexically_normal().string();
    } else if (model_config.IsMap()) {
      try {
        const json config = yaml_to_json(model_config, model_config_where);
        check_config_keys(config, "model.config");
        r.model.config_json = config.dump(2);
      } catch (const json::type_error&) {
        // dump() refuses strings that are not UTF-8, as a config.json must be.
        IRIS_FAIL("recipe: model.config holds text that is not valid UTF-8 (", model_config_where,
                  ")");
      }
    } else {
      IRIS_FAIL("recipe: model.config expects a path or a map of config.json fields, got a list (",
                model_config_where, ")");
    }
  }
}

int64_t positive(int64_t v, const char* key, int64_t min = 1) {
  IRIS_CHECK(v >= min, "recipe: ", key, " must be >= ", min, ", got ", v);
  return v;
}

// train.offload_activations: none or all alone, or names the recompute mode keeps per layer; the
// copies run between per-layer graphs, on one stage.
void validate_offload(Recipe& r) {
  std::vector<std::string>& names = r.train.offload_activations;
  if (names.empty()) names = {"none"};
  const bool special = std::find_if(names.begin(), names.end(), [](const std::string& n) {
                         return n == "none" || n == "all";
                       }) != names.end();
  IRIS_CHECK(!special || names.size() == 1,
             "recipe: train.offload_activations takes none, all, or a list of activation names, "
             "not none or all among names");
  const std::vector<std::string> can = offloadable_activations(parse_recompute(r.train.recompute));
  std::string listed;
  for (const std::string& n : can) listed += (listed.empty() ? "" : ", ") + n;
  for (size_t i = 0; i < names.size() && !special; ++i) {
    IRIS_CHECK(std::find(can.begin(), can.end(), names[i]) != can.end(),
               "recipe: train.offload_activations names '", names[i],
               "', which is not an activation the decoder layers keep with train.recompute=",
               r.train.recompute, "; those are: ", listed);
    IRIS_CHECK(std::find(names.begin(), names.begin() + i, names[i]) == names.begin() + i,
               "recipe: train.offload_activations names '", names[i], "' twice");
  }
}

// peft.*: refused where set without peft.type=lora (a setting would be silently ignored); with
// it, checked against the model, whose config then carries the adapters.
void validate_peft(Recipe& r) {
  const PeftRecipe& pe = r.peft;
  const PeftRecipe defaults;
  if (!pe.lora()) {
    for (const auto& [set, key] :
         {std::pair{pe.rank != defaults.rank, "peft.rank"},
          {pe.alpha != defaults.alpha, "peft.alpha"},
          {pe.dropout != defaults.dropout, "peft.dropout"},
          {pe.use_rslora != defaults.use_rslora, "peft.use_rslora"},
          {pe.target_modules != defaults.target_modules, "peft.target_modules"},
          {!pe.modules_to_save.empty(), "peft.modules_to_save"}})
      IRIS_CHECK(!set, "recipe: ", key,
                 " is set but peft.type is none; set peft.type=lora to "
                 "train adapters, or drop ",
                 key);
    return;
  }
  IRIS_CHECK(pe.rank >= 1 && pe.rank <= 65536, "recipe: peft.rank must be in [1, 65536], got ",
             pe.rank);
  IRIS_CHECK(pe.alpha > 0 && std::isfinite(pe.alpha), "recipe: peft.alpha must be positive, got ",
             pe.alpha);
  IRIS_CHECK(pe.dropout >= 0.0 && pe.dropout < 1.0, "recipe: peft.dropout must be in [0, 1), got ",
             pe.dropout);
  check_lora_targets(pe.target_modules, "recipe");
  const TrainRecipe& t = r.train;
  for (const auto& [set, key] : {std::pair{t.freeze_vision_tower, "train.freeze_vision_tower"},
                                 {t.freeze_merger, "train.freeze_merger"},
                                 {t.freeze_language_model, "train.freeze_language_model"}})
    IRIS_CHECK(!set, "recipe: ", key,
               " is true, but with peft.type=lora the whole base model is frozen already; drop "
               "it (peft.target_modules picks the adapted modules, peft.modules_to_save the ones "
               "trained in full)");
  if (!r.has_model_config) return;
  r.model_config.lora = recipe_lora(pe);
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const auto layout =
      allocate_weights(*cpu, r.model_config, DType::f32, [](const std::string&) { return false; });
  check_lora_matches(r.model_config, *layout, "recipe");
  for (const std::string& m : pe.modules_to_save) {
    const FreezeSpec only{true, true, true, {m}};
    bool matched = false;
    for (const WeightBinding& b : layout->bindings)
      matched = matched || (!is_lora_tensor(b.hf_name) && !only.frozen(b.hf_name));
    IRIS_CHECK(matched, "recipe: peft.modules_to_save has '", m,
               "', which names no module of the model (e.g. merger, lm_head, embed_tokens, or a "
               "path such as model.visual.merger)");
  }
}

}  // namespace

LoraConfig recipe_lora(const PeftRecipe& pe) {
  LoraConfig l;
  if (!pe.lora()) return l;
  l.rank = static_cast<int>(pe.rank);
  l.alpha = pe.alpha;
  l.rslora = pe.use_rslora;
  l.dropout = pe.dropout;
  l.target_modules = pe.target_modules;
  return l;
}

namespace {

void validate(Recipe& r) {
  // --- model: Megatron's capacity rules
  const ModelRecipe& mr = r.model;
  IRIS_CHECK(std::isfinite(mr.moe_expert_capacity_factor) && mr.moe_expert_capacity_factor >= 0.0,
             "recipe: model.moe_expert_capacity_factor must be >= 0 (0: dropless), got ",
             mr.moe_expert_capacity_factor);
  IRIS_CHECK(!mr.moe_pad_expert_input_to_capacity || mr.moe_expert_capacity_factor > 0.0,
             "recipe: model.moe_pad_expert_input_to_capacity needs a capacity to pad to; set "
             "model.moe_expert_capacity_factor (e.g. 1.0)");
  IRIS_CHECK(mr.moe_token_drop_policy == "probs" || mr.moe_expert_capacity_factor > 0.0,
             "recipe: model.moe_token_drop_policy is ", mr.moe_token_drop_policy,
             ", but nothing drops without model.moe_expert_capacity_factor; set it or leave the "
             "policy out");

  // --- train
  TrainRecipe& t = r.train;
  positive(t.micro_batch_size, "train.micro_batch_size");
  positive(t.global_batch_size, "train.global_batch_size");
  positive(t.train_iters, "train.train_iters");
  positive(t.seq_length, "train.seq_length", 2);
  positive(t.eval_interval, "train.eval_interval", 0);
  positive(t.eval_iters, "train.eval_iters");
  positive(t.max_vision_patches, "train.max_vision_patches", 0);
  IRIS_CHECK(t.seed >= 0, "recipe: train.seed must be >= 0, got ", t.seed);
  IRIS_CHECK(t.device_memory_gib >= 0,
             "recipe: train.device_memory_gib must be >= 0 (0: the GPU's own memory), got ",
             t.device_memory_gib);
  IRIS_CHECK(!(t.freeze_vision_tower && t.freeze_merger && t.freeze_language_model),
             "recipe: train.freeze_vision_tower, train.freeze_merger and "
             "train.freeze_language_model are all true, which leaves nothing to train; unfreeze "
             "at least one");

  // --- parallel and batch geometry
  ParallelRecipe& p = r.parallel;
  positive(p.tensor_parallel_size, "parallel.tensor_parallel_size");
  positive(p.pipeline_parallel_size, "parallel.pipeline_parallel_size");
  positive(p.data_parallel_size, "parallel.data_parallel_size");
  const int64_t per_step = t.micro_batch_size * p.data_parallel_size;
  if (t.global_batch_size % per_step != 0) {
    const int64_t down = t.global_batch_size / per_step * per_step, up = down + per_step;
    IRIS_FAIL("recipe: train.global_batch_size ", t.global_batch_size,
              " is not divisible by train.micro_batch_size ", t.micro_batch_size,
              " x parallel.data_parallel_size ", p.data_parallel_size, " = ", per_step,
              " (global batch = micro batch x accumulation steps x data-parallel size); use ",
              down > 0 ? str_cat(down, " or ", up) : str_cat(up));
  }
  r.accumulation_steps = t.global_batch_size / per_step;

  positive(p.timeout_seconds, "parallel.timeout_seconds");
  positive(p.grad_bucket_elements, "parallel.grad_bucket_elements");
  // optimizer.distributed is Megatron-LM's switch for what Megatron-FSDP calls optimizer
  // sharding: either key turns it on, and the resolved config shows both.
  if (r.optimizer.distributed && p.sharding == "none") p.sharding = "optimizer";
  IRIS_CHECK(p.sharding != "optimizer_grads_params" || (!t.freeze_language_model && !r.peft.lora()),
             "recipe: parallel.sharding=optimizer_grads_params shards the decoder layers' "
             "trainable weights, but ",
             r.peft.lora() ? "peft.type=lora" : "train.freeze_language_model=true",
             " freezes them (a frozen weight has no owner among the optimizer's shards); use "
             "parallel.sharding=optimizer_grads");
  r.optimizer.distributed = p.sharding != "none";
  IRIS_CHECK(p.tensor_parallel_size == 1,
             "recipe: parallel.tensor_parallel_size=", p.tensor_parallel_size,
             ": tensor parallelism is not supported yet (set it to 1 and use "
             "parallel.data_parallel_size with mpirun -np N)");
  IRIS_CHECK(p.pipeline_layers.empty() ||
                 static_cast<int64_t>(p.pipeline_layers.size()) == p.pipeline_parallel_size,
             "recipe: parallel.pipeline_layers lists ", p.pipeline_layers.size(),
             " stages but parallel.pipeline_parallel_size is ", p.pipeline_parallel_size,
             "; give one layer count per stage, or [] for an automatic split");
  for (double n : p.pipeline_layers)
    IRIS_CHECK(n >= 1 && n == std::floor(n) && n < 1e6,
               "recipe: parallel.pipeline_layers entries are layer counts, positive integers; got ",
               n);
  IRIS_CHECK(p.pipeline_costs.empty() || p.pipeline_parallel_size > 1,
             "recipe: parallel.pipeline_costs balances pipeline stages, but "
             "parallel.pipeline_parallel_size is 1; drop the key or set more stages");
  IRIS_CHECK(p.pipeline_costs.empty() || p.pipeline_layers.empty(),
             "recipe: parallel.pipeline_costs and parallel.pipeline_layers both split the stages; "
             "give one of them");

  // --- optimizer and schedule
  OptimizerRecipe& o = r.optimizer;
  IRIS_CHECK(o.lr > 0, "recipe: optimizer.lr must be > 0, got ", o.lr);
  IRIS_CHECK(o.min_lr >= 0 && o.min_lr <= o.lr, "recipe: optimizer.min_lr ", o.min_lr,
             " must be in [0, optimizer.lr = ", o.lr, "]");
  IRIS_CHECK(o.vision_lr >= 0, "recipe: optimizer.vision_lr must be >= 0 (0 = optimizer.lr), got ",
             o.vision_lr);
  IRIS_CHECK(o.merger_lr >= 0, "recipe: optimizer.merger_lr must be >= 0 (0 = optimizer.lr), got ",
             o.merger_lr);
  IRIS_CHECK(o.betas.size() == 2, "recipe: optimizer.betas expects 2 numbers [beta1, beta2], got ",
             o.betas.size());
  for (double b : o.betas)
    IRIS_CHECK(b >= 0 && b < 1, "recipe: optimizer.betas entries must be in [0, 1), got ", b);
  IRIS_CHECK(o.eps > 0, "recipe: optimizer.eps must be > 0, got ", o.eps);
  IRIS_CHECK(o.weight_decay >= 0, "recipe: optimizer.weight_decay must be >= 0, got ",
             o.weight_decay);
  IRIS_CHECK(o.clip_grad >= 0, "recipe: optimizer.clip_grad must be >= 0 (0 = off), got ",
             o.clip_grad);
  positive(r.schedule.warmup_iters, "schedule.warmup_iters", 0);
  positive(r.schedule.decay_iters, "schedule.decay_iters", 0);
  // The schedule's own checks, said in recipe keys.
  const ScheduleSettings schedule = recipe_schedule(r);
  const int64_t decay_end = schedule.decay_end();
  IRIS_CHECK(r.schedule.kind != "cosine" || decay_end > r.schedule.warmup_iters,
             "recipe: a cosine schedule decays after its warmup, so ",
             r.schedule.decay_iters > 0 ? "schedule.decay_iters (" : "train.train_iters (",
             decay_end, ") must exceed schedule.warmup_iters (", r.schedule.warmup_iters,
             "); lower schedule.warmup_iters or use schedule.kind=constant");
  schedule.lr_schedule();
  if (r.schedule.warmup_iters > t.train_iters)
    r.notes.push_back(str_cat("schedule.warmup_iters ", r.schedule.warmup_iters,
                              " exceeds train.train_iters ", t.train_iters,
                              ": the learning rate never reaches optimizer.lr"));

  // --- checkpoint and logging
  positive(r.checkpoint.save_interval, "checkpoint.save_interval", 0);
  positive(r.checkpoint.keep_last, "checkpoint.keep_last", 0);
  IRIS_CHECK(!r.checkpoint.resume.empty(),
             "recipe: checkpoint.resume must be auto, never or a checkpoint path");
  positive(r.logging.log_interval, "logging.log_interval");
  positive(r.logging.host_probe_steps, "logging.host_probe_steps", 0);
  IRIS_CHECK(r.logging.host_probe_steps < t.train_iters, "recipe: logging.host_probe_steps ",
             r.logging.host_probe_steps, " must be below train.train_iters ", t.train_iters,
             " (the probed steps are the run's last ones, outside its steady state)");
  positive(r.logging.op_profile_step, "logging.op_profile_step", 0);
  IRIS_CHECK(r.logging.op_profile_step <= t.train_iters, "recipe: logging.op_profile_step ",
             r.logging.op_profile_step, " is past train.train_iters ", t.train_iters,
             "; pick an iteration of the run (after the first few, which warm up)");
  IRIS_CHECK(r.logging.op_profile_step == 0 || (r.cuda_graph.language.impl == GraphImpl::none &&
                                                r.cuda_graph.vision.impl == VisionGraphImpl::none),
             "recipe: logging.op_profile_step times each op on its own, and a replayed CUDA graph "
             "runs its ops as one launch; set cuda_graph.cuda_graph_impl=none and "
             "cuda_graph.vision_cuda_graph_impl=none for the profiled run");
  // Outputs named relative to the run directory stay inside it, apart from each other and from
  // what the run keeps there itself.
  for (const auto& [key, value] :
       {std::pair<const char*, const std::string&>{"logging.metrics_file", r.logging.metrics_file},
        {"logging.plot", r.logging.plot}}) {
    if (value.empty()) continue;  // off
    check_relative_output(value, str_cat("recipe: ", key), "the run directory (checkpoint.dir)");
    const std::string first = fs::path(value).lexically_normal().begin()->string();
    IRIS_CHECK(!is_run_directory_entry(first), "recipe: ", key, " '", value, "' would take over ",
               first,
               ", which the run directory keeps for itself; choose another name (the default is ",
               std::string(key) == "logging.plot" ? "training_curves.svg" : "metrics.jsonl", ")");
  }
  IRIS_CHECK(
      r.logging.metrics_file.empty() || fs::path(r.logging.metrics_file).lexically_normal() !=
                                            fs::path(r.logging.plot).lexically_normal(),
      "recipe: logging.metrics_file and logging.plot are both '", r.logging.metrics_file,
      "'; the plot would overwrite the metrics: give them different names");
  if (r.checkpoint.dir.empty()) {
    const std::string stem = fs::path(r.source).stem().string();
    r.checkpoint.dir = "runs/" + (stem.empty() ? std::string("recipe") : stem);
  }

  // --- data
  DataRecipe& d = r.data;
  d.config.seq_length = t.seq_length;
  d.config.seed = static_cast<uint64_t>(t.seed);
  positive(d.min_pixels, "data.min_pixels", 0);
  positive(d.max_pixels, "data.max_pixels", 0);
  IRIS_CHECK(d.min_pixels == 0 || d.max_pixels == 0 || d.min_pixels <= d.max_pixels,
             "recipe: data.min_pixels ", d.min_pixels, " exceeds data.max_pixels ", d.max_pixels);
  IRIS_CHECK(d.config.mock || !d.config.train_files.empty(),
             "recipe: data.train_files is empty; list the training JSONL files (or set "
             "data.mock=true for a performance run)");
  try {
    d.config.validate();
  } catch (const Error& e) {
    IRIS_FAIL("recipe: section data: ", e.what());
  }
  if (t.eval_interval > 0)
    IRIS_CHECK(!d.eval_files.empty() || d.config.mock, "recipe: train.eval_interval is ",
               t.eval_interval,
               " but data.eval_files is empty; list held-out JSONL files or "
               "set train.eval_interval=0");
  for (const auto* files : {&d.config.train_files, &d.eval_files})
    for (const std::string& f : *files)
      if (!d.config.mock && !fs::exists(f))
        r.notes.push_back(str_cat("data file ", f, " does not exist yet",
                                  f.find("shapes") != std::string::npos
                                      ? " (create it with: iris data shapes --out " +
                                            fs::path(f).parent_path().string() + ")"
                                      : ""));

  // --- model
  ModelRecipe& m = r.model;
  IRIS_CHECK(m.config_path.empty() || m.config_json.empty(),
             "recipe: model.config is both a path and a map");
  const bool has_config = !m.config_path.empty() || !m.config_json.empty();
  ModelConfig from_config;
  std::string config_text, config_name;
  if (has_config) {
    config_name = m.config_json.empty() ? m.config_path : "the inline model.config";
    if (!m.config_path.empty())
      IRIS_CHECK(fs::is_regular_file(m.config_path), "recipe: model.config ", m.config_path,
                 " does not exist (a relative model.config is relative to the recipe file)");
    config_text = m.config_json.empty() ? read_text_file(m.config_path) : m.config_json;
    from_config = ModelConfig::from_json_text(config_text, config_name);
  }
  if (m.init == "random") {
    IRIS_CHECK(has_config,
               "recipe: model.init is random but model.config is not set; give a "
               "config.json path (relative to the recipe) or an inline map of its fields");
    IRIS_CHECK(m.hf_dir.empty(), "recipe: model.hf_dir is set (", m.hf_dir,
               ") but model.init is random; set model.init=pretrained to start from it");
    IRIS_CHECK(!m.tokenizer.empty(),
               "recipe: model.tokenizer is required with model.init=random "
               "(the path of a Qwen tokenizer.json)");
    r.model_config = from_config;
    r.model_config_json = config_text;
    r.has_model_config = true;
  } else if (!m.hf_dir.empty()) {
    const std::string cj = (fs::path(m.hf_dir) / "config.json").string();
    IRIS_CHECK(fs::is_regular_file(cj), "recipe: model.hf_dir ", m.hf_dir,
               " has no config.json; point it at a Hugging Face Qwen3-VL checkpoint directory");
    r.model_config_json = read_text_file(cj);
    r.model_config = ModelConfig::from_json_text(r.model_config_json, cj);
    r.has_model_config = true;
    if (has_config)
      check_same_model_geometry(from_config, r.model_config, config_name, cj,
                                "model.config describes a different model than model.hf_dir (drop "
                                "model.config or point model.hf_dir at the matching checkpoint)");
    if (m.tokenizer.empty()) m.tokenizer = (fs::path(m.hf_dir) / "tokenizer.json").string();
  } else {
    r.notes.push_back(
        "model.hf_dir is not set: training needs it (model.hf_dir=/path/to/a Qwen-VL checkpoint "
        "directory)");
    if (has_config) {
      r.model_config = from_config;
      r.model_config_json = config_text;
      r.has_model_config = true;
    }
  }
  if (!m.tokenizer.empty() && !fs::exists(m.tokenizer))
    r.notes.push_back(str_cat("model.tokenizer ", m.tokenizer, " does not exist yet",
                              m.tokenizer.find("qwen3vl-tiny") != std::string::npos
                                  ? " (scripts/fetch_tokenizer.sh places it there)"
                                  : ""));

  // The model's own settings are checked before the graph settings derived from them, so that a
  // mistake in one of them is reported as such and not as a cuda_graph error.
  const PreprocessorConfig pp = recipe_preprocessor(r);  // validates the pixel bounds
  const int64_t unit = int64_t(pp.merge_size) * pp.merge_size;
  IRIS_CHECK(t.max_vision_patches % unit == 0, "recipe: train.max_vision_patches ",
             t.max_vision_patches, " must be a multiple of ", unit, " (whole merge windows); use ",
             t.max_vision_patches / unit * unit + unit);
  validate_peft(r);
  validate_offload(r);
  if (r.has_model_config) {
    const ModelConfig& mc = r.model_config;
    IRIS_CHECK(recipe_offloaded_activations(r).empty() || !mc.text.any_sparse_layer(),
               "recipe: train.offload_activations: offloading a mixture-of-experts model's "
               "activations is not implemented yet; set train.offload_activations=none");
    IRIS_CHECK(t.seq_length <= mc.text.max_position_embeddings, "recipe: train.seq_length ",
               t.seq_length, " exceeds the model's max_position_embeddings ",
               mc.text.max_position_embeddings);
    // The split against the model's layers, before any process is launched for it.
    try {
      pipeline_split(mc, static_cast<int>(std::min<int64_t>(p.pipeline_parallel_size, 1 << 20)),
                     r.parallel.pipeline_layers, {});
      if (!p.pipeline_costs.empty()) read_pipeline_costs(p.pipeline_costs);
    } catch (const Error& e) {
      IRIS_FAIL("recipe: ", e.what());
    }
    const double factor = r.model.moe_expert_capacity_factor;
    IRIS_CHECK(factor == 0.0 || mc.text.any_sparse_layer(),
               "recipe: model.moe_expert_capacity_factor is ", factor,
               ", but the model has no MoE layers; leave it 0");
    GraphModelTraits traits;
    traits.has_moe = mc.text.any_sparse_layer();
    traits.has_dense_mlp = false;
    for (int l = 0; l < mc.text.num_hidden_layers; ++l)
      traits.has_dense_mlp = traits.has_dense_mlp || !mc.text.sparse_layer(l);
    traits.moe_static_capacity = factor > 0.0 && r.model.moe_pad_expert_input_to_capacity;
    traits.has_deepstack = !mc.vision.deepstack_visual_indexes.empty();
    traits.spatial_merge_size = mc.vision.spatial_merge_size;
    // The largest encoder call of a micro-batch is what the trainer plans its memory for.
    traits.max_vision_seq_length = recipe_max_vision_patches(r) * t.micro_batch_size;
    try {
      finalize_graph_configs(r.cuda_graph, traits);
    } catch (const Error& e) {
      IRIS_FAIL("recipe: section cuda_graph: ", e.what());
    }
  }
  for (const std::string& w : r.cuda_graph.warnings) r.notes.push_back("cuda_graph: " + w);
  // Modules select parts of what an impl captures: without that impl they would do nothing.
  const auto& cg = r.cuda_graph;
  IRIS_CHECK(cg.language.modules.empty() || cg.language.impl == GraphImpl::local,
             "recipe: cuda_graph.cuda_graph_modules selects parts of each layer for "
             "cuda_graph.cuda_graph_impl local; with cuda_graph_impl ",
             cg.language.impl == GraphImpl::none ? "none" : "full_iteration",
             " it would do nothing: leave it empty or set cuda_graph_impl=local");
  IRIS_CHECK((r.parallel.sharding != "optimizer_grads" &&
              r.parallel.sharding != "optimizer_grads_params") ||
                 cg.language.impl != GraphImpl::full_iteration,
             "recipe: parallel.sharding=", r.parallel.sharding,
             " exchanges each decoder layer's gradients (and weights) between the layers' "
             "graphs, which cuda_graph.cuda_graph_impl=full_iteration captures as one; use "
             "cuda_graph_impl=local (per-layer graphs) or parallel.sharding=optimizer");
  IRIS_CHECK(
      recipe_offloaded_activations(r).empty() || cg.language.impl != GraphImpl::full_iteration,
      "recipe: train.offload_activations copies each layer's activations between the "
      "layers' graphs, which cuda_graph.cuda_graph_impl=full_iteration captures as one; use "
      "cuda_graph_impl=local (per-layer graphs) or train.offload_activations=none");
  IRIS_CHECK(cg.vision.modules.empty() || cg.vision.impl == VisionGraphImpl::local,
             "recipe: cuda_graph.vision_cuda_graph_modules selects parts of each vision block for "
             "cuda_graph.vision_cuda_graph_impl local; with vision_cuda_graph_impl none it would "
             "do nothing: leave it empty or set vision_cuda_graph_impl=local");
}

Recipe load(const std::string& text, const std::string& source,
            const std::vector<std::string>& overrides) {
  Parsed p;
  try {
    p.root = load_yaml(text, source);
  } catch (const YAML::Exception& e) {
    IRIS_FAIL("recipe: ", source, " is not valid YAML: ", clip_text(e.what()));
  }
  if (!p.root.IsDefined() || p.root.IsNull()) p.root = YAML::Node(YAML::NodeType::Map);
  IRIS_CHECK(p.root.IsMap(), "recipe: ", source,
             " must be a YAML map of sections (model:, data:, train:, ...)");
  Recipe r;
  r.source = source;
  for (const std::string& o : overrides) {
    auto kv = parse_override(o);
    apply_override(p, kv.first, kv.second);
    r.overrides.push_back(std::move(kv));
  }
  resolve(r, p, source);
  validate(r);
  return r;
}

}  // namespace

ScheduleSettings recipe_schedule(const Recipe& r) {
  ScheduleSettings s;
  s.kind = r.schedule.kind;
  s.lr = r.optimizer.lr;
  s.min_lr = r.optimizer.min_lr;
  s.vision_lr = r.optimizer.vision_lr;
  s.merger_lr = r.optimizer.merger_lr;
  s.weight_decay = r.optimizer.weight_decay;
  s.warmup_iters = r.schedule.warmup_iters;
  s.decay_iters = r.schedule.decay_iters;
  s.train_iters = r.train.train_iters;
  return s;
}

ChatFormat recipe_chat_format(const Recipe& r) {
  std::vector<std::string> dirs;
  if (!r.model.hf_dir.empty()) dirs.push_back(r.model.hf_dir);
  if (!r.model.tokenizer.empty())
    dirs.push_back(fs::path(r.model.tokenizer).parent_path().string());
  ChatFormat f = r.data.chat_template.empty()
                     ? ChatFormat::from_dirs(dirs)
                     : ChatFormat::from_file(r.data.chat_template, "data.chat_template", dirs);
  if (r.data.enable_thinking != "auto")
    f.set_kwargs({{"enable_thinking", r.data.enable_thinking == "true"}}, "data.enable_thinking");
  return f;
}

PreprocessorConfig recipe_preprocessor(const Recipe& r) {
  PreprocessorConfig pp;
  if (!r.model.hf_dir.empty()) {
    const fs::path p = fs::path(r.model.hf_dir) / "preprocessor_config.json";
    if (fs::is_regular_file(p)) pp = PreprocessorConfig::from_file(p.string());
  }
  if (r.has_model_config) {
    // The patch geometry belongs to the model: a randomly initialised model with its own
    // patch_size has no preprocessor file, and a checkpoint's file must agree with its config.
    const VisionConfig& v = r.model_config.vision;
    if (!r.model.hf_dir.empty()) {
      try {
        check_preprocessor_matches(
            r.model_config, pp, (fs::path(r.model.hf_dir) / "config.json").string(),
            (fs::path(r.model.hf_dir) / "preprocessor_config.json").string());
      } catch (const Error& e) {
        IRIS_FAIL("recipe: ", e.what());
      }
    }
    pp.patch_size = v.patch_size;
    pp.merge_size = v.spatial_merge_size;
    pp.temporal_patch_size = v.temporal_patch_size;
  }
  if (r.data.min_pixels > 0) pp.min_pixels = r.data.min_pixels;
  if (r.data.max_pixels > 0) pp.max_pixels = r.data.max_pixels;
  try {
    pp.validate();
  } catch (const Error& e) {
    IRIS_FAIL("recipe: data.min_pixels/data.max_pixels: ", e.what());
  }
  return pp;
}

void check_same_model_geometry(const ModelConfig& a, const ModelConfig& b,
                               const std::string& a_name, const std::string& b_name,
                               const std::string& fix) {
  // Every value that changes what the model computes: a resume under another one would train
  // the checkpoint's model while the run folder recorded the other.
  auto text_of = [](const auto& v) {
    std::ostringstream s;
    s.precision(9);
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::vector<int>> ||
                  std::is_same_v<std::decay_t<decltype(v)>, std::array<int, 3>>) {
      s << "[";
      for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
      s << "]";
    } else {
      s << v;
    }
    return s.str();
  };
  auto same = [&](const char* field, const auto& x, const auto& y) {
    const std::string xs = text_of(x), ys = text_of(y);
    IRIS_CHECK(xs == ys, field, " is ", xs, " in ", a_name, " but ", ys, " in ", b_name, "; ", fix);
  };
  same("model_type", a.model_type, b.model_type);
  const TextConfig &at = a.text, &bt = b.text;
  same("text_config.hidden_size", at.hidden_size, bt.hidden_size);
  same("text_config.num_hidden_layers", at.num_hidden_layers, bt.num_hidden_layers);
  same("text_config.intermediate_size", at.intermediate_size, bt.intermediate_size);
  same("text_config.num_attention_heads", at.num_attention_heads, bt.num_attention_heads);
  same("text_config.num_key_value_heads", at.num_key_value_heads, bt.num_key_value_heads);
  same("text_config.head_dim", at.head_dim, bt.head_dim);
  same("text_config.vocab_size", at.vocab_size, bt.vocab_size);
  same("text_config.rms_norm_eps", at.rms_norm_eps, bt.rms_norm_eps);
  same("text_config.rope_theta", at.rope_theta, bt.rope_theta);
  same("text_config.mrope_section", at.mrope_section, bt.mrope_section);
  same("text_config.mrope_interleaved", at.mrope_interleaved, bt.mrope_interleaved);
  const VisionConfig &av = a.vision, &bv = b.vision;
  same("vision_config.depth", av.depth, bv.depth);
  same("vision_config.hidden_size", av.hidden_size, bv.hidden_size);
  same("vision_config.intermediate_size", av.intermediate_size, bv.intermediate_size);
  same("vision_config.num_heads", av.num_heads, bv.num_heads);
  same("vision_config.patch_size", av.patch_size, bv.patch_size);
  same("vision_config.temporal_patch_size", av.temporal_patch_size, bv.temporal_patch_size);
  same("vision_config.spatial_merge_size", av.spatial_merge_size, bv.spatial_merge_size);
  same("vision_config.out_hidden_size", av.out_hidden_size, bv.out_hidden_size);
  same("vision_config.num_position_embeddings", av.num_position_embeddings,
       bv.num_position_embeddings);
  same("vision_config.deepstack_visual_indexes", av.deepstack_visual_indexes,
       bv.deepstack_visual_indexes);
  same("vision_config.window_size", av.window_size, bv.window_size);
  same("vision_config.fullatt_block_indexes", av.fullatt_block_indexes, bv.fullatt_block_indexes);
  same("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings);
  same("image_token_id", a.image_token_id, b.image_token_id);
  same("video_token_id", a.video_token_id, b.video_token_id);
}

int64_t recipe_max_vision_patches(const Recipe& r) {
  if (r.train.max_vision_patches > 0) return r.train.max_vision_patches;
  const PreprocessorConfig pp = recipe_preprocessor(r);
  if (r.data.config.mock) {
    int64_t per_sample = 0;
    for (const auto& wh : r.data.config.mock_image_sizes) {
      const ResizedSize rs =
          smart_resize(wh[1], wh[0], pp.patch_size * pp.merge_size, pp.min_pixels, pp.max_pixels);
      per_sample += int64_t(rs.height / pp.patch_size) * (rs.width / pp.patch_size);
    }
    return per_sample;
  }
  return r.train.seq_length * pp.merge_size * pp.merge_size;
}

std::pair<std::string, std::string> parse_override(const std::string& arg) {
  const size_t eq = arg.find('=');
  IRIS_USAGE_CHECK(eq != std::string::npos && eq > 0, "override '", arg,
                   "' must look like section.key=value, e.g. train.train_iters=100");
  return {arg.substr(0, eq), arg.substr(eq + 1)};
}

std::string find_recipe(const std::string& name_or_path) {
  if (fs::is_regular_file(name_or_path)) return name_or_path;
  // A bare name (qwen3vl_tiny_shapes), as scripts/performance/run.sh takes it: recipes/NAME.yaml
  // from the working directory, else from the repository the binary was built in (build/iris).
  const bool bare = name_or_path.find('/') == std::string::npos && !name_or_path.empty() &&
                    fs::path(name_or_path).extension() != ".yaml";
  if (bare) {
    std::vector<fs::path> dirs = {fs::path("recipes")};
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) dirs.push_back(exe.parent_path().parent_path() / "recipes");
    for (const fs::path& d : dirs) {
      const fs::path p = d / (name_or_path + ".yaml");
      if (fs::is_regular_file(p)) return p.lexically_normal().string();
    }
  }
  IRIS_FAIL("recipe ", name_or_path, " does not exist",
            bare ? " (looked for recipes/" + name_or_path + ".yaml too)" : std::string(),
            "; give a recipe file or the name of one in recipes/");
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string file = find_recipe(path);
  return load(read_text_file(file), file, overrides);
}

Recipe load_recipe_text(const std::string& text, const std::string& source,
                        const std::vector<std::string>& overrides) {
  return load(text, source, overrides);
}

std::string recipe_to_yaml(const Recipe& recipe) {
  Recipe r = recipe;  // fields() binds mutable pointers
  std::map<std::string, YAML::Node> sections;
  for (const std::string& s : section_names()) sections[s] = YAML::Node(YAML::NodeType::Map);
  for (const Field& f : fields(r)) {
    const size_t dot = f.key.find('.');
    const std::string section = f.key.substr(0, dot), key = f.key.substr(dot + 1);
    YAML::Node v = value_node(f);
    if (f.path) {
      if (v.IsScalar()) {
        v = absolute_path(v.Scalar());
      } else {
        for (size_t i = 0; i < v.size(); ++i) v[i] = absolute_path(v[i].Scalar());
      }
    }
    if (f.key == "checkpoint.resume" && r.checkpoint.resume != "auto" &&
        r.checkpoint.resume != "never")
      v = absolute_path(r.checkpoint.resume);
    sections[section][key] = v;
    if (f.key == "model.hf_dir") {
      if (!r.model.config_json.empty())
        sections["model"]["config"] = json_to_yaml(json::parse(r.model.config_json));
      else if (!r.model.config_path.empty())
        sections["model"]["config"] = absolute_path(r.model.config_path);
      else
        sections["model"]["config"] = YAML::Node(YAML::NodeType::Null);
    }
  }
  sections["cuda_graph"] = YAML::Node(YAML::NodeType::Map);
  for (const auto& [key, value] : graph_config_values(r.cuda_graph))
    sections["cuda_graph"][key] = graph_value_node(value);
  YAML::Emitter e;
  e << YAML::BeginMap;
  for (const std::string& s : section_names()) e << YAML::Key << s << YAML::Value << sections[s];
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

std::vector<RecipeKey> recipe_schema() {
  Recipe r;
  std::vector<RecipeKey> out;
  for (const Field& f : fields(r)) {
    YAML::Emitter e;
    e << YAML::Flow << value_node(f);
    out.push_back({f.key, type_name(f), e.c_str(), f.doc});
    if (f.key == "model.hf_dir")
      out.push_back({"model.config", "path or map", "null", kModelConfigDoc});
  }
  for (const std::string& k : graph_config_keys()) {
    if (is_deprecated_graph_config_key(k)) continue;
    const GraphKeyDoc doc = graph_config_key_doc(k);
    out.push_back({"cuda_graph." + k, doc.type, doc.default_value,
                   doc.doc + " (flag " + graph_config_flag_name(k) + " of iris generate)"});
  }
  return out;
}

std::string describe_recipe_schema() {
  std::string out;
  std::string section;
  for (const RecipeKey& k : recipe_schema()) {
    const std::string s = k.key.substr(0, k.key.find('.'));
    if (s != section) {
      out += (section.empty() ? "" : "\n") + s + ":\n";
      section = s;
    }
    out +=
        str_cat("  ", k.key, " (", k.type, ", default ", k.default_value, ")\n      ", k.doc, "\n");
  }
  return out;
}

std::vector<std::string> recipe_offloaded_activations(const Recipe& r) {
  const std::vector<std::string>& names = r.train.offload_activations;
  if (names.empty() || names == std::vector<std::string>{"none"}) return {};
  if (names == std::vector<std::string>{"all"})
    return offloadable_activations(parse_recompute(r.train.recompute));
  return names;
}

}  // namespace iris
