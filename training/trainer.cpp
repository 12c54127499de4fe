#include "training/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include <omp.h>

#include "bridge/random_weights.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "language/tokenizer.h"
#include "training/chat_format.h"
#include "training/checkpoint.h"
#include "training/data_parallel.h"
#include "training/dataset.h"
#include "training/lr_schedule.h"
#include "training/memory_plan.h"
#include "training/metrics_log.h"
#include "training/optimizer.h"
#include "training/param_spec.h"
#include "training/pipeline_parallel.h"
#include "training/train_model.h"
#include "training/train_setup.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
// How long a probed step may hold the device (logging.host_probe_steps): far above any step's
// enqueue, so that a hold that ends by itself means the host filled the launch queue.
constexpr double kHostProbeHoldSeconds = 5.0;

// A pipeline stage's part of a checkpoint, named as Hugging Face names the shards of a model.
std::string stage_file(const char* stem, int stage, int stages) {
  char name[96];
  std::snprintf(name, sizeof(name), "%s-%05d-of-%05d.safetensors", stem, stage + 1, stages);
  return name;
}

// The optimizer state of a checkpoint: one file, or one per pipeline stage that wrote it; the
// tensors are found by name in whichever holds them, so any split resumes any other.
std::vector<std::string> optimizer_files(const std::string& dir) {
  const fs::path whole = fs::path(dir) / kOptimizerFile;
  if (fs::exists(whole)) return {whole.string()};
  std::vector<std::string> parts;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("optimizer-", 0) == 0 && name.find("-of-") != std::string::npos &&
        name.size() > 12 && name.substr(name.size() - 12) == ".safetensors")
      parts.push_back(e.path().string());
  }
  IRIS_CHECK(!parts.empty(), dir, " holds neither ", kOptimizerFile,
             " nor the optimizer-NNNNN-of-NNNNN.safetensors parts of a pipelined run");
  std::sort(parts.begin(), parts.end());
  return parts;
}

// A config.json as HF loads it: model types and architectures filled in when a hand-written
// (inline) config leaves them out.
std::string hf_config_text(const std::string& config_json) {
  json j = json::parse(config_json);
  if (!j.contains("model_type")) j["model_type"] = "qwen3_vl";
  if (!j.contains("architectures")) j["architectures"] = {"Qwen3VLForConditionalGeneration"};
  if (j.contains("text_config") && !j["text_config"].contains("model_type"))
    j["text_config"]["model_type"] = "qwen3_vl_text";
  if (j.contains("vision_config") && !j["vision_config"].contains("model_type"))
    j["vision_config"]["model_type"] = "qwen3_vl_vision";
  return j.dump(2) + "\n";
}

json preprocessor_json(const PreprocessorConfig& pp) {
  return {{"image_processor_type", "Qwen2VLImageProcessorFast"},
          {"processor_class", "Qwen3VLProcessor"},
          {"do_convert_rgb", pp.do_convert_rgb},
          {"do_normalize", pp.do_normalize},
          {"do_rescale", pp.do_rescale},
          {"do_resize", pp.do_resize},
          {"image_mean", pp.image_mean},
          {"image_std", pp.image_std},
          {"merge_size", pp.merge_size},
          {"patch_size", pp.patch_size},
          {"temporal_patch_size", pp.temporal_patch_size},
          {"resample", 3},
          {"rescale_factor", pp.rescale_factor},
          {"size", {{"shortest_edge", pp.min_pixels}, {"longest_edge", pp.max_pixels}}}};
}

// Qwen3-VL Instruct's generation config: stop at <|im_end|> or <|endoftext|>.
json generation_json(const Tokenizer& tok) {
  const auto im_end = tok.find_token("<|im_end|>");
  const auto eot = tok.find_token("<|endoftext|>");
  IRIS_CHECK(im_end && eot,
             "the tokenizer lacks <|im_end|> or <|endoftext|>; Qwen3-VL training "
             "needs a Qwen tokenizer.json");
  return {{"bos_token_id", *eot},
          {"eos_token_id", {*im_end, *eot}},
          {"pad_token_id", *eot},
          {"do_sample", false}};
}

// Files that travel with every checkpoint so that an export is a complete HF directory.
struct SideFiles {
  std::vector<std::pair<std::string, std::string>> files;  // name, contents
};

SideFiles side_files(const Recipe& r, const Tokenizer& tok, const PreprocessorConfig& pp,
                     const ChatFormat& chat) {
  SideFiles s;
  s.files.emplace_back("tokenizer.json", read_text_file(r.model.tokenizer));
  // tokenizer_config.json comes from where the model or the tokenizer does.
  std::vector<fs::path> dirs;
  if (!r.model.hf_dir.empty()) dirs.push_back(r.model.hf_dir);
  dirs.push_back(fs::path(r.model.tokenizer).parent_path());
  for (const fs::path& d : dirs)
    if (fs::is_regular_file(d / "tokenizer_config.json")) {
      s.files.emplace_back("tokenizer_config.json",
                           read_text_file((d / "tokenizer_config.json").string()));
      break;
    }
  // The template the run trained with, wherever it came from: chat_template.jinja is what
  // inference looks for first, so an export is prompted as it was trained.
  if (chat.has_template()) s.files.emplace_back("chat_template.jinja", chat.template_text());
  s.files.emplace_back("preprocessor_config.json", preprocessor_json(pp).dump(2) + "\n");
  const fs::path gen = fs::path(r.model.hf_dir) / "generation_config.json";
  s.files.emplace_back("generation_config.json", !r.model.hf_dir.empty() && fs::is_regular_file(gen)
                                                     ? read_text_file(gen.string())
                                                     : generation_json(tok).dump(2) + "\n");
  return s;
}

TrainSample to_train_sample(Sample&& s) {
  TrainSample t;
  t.ids = std::move(s.ids);
  t.labels = std::move(s.labels);
  t.pixel_values = std::move(s.pixel_values);
  t.grids = std::move(s.grids);
  return t;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// queue_forward_backward of every micro-batch, micro-batch i on replica i % replicas.size(); the
// losses stay on each replica's device total. One replica takes the step whole (queue_step: with
// full_iteration graphs, one graph). With several replicas (CPU only) each runs on a thread of its
// own, and the ops inside run on that one thread. Returns the labelled tokens seen.
int64_t run_on_replicas(const std::vector<std::unique_ptr<TrainableQwen3VL>>& replicas,
                        const std::vector<std::vector<const TrainSample*>>& micro_batches,
                        float grad_scale) {
  const auto n = static_cast<int64_t>(replicas.size());
  if (n == 1) return replicas[0]->queue_step(micro_batches, grad_scale);
  std::vector<int64_t> labelled(micro_batches.size(), 0);
  {
    // An exception must not leave an OpenMP region; the first one is rethrown after it.
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    const int n_threads = static_cast<int>(n);
#pragma omp parallel num_threads(n_threads)
    {
      // The runtime may give fewer threads than asked for; a thread then takes several replicas.
      for (int64_t k = omp_get_thread_num(); k < n; k += omp_get_num_threads()) {
        try {
          for (auto i = static_cast<size_t>(k); i < micro_batches.size();
               i += static_cast<size_t>(n))
            labelled[i] = replicas[static_cast<size_t>(k)]->queue_forward_backward(micro_batches[i],
                                                                                   grad_scale);
        } catch (...) {
          errors[static_cast<size_t>(k)] = std::current_exception();
        }
      }
    }
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
  }
  int64_t total = 0;
  for (int64_t c : labelled) total += c;
  return total;
}

// SIGTERM (a scheduler's preemption or time limit) and SIGINT (Ctrl-C) ask the step loop to save
// a checkpoint after the step in progress and return; a second one ends the process at once.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_stop_signal = sig;
  // write() is async-signal-safe; the step loop may not notice the flag for a while.
  static const char kText[] =
      "\niris train: stop requested; saving a checkpoint after the current step (send the "
      "signal again to stop at once, without it)\n";
  const ssize_t ignored = ::write(STDERR_FILENO, kText, sizeof(kText) - 1);
  (void)ignored;
}

// Installs the handlers for the lifetime of the object, then puts back whatever was there.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // reads and writes in progress go on rather than fail with EINTR
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGINT, &sa, &old_int_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int received() const { return g_stop_signal; }

 private:
  struct sigaction old_term_ {};
  struct sigaction old_int_ {};
};

// Copies every tensor of `src` (f32, on the host) that `dst` holds into `dst` on `be` (converted
// to dst's dtype).
void upload_weights(Backend& be, ModelWeights& dst, const ModelWeights& src) {
  for (size_t i = 0; i < src.bindings.size(); ++i)
    if (dst.bindings[i].allocated())
      be.write(dst.bindings[i].tensor(), src.bindings[i].tensor().data, DType::f32);
}

// The f32 values of the model's weights as a checkpoint stores them, tensor by tensor: the master
// weights where there are some (the trainable tensors), else the weights the model reads (a frozen
// part keeps nothing else; on the GPU its saved values are its bf16 weights, exact for bf16
// checkpoints such as the released ones, and what the model has trained against otherwise).
void save_model_weights(Backend& be, const ModelWeights& master, const ModelWeights& weights,
                        const std::string& path,
                        const std::function<bool(const std::string&)>& keep = {}) {
  std::vector<std::vector<float>> storage;
  std::vector<SafetensorsWriteItem> items;
  storage.reserve(weights.bindings.size());
  for (size_t i = 0; i < weights.bindings.size(); ++i) {
    const WeightBinding& b = weights.bindings[i];
    if (keep && !keep(b.hf_name)) continue;
    const WeightBinding& from = master.bindings[i].allocated() ? master.bindings[i] : b;
    storage.emplace_back(static_cast<size_t>(from.tensor().numel()));
    be.read(storage.back().data(), DType::f32, from.tensor());
    items.push_back({b.hf_name, DType::f32, b.hf_shape, storage.back().data()});
  }
  write_safetensors(path, items, {{"format", "pt"}});
}

}  // namespace

int gpu_host_threads(int cores, int processes_on_host, int data_workers) {
  return std::max(1, cores / std::max(1, processes_on_host) - data_workers - 1);
}

void init_random_weights(Backend& backend, ModelWeights& weights, const std::string& config_json,
                         uint64_t seed) {
  const json j = json::parse(config_json);
  auto range = [&](const char* section) {
    if (j.contains(section) && j[section].contains("initializer_range") &&
        j[section]["initializer_range"].is_number())
      return j[section]["initializer_range"].get<double>();
    return j.value("initializer_range", 0.02);
  };
  RandomInit init;
  init.seed = seed;
  init.text_std = range("text_config");
  init.vision_std = range("vision_config");
  fill_random_weights(backend, weights, init);
}

namespace {

TrainResult train(const Recipe& recipe, const TrainerOptions& options, DataParallel& dp) {
  const Recipe& r = recipe;
  const bool graphs_on = r.cuda_graph.language.impl != GraphImpl::none ||
                         r.cuda_graph.vision.impl != VisionGraphImpl::none;
  const std::string run_dir = r.checkpoint.dir;
  fs::create_directories(run_dir);
  // Everything below reads or writes the run directory: one run at a time. Of a multi-process
  // run, rank 0 writes it; the others read what it holds once rank 0 has cleaned it.
  std::optional<RunLock> lock;
  if (dp.writer()) lock.emplace(run_dir);
  const StopSignals stop;
  if (dp.writer()) remove_checkpoint_debris(run_dir);
  dp.barrier("the run directory check");

  // Where to start from.
  const ResumePoint found = find_resume_point(run_dir);
  std::string resume_dir;
  if (r.checkpoint.resume == "auto") {
    resume_dir = found.dir;
  } else if (r.checkpoint.resume == "never") {
    const std::vector<int64_t> existing = list_checkpoints(run_dir);
    IRIS_CHECK(existing.empty(), "checkpoint.dir ", run_dir, " already holds checkpoints (",
               checkpoint_name(existing.empty() ? 0 : existing.back()),
               existing.size() > 1 ? str_cat(" and ", existing.size() - 1, " more") : "",
               ") and checkpoint.resume is never; set checkpoint.resume=auto to continue that "
               "run, or choose another checkpoint.dir");
  } else {
    std::string why;
    IRIS_CHECK(checkpoint_complete(r.checkpoint.resume, &why), "checkpoint.resume ",
               r.checkpoint.resume, " is not a complete checkpoint directory (", why,
               "); give a step_NNNNNNN directory, auto or never");
    // The path seeds a new run; once the run directory has checkpoints of its own, a restart of
    // the same command continues those instead of starting over from the seed.
    resume_dir = found.dir.empty() ? r.checkpoint.resume : found.dir;
  }
  TrainerState state;
  if (!resume_dir.empty()) state = load_trainer_state((fs::path(resume_dir) / kStateFile).string());
  IRIS_CHECK(state.iteration <= r.train.train_iters, "the checkpoint ", resume_dir, " is at step ",
             state.iteration, ", past train.train_iters ", r.train.train_iters,
             "; raise train.train_iters to train further");
  // This run writes only steps past its start, and never over a directory it did not write: one
  // there (an incomplete checkpoint, or one a resume was pointed away from) is refused now rather
  // than when the run reaches it. The complete ones up to the start are the run this one
  // continues, so checkpoint.keep_last counts them with its own.
  std::vector<int64_t> owned;
  for (int64_t s : list_checkpoints(run_dir)) {
    const std::string dir = (fs::path(run_dir) / checkpoint_name(s)).string();
    IRIS_CHECK(s <= state.iteration, "checkpoint.dir ", run_dir, " holds ", checkpoint_name(s),
               ", past step ", state.iteration, " where this run ",
               resume_dir.empty() ? "starts" : "resumes (from " + resume_dir + ")",
               ", and a run never replaces a checkpoint it did not write; move ", dir,
               " out of checkpoint.dir (or set another checkpoint.dir) and restart");
    if (checkpoint_complete(dir)) owned.push_back(s);
  }

  // Model.
  const bool on_gpu = r.train.device == "cuda" || (r.train.device == "auto" && cuda_available());
  IRIS_CHECK(!on_gpu || cuda_available(),
             "train.device is cuda, but this machine has no usable GPU or this iris was built "
             "without CUDA; set train.device=cpu (or auto, which picks the GPU when there is one)");
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::string config_text;
  ModelConfig cfg;
  std::string weights_dir;  // where the weights come from; empty: drawn at random
  if (!resume_dir.empty()) {
    const std::string cj = (fs::path(resume_dir) / "config.json").string();
    config_text = read_text_file(cj);
    cfg = ModelConfig::from_json_text(config_text, cj);
    if (r.has_model_config)
      check_same_model_geometry(r.model_config, cfg, "the recipe's model", cj,
                                "the checkpoint belongs to another model; use another "
                                "checkpoint.dir or set checkpoint.resume=never");
    weights_dir = resume_dir;
  } else {
    IRIS_CHECK(r.model.init == "random" || !r.model.hf_dir.empty(),
               "model.init is pretrained but model.hf_dir is not set; pass "
               "model.hf_dir=/path/to/Qwen3-VL-Instruct (a Hugging Face checkpoint directory)");
    IRIS_CHECK(r.has_model_config, "no model config: set model.config or model.hf_dir");
    config_text = r.model_config_json;
    cfg = r.model_config;
    if (r.model.init != "random") weights_dir = r.model.hf_dir;
  }
  std::unique_ptr<Backend> gpu;
  if (on_gpu) {
    gpu = make_cuda_backend(dp.cuda_device());
    // cuBLASLt's first choice for every GEMM, neither timed nor read from the tuning cache: the
    // algorithm decides the rounding, and a run resumed in a new process (after someone filled
    // the cache, or on a newer cache) must continue bit for bit.
    gpu->set_gemm_tuning(GemmTuning::heuristic);
    // The run's memory per GPU, planned before anything of it is allocated (or the weights read).
    const MemoryPlan memory = plan_training_memory(
        r, cfg, true, planned_device_bytes(r, static_cast<int64_t>(gpu->device_memory_total())));
    IRIS_CHECK(memory.fits(), "the run does not fit the GPU's memory:\n",
               memory_refusal(r, cfg, memory));
  }
  // The host copy of the f32 weights: on the CPU the weights the model reads; on the GPU only
  // the source of the upload, released after it.
  std::unique_ptr<ModelWeights> params;
  if (weights_dir.empty()) {
    params = allocate_weights(*cpu, cfg);
    init_random_weights(*cpu, *params, config_text, static_cast<uint64_t>(r.model.init_seed));
  } else {
    params = load_weights(*cpu, cfg, weights_dir);
  }
  config_text = hf_config_text(config_text);

  const Tokenizer tok = Tokenizer::from_file(r.model.tokenizer);
  const PreprocessorConfig pp = recipe_preprocessor(r);
  const ChatFormat chat = recipe_chat_format(r);
  const SideFiles side = side_files(r, tok, pp, chat);

  // Data. The files' fingerprints go into every checkpoint, so that a resume can tell when the
  // data changed under it (its position would then point into other samples).
  std::vector<DataFileFingerprint> data_files;
  if (!r.data.config.mock)
    for (const std::string& f : r.data.config.train_files)
      data_files.push_back(fingerprint_data_file(f));
  Dataset train_data(r.data.config, tok, pp, chat);
  if (!resume_dir.empty()) {
    IRIS_CHECK(state.data_seed == r.data.config.seed, "the checkpoint ", resume_dir,
               " was trained with data seed ", state.data_seed, " but train.seed is ",
               r.data.config.seed,
               "; resuming would continue another data order (restore "
               "train.seed=",
               state.data_seed, ")");
    train_data.seek(state.data_position);
  }
  std::unique_ptr<Dataset> eval_data;
  if (r.train.eval_interval > 0) {
    DataConfig ec = r.data.config;
    ec.train_files = r.data.eval_files;
    ec.shuffle = false;
    ec.seed = r.data.config.seed + 1;  // mock mode: held-out samples differ from training ones
    eval_data = std::make_unique<Dataset>(ec, tok, pp, chat);
  }

  const int64_t micro = r.train.micro_batch_size;
  const FreezeSpec frozen = recipe_frozen_parts(r);
  TrainLimits limits = recipe_train_limits(r, cfg, on_gpu);
  // Pipeline stages: this rank plans and runs its stage's share of the model only.
  const bool pipelined = dp.stages() > 1;
  std::vector<PipelineStage> stages;
  if (pipelined) {
    stages = recipe_pipeline_stages(r, cfg, limits);
    limits.stage = stages[static_cast<size_t>(dp.stage())];
  }
  const int64_t n_params = ParamSpecs(*params, frozen, DType::f32).parameters();

  AdamWConfig ac;
  ac.beta1 = static_cast<float>(r.optimizer.betas[0]);
  ac.beta2 = static_cast<float>(r.optimizer.betas[1]);
  ac.eps = static_cast<float>(r.optimizer.eps);
  ac.weight_decay = static_cast<float>(r.optimizer.weight_decay);
  ac.clip_grad_norm = static_cast<float>(r.optimizer.clip_grad);
  if (r.optimizer.vision_lr > 0)
    ac.vision_tower_lr_scale = static_cast<float>(r.optimizer.vision_lr / r.optimizer.lr);
  if (r.optimizer.merger_lr > 0)
    ac.merger_lr_scale = static_cast<float>(r.optimizer.merger_lr / r.optimizer.lr);

  // The weights the model reads hold every parameter; the f32 master weights, gradients and
  // moments hold the trainable ones only (training/param_spec.h). On the CPU the weights are f32
  // and, with nothing frozen, are the master weights themselves; with a part frozen the master
  // weights are the trainable tensors' own copy, which the optimizer writes through to them.
  std::unique_ptr<ModelWeights> master, working;
  std::vector<std::unique_ptr<TrainableQwen3VL>> replicas;
  int n_replicas = 1;
  if (on_gpu) {
    const ParamSpecs specs(*params, frozen, gpu->compute_dtype());
    master = allocate_state(*gpu, cfg, specs);
    working = allocate_weights(*gpu, cfg);
    upload_weights(*gpu, *master, *params);
    upload_weights(*gpu, *working, *params);
    // The host copy served the load (or the random draw) only: checkpoints read the device.
    params.reset();
    replicas.push_back(std::make_unique<TrainableQwen3VL>(*gpu, cfg, *working, limits));
    if (pipelined) {
      // As on the CPU: a model per micro-batch 1F1B keeps in flight, over one gradient buffer.
      const int slots =
          pipeline_slots(dp.stage(), dp.stages(),
                         static_cast<int>(r.train.global_batch_size / micro / dp.replicas()));
      for (int k = 1; k < slots; ++k)
        replicas.push_back(
            std::make_unique<TrainableQwen3VL>(*gpu, cfg, *working, limits, &replicas[0]->grads()));
    }
  } else {
    if (frozen.vision_tower || frozen.merger || frozen.language_model) {
      const ParamSpecs specs(*params, frozen, cpu->compute_dtype());
      master = allocate_state(*cpu, cfg, specs);
      upload_weights(*cpu, *master, *params);
    }
    // A small model's ops are too small to split across threads without most of the time going
    // to barriers, so each thread trains whole micro-batches on a replica of its own
    // (activations and gradients; the parameters are shared) and the replicas' gradients are
    // summed before the optimizer step. A large model keeps one replica and splits each op
    // instead: a replica costs a second copy of the gradients.
    constexpr int64_t kReplicaGradientBudget = int64_t(1) << 30;
    const int64_t n_micro = r.train.global_batch_size / micro;
    // Of a multi-process run, each rank is one replica (data_parallel.h): the ranks' gradients
    // are then summed as a single process sums its replicas'.
    n_replicas =
        n_params * int64_t(sizeof(float)) <= kReplicaGradientBudget && dp.world() == 1 && !graphs_on
            ? static_cast<int>(std::min<int64_t>(omp_get_max_threads(), n_micro))
            : 1;
    if (pipelined) {
      // A stage keeps the activations of every micro-batch 1F1B has in flight on it, in models
      // of their own over one gradient buffer.
      const int slots =
          pipeline_slots(dp.stage(), dp.stages(), static_cast<int>(n_micro / dp.replicas()));
      replicas.push_back(std::make_unique<TrainableQwen3VL>(*cpu, cfg, *params, limits));
      for (int k = 1; k < slots; ++k)
        replicas.push_back(
            std::make_unique<TrainableQwen3VL>(*cpu, cfg, *params, limits, &replicas[0]->grads()));
    } else {
      for (int k = 0; k < n_replicas; ++k)
        replicas.push_back(std::make_unique<TrainableQwen3VL>(*cpu, cfg, *params, limits));
    }
  }
  // The weights the model reads; the master weights the optimizer updates (these weights
  // themselves on the CPU with nothing frozen); the copy it writes through to, if any.
  ModelWeights& weights = on_gpu ? *working : *params;
  ModelWeights& master_weights = master ? *master : weights;
  ModelWeights* const written_through = master ? &weights : nullptr;
  // Graphs: one replica (a capture is per backend, which the CPU's replica threads share).
  std::unique_ptr<GraphApi> graph_api;
  if (graphs_on) {
    graph_api = make_graph_api(replicas[0]->backend());
    TrainGraphs tg;
    tg.decoder = r.cuda_graph.language.impl;
    tg.decoder_modules = r.cuda_graph.language.modules;
    tg.vision = r.cuda_graph.vision.impl == VisionGraphImpl::local;
    tg.vision_modules = r.cuda_graph.vision.modules;
    tg.warmup_runs = r.cuda_graph.language.warmup_steps;
    tg.overflow_is_error = r.cuda_graph.vision.overflow == VisionGraphOverflow::error;
    // This replica's micro-batches of a step (data_parallel.h: micro-batch i is replica
    // i % replicas'), which a full_iteration step graph plans input slots for; a pipeline stage
    // exchanges with its neighbours between micro-batches, so its graphs stop there.
    tg.step_micro_batches = pipelined ? 0
                                      : static_cast<int>((r.train.global_batch_size / micro +
                                                          dp.replicas() - 1 - dp.replica()) /
                                                         dp.replicas());
    // Graph replicas are pipeline slots (one thread runs them in turn); CPU micro-batch threads
    // keep graphs off.
    for (auto& m : replicas) m->use_graphs(*graph_api, tg);
  }
  // The graphs go before the API that destroys them, on every way out of this function.
  struct GraphsFirst {
    std::vector<std::unique_ptr<TrainableQwen3VL>>* models;
    ~GraphsFirst() {
      if (models != nullptr)
        for (auto& m : *models) m->delete_graphs();
    }
  } graphs_first{graphs_on ? &replicas : nullptr};
  TrainableQwen3VL& model = *replicas[0];
  Backend& be = model.backend();
  // A step's writes (its micro-batches' inputs and the optimizer's few values) stage at once, so
  // the host queues the step without waiting for the device's copies of its first micro-batches.
  be.reserve_write_staging(static_cast<size_t>(r.train.global_batch_size / micro) *
                               model.write_bytes_per_micro_batch() +
                           (size_t{1} << 16));
  // ZeRO-1: each rank keeps the optimizer state of its shard (on the GPU with the f32 master
  // weights of the shard; the bf16 weights the model reads are gathered whole every step). A
  // pipeline stage's replicas shard the stage's tensors; with one replica there is nothing to
  // shard them over.
  const bool sharded = r.optimizer.distributed && dp.replicas() > 1;
  // A stage's data-parallel group sums only the gradients the stage computes (the rest are zero):
  // runs of its tensors in the flat gradients, alignment gaps between them included, so that the
  // group makes few exchanges.
  std::vector<std::pair<int64_t, int64_t>> reduce_ranges;
  if (pipelined) {
    const ModelWeights& g = model.grads();
    std::vector<std::tuple<int64_t, int64_t, bool>> tensors;  // begin, end, held
    for (const WeightBinding& b : g.bindings) {
      if (!b.allocated()) continue;  // frozen: no gradient
      const Tensor t = b.tensor();
      const auto begin = static_cast<int64_t>(
          (static_cast<const char*>(t.data) - static_cast<const char*>(g.arena.base())) /
          sizeof(float));
      tensors.emplace_back(begin, begin + t.numel(), model.holds(b.hf_name));
    }
    std::sort(tensors.begin(), tensors.end());
    bool extend = false;
    for (const auto& [begin, end, held] : tensors) {
      if (held && extend)
        reduce_ranges.back().second = std::max(reduce_ranges.back().second, end);
      else if (held)
        reduce_ranges.push_back({begin, end});
      extend = held;
    }
  }
  ModelWeights* const rank0_weights[] = {&master_weights, written_through};
  const DataParallel::Link dp_link =
      dp.connect(be, model.grads(), rank0_weights, 2, /*reduce_gradients=*/!sharded, reduce_ranges);
  // Each bucket's all-reduce starts during the backward of the step's last micro-batch, once its
  // gradients are final.
  if (const auto hook = dp.gradients_final_hook())
    for (auto& m : replicas) m->on_gradients_final(hook);
  // A pipeline stage updates the tensors it computes, and the gradient norm is the pipeline's.
  StageTensors stage_tensors;
  if (pipelined) {
    stage_tensors.stages = dp.pipeline_communicator();
    for (const PipelineStage& st : stages) {
      stage_tensors.held.emplace_back();
      for (const WeightBinding& b : weights.bindings)
        stage_tensors.held.back().push_back(stage_holds(st, cfg.tie_word_embeddings, b.hf_name));
    }
  }
  AdamW opt(be, cfg, master_weights, model.grads(), ac, written_through,
            sharded ? dp.data_parallel_communicator() : nullptr, int64_t(1) << 25,
            pipelined ? &stage_tensors : nullptr);
  // Tied embeddings across stages: room for the other stage's gradient (and, sharded, for the
  // sum over the stage's replicas), allocated once.
  const bool tied_across = pipelined && cfg.tie_word_embeddings && !frozen.language_model &&
                           (dp.stage() == 0 || dp.stage() == dp.stages() - 1);
  Arena tied_arena;
  Tensor tied_scratch;
  if (tied_across) {
    const int64_t n = dp.tied_scratch_elements(model.grads().text.embed.numel());
    Arena plan;
    plan.alloc(DType::f32, {n});
    tied_arena = Arena(be, plan.used());
    tied_scratch = tied_arena.alloc(DType::f32, {n});
  }
  if (!resume_dir.empty()) opt.load(optimizer_files(resume_dir));
  const LrSchedule schedule(
      parse_lr_schedule_kind(r.schedule.kind), static_cast<float>(r.optimizer.lr),
      static_cast<float>(r.optimizer.min_lr), r.schedule.warmup_iters,
      r.schedule.decay_iters > 0 ? r.schedule.decay_iters : r.train.train_iters);

  const std::string resolved = recipe_to_yaml(r);
  if (dp.writer())
    write_file_atomic((fs::path(run_dir) / "resolved_config.yaml").string(), resolved);

  // MFU's denominator, when the device is one whose peak is known.
  const DevicePeak peak = dense_bf16_peak(be.device(), be.name());
  MetricsLog::Options lo;
  lo.ranks = dp.world();
  lo.peak_flops_per_second = peak.flops_per_second;
  lo.run_dir = run_dir;
  lo.metrics_file = r.logging.metrics_file;
  lo.plot_file = r.logging.plot;
  lo.total_iterations = r.train.train_iters;
  lo.progress_bar = options.progress_bar;
  lo.out = options.out;
  // Ranks other than 0 train silently: one log, one metrics file.
  std::unique_ptr<FILE, int (*)(FILE*)> quiet(nullptr, &std::fclose);
  if (!dp.writer()) {
    quiet.reset(std::fopen("/dev/null", "w"));
    IRIS_CHECK(quiet != nullptr, "cannot open /dev/null for rank ", dp.rank(), "'s silent log");
    lo = MetricsLog::Options{"", "", "", r.train.train_iters, false, quiet.get(), dp.world(), 0};
  }
  MetricsLog log(lo, state.iteration);
  for (const std::string& w : found.warnings) log.message(w);
  if (!opt.reinitialised_parts().empty()) {
    std::string parts;
    for (const std::string& p : opt.reinitialised_parts())
      parts += str_cat(parts.empty() ? "" : ", ", p);
    log.message(str_cat("note: the checkpoint has no optimizer state for ", parts,
                        " (frozen in the run that wrote it); its AdamW moments and step counts "
                        "start at zero"));
  }
  log.message(chat.describe());
  if (!chat.has_template() && !chat.kwargs().empty())
    log.message("note: data.enable_thinking has no effect: the built-in ChatML has no variables");
  if (!resume_dir.empty())
    for (const std::string& change : data_changes(state.data_files, data_files))
      log.message(str_cat("warning: ", change, "; the resumed run continues at epoch ",
                          state.data_position.epoch, ", sample ", state.data_position.index,
                          " of the data as it is now, so samples may be skipped or repeated"));

  log.message(
      str_cat(resume_dir.empty() ? "starting" : "resuming from " + resume_dir + " at",
              " iteration ", state.iteration, " of ", r.train.train_iters, ": ", n_params,
              " parameters, global batch ", r.train.global_batch_size, " = ",
              r.train.micro_batch_size, " x ", r.accumulation_steps, " accumulation steps",
              dp.replicas() > 1 ? str_cat(" x ", dp.replicas(), " data-parallel ranks") : "",
              pipelined ? str_cat(", through ", dp.stages(), " pipeline stages") : "", ", on ",
              be.name(), ", activation arena ", model.arena_bytes() / (1024 * 1024), " MiB",
              n_replicas > 1 ? str_cat(" x ", n_replicas, " micro-batch threads") : "",
              ", run directory ", run_dir));
  {
    // The memory planned for the run, by category; nothing is allocated once steps begin.
    const auto mib = [](size_t b) { return str_cat(b / (size_t(1) << 20), " MiB"); };
    std::string plan = str_cat("memory on ", be.name(), ": weights ",
                               mib(weights.arena.capacity()));
    if (master) plan += str_cat(", f32 master weights ", mib(master->arena.capacity()));
    plan += str_cat(", gradients ", mib(model.grads().arena.capacity()), " x ", n_replicas,
                    ", AdamW moments ", mib(opt.state_bytes()), ", activations ",
                    mib(model.activation_bytes()), " (train.recompute ", r.train.recompute,
                    ") and workspace ", mib(model.arena_bytes() - model.activation_bytes()), " x ",
                    replicas.size(),
                    pipelined ? " (this stage's parts, per micro-batch in flight)" : "");
    if (opt.shards() > 1)
      plan += str_cat("; the AdamW moments are this rank's 1/", opt.shards(),
                      pipelined ? " of its stage's" : "",
                      " (optimizer.distributed), exchange scratch ", mib(opt.exchange_bytes()));
    else if (r.optimizer.distributed && pipelined)
      plan +=
          "; optimizer.distributed has no replicas to shard a stage's moments over "
          "(parallel.data_parallel_size 1): each stage keeps its own";
    if (dp.world() > 1)
      plan +=
          ", " + dp.describe(graphs_on && r.cuda_graph.language.impl == GraphImpl::full_iteration);
    if (graphs_on) {
      std::string tb, vb;
      for (int64_t b : limits.text_buckets) tb += str_cat(tb.empty() ? "" : ",", b);
      for (int64_t b : limits.vision_buckets) vb += str_cat(vb.empty() ? "" : ",", b);
      auto scope = [](const std::vector<GraphModule>& modules) {
        if (modules.empty()) return std::string();
        std::string m;
        for (GraphModule g : modules) m += str_cat(m.empty() ? "" : ",", to_string(g));
        return " (" + m + ")";
      };
      plan += str_cat("; graphs: decoder ", to_string(r.cuda_graph.language.impl),
                      scope(r.cuda_graph.language.modules), ", vision ",
                      to_string(r.cuda_graph.vision.impl), scope(r.cuda_graph.vision.modules),
                      ", captured after ", r.cuda_graph.language.warmup_steps,
                      " eager runs of a shape; text buckets [", tb, "], vision buckets [", vb, "]");
    }
    log.message(plan);
  }
  log.message("peak for MFU: " + peak.source);
  if (dp.world() > 1) log.message(dp.layout(r.train.global_batch_size / micro, micro));
  if (pipelined) {
    // Which graphs each stage captures: its own layers', and the encoder's on stage 0 only.
    std::vector<std::string> graph_sets;
    for (const PipelineStage& st : stages) {
      std::string g;
      if (r.cuda_graph.language.impl != GraphImpl::none)
        g = str_cat("decoder ", to_string(r.cuda_graph.language.impl), " (layers ", st.first_layer,
                    "-", st.end_layer - 1, ")");
      if (st.has_vision && r.cuda_graph.vision.impl != VisionGraphImpl::none &&
          r.cuda_graph.language.impl != GraphImpl::full_iteration)
        g += str_cat(g.empty() ? "" : ", ", "vision ", to_string(r.cuda_graph.vision.impl));
      graph_sets.push_back(g);
    }
    log.message(str_cat(
        "pipeline stages (",
        r.parallel.pipeline_layers.empty() ? "split by training FLOPs" : "parallel.pipeline_layers",
        "; stage s keeps the activations of min(", dp.stages(),
        " - s, micro-batches per replica) micro-batches):\n",
        describe_pipeline(stages, dp.replicas(), graph_sets)));
  }
  // After the weights are drawn and uploaded, which use every core. OMP_NUM_THREADS, when set,
  // is the user's own choice.
  if (on_gpu && std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = omp_get_num_procs();
    const int local = dp.local_processes();
    const int threads = gpu_host_threads(cores, local, r.data.config.num_workers);
    omp_set_num_threads(threads);
    log.message(str_cat("host threads: ", threads, " (", cores, " cores",
                        local > 1 ? str_cat(" shared by ", local, " processes") : std::string(),
                        ", less ", r.data.config.num_workers,
                        " data workers and the step's own thread; OMP_NUM_THREADS overrides)"));
  }
  if (!resume_dir.empty() && state.threads > 0 && state.threads != omp_get_max_threads())
    log.message(str_cat("note: the checkpoint was written with ", state.threads,
                        " threads and this run has ", omp_get_max_threads(),
                        "; losses will differ from an uninterrupted run in the last bits (set "
                        "OMP_NUM_THREADS=",
                        state.threads, " for an exact continuation)"));

  const TrainedParts parts{!r.train.freeze_vision_tower, !r.train.freeze_merger,
                           !r.train.freeze_language_model};
  TrainResult result;
  result.run_dir = run_dir;
  result.start_iteration = state.iteration;
  result.last_checkpoint = resume_dir;

  // Pipelined: every rank calls it. Rank 0 makes step_N.tmp, the first replica of each stage
  // writes the tensors (and their moments) that its stage owns as one shard, and once all have
  // written, rank 0 adds the shard index, the side files and the trainer state and renames it.
  auto save_pipelined = [&](int64_t iteration) {
    const fs::path d = fs::path(run_dir) / (checkpoint_name(iteration) + ".tmp");
    if (dp.writer()) begin_checkpoint(run_dir, iteration);
    dp.barrier("the checkpoint directory");
    const int P = dp.stages();
    std::vector<int> owner;
    for (size_t i = 0; i < weights.bindings.size(); ++i) owner.push_back(stage_tensors.owner(i));
    if (dp.replica() == 0) {
      const int me = dp.stage();
      std::set<std::string> mine;
      for (size_t i = 0; i < owner.size(); ++i)
        if (owner[i] == me) mine.insert(weights.bindings[i].hf_name);
      save_model_weights(be, master_weights, weights, (d / stage_file("model", me, P)).string(),
                         [&](const std::string& name) { return mine.count(name) > 0; });
      opt.save((d / stage_file("optimizer", me, P)).string());
    }
    dp.barrier("the checkpoint's stage files");
    if (!dp.writer()) return;
    state.data_position = train_data.position();
    state.data_seed = r.data.config.seed;
    state.threads = omp_get_max_threads();
    state.data_files = data_files;
    json weight_map = json::object();
    int64_t total = 0;
    for (size_t i = 0; i < weights.bindings.size(); ++i) {
      const WeightBinding& b = weights.bindings[i];
      weight_map[b.hf_name] = stage_file("model", owner[i], P);
      total += b.tensor().numel() * int64_t(sizeof(float));
    }
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic((d / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    write_file_atomic((d / "config.json").string(), config_text);
    for (const auto& [name, text] : side.files) write_file_atomic((d / name).string(), text);
    write_file_atomic((d / "resolved_config.yaml").string(), resolved);
    state.files = list_checkpoint_files(d.string());
    save_trainer_state((d / kStateFile).string(), state);
    result.last_checkpoint = finish_checkpoint(run_dir, iteration);
    log.message("saved checkpoint " + result.last_checkpoint);
    owned.push_back(iteration);
    prune_checkpoints(run_dir, owned, r.checkpoint.keep_last);
  };

  auto save = [&](int64_t iteration) {
    if (pipelined) return save_pipelined(iteration);
    if (!dp.writer()) return;
    state.data_position = train_data.position();
    state.data_seed = r.data.config.seed;
    state.threads = omp_get_max_threads();
    state.data_files = data_files;
    result.last_checkpoint = commit_checkpoint(run_dir, iteration, [&](const std::string& dir) {
      const fs::path d(dir);
      save_model_weights(be, master_weights, weights, (d / "model.safetensors").string());
      opt.save((d / kOptimizerFile).string());
      write_file_atomic((d / "config.json").string(), config_text);
      for (const auto& [name, text] : side.files) write_file_atomic((d / name).string(), text);
      write_file_atomic((d / "resolved_config.yaml").string(), resolved);
      // Last: it lists the files above with their sizes, and checkpoint_complete() checks them.
      state.files = list_checkpoint_files(dir);
      save_trainer_state((d / kStateFile).string(), state);
    });
    log.message("saved checkpoint " + result.last_checkpoint);
    owned.push_back(iteration);
    prune_checkpoints(run_dir, owned, r.checkpoint.keep_last);
  };

  // Samples whose images exceed the planned activation memory are skipped, deterministically, so
  // a resumed run skips the same ones.
  int64_t skipped_large = 0;
  auto next_sample = [&](Dataset& data) {
    for (int64_t tries = 0;; ++tries) {
      Sample s = data.next();
      if (count_patches(s.grids) <= limits.max_patches) return to_train_sample(std::move(s));
      ++skipped_large;
      IRIS_CHECK(tries <= data.size(),
                 "no sample fits train.max_vision_patches = ", limits.max_patches,
                 " (the last one, ", s.source, ", has ", count_patches(s.grids),
                 " patches); raise it or lower data.max_pixels");
    }
  };

  auto evaluate = [&](int64_t iteration) {
    eval_data->seek(DataPosition{});
    EvalMetrics em;
    em.iteration = iteration;
    double loss_sum = 0;
    std::vector<TrainSample> eval_batch;
    for (int64_t b = 0; b < r.train.eval_iters * r.train.global_batch_size; b += micro) {
      eval_batch.clear();
      for (int64_t i = 0; i < micro; ++i) eval_batch.push_back(next_sample(*eval_data));
      std::vector<const TrainSample*> mb;
      for (const TrainSample& s : eval_batch) mb.push_back(&s);
      if (pipelined) {
        // Forward only, one micro-batch at a time through the stages.
        em.labelled_tokens += model.stage_prepare(mb, 0.0f, /*forward_only=*/true);
        dp.stage_exchange({}, model.forward_inputs(), {}, {}, "the evaluation's forward receive");
        model.stage_forward();
        dp.stage_exchange({}, {}, model.forward_outputs(), {}, "the evaluation's forward send");
        dp.mark_progress();
        // Read per micro-batch and added in f64, as forward() is (zero before the last stage).
        loss_sum += model.take_forward_loss_sum();
      } else {
        const LossStats ls = model.forward(mb);
        loss_sum += ls.loss_sum;
        em.labelled_tokens += ls.n_tokens;
      }
      em.samples += micro;
    }
    if (pipelined) {
      // Every pipeline evaluates the whole set: the last stage of the first one counts.
      loss_sum = dp.global_loss_sum(dp.replica() == 0 ? loss_sum : 0.0);
    }
    em.loss = em.labelled_tokens > 0 ? loss_sum / em.labelled_tokens : 0.0;
    log.log_eval(em);
  };

  StepMetrics interval;
  // This run's intervals, and the most device memory seen, for run_summary.json.
  std::vector<StepMetrics> run_intervals;
  int64_t peak_memory = 0;
  StepTimer step_timer(be);
  // A pipeline stage's graphs are those of all its micro-batch models.
  auto graph_count = [&] {
    size_t n = 0;
    for (const auto& m : replicas) n += m->graph_count();
    return n;
  };
  auto capture_ms = [&] {
    double ms = 0;
    for (const auto& m : replicas) ms += m->capture_ms();
    return ms;
  };
  size_t graphs_at_interval_start = graph_count();
  double interval_loss_sum = 0;
  int64_t unread_labels = 0;  // labelled tokens of the steps whose loss is still on the device
  auto interval_start = std::chrono::steady_clock::now();
  std::vector<TrainSample> batch;
  batch.reserve(static_cast<size_t>(r.train.global_batch_size));
  std::vector<std::vector<const TrainSample*>> micro_batches;
  log.progress(state.iteration);
  // A stop asked for before the first step leaves nothing new to save.
  result.stop_signal = dp.agreed_stop(stop.received());
  for (int64_t it = state.iteration + 1; it <= r.train.train_iters && !result.stop_signal; ++it) {
    const auto fetch_start = std::chrono::steady_clock::now();
    batch.clear();
    int64_t batch_labels = 0;
    for (int64_t i = 0; i < r.train.global_batch_size; ++i) {
      batch.push_back(next_sample(train_data));
      batch_labels += labelled_positions(batch.back().labels);
    }
    IRIS_CHECK(batch_labels > 0, "global batch of iteration ", it,
               " has no labelled token; every sample needs an assistant reply");
    interval.data_seconds += seconds_since(fetch_start);

    // A probed step is queued while the device, idle after the synchronisation, is held: its
    // host enqueue is then the host's own work, where a busy device makes the host wait in
    // launches once the launch queue is full (a compute-bound step's host figure is mostly that).
    const bool probed = it > r.train.train_iters - r.logging.host_probe_steps;
    if (probed) {
      be.synchronize();
      be.hold_device(kHostProbeHoldSeconds);
    }
    const auto step_start = std::chrono::steady_clock::now();
    // Waits and host times outside the step (an evaluation, a checkpoint) are not the step's.
    be.take_write_wait_seconds();
    for (auto& m : replicas) m->take_host_seconds();
    step_timer.begin_step();
    model.zero_grads();
    const float grad_scale = static_cast<float>(1.0 / static_cast<double>(batch_labels));
    // This rank's micro-batches (all of them for a single process).
    micro_batches.clear();
    int64_t share_labels = 0;
    for (size_t i = 0; i < batch.size(); i += static_cast<size_t>(micro)) {
      if (!dp.owns(static_cast<int64_t>(i) / micro)) continue;
      micro_batches.emplace_back();
      for (size_t j = i; j < i + static_cast<size_t>(micro); ++j) {
        micro_batches.back().push_back(&batch[j]);
        share_labels += labelled_positions(batch[j].labels);
      }
    }
    // Micro-batch i runs on replica i % n_replicas, each replica's in order, and the replicas are
    // summed in order: the result depends on the thread count but not on timing.
    const int64_t counted = pipelined ? run_pipeline_step(replicas, micro_batches, grad_scale, dp)
                                      : run_on_replicas(replicas, micro_batches, grad_scale);
    for (int k = 1; k < n_replicas; ++k) replicas[k]->move_grads_into(model);
    dp.reduce_gradients();
    if (tied_across) dp.sum_tied_gradient(be, model.grads().text.embed, tied_scratch, sharded);
    for (size_t i = 0; i < batch.size(); ++i) {
      const TrainSample& s = batch[i];
      interval.tokens += static_cast<int64_t>(s.ids.size());
      interval.flops += training_flops(
          cfg, {static_cast<int64_t>(s.ids.size()), labelled_positions(s.labels), s.grids}, parts);
    }
    IRIS_CHECK(counted == share_labels, "the model counted ", counted,
               " labelled tokens in iteration ", it, " but the labels hold ", share_labels,
               "; the loss normalisation would be wrong (label convention mismatch)");
    const float lr = schedule.at(it - 1);
    // Queued behind the backward: the loss and the gradient norm stay on the device until the
    // next logged step (a step with a non-finite gradient changes no weight meanwhile).
    opt.step(lr, model.frozen());
    // The step's end, which the GPU must reach within parallel.timeout_seconds (NCCL has no
    // timeout of its own); no host wait.
    dp.mark_progress();
    // Waits for the device inside the step's writes are throttling, not enqueue work.
    const double waited = be.take_write_wait_seconds();
    interval.host_wait_seconds += waited;
    for (auto& m : replicas) {
      const TrainableQwen3VL::HostSeconds h = m->take_host_seconds();
      interval.host_prepare_seconds += h.prepare;
      interval.graph_launch_seconds += h.graph_launch;
      interval.graph_launch_cpu_seconds += h.graph_launch_cpu;
    }
    interval.host_seconds += seconds_since(step_start) - waited;
    step_timer.end_step();
    ++interval.steps;
    if (probed) {
      ++interval.probed_steps;
      if (be.release_device()) ++interval.probe_queue_full;
    }

    state.iteration = it;
    state.consumed_samples += r.train.global_batch_size;
    for (const TrainSample& s : batch) state.consumed_tokens += static_cast<int64_t>(s.ids.size());
    interval.labelled_tokens += batch_labels;
    interval.samples += r.train.global_batch_size;
    unread_labels += batch_labels;
    result.final_iteration = it;

    // Intervals end at multiples of log_interval; after a resume the first one starts at the
    // checkpoint, so its averages cover fewer steps than an uninterrupted run's would.
    const bool saving = (r.checkpoint.save_interval > 0 && it % r.checkpoint.save_interval == 0) ||
                        (it == r.train.train_iters && r.checkpoint.save_final);
    // A probed step is an interval of its own, kept out of the steady state.
    const bool interval_ends = it % r.logging.log_interval == 0 || it == r.train.train_iters ||
                               probed || it == r.train.train_iters - r.logging.host_probe_steps;
    if (interval_ends || saving) {
      // The one read of the interval: its summed loss and each step's gradient norm.
      double loss_sum = 0;
      for (auto& m : replicas) loss_sum += m->take_loss_sum();
      loss_sum = dp.global_loss_sum(loss_sum);
      const std::vector<float> norms = opt.take_grad_norms();
      const int64_t first = it - static_cast<int64_t>(norms.size()) + 1;
      for (size_t k = 0; k < norms.size(); ++k)
        IRIS_CHECK(std::isfinite(norms[k]), "the gradient norm is ", norms[k], " at iteration ",
                   first + static_cast<int64_t>(k),
                   " (NaN or overflow in the backward; that step changed no weight); lower "
                   "optimizer.lr or check the data (the last checkpoint is ",
                   result.last_checkpoint.empty() ? "none" : result.last_checkpoint, ")");
      const double loss = loss_sum / static_cast<double>(unread_labels);
      IRIS_CHECK(std::isfinite(loss), "the loss is ", loss, " in iterations ", first, "-", it,
                 "; lower optimizer.lr or check the data (the last checkpoint is ",
                 result.last_checkpoint.empty() ? "none" : result.last_checkpoint, ")");
      result.last_loss = loss;
      interval_loss_sum += loss_sum;
      unread_labels = 0;
    }
    if (interval_ends) {
      interval.iteration = it;
      interval.loss = interval_loss_sum / static_cast<double>(interval.labelled_tokens);
      interval.learning_rate = lr;
      interval.grad_norm = opt.last_grad_norm();
      interval.seconds = seconds_since(interval_start);
      // On the GPU memory is planned up front, so what the device holds now is its peak.
      interval.memory_bytes =
          on_gpu ? static_cast<int64_t>(gpu->device_memory_in_use()) : peak_host_memory_bytes();
      // The loss read above waited for the device, so these marks are complete.
      interval.device_seconds = step_timer.take_seconds();
      interval.graphs_captured = static_cast<int64_t>(graph_count() - graphs_at_interval_start);
      graphs_at_interval_start = graph_count();
      peak_memory = std::max(peak_memory, interval.memory_bytes);
      log.log(interval);
      run_intervals.push_back(interval);
      interval = StepMetrics{};
      interval_loss_sum = 0;
      interval_start = std::chrono::steady_clock::now();
    }
    if (eval_data && it % r.train.eval_interval == 0) evaluate(it);
    // A sharded optimizer's state comes to rank 0 from every rank.
    if (saving) opt.gather_state();
    if (saving) save(it);
    log.progress(it);
    // Every rank stops after the same step, whichever of them the signal reached.
    const int stop_signal = dp.agreed_stop(stop.received());
    if (stop_signal != 0) {
      if (!saving) opt.gather_state();
      if (!saving) save(it);
      result.stop_signal = stop_signal;
    }
  }
  if (result.stop_signal != 0)
    log.message(str_cat(
        "stopped by ", result.stop_signal == SIGINT ? "SIGINT" : "SIGTERM", " at iteration ",
        result.final_iteration > 0 ? result.final_iteration : state.iteration, " of ",
        r.train.train_iters,
        result.last_checkpoint.empty() ? std::string("; no checkpoint yet")
                                       : "; the last checkpoint is " + result.last_checkpoint,
        ": run the same command to resume"));
  const DataStats& ds = train_data.stats();
  if (ds.dropped_too_long > 0 || ds.bad_samples > 0) {
    std::string text =
        str_cat("data: ", ds.dropped_too_long, " samples longer than ", r.train.seq_length,
                " tokens skipped, ", ds.bad_samples, " unusable lines skipped");
    for (const std::string& e : ds.bad_examples) text += "\n  " + e;
    log.message(text);
  }
  if (skipped_large > 0)
    log.message(str_cat("data: ", skipped_large, " samples with more than ", limits.max_patches,
                        " vision patches skipped (train.max_vision_patches)"));
  if (result.final_iteration == 0) result.final_iteration = state.iteration;
  if (const std::string o = dp.overlap_summary(); !o.empty()) log.message(o);
  if (graphs_on) {
    const auto& p = model.padding_stats();
    log.message(str_cat("graphs: ", graph_count(), " captured in ", int(capture_ms()),
                        " ms; padding: ", p.tokens, " of ", p.padded_tokens, " tokens and ",
                        p.patches, " of ", p.padded_patches, " patch rows and ", p.labels, " of ",
                        p.label_slots, " label slots real; ", model.overflow_runs(),
                        " micro-batches above the largest bucket ran eagerly"));
    if (on_gpu) {
      // What the graphs hold, by set: the largest one names the shape that costs most.
      std::pair<std::string, int64_t> largest{"", -1};
      int64_t total = 0;
      size_t sets = 0;
      for (const auto& m : replicas)
        for (const auto& set : m->graph_memory_by_set()) {
          total += set.second;
          ++sets;
          if (set.second > largest.second) largest = set;
        }
      if (sets > 0)
        log.message(str_cat("graph memory: ", total >> 20, " MiB in ", sets, " graphs; largest '",
                            largest.first, "', ", largest.second >> 20, " MiB"));
    }
  }
  if (dp.writer()) {
    RunSummary sum;
    sum.device = be.name();
    sum.on_gpu = on_gpu;
    sum.ranks = dp.world();
    sum.start_iteration = result.start_iteration;
    sum.final_iteration = result.final_iteration;
    sum.stop_signal = result.stop_signal;
    sum.micro_batch_size = r.train.micro_batch_size;
    sum.global_batch_size = r.train.global_batch_size;
    sum.seq_length = r.train.seq_length;
    sum.recompute = r.train.recompute;
    sum.intervals = run_intervals;
    sum.peak = peak;
    sum.peak_memory_bytes =
        on_gpu ? std::max(peak_memory, static_cast<int64_t>(gpu->device_memory_in_use()))
               : peak_host_memory_bytes();
    sum.decoder_graphs = to_string(r.cuda_graph.language.impl);
    sum.vision_graphs = to_string(r.cuda_graph.vision.impl);
    sum.graph_count = static_cast<int64_t>(graph_count());
    sum.capture_ms = capture_ms();
    sum.graph_memory_bytes = model.graph_memory_bytes();
    sum.overflow_runs = model.overflow_runs();
    for (const auto& m : replicas) {
      const auto& p = m->padding_stats();
      sum.tokens += p.tokens;
      sum.padded_tokens += p.padded_tokens;
      sum.patches += p.patches;
      sum.padded_patches += p.padded_patches;
      sum.labels += p.labels;
      sum.label_slots += p.label_slots;
    }
    const SteadyState st = steady_state(run_intervals);
    const auto g4 = [](double v) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.4g", v);
      return std::string(buf);
    };
    const double per_rank = static_cast<double>(dp.world());
    if (st.steps > 0)
      log.message(str_cat(
          "steady state (iterations ", st.first_iteration, "-", st.last_iteration, "): step ",
          g4(st.step_seconds), " s (data ", g4(st.data_seconds), ", host enqueue ",
          g4(st.host_seconds), " (preparing inputs ", g4(st.host_prepare_seconds),
          ", launching graphs ", g4(st.graph_launch_seconds), "), host waiting for write staging ",
          g4(st.host_wait_seconds), ", device ", g4(st.device_seconds), "), ",
          g4(st.tokens_per_second / per_rank), " tokens/s and ",
          g4(st.flops_per_second / per_rank / 1e12), " model TFLOP/s per ",
          on_gpu ? "GPU" : "process",
          peak.flops_per_second > 0
              ? ", MFU " + g4(100 * st.flops_per_second / per_rank / peak.flops_per_second) + "%"
              : std::string()));
    else
      log.message(
          "steady state: none (it starts after the first logged interval and after the last "
          "graph capture; run more iterations or lower logging.log_interval)");
    const std::string summary_path = (fs::path(run_dir) / "run_summary.json").string();
    write_file_atomic(summary_path, run_summary_json(sum));
    log.message("run summary: " + summary_path);
  }
  return result;
}

}  // namespace

TrainResult run_training(const Recipe& recipe, const TrainerOptions& options) {
  DataParallel dp(recipe.parallel);
  if (dp.world() == 1) return train(recipe, options, dp);
  // An error on one rank would leave the others waiting in their next exchange: it ends the job.
  try {
    return train(recipe, options, dp);
  } catch (const std::exception& e) {
    dp.abort_job(e);
  }
}

}  // namespace iris
