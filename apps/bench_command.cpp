// iris bench: inference figures for a Qwen3-VL geometry with random weights on the current
// device, each printed beside the hardware limit measured in the same run (bf16 GEMM TFLOP/s
// for compute-bound phases, device copy bandwidth for decode), optionally beside a peer
// (HF transformers) run on the same config.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>

#include "apps/bench_common.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "bridge/model_flops.h"
#include "bridge/pipeline_stage.h"
#include "bridge/qwen3vl_model.h"
#include "bridge/random_weights.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "core/arena.h"
#include "core/fs.h"
#include "core/graph_capture.h"
#include "core/graph_config.h"
#include "core/op_profile.h"
#include "core/usable_cores.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

using nlohmann::json;

// Alternating pairs of two timed runs (first, second), in ms: the median of the quotients
// second / first, and each side's median and range. The pairs keep a slow drift of the host out
// of the quotient, but not stalls: on a shared H100 machine one side has been seen to double
// within a set (one image with graphs, 2.40-4.79 ms), and a stalled host has printed vision 1x256
// graphs-vs-eager 1.58x where steady runs give 1.12-1.22x. So a side whose slowest run exceeds
// 1.5x its fastest marks the set unstable, and the printed line says so.
json paired_stats(const std::vector<double>& first_ms, const std::vector<double>& second_ms) {
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> quotients;
  for (size_t i = 0; i < first_ms.size(); ++i) quotients.push_back(second_ms[i] / first_ms[i]);
  auto side = [&](const std::vector<double>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return json{{"median_ms", median(v)}, {"min_ms", *lo}, {"max_ms", *hi}};
  };
  const json a = side(first_ms), b = side(second_ms);
  const bool unstable = a["max_ms"].get<double>() > 1.5 * a["min_ms"].get<double>() ||
                        b["max_ms"].get<double>() > 1.5 * b["min_ms"].get<double>();
  return json{{"second_over_first", median(quotients)},
              {"first", a},
              {"second", b},
              {"pairs", first_ms.size()},
              {"unstable", unstable}};
}

// "(graphs 1.31 ms [1.30-1.33], eager 1.47 ms [1.46-1.56]; median of 5 alternating pairs)".
std::string describe_pairs(const json& p, const std::string& first, const std::string& second,
                           const std::string& unit_note = "") {
  auto side = [](const std::string& name, const json& s) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s %.2f ms [%.2f-%.2f]", name.c_str(),
                  s["median_ms"].get<double>(), s["min_ms"].get<double>(),
                  s["max_ms"].get<double>());
    return std::string(buf);
  };
  std::string out = "(" + side(first, p["first"]) + ", " + side(second, p["second"]) +
                    "; median of " + std::to_string(p["pairs"].get<size_t>()) +
                    " alternating pairs" + unit_note + ")";
  if (p["unstable"].get<bool>())
    out +=
        "\n  UNSTABLE: a side's slowest run is over 1.5x its fastest (host stalls); do not "
        "rely on this ratio, rerun on a quiet machine";
  return out;
}

// The vision tower's GEMMs for S patches: y[m,n] = x[m,k] w[n,k]^T + bias. fc1 carries the tanh
// GELU in its epilogue; the attention projection and fc2 add into the residual stream.
struct GemmShape {
  int64_t m, n, k;
  bool gelu_tanh = false, accumulate = false;
  double flops() const { return 2.0 * double(m) * n * k; }
};
struct VisionGemms {
  GemmShape patch_embed;
  std::vector<GemmShape> block;  // qkv, proj, fc1, fc2
  int blocks;
  std::vector<GemmShape> merger;  // fc1, fc2
  int mergers;                    // the final merger and the deepstack ones
  double flops() const {
    double f = patch_embed.flops();
    for (const GemmShape& g : block) f += blocks * g.flops();
    for (const GemmShape& g : merger) f += mergers * g.flops();
    return f;
  }
};
VisionGemms vision_gemms(const VisionConfig& v, int64_t S) {
  const int64_t D = v.hidden_size, I = v.intermediate_size, M = v.merged_dim(),
                merged_rows = S / v.merge_unit();
  return {{S, D, v.patch_dim()},
          {{S, 3 * D, D}, {S, D, D, false, true}, {S, I, D, true, false}, {S, D, I, false, true}},
          v.depth,
          {{merged_rows, M, M}, {merged_rows, v.out_hidden_size, M}},
          1 + static_cast<int>(v.deepstack_visual_indexes.size())};
}

// Forward FLOPs of the vision tower with its mergers for the given grids, and of the decoder
// for T new tokens after `past` cached ones: the count the trainer's MFU uses
// (bridge/model_flops.h).
double vision_flops(const VisionConfig& v, const std::vector<GridTHW>& grids) {
  return vision_tower_flops(v, grids).total() + merger_flops(v, count_patches(grids));
}

double text_flops(const TextConfig& t, double T, double past, double logit_rows) {
  return decoder_flops(t, T, past, logit_rows).total();
}

// The weights a decode step reads: a sparse layer's router and the k experts a token runs (its
// active parameters), a dense layer's whole MLP.
double text_weight_bytes(const TextConfig& t, size_t elem) {
  const double H = t.hidden_size, q = t.q_width(), kv = t.kv_width();
  const double attention_and_norms = H * (q + 2 * kv) + q * H + 2 * H + 2 * t.head_dim;
  return elem * (t.num_hidden_layers * attention_and_norms + active_mlp_params(t) + H +
                 double(t.vocab_size) * H);
}

// Attention alone at the model's shapes, outside the model (it is the same op eager or in a
// graph): vision segments of one image per side and `n_multi` images of side_small, and the
// decoder's causal prefill of `prefill` tokens. Inputs are zeros: the kernels' work does not
// depend on the values. FLOPs count QK^T and PV (causal: the keys each query sees).
// One attention case: the inference op, and the training forward (which also writes the
// log-sum-exp) and backward at the same shape.
struct AttentionFigure {
  std::string name;
  double us, tflops;
  double train_forward_us, train_forward_tflops;
  double train_backward_us, train_backward_tflops;
};
// Calls per timed sample: one call is short beside the synchronisation that ends a sample.
constexpr int kAttentionReps = 10;
// FLOPs of the QK^T and PV products (4 L^2 D per head and segment, half of it causal); the
// backward counts 2.5 times the forward, as FlashAttention's reports do.
constexpr double kAttentionBackwardFlops = 2.5;
std::vector<AttentionFigure> measure_attention(Backend& be, const ModelConfig& cfg,
                                               const std::vector<std::vector<int32_t>>& images,
                                               const std::vector<std::string>& names,
                                               int64_t prefill, int iters) {
  const VisionConfig& v = cfg.vision;
  const TextConfig& t = cfg.text;
  int64_t max_rows = 0, max_offsets = 2;
  for (const auto& lens : images) {
    max_rows = std::max<int64_t>(max_rows, std::accumulate(lens.begin(), lens.end(), int64_t{0}));
    max_offsets = std::max<int64_t>(max_offsets, static_cast<int64_t>(lens.size()) + 1);
  }
  const int64_t vis_width = int64_t{v.num_heads} * v.head_dim();
  const int64_t rows = std::max(max_rows, prefill);
  const int64_t qkv_cols = std::max<int64_t>(3 * vis_width, t.qkv_width());
  const int64_t out_cols = std::max<int64_t>(vis_width, t.q_width());
  const int64_t heads = std::max<int64_t>(v.num_heads, t.num_attention_heads);
  const DType dt = be.compute_dtype();
  // qkv, out, dout, dqkv, lse and dsum as flat buffers for the larger of the two shapes (take()
  // views their first rows x cols), the offsets, and the decoder's caches and past length.
  const std::vector<std::pair<DType, std::vector<int64_t>>> shapes = {
      {dt, {rows * qkv_cols}},       {dt, {rows * out_cols}},
      {dt, {rows * out_cols}},       {dt, {rows * qkv_cols}},
      {DType::f32, {rows * heads}},  {DType::f32, {rows * heads}},
      {DType::i32, {max_offsets}},   {dt, {prefill, t.kv_width()}},
      {dt, {prefill, t.kv_width()}}, {DType::i32, {1}}};
  Arena plan;
  for (const auto& [dtype, shape] : shapes) plan.alloc(dtype, shape);
  Arena a(be, plan.used());
  std::vector<Tensor> buf;
  for (const auto& [dtype, shape] : shapes) buf.push_back(a.alloc(dtype, shape));
  const Tensor &qkv = buf[0], &out = buf[1], &dout = buf[2], &dqkv = buf[3], &lse = buf[4],
               &dsum = buf[5], &cu = buf[6], &kc = buf[7], &vc = buf[8], &past = buf[9];
  for (const Tensor& x : {qkv, dout, kc, vc, past}) be.fill_zero(x);
  auto take = [](const Tensor& flat, int64_t r, int64_t c) {
    return flat.slice(0, r * c).view({r, c});
  };
  auto timed = [&](auto&& call) {
    return time_median(be, iters,
                       [&] {
                         for (int r = 0; r < kAttentionReps; ++r) call();
                       }) /
           kAttentionReps;
  };
  // The training pair on rows [0, n) of a layout of `width` columns: seconds forward, backward.
  auto time_training = [&](const Tensor& cu_i, int n_segments, int64_t n, int64_t width, int nq,
                           int nkv, int hd, bool causal) {
    const int64_t hidden = int64_t{nq} * hd;
    const Tensor q = take(qkv, n, width), o = take(out, n, hidden), g = take(dout, n, hidden),
                 dq = take(dqkv, n, width), l = take(lse, n, nq), ds = take(dsum, n, nq);
    const float scale = 1.f / std::sqrt(float(hd));
    auto forward = [&] {
      be.attention_train(o, l, q, cu_i, n_segments, nq, nkv, hd, scale, causal, Tensor());
    };
    const double fwd = timed(forward);
    forward();
    const double bwd = timed([&] {
      be.attention_backward(dq, ds, g, o, l, q, cu_i, n_segments, nq, nkv, hd, scale, causal,
                            Tensor());
    });
    return std::pair{fwd, bwd};
  };
  std::vector<AttentionFigure> figures;
  auto add = [&](std::string name, double flops, double s, std::pair<double, double> train) {
    figures.push_back({std::move(name), s * 1e6, flops / s / 1e12, train.first * 1e6,
                       flops / train.first / 1e12, train.second * 1e6,
                       kAttentionBackwardFlops * flops / train.second / 1e12});
  };
  for (size_t i = 0; i < images.size(); ++i) {
    const auto& lens = images[i];
    std::vector<int32_t> offsets = {0};
    double flops = 0;
    for (int32_t len : lens) {
      offsets.push_back(offsets.back() + len);
      flops += 4.0 * double(len) * len * vis_width;
    }
    const int64_t n = offsets.back();
    const int n_segments = static_cast<int>(lens.size());
    const Tensor cu_i = cu.slice(0, static_cast<int64_t>(offsets.size()));
    be.write(cu_i, offsets.data(), DType::i32);
    const Tensor q = take(qkv, n, 3 * vis_width), o = take(out, n, vis_width);
    const double s = timed([&] {
      be.attention_segments(o, q, cu_i, n_segments, v.num_heads, v.head_dim(),
                            1.f / std::sqrt(float(v.head_dim())), Tensor());
    });
    add("vision " + names[i], flops, s,
        time_training(cu_i, n_segments, n, 3 * vis_width, v.num_heads, v.num_heads, v.head_dim(),
                      false));
  }
  const Tensor tqkv = take(qkv, prefill, t.qkv_width()), tout = take(out, prefill, t.q_width());
  const double s = timed([&] {
    be.attention_causal(tout, tqkv, kc, vc, past, t.num_attention_heads, t.num_key_value_heads,
                        t.head_dim, 1.f / std::sqrt(float(t.head_dim)));
  });
  const std::vector<int32_t> one = {0, static_cast<int32_t>(prefill)};
  const Tensor cu_1 = cu.slice(0, 2);
  be.write(cu_1, one.data(), DType::i32);
  add("prefill " + std::to_string(prefill), 4.0 * t.q_width() * double(prefill) * (prefill + 1) / 2,
      s,
      time_training(cu_1, 1, prefill, t.qkv_width(), t.num_attention_heads, t.num_key_value_heads,
                    t.head_dim, true));
  return figures;
}

// The vision tower's GEMMs alone for each patch count, in the encoder's order and number, replayed
// as one CUDA graph (launched one by one, the small GEMMs of one image would time the host) on
// random bf16 operands (GEMM power, and so the clock, depends on the data): the time the encoder
// cannot go below while its GEMMs run through cuBLASLt one after another. One weight set serves
// every layer, so the small shapes may find their weights in L2 where the model would not: a
// floor, if anything low.
struct GemmFigure {
  std::string name;
  double ms, tflops;
};
std::vector<GemmFigure> measure_vision_gemms(Backend& be, const VisionConfig& v,
                                             const std::vector<int64_t>& patches,
                                             const std::vector<std::string>& names, int iters) {
  int64_t x_elems = 0, w_elems = 0, y_elems = 0, max_n = 0;
  for (int64_t S : patches) {
    const VisionGemms gemms = vision_gemms(v, S);
    std::vector<GemmShape> all = gemms.block;
    all.push_back(gemms.patch_embed);
    all.insert(all.end(), gemms.merger.begin(), gemms.merger.end());
    for (const GemmShape& g : all) {
      x_elems = std::max(x_elems, g.m * g.k), w_elems = std::max(w_elems, g.n * g.k);
      y_elems = std::max(y_elems, g.m * g.n), max_n = std::max(max_n, g.n);
    }
  }
  const DType dt = be.compute_dtype();
  Arena plan;
  for (int64_t n : {x_elems, w_elems, max_n, y_elems}) plan.alloc(dt, {n});
  Arena a(be, plan.used());
  const Tensor x = a.alloc(dt, {x_elems}), w = a.alloc(dt, {w_elems}), bias = a.alloc(dt, {max_n}),
               y = a.alloc(dt, {y_elems});
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  for (const Tensor* t : {&x, &w, &bias, &y}) {
    std::vector<float> host(static_cast<size_t>(t->numel()));
    const float scale = t == &w ? 0.03f : 1.f;  // keeps fc2's outputs (K = 4096) in range
    for (float& e : host) e = uni(rng) * scale;
    be.write(*t, host.data(), DType::f32);
  }
  const auto api = make_graph_api(be);
  std::vector<GemmFigure> out;
  for (size_t i = 0; i < patches.size(); ++i) {
    const VisionGemms gemms = vision_gemms(v, patches[i]);
    auto run = [&](const GemmShape& g) {
      const Tensor xs = x.slice(0, g.m * g.k).view({g.m, g.k}),
                   ws = w.slice(0, g.n * g.k).view({g.n, g.k}), bs = bias.slice(0, g.n),
                   ys = y.slice(0, g.m * g.n).view({g.m, g.n});
      if (g.gelu_tanh)
        be.linear_gelu_tanh(ys, xs, ws, bs);
      else
        be.linear(ys, xs, ws, bs, g.accumulate);
    };
    auto encoder_gemms = [&] {
      run(gemms.patch_embed);
      for (int b = 0; b < gemms.blocks; ++b)
        for (const GemmShape& g : gemms.block) run(g);
      for (int m = 0; m < gemms.mergers; ++m)
        for (const GemmShape& g : gemms.merger) run(g);
    };
    encoder_gemms();  // picks each shape's algorithm, which a capture cannot time
    be.synchronize();
    CapturedGraph graph(*api, be, "vision GEMMs " + names[i], encoder_gemms);
    const double s = time_median(be, iters, [&] { graph.launch(); });
    const double flops = gemms.flops();
    out.push_back({names[i], s * 1e3, flops / s / 1e12});
  }
  return out;
}

// One thread per core spinning on arithmetic until destroyed: a host as busy as a training job's
// data workers or a loaded server make it, for --busy-host.
class HostLoad {
 public:
  explicit HostLoad(int threads) {
    for (int i = 0; i < threads; ++i)
      workers_.emplace_back([this] {
        volatile double sink = 0;
        double x = 1;
        while (!stop_.load(std::memory_order_relaxed)) {
          for (int k = 0; k < 4096; ++k) x = x * 1.0000001 + 1e-9;
          sink = x;
        }
        (void)sink;
      });
  }
  ~HostLoad() {
    stop_.store(true);
    for (std::thread& t : workers_) t.join();
  }
  HostLoad(const HostLoad&) = delete;
  HostLoad& operator=(const HostLoad&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

// The issue's bar for a figure measured beside a busy host: at most this factor of its quiet time.
constexpr double kBusyHostBar = 1.3;

struct Row {
  std::string name;
  double value;
  std::string unit;
  double limit_ratio;  // fraction of the hardware limit, < 0 when not applicable
  std::string limit_name;
};

}  // namespace

int run_bench_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--train") return run_bench_train(argc, argv);
  CLI::App app{
      "Benchmark inference of a Qwen3-VL geometry with random weights (iris bench --train "
      "--help: training).",
      "iris bench"};
  std::string config_path = "bench/configs/qwen3vl_2b.json", device = "auto", json_out, peer;
  int iters = 5;
  bool quick = false, tune = false, busy_host = false, op_profile = false;
  std::vector<std::string> only;
  std::string profile_case;
  app.add_option("--config", config_path, "HF config.json of the geometry")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_option("--iters", iters, "timed repetitions per figure (median reported)")
      ->capture_default_str();
  app.add_option("--json", json_out, "also write the results as JSON to this file");
  app.add_option("--peer", peer,
                 "command printing the same figures as JSON for comparison, e.g. "
                 "'python3 bench/peers/hf_transformers.py --config bench/configs/qwen3vl_2b.json'");
  app.add_flag("--quick", quick, "smaller shapes (for smoke tests on the CPU)");
  app.add_flag("--tune", tune,
               "time the cuBLASLt candidates of every GEMM shape the benchmark runs and save the "
               "fastest to the GEMM tuning cache, which later commands on this GPU then use "
               "(without it, shapes missing from the cache take cuBLASLt's first choice)");
  app.add_flag("--busy-host", busy_host,
               "measure the vision, prefill, decode and TTFT figures with graphs again beside one "
               "spinning thread per core the process may use, and print each one's slowdown");
  app.add_flag("--op-profile", op_profile,
               "also run one eager decode step op by op, each op timed alone, and print where its "
               "device time goes by op family and by op, each against its floor");
  app.add_option("--only", only, "figures to measure (default: all)")
      ->delimiter(',')
      ->check(CLI::IsMember({"vision", "prefill", "decode", "ttft", "attention", "gemm"}));
  app.add_option("--profile", profile_case,
                 "case to bracket once for a profiler started with collection off (ncu "
                 "--profile-from-start off): a vision case such as 'graphs 1x256', or 'eager "
                 "decode' / 'graphs decode' for one decode step");
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris bench")) return 0;
  const std::string dev = device == "auto" ? (cuda_available() ? "cuda" : "cpu") : device;
  const std::unique_ptr<Backend> device_backend = make_backend(dev);
  // With --op-profile every op passes through a recorder, which times them only between its
  // start() and stop(): the model must be built on it to be profiled at all.
  const std::unique_ptr<ProfilingBackend> recorder =
      op_profile ? std::make_unique<ProfilingBackend>(*device_backend) : nullptr;
  Backend* const be = recorder ? recorder.get() : device_backend.get();
  const bool on_gpu = be->device() == Device::cuda;
  if (tune) {
    if (on_gpu)
      be->set_gemm_tuning(GemmTuning::tune);
    else
      std::fprintf(stderr, "note: --tune has no effect on the CPU: only GPU GEMMs are tuned\n");
  }
  config_path = find_bench_config(config_path);
  const ModelConfig cfg = ModelConfig::from_file(config_path);

  // Shapes of the standard figures (smaller under --quick so that the CPU can run them).
  const int64_t side_tiny = quick ? 32 : 256, side_small = quick ? 64 : 448,
                side_mid = quick ? 128 : 896, side_big = quick ? 192 : 1344;
  const int n_multi = quick ? 2 : 8;
  const int64_t prefill_short = quick ? 32 : 512, prefill_long = quick ? 128 : 4096,
                decode_context = quick ? 64 : 1024, decode_steps = quick ? 8 : 64, ttft_text = 32;
  const int64_t P = cfg.vision.patch_size;
  // Whole merge windows (a 14-pixel patch does not divide every side evenly by two).
  const int64_t m = cfg.vision.spatial_merge_size;
  auto grid_of = [&](int64_t side) { return GridTHW{1, side / (P * m) * m, side / (P * m) * m}; };

  ModelLimits limits;
  limits.max_context = std::max(prefill_long, decode_context + decode_steps) + 64;
  limits.max_step_tokens = prefill_long;
  limits.max_images = n_multi;
  limits.max_vision_patches =
      std::max(count_patches({grid_of(side_big)}),
               count_patches(std::vector<GridTHW>(n_multi, grid_of(side_small))));
  const HardwareLimits hw = measure_limits(*be, quick, iters);
  const std::string s1 = std::to_string(side_small), s2 = std::to_string(side_mid),
                    s3 = std::to_string(side_big);
  Qwen3VLModel model(*be, cfg, random_weights(*be, cfg, 1234), limits);

  std::mt19937 rng(7);
  // Images and videos go up as a user's do: frames of bytes at their grids' sizes, normalised and
  // patchified by the backend (VisionPixels).
  std::map<std::vector<GridTHW>, std::vector<ImageRGB8>> frame_sets;
  const PixelTable table = pixel_table(PreprocessorConfig{});
  auto pixels_of = [&](const std::vector<GridTHW>& grids) {
    std::vector<ImageRGB8>& frames = frame_sets[grids];
    if (frames.empty())
      for (const GridTHW& g : grids)
        for (int64_t f = 0; f < (g[0] == 1 ? 1 : g[0] * cfg.vision.temporal_patch_size); ++f) {
          ImageRGB8 im;
          im.height = static_cast<int>(g[1]) * cfg.vision.patch_size;
          im.width = static_cast<int>(g[2]) * cfg.vision.patch_size;
          im.pixels.resize(static_cast<size_t>(im.height) * im.width * 3);
          for (uint8_t& v : im.pixels) v = static_cast<uint8_t>(rng() & 0xff);
          frames.push_back(std::move(im));
        }
    VisionPixels p;
    size_t next = 0;
    for (const GridTHW& g : grids) {
      VisionMedia m;
      m.table = &table;
      for (int64_t f = 0; f < (g[0] == 1 ? 1 : g[0] * cfg.vision.temporal_patch_size); ++f)
        m.frames.push_back(&frames[next++]);
      p.media.push_back(std::move(m));
    }
    return p;
  };
  std::uniform_int_distribution<int32_t> tok(0, 151000);
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (auto& i : ids) i = tok(rng);
    return ids;
  };

  std::vector<Row> rows;
  json results;
  std::vector<OpRecord> decode_records;  // --op-profile: one eager decode step's ops
  double eager_decode_ms = 0;
  std::vector<std::string> graphed_vision_cases;  // in the order measured
  VisionCudaGraphHelper* graphs = nullptr;
  // The next greedy token after a decode step: on the device by the decode graph when graphs
  // run, else by the argmax op; either way one int crosses to the host.
  auto greedy_after_decode = [&]() {
    if (graphs) return graphs->greedy_token();
    int32_t next = 0;
    model.decoder().argmax(1);
    be->read(&next, DType::i32, model.decoder().next_tokens(1));
    return next;
  };
  auto wanted = [&](const char* group) {
    return only.empty() || std::find(only.begin(), only.end(), group) != only.end();
  };
  auto measure = [&](const std::string& mode) {
    json r;
    auto vision_case = [&](const std::string& name, std::vector<GridTHW> grids) {
      const double t =
          time_median(*be, iters, [&] { model.encode_images(pixels_of(grids), grids); });
      // Where the time goes: host time until the call returns, without the pixel upload (a copy
      // that grows with the images and may wait for the staging buffer, so it says nothing about
      // launch overhead; it gets a line of its own), and the device's busy span.
      std::vector<double> enqueue_ms, pixel_ms, span_ms, launch_ms;
      for (int i = 0; i < iters; ++i) {
        span_ms.push_back(be->device_span_ms([&] {
          const auto te = Clock::now();
          model.encode_images(pixels_of(grids), grids);
          const double call_ms = seconds_since(te) * 1e3;
          pixel_ms.push_back(model.vision().last_pixel_upload_ms());
          enqueue_ms.push_back(call_ms - pixel_ms.back());
          if (graphs != nullptr) launch_ms.push_back(graphs->last_launch_ms());
        }));
      }
      // The same call queued while the device is held (after a synchronisation): a launch or a
      // staging reuse that waits for the device is then a wait no longer, so what is left is
      // the host's own work. Staging for the whole call is reserved first, once, as the trainer
      // reserves a step's; a call that still waits for the device outlasts the hold, which
      // release_device() reports ("full").
      std::vector<double> held_ms;
      int held_full = 0;
      if (graphs != nullptr) {
        be->reserve_write_staging(static_cast<size_t>(count_patches(grids)) *
                                  static_cast<size_t>(cfg.vision.patch_dim()) * sizeof(float));
        for (int i = 0; i < iters; ++i) {
          be->synchronize();
          be->hold_device(1.0);
          const auto te = Clock::now();
          model.encode_images(pixels_of(grids), grids);
          held_ms.push_back(seconds_since(te) * 1e3 - model.vision().last_pixel_upload_ms());
          if (be->release_device()) ++held_full;
        }
        std::sort(held_ms.begin(), held_ms.end());
      }
      if (profile_case == mode + " " + name) {
        be->profiler_collect(true);
        model.encode_images(pixels_of(grids), grids);
        be->profiler_collect(false);
      }
      std::sort(enqueue_ms.begin(), enqueue_ms.end());
      std::sort(pixel_ms.begin(), pixel_ms.end());
      std::sort(span_ms.begin(), span_ms.end());
      const double tokens = double(count_patches(grids)) / cfg.vision.merge_unit();
      const double tflops = vision_flops(cfg.vision, grids) / t / 1e12;
      rows.push_back(
          {mode + " vision " + name + " time", t * 1e3, "ms", tflops / hw.gemm_tflops, "GEMM"});
      rows.push_back({mode + " vision " + name + " tokens/s", tokens / t, "tok/s", -1, ""});
      rows.push_back({mode + " vision " + name + " host enqueue", enqueue_ms[enqueue_ms.size() / 2],
                      "ms", -1, ""});
      rows.push_back({mode + " vision " + name + " pixel upload", pixel_ms[pixel_ms.size() / 2],
                      "ms", -1, ""});
      if (!launch_ms.empty()) {
        // The graph launch's share of the host enqueue above.
        std::sort(launch_ms.begin(), launch_ms.end());
        rows.push_back({mode + " vision " + name + " graph launch", launch_ms[launch_ms.size() / 2],
                        "ms", -1, ""});
      }
      if (!held_ms.empty())
        rows.push_back({mode + " vision " + name + " host enqueue, device held" +
                            (held_full > 0 ? " (full)" : ""),
                        held_ms[held_ms.size() / 2], "ms", -1, ""});
      rows.push_back(
          {mode + " vision " + name + " device span", span_ms[span_ms.size() / 2], "ms", -1, ""});
      r["vision_" + name] = {{"ms", t * 1e3},
                             {"tokens_per_s", tokens / t},
                             {"tflops", tflops},
                             {"host_enqueue_ms", enqueue_ms[enqueue_ms.size() / 2]},
                             {"host_enqueue_max_ms", enqueue_ms.back()},
                             {"pixel_upload_ms", pixel_ms[pixel_ms.size() / 2]},
                             {"device_span_ms", span_ms[span_ms.size() / 2]}};
      if (!launch_ms.empty())
        r["vision_" + name]["graph_launch_ms"] = launch_ms[launch_ms.size() / 2];
      if (!held_ms.empty()) {
        r["vision_" + name]["host_enqueue_held_ms"] = held_ms[held_ms.size() / 2];
        r["vision_" + name]["held_calls_that_waited"] = held_full;
      }
      if (mode == "graphs") graphed_vision_cases.push_back(name);
      return t;
    };
    if (wanted("vision")) {
      const std::vector<GridTHW> one = {grid_of(side_small)}, multi(n_multi, grid_of(side_small));
      vision_case("1x" + std::to_string(side_tiny), {grid_of(side_tiny)});
      vision_case("1x" + s1, one);
      vision_case("1x" + s2, {grid_of(side_mid)});
      vision_case("1x" + s3, {grid_of(side_big)});
      vision_case(std::to_string(n_multi) + "x" + s1, multi);
      // A video of n_multi frames of the small side: a grid step per temporal_patch_size frames,
      // each step attending within itself (HF's video path through the same tower).
      GridTHW video = grid_of(side_small);
      video[0] = n_multi / cfg.vision.temporal_patch_size;
      vision_case("video_" + std::to_string(n_multi) + "x" + s1, {video});
      // The multi-image ratio from alternating pairs: the two figures above are taken seconds
      // apart, and a host stall during one of them alone would skew their quotient.
      std::vector<double> single_ms, multi_ms;
      for (int i = 0; i < iters; ++i) {
        for (const int k : {0, 1}) {
          be->synchronize();
          const auto t0 = Clock::now();
          model.encode_images(pixels_of(k == 0 ? one : multi), k == 0 ? one : multi);
          be->synchronize();
          (k == 0 ? single_ms : multi_ms).push_back(seconds_since(t0) * 1e3);
        }
      }
      const json pairs = paired_stats(single_ms, multi_ms);
      r["vision_multi_over_single"] = pairs["second_over_first"];
      r["vision_multi_over_single_pairs"] = pairs;
    }

    model.encode_images(nullptr, {});
    for (int64_t T : {prefill_short, prefill_long}) {
      if (!wanted("prefill")) break;
      const auto ids = random_ids(T);
      const double t = time_median(*be, iters, [&] { model.prefill(ids); });
      const double tflops = text_flops(cfg.text, double(T), 0, 1) / t / 1e12;
      rows.push_back({mode + " prefill " + std::to_string(T) + " tokens/s", double(T) / t, "tok/s",
                      tflops / hw.gemm_tflops, "GEMM"});
      r["prefill_" + std::to_string(T)] = {{"tokens_per_s", double(T) / t}, {"tflops", tflops}};
    }

    if (wanted("decode")) {
      const auto ids = random_ids(decode_context);
      model.prefill(ids);
      int32_t next = 0;
      // Host time spent issuing the step's work: when it exceeds the GPU time of the step, the
      // step is launch-bound, which is what graphs remove.
      double enqueue_s = 0;
      auto step = [&] {
        const auto te = Clock::now();
        model.decode(next);
        enqueue_s += seconds_since(te);
        next = greedy_after_decode();
      };
      for (int i = 0; i < 4; ++i) step();  // warm-up (and graph capture, when lazy)
      be->synchronize();
      enqueue_s = 0;
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < decode_steps; ++i) step();
      const double t = seconds_since(t0) / double(decode_steps);
      if (profile_case == mode + " decode") {
        be->synchronize();
        be->profiler_collect(true);
        step();
        be->profiler_collect(false);
      }
      if (recorder && mode == "eager") {
        recorder->start();
        model.decode(next);
        decode_records = recorder->stop();
        next = greedy_after_decode();
        eager_decode_ms = t * 1e3;
      }
      const double enqueue_ms = enqueue_s / double(decode_steps) * 1e3;
      const double ctx = double(decode_context) + 5 + double(decode_steps) / 2;
      const size_t elem = dtype_size(be->compute_dtype());
      const double bytes = text_weight_bytes(cfg.text, elem) +
                           cfg.text.num_hidden_layers * 2.0 * ctx * cfg.text.kv_width() * elem;
      const double gbps = bytes / t / 1e9;
      rows.push_back({mode + " decode @" + std::to_string(decode_context) + " tokens/s", 1.0 / t,
                      "tok/s", gbps / hw.copy_gbps, "copy BW"});
      rows.push_back({mode + " decode host enqueue / step", enqueue_ms, "ms", -1, ""});
      r["decode"] = {{"context", decode_context},
                     {"tokens_per_s", 1.0 / t},
                     {"host_enqueue_ms", enqueue_ms},
                     {"bytes_per_token", bytes},
                     {"gbps", gbps}};
    }

    if (wanted("ttft")) {
      const GridTHW g = grid_of(side_mid);
      const int64_t pads = count_patches({g}) / cfg.vision.merge_unit();
      std::vector<int32_t> ids = random_ids(ttft_text);
      ids.insert(ids.begin() + ttft_text / 2, cfg.vision_start_token_id);
      ids.insert(ids.begin() + ttft_text / 2 + 1, pads, cfg.image_token_id);
      ids.insert(ids.begin() + ttft_text / 2 + 1 + pads, cfg.vision_end_token_id);
      int32_t first = 0;
      const double t = time_median(*be, iters, [&] {
        model.encode_images(pixels_of({g}), {g});
        model.prefill(ids);
        model.decoder().argmax(1);
        be->read(&first, DType::i32, model.decoder().next_tokens(1));
      });
      rows.push_back({mode + " TTFT 1x" + s2 + " + " + std::to_string(ttft_text) + " text", t * 1e3,
                      "ms", -1, ""});
      r["ttft_ms"] = t * 1e3;
    }
    return r;
  };

  if (wanted("attention")) {
    auto patches = [&](int64_t side) { return static_cast<int32_t>((side / P) * (side / P)); };
    const auto figures = measure_attention(
        *be, cfg,
        {{patches(side_mid)},
         {patches(side_big)},
         std::vector<int32_t>(n_multi, patches(side_small))},
        {"1x" + s2, "1x" + s3, std::to_string(n_multi) + "x" + s1}, prefill_long, iters);
    for (const auto& f : figures) {
      rows.push_back(
          {"attention " + f.name + " time", f.us, "us", f.tflops / hw.gemm_tflops, "GEMM"});
      rows.push_back({"attention " + f.name + " train forward", f.train_forward_us, "us",
                      f.train_forward_tflops / hw.gemm_tflops, "GEMM"});
      rows.push_back({"attention " + f.name + " train backward", f.train_backward_us, "us",
                      f.train_backward_tflops / hw.gemm_tflops, "GEMM"});
      results["attention"][f.name] = {{"us", f.us},
                                      {"tflops", f.tflops},
                                      {"train_forward_us", f.train_forward_us},
                                      {"train_forward_tflops", f.train_forward_tflops},
                                      {"train_backward_us", f.train_backward_us},
                                      {"train_backward_tflops", f.train_backward_tflops}};
    }
  }
  const std::string multi_name = std::to_string(n_multi) + "x" + s1;
  if (wanted("gemm")) {
    const std::vector<GridTHW> one = {grid_of(side_small)}, multi(n_multi, grid_of(side_small));
    const auto figures =
        measure_vision_gemms(*be, cfg.vision,
                             {count_patches(one), count_patches({grid_of(side_mid)}),
                              count_patches({grid_of(side_big)}), count_patches(multi)},
                             {"1x" + s1, "1x" + s2, "1x" + s3, multi_name}, iters);
    for (const auto& f : figures) {
      rows.push_back(
          {"GEMMs vision " + f.name + " time", f.ms, "ms", f.tflops / hw.gemm_tflops, "GEMM"});
      results["vision_gemms"][f.name] = {{"ms", f.ms}, {"tflops", f.tflops}};
    }
  }
  results["eager"] = measure("eager");
  const size_t in_use_before_graphs = be->device_memory_in_use();
  GraphConfigs gc = parse_graph_configs(
      {{"cuda_graph_impl", "local"},
       {"inference_cuda_graph_scope", "block"},
       {"vision_cuda_graph_impl", "local"},
       {"max_vision_cuda_graph_seq_length", std::to_string(limits.max_vision_patches)}});
  GraphModelTraits traits;
  traits.has_deepstack = !cfg.vision.deepstack_visual_indexes.empty();
  traits.spatial_merge_size = cfg.vision.spatial_merge_size;
  finalize_graph_configs(gc, traits);
  GraphHelperOptions options;
  options.capture_at_startup = true;
  VisionCudaGraphHelper helper(model, split_stages(cfg, 1)[0], gc, options);
  model.attach_graphs(&helper);
  graphs = &helper;
  const size_t in_use_after_capture = be->device_memory_in_use();
  results["graphs"] = measure("graphs");
  const double graph_mib =
      double(in_use_after_capture - std::min(in_use_after_capture, in_use_before_graphs)) /
      (1 << 20);
  results["graph_memory_mib"] = graph_mib;
  results["graph_count"] = {{"vision", helper.graph_count(GraphSet::vision)},
                            {"decoder", helper.graph_count(GraphSet::decoder)}};

  // Graphs against eager in alternating pairs, for the speed-up lines: the eager and graphs
  // figures above are taken a minute apart, and a host that slows down in between (other
  // tenants, clock changes) would skew their ratio; within a pair both sides see the same host.
  const int64_t paired_decode_steps = std::max<int64_t>(1, decode_steps / 4);
  // Each side's median time and range go beside the ratio (paired_stats), so that a reader can
  // set it against the single figures above and see whether the host held still.
  auto paired_speedup = [&](const std::function<void()>& run) {
    std::vector<double> graphs_ms, eager_ms;
    for (int i = 0; i < iters; ++i) {
      for (const bool with_graphs : {false, true}) {
        if (with_graphs) {
          model.attach_graphs(&helper);
          graphs = &helper;
        } else {
          model.detach_graphs(&helper);
          graphs = nullptr;
        }
        be->synchronize();
        const auto t0 = Clock::now();
        run();
        be->synchronize();
        (with_graphs ? graphs_ms : eager_ms).push_back(seconds_since(t0) * 1e3);
      }
    }
    // graphs first, so that second / first is the speed-up of graphs over eager.
    json p = paired_stats(graphs_ms, eager_ms);
    p["ratio"] = p["second_over_first"];
    return p;
  };
  if (wanted("vision")) {
    const std::vector<GridTHW> tiny = {grid_of(side_tiny)};
    results["paired_speedup"]["vision_1x" + std::to_string(side_tiny)] =
        paired_speedup([&] { model.encode_images(pixels_of(tiny), tiny); });
    model.encode_images(nullptr, {});
  }
  if (wanted("decode")) {
    model.prefill(random_ids(decode_context));
    int32_t next = 0;
    results["paired_speedup"]["decode"] = paired_speedup([&] {
      for (int64_t i = 0; i < paired_decode_steps; ++i) {
        model.decode(next);
        next = greedy_after_decode();
      }
    });
  }
  model.attach_graphs(&helper);
  graphs = &helper;

  if (busy_host) {
    const int threads = usable_cores();
    json busy;
    {
      HostLoad load(threads);
      busy = measure("graphs, busy host");
    }
    results["graphs_busy_host"] = busy;
    results["busy_host_threads"] = threads;
    // Times grow and rates shrink under load: either way, the factor is busy over quiet time.
    const json& quiet = results["graphs"];
    for (const auto& [key, q] : quiet.items()) {
      if (!busy.contains(key)) continue;
      const json& b = busy[key];
      double slowdown = 0;
      if (q.is_object() && q.contains("ms"))
        slowdown = b["ms"].get<double>() / q["ms"].get<double>();
      else if (q.is_object() && q.contains("tokens_per_s"))
        slowdown = q["tokens_per_s"].get<double>() / b["tokens_per_s"].get<double>();
      else if (q.is_number() && key.ends_with("_ms"))
        slowdown = b.get<double>() / q.get<double>();
      else
        continue;
      results["busy_host_slowdown"][key] = slowdown;
      rows.push_back(
          {"busy host (" + std::to_string(threads) + " threads): graphs " + key + " slowdown",
           slowdown, "x", slowdown / kBusyHostBar, "of 1.3x"});
    }
  }

  const double mem = double(model.weights().arena.capacity() + model.vision().arena().capacity() +
                            model.decoder().arena().capacity());
  rows.push_back({"memory (planned arenas)", mem / (1 << 20), "MiB", -1, ""});
  rows.push_back({"memory held by CUDA graphs", graph_mib, "MiB", -1, ""});
  // Everything the process holds on the device: arenas, graphs, cuBLASLt workspaces and the CUDA
  // context. The arenas are the peak of what the model touches (no allocation after planning),
  // the figure to set beside the peer's peak of allocated tensors.
  const double in_use_mib = double(be->device_memory_in_use()) / (1 << 20);
  if (be->device() == Device::cuda)
    rows.push_back({"device memory in use (all)", in_use_mib, "MiB", -1, ""});
  results["memory_mib"] = mem / (1 << 20);
  results["device_memory_in_use_mib"] = in_use_mib;
  results["hardware"] = {{"gemm_tflops", hw.gemm_tflops}, {"copy_gbps", hw.copy_gbps}};
  results["device"] = be->name();
  results["config"] = config_path;
  // Where the GEMMs took their algorithms: the figures above depend on it.
  const GemmTuningReport tuning = be->gemm_tuning_report();
  const bool tuning_saved = tune && on_gpu && be->save_gemm_tuning();
  if (on_gpu)
    results["gemm_tuning"] = {{"mode", std::string(to_string(tuning.mode))},
                              {"cache", tuning.cache_path},
                              {"timed", tuning.plans.timed},
                              {"cached", tuning.plans.cached},
                              {"first_choice", tuning.plans.heuristic},
                              {"rejected", tuning.plans.rejected},
                              {"saved", tuning_saved}};

  json peer_results;
  if (!peer.empty()) {
    peer_results = run_peer(peer);
    results["peer"] = peer_results;
  }

  std::printf("iris bench: %s on %s (GEMM %.1f TFLOP/s, copy %.1f GB/s measured)\n",
              config_path.c_str(), be->name().c_str(), hw.gemm_tflops, hw.copy_gbps);
  if (on_gpu) {
    std::printf(
        "GEMM algorithms: %lld timed now, %lld from the tuning cache, %lld cuBLASLt's "
        "first choice",
        static_cast<long long>(tuning.plans.timed), static_cast<long long>(tuning.plans.cached),
        static_cast<long long>(tuning.plans.heuristic));
    if (tuning.plans.rejected > 0)
      std::printf(" (%lld cached entries no longer valid, dropped)",
                  static_cast<long long>(tuning.plans.rejected));
    if (tuning_saved)
      std::printf("; saved to %s", tuning.cache_path.c_str());
    else if (!tune && tuning.plans.heuristic > 0)
      std::printf("; iris bench --tune times them and fills the cache");
    std::printf("\n");
  }
  int name_width = 34;
  for (const Row& r : rows) name_width = std::max(name_width, static_cast<int>(r.name.size()));
  std::printf("%-*s %14s %-6s %12s\n", name_width, "figure", "value", "unit", "of limit");
  for (const Row& r : rows) {
    std::printf("%-*s %14.2f %-6s", name_width, r.name.c_str(), r.value, r.unit.c_str());
    if (r.limit_ratio >= 0) std::printf(" %6.1f%% %s", 100 * r.limit_ratio, r.limit_name.c_str());
    std::printf("\n");
  }
  if (wanted("vision"))
    for (const char* mode : {"eager", "graphs"}) {
      const json& p = results[mode]["vision_multi_over_single_pairs"];
      std::printf("%s: %d-image / 1-image vision time %.2fx %s\n", mode, n_multi,
                  p["second_over_first"].get<double>(),
                  describe_pairs(p, "1 image", std::to_string(n_multi) + " images").c_str());
    }
  // A graphed vision call should cost the host little beyond the pixel copy: the tables are
  // computed on the device, so what is left is the grids' upload and the graph launch.
  if (wanted("vision")) {
    std::string per_case, per_case_held;
    double worst = 0, worst_held = 0;
    int waited = 0;
    for (const std::string& name : graphed_vision_cases) {
      const json& c = results["graphs"]["vision_" + name];
      const double ms = c["host_enqueue_ms"].get<double>();
      const double held = c["host_enqueue_held_ms"].get<double>();
      worst = std::max(worst, ms);
      worst_held = std::max(worst_held, held);
      waited += c["held_calls_that_waited"].get<int>();
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%s %.3f", per_case.empty() ? "" : ", ", name.c_str(), ms);
      per_case += buf;
      std::snprintf(buf, sizeof buf, "%s%s %.3f", per_case_held.empty() ? "" : ", ", name.c_str(),
                    held);
      per_case_held += buf;
    }
    std::printf(
        "graphs: vision host enqueue per call, pixel upload aside (median ms): %s; largest %.3f "
        "ms (target: at most 0.2 ms)\n",
        per_case.c_str(), worst);
    std::printf(
        "graphs: the same with the device held, the host's own work (median ms): %s; largest "
        "%.3f ms%s\n",
        per_case_held.c_str(), worst_held,
        waited > 0 ? " (some calls still waited for the device: see the rows marked full)" : "");
  }
  // What the multi-image encode cannot go below whatever the rest of it costs: its GEMMs alone.
  if (wanted("vision") && wanted("gemm")) {
    const json& g = results["vision_gemms"];
    std::printf("vision GEMMs alone (one graph of them): 1 image %.2f ms, %d images %.2f ms\n",
                g["1x" + s1]["ms"].get<double>(), n_multi, g[multi_name]["ms"].get<double>());
  }
  const json& paired = results["paired_speedup"];
  if (wanted("decode")) {
    const json& p = paired["decode"];
    std::printf("graphs vs eager: decode %.2fx %s\n", p["ratio"].get<double>(),
                describe_pairs(p, "graphs", "eager",
                               " of " + std::to_string(paired_decode_steps) + " steps")
                    .c_str());
  }
  if (wanted("vision")) {
    const json& p = paired["vision_1x" + std::to_string(side_tiny)];
    std::printf("graphs vs eager: vision 1x%lld %.2fx %s\n", static_cast<long long>(side_tiny),
                p["ratio"].get<double>(), describe_pairs(p, "graphs", "eager").c_str());
  }
  std::printf("graphs hold %.1f MiB\n", graph_mib);
  if (!peer_results.is_null()) {
    const json& best = results["graphs"];
    auto ratio = [&](const char* key, const char* field, bool higher_is_better) {
      if (!peer_results.contains(key) || !best.contains(key)) return;
      const double ours = field ? best[key][field].get<double>() : best[key].get<double>();
      const double theirs =
          field ? peer_results[key][field].get<double>() : peer_results[key].get<double>();
      std::printf("vs peer %-22s iris %.2f  peer %.2f  ratio %.2fx%s\n", key, ours, theirs,
                  ours / theirs, higher_is_better ? "" : " (lower is better)");
    };
    for (const std::string& name : graphed_vision_cases)
      ratio(("vision_" + name).c_str(), "ms", false);
    ratio("decode", "tokens_per_s", true);
    ratio("ttft_ms", nullptr, false);
    ratio(("prefill_" + std::to_string(prefill_long)).c_str(), "tokens_per_s", true);
    if (peer_results.contains("peak_memory_mib")) {
      const double ours = results["memory_mib"].get<double>(),
                   theirs = peer_results["peak_memory_mib"].get<double>();
      std::printf(
          "vs peer %-22s iris %.2f  peer %.2f  ratio %.2fx (lower is better; iris: planned "
          "arenas, peer: torch peak allocated)\n",
          "memory_mib", ours, theirs, ours / theirs);
    }
  }
  if (!decode_records.empty()) {
    // Each op ran alone, so their sum is the device's busy time for the step without the gaps
    // between kernels; set against the timed steps, it says how much of a step is launches and
    // gaps, and each op's rate says how far its kernel is from the copy bandwidth.
    // At one token a GEMM reads its weights once and does two FLOPs per weight: its floor is its
    // bytes, as every other op's is. (Rates count the whole of each tensor an op names, so the
    // embedding lookup and the attention's cache, which read only some rows, show too high and
    // too low.)
    for (OpRecord& r : decode_records) r.flops = 0;
    const StepProfile p = step_profile(decode_records, eager_decode_ms);
    std::printf(
        "\neager decode step, op by op: %.3f ms in its ops (each timed alone) against %.3f ms a "
        "timed eager step\n",
        p.ops_ms, eager_decode_ms);
    for (const std::string& line : step_profile_table(p, hw.gemm_tflops, hw.copy_gbps))
      std::printf("  %s\n", line.c_str());
    for (const std::string& line : op_totals_table(totals_by_op(decode_records), 16, p.step_ms(),
                                                   hw.gemm_tflops, hw.copy_gbps))
      std::printf("  %s\n", line.c_str());
    results["decode_profile"] = step_profile_json(p);
  }
  if (!json_out.empty()) write_file_atomic(json_out, results.dump(2) + "\n");
  return 0;
}

}  // namespace iris
