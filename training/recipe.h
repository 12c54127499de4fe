// Training recipes: a YAML file of sections (model, data, train, optimizer, schedule, checkpoint,
// logging, cuda_graph, parallel) against a typed schema, plus dotted command-line overrides
// (`train.train_iters=100`), resolved into one validated Recipe.
//
// Every key has a type, a default and a doc string (recipe_schema()); an unknown key fails naming
// the closest valid one, a value of the wrong type fails naming the key and the expected type.
// Those failures are UsageErrors when an override made them (the command line is wrong), Errors
// when the recipe file did.
// The cuda_graph section goes through core/graph_config.h so that a bad combination is rejected on
// every backend, the CPU included (which then ignores graphs).
//
// Relative paths in a recipe are relative to the working directory, except model.config, which
// is relative to the recipe file so that a recipe can ship its model geometry beside it. The
// resolved config holds absolute paths, so it can be reloaded from anywhere (a resumed run does).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bridge/model_config.h"
#include "core/graph_config.h"
#include "training/dataset.h"
#include "training/lr_schedule.h"
#include "vision/preprocess.h"

namespace iris {

struct ModelRecipe {
  // "random": initialise from `config` with `init_seed`; "pretrained": load `hf_dir`.
  std::string init = "random";
  std::string hf_dir;
  // config.json path (or, in YAML, an inline map of its fields). For pretrained runs it is
  // optional and, when given, must describe the same geometry as hf_dir/config.json.
  std::string config_path;
  std::string config_json;  // inline config serialised to JSON; empty when config_path is used
  std::string tokenizer;    // tokenizer.json; empty: hf_dir/tokenizer.json
  int64_t init_seed = 0;
  // Megatron's static expert capacity for MoE training (language/decoder.h MoeCapacity); 0:
  // dropless.
  double moe_expert_capacity_factor = 0.0;
  bool moe_pad_expert_input_to_capacity = false;
  std::string moe_token_drop_policy = "probs";
};

struct DataRecipe {
  DataConfig config;                    // seq_length and seed come from the train section
  std::vector<std::string> eval_files;  // held-out JSONL for train.eval_interval
  // Preprocessor pixel bounds; 0 keeps the preprocessor config's value (hf_dir's
  // preprocessor_config.json, else Qwen3-VL's defaults).
  int64_t min_pixels = 0, max_pixels = 0;
  // A chat template file to render the conversations with instead of the model's own (hf_dir's,
  // else the one beside the tokenizer); it is saved with the checkpoints, so an export is prompted
  // the same way.
  std::string chat_template;
  // enable_thinking for the chat template: auto (not passed), true or false.
  std::string enable_thinking = "auto";
};

struct TrainRecipe {
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t train_iters = 100;
  int64_t seq_length = 2048;
  int64_t seed = 1234;
  bool freeze_vision_tower = false;
  bool freeze_merger = false;
  bool freeze_language_model = false;
  int64_t eval_interval = 0;  // 0: no evaluation
  int64_t eval_iters = 1;     // global batches per evaluation
  // Vision patch rows of one sample that the activation memory is planned for; 0 derives it
  // (recipe_max_vision_patches). Samples above it are skipped.
  int64_t max_vision_patches = 0;
  // auto | cpu | cuda: where the step runs (auto: the GPU when one is present).
  std::string device = "auto";
  // none | selective | full (core/recompute.h).
  std::string recompute = "none";
  // The device memory per GPU the memory plan must fit (training/memory_plan.h); 0: the GPU's own
  // (a dry run without a GPU then prints the plan without a verdict).
  double device_memory_gib = 0;
  // The decoder layers' saved activations that go to pinned host memory during the forward and
  // come back one layer ahead in the backward: none, all (every one the recompute mode keeps per
  // layer) or a list of their names (offloadable_activations in training/train_model.h).
  std::vector<std::string> offload_activations = {"none"};
};

// LoRA fine-tuning, with Hugging Face PEFT's LoraConfig names and Megatron-Bridge's defaults: the
// base model stays in its compute dtype with no f32 state, the adapters keep f32 master weights
// and moments (bridge/peft.h says which modules each target adapts).
struct PeftRecipe {
  std::string type = "none";  // none | lora
  int64_t rank = 32;
  double alpha = 32;
  double dropout = 0.0;
  bool use_rslora = false;
  std::vector<std::string> target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  // Modules trained in full beside the adapters (e.g. merger), named as PEFT names them.
  std::vector<std::string> modules_to_save;
  bool lora() const { return type == "lora"; }
};

struct OptimizerRecipe {
  double lr = 1e-4;
  double min_lr = 0.0;
  // Peak learning rates of the vision tower and of the mergers (Qwen's vision_tower_lr and
  // mm_projector_lr); 0: optimizer.lr. The schedule scales them like optimizer.lr.
  double vision_lr = 0.0;
  double merger_lr = 0.0;
  std::vector<double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  double clip_grad = 1.0;  // global L2 norm; 0 disables clipping
  // Shard the AdamW state over the data-parallel ranks (ZeRO-1): parallel.sharding=optimizer,
  // which validation sets it from (and it, when true, sets parallel.sharding).
  bool distributed = false;
};

struct ScheduleRecipe {
  std::string kind = "cosine";  // constant | cosine
  int64_t warmup_iters = 0;
  int64_t decay_iters = 0;  // 0: decay over train_iters
  // A resume whose schedule differs from the checkpoint's (schedule_changes) is refused unless
  // this is set; then the recipe's schedule is used from the resumed step on (Megatron's
  // override_opt_param_scheduler).
  bool override_on_resume = false;
};

struct CheckpointRecipe {
  std::string dir;            // run directory; empty: runs/<recipe file stem>
  int64_t save_interval = 0;  // 0: no periodic saves
  bool save_final = true;
  int64_t keep_last = 3;        // 0: keep every checkpoint
  std::string resume = "auto";  // auto | never | path of a step_NNNNNNN directory
};

struct LoggingRecipe {
  int64_t log_interval = 10;
  int64_t host_probe_steps = 0;  // the run's last steps, each queued behind a held device
  // The iteration run op by op through the step profile (core/op_profile.h), whose table of
  // device time by op family goes to the log; 0: none.
  int64_t op_profile_step = 0;
  std::string metrics_file = "metrics.jsonl";
  std::string plot = "training_curves.svg";
  // auto | on | off: the progress bar between log lines (auto: on a terminal that no launcher
  // gave the process, progress_bar_wanted in training/metrics_log.h).
  std::string progress = "auto";
};

struct ParallelRecipe {
  int64_t tensor_parallel_size = 1;
  int64_t pipeline_parallel_size = 1;
  // Decoder layers per pipeline stage, in stage order (they sum to the model's layers); empty:
  // split automatically, balancing the training FLOPs of a full micro-batch (or the times of
  // pipeline_costs) with the vision encoder counted on stage 0 and the lm_head on the last stage.
  // Numbers, for the recipe's list type; each must be a positive integer.
  std::vector<double> pipeline_layers;
  // The pipeline_costs.json a run with logging.op_profile_step wrote (training/pipeline_costs.h):
  // the automatic split balances those measured times instead of FLOP estimates. Empty: FLOPs.
  std::string pipeline_costs;
  // Processes that each train on their share of every global batch; must equal the launcher's
  // process count (mpirun -np N, srun) divided by pipeline_parallel_size.
  int64_t data_parallel_size = 1;
  // How long one rank waits for the others in a collective before the whole job is aborted.
  int64_t timeout_seconds = 900;
  // Start each gradient bucket's all-reduce while the backward of the step's last micro-batch
  // still runs (parallel/grad_reducer.h); the same bits either way.
  bool overlap_grad_reduce = true;
  // Elements per gradient bucket (f32): smaller buckets start earlier and cost less scratch,
  // larger ones make fewer calls.
  int64_t grad_bucket_elements = int64_t(1) << 25;
  // What the data-parallel ranks shard, in Megatron-FSDP's names: none, optimizer (the AdamW
  // moments and the f32 master weights; optimizer.distributed=true is its synonym),
  // optimizer_grads (and the f32 gradients: training/sharded_gradients.h; not with pipeline
  // stages or full_iteration graphs yet), optimizer_grads_params (and the weights: refused).
  std::string sharding = "none";
};

struct Recipe {
  std::string source;                                          // the recipe file
  std::vector<std::pair<std::string, std::string>> overrides;  // as given, in order
  ModelRecipe model;
  DataRecipe data;
  TrainRecipe train;
  PeftRecipe peft;
  OptimizerRecipe optimizer;
  ScheduleRecipe schedule;
  CheckpointRecipe checkpoint;
  LoggingRecipe logging;
  ParallelRecipe parallel;
  GraphConfigs cuda_graph;

  // Filled by validation.
  int64_t accumulation_steps = 1;  // global / (micro * data parallel)
  bool has_model_config = false;   // false only for a pretrained recipe without hf_dir or config
  ModelConfig model_config;
  std::string model_config_json;   // the text the model config came from (saved with checkpoints)
  std::vector<std::string> notes;  // non-fatal remarks printed with the resolved config
};

// The image preprocessor a run uses: <model.hf_dir>/preprocessor_config.json when there is one,
// else Qwen3-VL's defaults, with data.min_pixels / data.max_pixels applied.
PreprocessorConfig recipe_preprocessor(const Recipe& r);

// The chat template a run renders its conversations with: data.chat_template when set, else the
// model's own (<model.hf_dir>'s, else the one beside model.tokenizer), else the built-in ChatML;
// data.enable_thinking passed to it unless auto.
ChatFormat recipe_chat_format(const Recipe& r);

// The settings the run's learning rates and weight decay follow (recorded in its checkpoints).
ScheduleSettings recipe_schedule(const Recipe& r);

// Throws when a and b differ in a field that decides the weight shapes; the message names the
// field, both sources and ends with `fix`.
void check_same_model_geometry(const ModelConfig& a, const ModelConfig& b,
                               const std::string& a_name, const std::string& b_name,
                               const std::string& fix);

// The train.max_vision_patches in force: the key when set; else, with mock data, the patches of
// one mock sample; else seq_length x merge_size^2, the most a sample within seq_length can hold
// (every token an image pad).
int64_t recipe_max_vision_patches(const Recipe& r);
// The decoder-layer activations train.offload_activations names (all: every one the recompute
// mode keeps per layer; none: empty).
std::vector<std::string> recipe_offloaded_activations(const Recipe& r);

// "a.b=value" -> ("a.b", "value"). Throws naming the argument when there is no '=' or no key.
std::pair<std::string, std::string> parse_override(const std::string& arg);

// Reads the recipe, applies the overrides in order, checks every key and value and resolves the
// derived fields. Throws iris::Error saying what is wrong and how to fix it.
// `path` is a recipe file, or the name of one in recipes/ (qwen3vl_tiny_shapes: the working
// directory's recipes/, else the source tree's beside the build folder of the binary).
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// The file load_recipe reads for `name_or_path`; an error names what was looked for.
std::string find_recipe(const std::string& name_or_path);
// The same from YAML text; `source` names it in messages and is the base of model.config paths.
Recipe load_recipe_text(const std::string& yaml_text, const std::string& source,
                        const std::vector<std::string>& overrides = {});

// The model's LoRA adapters as the peft section describes them (none unless peft.type is lora).
LoraConfig recipe_lora(const PeftRecipe& peft);

// The resolved recipe as YAML: every key, defaults included, paths absolute. Loading it back
// gives the same Recipe.
std::string recipe_to_yaml(const Recipe& r);

struct RecipeKey {
  std::string key;            // dotted, e.g. train.micro_batch_size
  std::string type;           // e.g. "integer", "list of strings"
  std::string default_value;  // YAML text
  std::string doc;
};
// Every key, in section order (cuda_graph keys included).
std::vector<RecipeKey> recipe_schema();
std::string describe_recipe_schema();

}  // namespace iris
