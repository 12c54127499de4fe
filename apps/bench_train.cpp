// iris bench --train: training throughput of a Qwen3-VL geometry with random weights, the step
// the trainer runs (packed micro-batches, gradient accumulation, clipping, AdamW with f32 master
// weights), beside the GEMM rate measured in the same run and, optionally, a peer's figures
// (bench/peers/hf_transformers_train.py) on the same geometry.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "apps/bench_common.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "bridge/random_weights.h"
#include "core/fs.h"
#include "core/op_profile.h"
#include "training/metrics_log.h"
#include "training/optimizer.h"
#include "training/param_spec.h"
#include "training/recipe.h"
#include "training/train_model.h"
#include "training/train_setup.h"

namespace iris {
namespace {

using nlohmann::json;

// Dense bf16 tensor-core peak of an H100 SXM and of an H200 (the same chip), the usual MFU
// denominator.
constexpr double kHopperBf16PeakTflops = 989.0;

// One sample as the peer builds it: the first half of the text, one image between its
// vision_start/end tokens, the second half of the text; the second half labelled.
TrainSample mock_sample(const ModelConfig& cfg, int64_t image_side, int64_t seq_tokens,
                        uint64_t seed) {
  const VisionConfig& v = cfg.vision;
  const int64_t side = image_side / v.patch_size;
  IRIS_CHECK(side > 0 && side % v.spatial_merge_size == 0 && side * v.patch_size == image_side,
             "--image ", image_side, " must be a multiple of ", v.patch_size * v.spatial_merge_size,
             " (patch size x merge size)");
  const GridTHW grid{1, side, side};
  const int64_t pads = count_patches({grid}) / v.merge_unit();
  const int64_t text = seq_tokens - pads - 2;
  IRIS_CHECK(text >= 2, "--seq ", seq_tokens, " leaves no room for text beside the image's ", pads,
             " tokens; raise --seq or lower --image");
  std::mt19937 rng(static_cast<uint32_t>(seed));
  // Ordinary text: below the vocabulary's end and its vision tokens (a small test vocabulary's
  // sit inside it).
  const int64_t below =
      std::min<int64_t>({150001, cfg.text.vocab_size, cfg.image_token_id, cfg.video_token_id,
                         cfg.vision_start_token_id, cfg.vision_end_token_id});
  IRIS_CHECK(below > 1, "the geometry leaves no ordinary text token below its vision tokens");
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(below - 1));
  TrainSample s;
  for (int64_t i = 0; i < text / 2; ++i) s.ids.push_back(tok(rng));
  s.ids.push_back(cfg.vision_start_token_id);
  s.ids.insert(s.ids.end(), static_cast<size_t>(pads), cfg.image_token_id);
  s.ids.push_back(cfg.vision_end_token_id);
  const size_t answer_start = s.ids.size();
  for (int64_t i = text / 2; i < text; ++i) s.ids.push_back(tok(rng));
  s.labels.assign(s.ids.size(), -100);
  for (size_t i = answer_start; i < s.ids.size(); ++i) s.labels[i] = s.ids[i];
  s.grids = {grid};
  std::normal_distribution<float> px(0.0f, 1.0f);
  s.pixel_values.resize(static_cast<size_t>(count_patches(s.grids) * v.patch_dim()));
  for (float& p : s.pixel_values) p = px(rng);
  return s;
}

}  // namespace

int run_bench_train(int argc, char** argv) {
  CLI::App app{
      "Benchmark training of a Qwen3-VL geometry with random weights: the trainer's step "
      "(packed micro-batches, accumulation, clipping, AdamW with f32 master weights).",
      "iris bench --train"};
  bool train = false;
  std::string config_path = "bench/configs/qwen3vl_2b.json", device = "auto", json_out, peer,
              recompute = "none";
  int64_t image = 896, seq = 4096, micro = 1, accumulation = 8;
  int steps = 3, warmup = 1;
  bool freeze_vision = false, freeze_merger = false, freeze_llm = false, profile = false;
  app.add_flag("--train", train, "benchmark training (this mode)")->required();
  app.add_option("--config", config_path, "HF config.json of the geometry")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_option("--image", image, "side of the one square image of each sample, in pixels")
      ->capture_default_str();
  app.add_option("--seq", seq, "tokens per sample, the image's included")->capture_default_str();
  app.add_option("--micro", micro, "samples packed into one micro-batch")->capture_default_str();
  app.add_option("--accumulation", accumulation, "micro-batches per optimizer step")
      ->capture_default_str();
  app.add_option("--steps", steps, "timed optimizer steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed optimizer steps first")->capture_default_str();
  app.add_option("--recompute", recompute, "train.recompute: none, selective or full")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_flag("--freeze-vision-tower", freeze_vision, "train.freeze_vision_tower");
  app.add_flag("--freeze-merger", freeze_merger, "train.freeze_merger");
  app.add_flag("--freeze-language-model", freeze_llm, "train.freeze_language_model");
  double capacity_factor = 0;
  bool pad_to_capacity = false;
  app.add_option("--moe-expert-capacity-factor", capacity_factor,
                 "model.moe_expert_capacity_factor: MoE geometries drop over each expert's "
                 "capacity, as Megatron does; 0: dropless")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--moe-pad-expert-input-to-capacity", pad_to_capacity,
               "model.moe_pad_expert_input_to_capacity (needs --moe-expert-capacity-factor)");
  int lora_rank = 0;
  double lora_alpha = 0;
  std::vector<std::string> lora_targets = PeftRecipe{}.target_modules;  // the recipe's default
  app.add_option("--lora-rank", lora_rank,
                 "peft.rank: train LoRA adapters of this rank on --lora-targets with the rest "
                 "frozen, as a recipe's peft section does (0: no adapters)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--lora-alpha", lora_alpha, "peft.alpha (default: the rank)");
  app.add_option("--lora-targets", lora_targets, "peft.target_modules (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--json", json_out, "also write the results as JSON to this file");
  app.add_flag("--profile", profile,
               "after the timed steps, run one more step op by op and print where its device time "
               "goes by op family, each against its floor (GEMMs at the measured GEMM rate, the "
               "rest's tensors at the measured copy rate); the step is also bracketed for a "
               "profiler started with its collection off (ncu --profile-from-start off)");
  app.add_option("--peer", peer,
                 "command printing the same figures as JSON, e.g. 'python3 "
                 "bench/peers/hf_transformers_train.py --config bench/configs/qwen3vl_2b.json "
                 "--text 3310 --accumulation 8'");
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris bench --train")) return 0;
  IRIS_USAGE_CHECK(micro > 0 && accumulation > 0 && steps > 0 && warmup >= 0,
                   "--micro, --accumulation and --steps must be positive, --warmup not negative");
  // The peer runs first, while this process holds no device memory: both need most of it.
  const json peer_results = peer.empty() ? json() : run_peer(peer);
  const std::string dev = device == "auto" ? (cuda_available() ? "cuda" : "cpu") : device;
  auto be = make_backend(dev);
  // As the trainer: cuBLASLt's first choices, neither timed nor cached, so that runs repeat bit
  // for bit.
  be->set_gemm_tuning(GemmTuning::heuristic);
  const bool on_gpu = be->device() == Device::cuda;
  config_path = find_bench_config(config_path);
  ModelConfig cfg = ModelConfig::from_file(config_path);
  const bool lora = lora_rank > 0;
  if (lora) {
    cfg.lora.rank = lora_rank;
    cfg.lora.alpha = lora_alpha > 0 ? lora_alpha : lora_rank;
    cfg.lora.target_modules = lora_targets;
    try {
      check_lora_targets(lora_targets, "--lora-targets");
    } catch (const Error& e) {
      throw UsageError(e.what());  // a flag's value: exit 2, as for every usage error
    }
    // PEFT's base: everything frozen but the adapters.
    freeze_vision = freeze_merger = freeze_llm = true;
  }
  IRIS_USAGE_CHECK(capacity_factor == 0 || cfg.text.any_sparse_layer(),
                   "--moe-expert-capacity-factor applies to MoE geometries; ", config_path,
                   " has no MoE layers");
  IRIS_USAGE_CHECK(!pad_to_capacity || capacity_factor > 0,
                   "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  const HardwareLimits hw = measure_limits(*be, !on_gpu, 5);

  const TrainSample sample = mock_sample(cfg, image, seq, 7);
  const int64_t patches = count_patches(sample.grids);
  TrainLimits limits;
  limits.max_samples = static_cast<int>(micro);
  limits.max_seq_len = seq * micro;
  limits.max_patches = patches * micro;
  limits.max_images = static_cast<int>(micro);
  limits.loss_chunk_rows = on_gpu ? 1024 : 256;
  limits.recompute = parse_recompute(recompute);
  limits.frozen = FreezeSpec{freeze_vision, freeze_merger, freeze_llm};
  // What trains, for the FLOP count; a tower keeps its block activations where anything in it
  // trains (under LoRA, its adapters), as the trainer plans it.
  const TrainedParts parts = trained_parts(cfg, limits.frozen);
  limits.vision_tower_frozen = !parts.vision_tower && !parts.vision_tower_adapters;
  limits.moe_capacity.factor = capacity_factor;
  limits.moe_capacity.pad = pad_to_capacity;

  // The weights the model reads, and the f32 master copy of the trainable ones (on the CPU with
  // nothing frozen, the weights themselves), as the trainer holds them.
  std::unique_ptr<ModelWeights> working = random_weights(*be, cfg, 1234), master;
  const bool any_frozen = freeze_vision || freeze_merger || freeze_llm;
  if (on_gpu || any_frozen) {
    master = allocate_state(*be, cfg, ParamSpecs(*working, limits.frozen, be->compute_dtype()));
    for (size_t i = 0; i < master->bindings.size(); ++i)
      if (master->bindings[i].allocated())
        be->convert(master->bindings[i].tensor(), working->bindings[i].tensor());
  }
  // The model and the optimizer issue their ops through the profile, which only times them while
  // it records (--profile).
  ProfilingBackend ops(*be);
  TrainableQwen3VL model(ops, cfg, *working, limits);
  AdamWConfig ac;
  ac.beta2 = 0.95f;
  ac.weight_decay = 0.1f;
  ac.clip_grad_norm = 1.0f;
  AdamW opt(ops, cfg, master ? master.get() : working.get(), model.grads(), ac,
            master ? working.get() : nullptr);

  const std::vector<const TrainSample*> mb(static_cast<size_t>(micro), &sample);
  const int64_t labels_per_sample = labelled_positions(sample.labels);
  const int64_t labels_per_step = micro * accumulation * labels_per_sample;
  const float grad_scale = 1.0f / static_cast<float>(labels_per_step);
  auto step = [&] {
    model.zero_grads();
    for (int64_t a = 0; a < accumulation; ++a) model.queue_forward_backward(mb, grad_scale);
    opt.step(1e-5f, model.frozen());
  };
  for (int i = 0; i < warmup; ++i) step();
  be->synchronize();
  (void)model.take_loss_sum();
  (void)model.take_moe_drops();
  (void)opt.take_grad_norms();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  // The one read of the run, as the trainer's per logged step.
  const double loss = model.take_loss_sum() / double(labels_per_step * steps);
  const std::vector<float> norms = opt.take_grad_norms();
  const double step_s = seconds_since(t0) / steps;
  const auto [dropped, routed] = model.take_moe_drops();
  IRIS_CHECK(std::isfinite(loss) && std::isfinite(norms.back()), "the benchmark's loss (", loss,
             ") or gradient norm (", norms.back(), ") is not finite");

  StepProfile step_prof;
  std::vector<OpFamilyTotal> step_ops;
  if (profile) {
    be->profiler_collect(true);
    ops.start();  // waits for the work before it
    const auto p0 = Clock::now();
    step();
    be->synchronize();
    const double wall_ms = 1e3 * seconds_since(p0);
    const std::vector<OpRecord> records = ops.stop();
    step_prof = step_profile(records, wall_ms);
    step_ops = totals_by_op(records);
    be->profiler_collect(false);
  }

  const double sample_flops = training_flops(
      cfg, {static_cast<int64_t>(sample.ids.size()), labels_per_sample, sample.grids}, parts);
  const double samples_per_step = double(micro * accumulation);
  const double tflops = sample_flops * samples_per_step / step_s / 1e12;
  const double tokens_per_s = double(seq) * samples_per_step / step_s;
  // On the GPU everything is planned before the first step, so what the device holds is the peak.
  const double mem_mib =
      double(on_gpu ? be->device_memory_in_use() : size_t(peak_host_memory_bytes())) / (1 << 20);

  json results{{"config", config_path},
               {"device", be->name()},
               {"image", image},
               {"tokens_per_sample", seq},
               {"micro_batch", micro},
               {"accumulation", accumulation},
               {"recompute", recompute},
               {"step_s", step_s},
               {"tokens_per_s", tokens_per_s},
               {"samples_per_s", samples_per_step / step_s},
               {"model_tflops", tflops},
               {"gemm_tflops_measured", hw.gemm_tflops},
               {"mfu_of_measured_gemm", tflops / hw.gemm_tflops},
               {"loss", loss},
               {on_gpu ? "device_memory_in_use_mib" : "peak_host_memory_mib", mem_mib},
               {"activation_mib", double(model.activation_bytes()) / (1 << 20)}};
  if (on_gpu) results["mfu_of_989"] = tflops / kHopperBf16PeakTflops;
  if (routed > 0) {
    results["moe_expert_capacity_factor"] = capacity_factor;
    results["moe_pad_expert_input_to_capacity"] = pad_to_capacity;
    results["moe_dropped_share"] = double(dropped) / double(routed);
  }
  if (lora) {
    results["lora_rank"] = cfg.lora.rank;
    results["lora_alpha"] = cfg.lora.alpha;
    results["lora_targets"] = cfg.lora.target_modules;
  }

  std::printf(
      "iris bench --train: %s on %s, one %lldx%lld image per sample, %lld tokens per sample, "
      "%lld x %lld samples per step, recompute %s\n",
      config_path.c_str(), be->name().c_str(), static_cast<long long>(image),
      static_cast<long long>(image), static_cast<long long>(seq), static_cast<long long>(micro),
      static_cast<long long>(accumulation), recompute.c_str());
  if (lora) {
    std::string targets;
    for (const std::string& t : cfg.lora.target_modules)
      targets += (targets.empty() ? "" : ",") + t;
    std::printf("  LoRA rank %d, alpha %g, on %s; the rest frozen\n", cfg.lora.rank, cfg.lora.alpha,
                targets.c_str());
  }
  std::printf("  step time              %10.3f s   (mean of %d steps after %d warm-up)\n", step_s,
              steps, warmup);
  std::printf("  tokens/s               %10.0f\n", tokens_per_s);
  std::printf("  samples/s              %10.2f\n", samples_per_step / step_s);
  std::printf("  model TFLOP/s          %10.1f     (vision FLOPs and real token counts included)\n",
              tflops);
  std::printf("  MFU of measured GEMM   %9.1f%%     (%.1f TFLOP/s, %lld^3 %s GEMM, this run)\n",
              100 * tflops / hw.gemm_tflops, hw.gemm_tflops, static_cast<long long>(hw.gemm_n),
              dtype_name(be->compute_dtype()));
  if (on_gpu)
    std::printf("  MFU of 989 TFLOP/s     %9.1f%%     (H100/H200 dense bf16)\n",
                100 * tflops / kHopperBf16PeakTflops);
  std::printf("  %-22s %10.0f MiB (activations %.0f MiB)\n",
              on_gpu ? "device memory in use" : "peak host memory", mem_mib,
              double(model.activation_bytes()) / (1 << 20));
  std::printf("  mean loss              %10.4f\n", loss);
  if (routed > 0)
    std::printf(
        "  MoE slots dropped      %9.2f%%     (capacity factor %.3g%s; of the timed steps)\n",
        100.0 * double(dropped) / double(routed), capacity_factor,
        pad_to_capacity ? ", padded" : "");
  if (!peer_results.is_null()) {
    const json& p = peer_results;
    results["peer"] = p;
    const double theirs = p.at("tokens_per_s").get<double>();
    std::printf("  vs peer tokens/s       iris %.0f  peer %.0f  ratio %.2fx\n", tokens_per_s,
                theirs, tokens_per_s / theirs);
    if (p.contains("peak_memory_gib"))
      std::printf(
          "  vs peer memory         iris %.1f GiB (all in use)  peer %.1f GiB (torch peak "
          "allocated)\n",
          mem_mib / 1024, p["peak_memory_gib"].get<double>());
  }
  if (profile) {
    // The profiled step's rows (its ops' own time, each op run alone, and the idle time between
    // them) add up to its time; the timed steps overlap what it runs apart.
    std::printf(
        "  step profile: one step op by op, %.1f ms of device time in its ops and %.1f ms idle "
        "between them (the timed step: %.1f ms)\n",
        step_prof.ops_ms, step_prof.idle_ms, 1e3 * step_s);
    for (const std::string& line : step_profile_table(step_prof, hw.gemm_tflops, hw.copy_gbps))
      std::printf("    %s\n", line.c_str());
    // Which ops of a family take its time: the first place to look for a kernel to improve.
    std::printf("  the profiled step's slowest ops:\n");
    for (const std::string& line :
         op_totals_table(step_ops, 16, step_prof.step_ms(), hw.gemm_tflops, hw.copy_gbps))
      std::printf("    %s\n", line.c_str());
    results["profile"] = step_profile_json(step_prof);
  }
  if (!json_out.empty()) write_file_atomic(json_out, results.dump(2) + "\n");
  return 0;
}

}  // namespace iris
