// CUDA graphs for Qwen3-VL inference: padded vision bucket graphs, decode graphs (block and layer
// scope), pipeline-stage ownership and deletion. On the CPU the graph API is the recording
// stand-in, so the helper's capture, replay and deletion logic runs (and is checked) here; the
// CUDA tests run the same paths with real graphs and skip without a GPU.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "bridge/pipeline_stage.h"
#include "bridge/qwen3vl_model.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using test::grids_of;
using test::ids_of;
using test::read_f32;

using Op = RecordingGraphApi::Op;
using test::all_close;
using test::Golden;

// ---- helpers ----

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

GraphConfigs make_configs(const std::string& scope, int warmup,
                          const std::string& buckets = "280,640,1024",
                          const std::string& overflow = "eager",
                          const std::string& vision_scope = "block") {
  const std::string max = buckets.substr(buckets.rfind(',') + 1);
  GraphConfigs c = parse_graph_configs({{"cuda_graph_impl", "local"},
                                        {"inference_cuda_graph_scope", scope},
                                        {"cuda_graph_warmup_steps", std::to_string(warmup)},
                                        {"vision_cuda_graph_impl", "local"},
                                        {"vision_inference_cuda_graph_scope", vision_scope},
                                        {"max_vision_cuda_graph_seq_length", max},
                                        {"vision_cuda_graph_buckets", buckets},
                                        {"vision_cuda_graph_overflow", overflow}});
  GraphModelTraits traits;
  traits.has_deepstack = true;
  traits.spatial_merge_size = 2;
  finalize_graph_configs(c, traits);
  return c;
}

ModelLimits fixture_limits() {
  ModelLimits l;
  l.max_context = 512;
  l.max_step_tokens = 256;
  l.max_vision_patches = 1024;
  l.max_images = 4;
  return l;
}

// The pixel rows and grids of the images `which` of the golden call, in that order.
struct Images {
  std::vector<float> pixels;
  std::vector<GridTHW> grids;
  std::vector<int64_t> merged_rows;  // per image
};

// Forwards every op to a backend and, for checking ordering and capture rules, logs each free
// into the graph API's log and flags host traffic or allocation while a capture is open.
class TracingBackend final : public Backend {
 public:
  TracingBackend(Backend& inner, RecordingGraphApi& api) : in_(inner), api_(api) {}

  std::vector<std::string> violations;
  // Base address of the live allocation that holds p (nullptr when none).
  const void* allocation_of(const void* p) const {
    for (const auto& [base, bytes] : live_)
      if (p >= base && static_cast<const char*>(p) < static_cast<const char*>(base) + bytes)
        return base;
    return nullptr;
  }
  static std::string free_note(const void* base) {
    std::ostringstream os;
    os << "free " << base;
    return os.str();
  }

  Device device() const override { return in_.device(); }
  std::string name() const override { return "tracing " + in_.name(); }
  DType compute_dtype() const override { return in_.compute_dtype(); }
  void* allocate(size_t bytes) override {
    flag("allocate");
    void* p = in_.allocate(bytes);
    live_[p] = bytes;
    return p;
  }
  void deallocate(void* ptr) override {
    flag("deallocate");
    if (ptr != nullptr) api_.note(free_note(ptr));
    live_.erase(ptr);
    in_.deallocate(ptr);
  }
  void write(const Tensor& dst, const void* src, DType dt) override {
    flag("write");
    in_.write(dst, src, dt);
  }
  void read(void* dst, DType dt, const Tensor& src) override {
    flag("read");
    in_.read(dst, dt, src);
  }
  void synchronize() override {
    flag("synchronize");
    in_.synchronize();
  }
  void* native_stream() override { return in_.native_stream(); }
  void finish_background_startup() override { in_.finish_background_startup(); }
  // Timing marks are host-timed work like synchronize(): never inside a capture.
  void record_timing_mark(int slot) override {
    flag("record_timing_mark");
    in_.record_timing_mark(slot);
  }
  double timing_mark_elapsed_ms(int from, int to) override {
    flag("timing_mark_elapsed_ms");
    return in_.timing_mark_elapsed_ms(from, to);
  }
  // The inner backend tapes what this one forwards, so launches replay the record.
  bool begin_op_tape() override { return in_.begin_op_tape(); }
  std::function<void()> end_op_tape() override { return in_.end_op_tape(); }
  size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                      int64_t vocab) const override {
    return in_.lm_head_loss_workspace_bytes(chunk_rows, hidden, vocab);
  }
  // Every op: forwarded as it is.
#define IRIS_BACKEND_OP(name, params, args) \
  void name params override {               \
    in_.name args;                          \
  }
#define IRIS_BACKEND_OP_WITH_DEFAULT IRIS_BACKEND_OP
#include "core/backend_ops.inc"
#undef IRIS_BACKEND_OP
#undef IRIS_BACKEND_OP_WITH_DEFAULT

 private:
  void flag(const char* what) {
    if (api_.capturing(this)) violations.push_back(std::string(what) + " inside a capture");
  }
  Backend& in_;
  RecordingGraphApi& api_;
  std::map<const void*, size_t> live_;
};

// Graph id -> op -> count.
std::map<uint64_t, std::map<Op, int>> counts_by_graph(
    const std::vector<RecordingGraphApi::Call>& log) {
  std::map<uint64_t, std::map<Op, int>> out;
  for (const auto& c : log)
    if (c.graph != 0) ++out[c.graph][c.op];
  return out;
}

int count_ops(const std::vector<RecordingGraphApi::Call>& log, Op op,
              const std::string& label_part = "") {
  int n = 0;
  for (const auto& c : log)
    if (c.op == op && c.label.find(label_part) != std::string::npos) ++n;
  return n;
}

// ---- pipeline stages ----

TEST(PipelineStages, SplitIsContiguousWithVisionFirstAndHeadLast) {
  ModelConfig cfg;
  cfg.text.num_hidden_layers = 28;
  for (int n : {1, 2, 3, 4, 28}) {
    const auto stages = split_stages(cfg, n);
    ASSERT_EQ(static_cast<int>(stages.size()), n);
    int next = 0;
    for (int i = 0; i < n; ++i) {
      const PipelineStage& s = stages[static_cast<size_t>(i)];
      EXPECT_EQ(s.index, i);
      EXPECT_EQ(s.count, n);
      EXPECT_EQ(s.first_layer, next);
      EXPECT_GE(s.n_layers(), 28 / n);
      EXPECT_LE(s.n_layers(), 28 / n + 1);
      EXPECT_EQ(s.has_vision, i == 0);
      EXPECT_EQ(s.has_embed(), i == 0);
      EXPECT_EQ(s.has_head, i == n - 1);
      EXPECT_NO_THROW(validate_stage(cfg, s));
      next = s.end_layer;
    }
    EXPECT_EQ(next, 28);
  }
  // Stage 0 carries the vision encoder, so the extra layers go to the later stages.
  const auto three = split_stages(cfg, 3);
  EXPECT_EQ(three[0].n_layers(), 9);
  EXPECT_EQ(three[1].n_layers(), 9);
  EXPECT_EQ(three[2].n_layers(), 10);
  EXPECT_EQ(three[2].describe(), "stage 2/3 (layers 18-27, head)");
  EXPECT_EQ(three[0].describe(), "stage 0/3 (vision, embed, layers 0-8)");
  EXPECT_THROW(split_stages(cfg, 0), Error);
  EXPECT_THROW(split_stages(cfg, 29), Error);
  PipelineStage bad = three[1];
  bad.has_head = true;
  EXPECT_THROW(validate_stage(cfg, bad), Error);
  bad = three[1];
  bad.first_layer = 0;
  EXPECT_THROW(validate_stage(cfg, bad), Error);
}

// ---- padded vision layouts ----

TEST(PaddedVisionLayout, TwoSmallImagesMatchHandComputedLayouts) {
  VisionConfig v;
  v.hidden_size = 16;
  v.num_heads = 2;                 // head_dim 8, rotary pairs 2 per axis
  v.num_position_embeddings = 16;  // a 4x4 learned grid
  v.spatial_merge_size = 2;
  v.rope_theta = 10000.0f;
  VisionGraphConfig g;
  g.impl = VisionGraphImpl::local;
  g.max_seq_length = 64;
  g.buckets = {32, 64};
  // Image A: 2x2 patches (one merge window). Image B: 2x6 patches (three windows). 16 patches.
  const std::vector<GridTHW> grids = {{1, 2, 2}, {1, 2, 6}};
  const PaddedVisionCall call = plan_padded_vision_call(v, g, grids, 4);
  ASSERT_TRUE(call.bucket.has_value());
  EXPECT_EQ(*call.bucket, 32);
  EXPECT_EQ(call.call.n_patches, 16);
  EXPECT_EQ(call.call.rows, 32);
  EXPECT_EQ(call.call.n_segments, 3);
  const VisionInputs in = plan_vision_inputs(v, grids, *call.bucket, 4);
  EXPECT_EQ(in.n_patches, 16);
  EXPECT_EQ(in.rows, 32);
  // Two images, then the padding rows as a third segment, then an empty fourth.
  EXPECT_EQ(in.cu_seqlens, (std::vector<int32_t>{0, 4, 16, 32, 32}));
  EXPECT_EQ(in.n_segments, 3);

  // (row, column) of each patch in merge-window order: A's window, then B's three windows.
  const int rc[16][2] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 0}, {0, 1}, {1, 0}, {1, 1},
                         {0, 2}, {0, 3}, {1, 2}, {1, 3}, {0, 4}, {0, 5}, {1, 4}, {1, 5}};
  // 10000^(-2j/4), rounded to bf16 as HF's cast buffer holds it: 0.01 -> 0.010009765625.
  const float inv_freq[2] = {1.0f, 0.010009765625f};
  ASSERT_EQ(in.cos.size(), 32u * 8);
  for (int row = 0; row < 32; ++row)
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 2; ++j) {
        const float r = row < 16 ? static_cast<float>(rc[row][0]) : 0.0f;
        const float c = row < 16 ? static_cast<float>(rc[row][1]) : 0.0f;
        const size_t at = static_cast<size_t>(row * 8 + half * 4);
        // Padding rows rotate by nothing: cos 1, sin 0.
        EXPECT_NEAR(in.cos[at + j], std::cos(r * inv_freq[j]), 1e-6) << "row " << row;
        EXPECT_NEAR(in.sin[at + j], std::sin(r * inv_freq[j]), 1e-6) << "row " << row;
        EXPECT_NEAR(in.cos[at + 2 + j], std::cos(c * inv_freq[j]), 1e-6) << "row " << row;
        EXPECT_NEAR(in.sin[at + 2 + j], std::sin(c * inv_freq[j]), 1e-6) << "row " << row;
      }

  // Bilinear corners on the 4x4 grid: A samples linspace(0,3,2) = {0,3} on both axes; B samples
  // {0,3} by rows and linspace(0,3,6) = {0,.6,1.2,1.8,2.4,3} by columns.
  struct Corner {
    int row;
    int32_t index[4];
    float weight[4];
  };
  const Corner corners[] = {
      {0, {0, 1, 4, 5}, {1, 0, 0, 0}},             // A (0,0)
      {1, {3, 3, 7, 7}, {1, 0, 0, 0}},             // A (0,1): column 3 is the grid's edge
      {2, {12, 13, 12, 13}, {1, 0, 0, 0}},         // A (1,0): row 3 is the grid's edge
      {5, {0, 1, 4, 5}, {0.4f, 0.6f, 0, 0}},       // B (0,1): column 0.6
      {9, {1, 2, 5, 6}, {0.2f, 0.8f, 0, 0}},       // B (0,3): column 1.8
      {14, {14, 15, 14, 15}, {0.6f, 0.4f, 0, 0}},  // B (1,4): row 3, column 2.4
      {15, {15, 15, 15, 15}, {1, 0, 0, 0}},        // B (1,5): the far corner
  };
  for (const Corner& k : corners)
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(in.pos_index[static_cast<size_t>(k.row * 4 + i)], k.index[i]) << "row " << k.row;
      EXPECT_NEAR(in.pos_weight[static_cast<size_t>(k.row * 4 + i)], k.weight[i], 1e-6)
          << "row " << k.row;
    }
  // Padding rows add nothing of the position embedding.
  for (int row = 16; row < 32; ++row)
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(in.pos_index[static_cast<size_t>(row * 4 + i)], 0);
      EXPECT_EQ(in.pos_weight[static_cast<size_t>(row * 4 + i)], 0.0f);
    }
}

TEST(PaddedVisionLayout, ExactFitHasNoPaddingSegmentAndOverflowHasNoBucket) {
  VisionConfig v;
  v.hidden_size = 16;
  v.num_heads = 2;
  v.num_position_embeddings = 16;
  VisionGraphConfig g;
  g.impl = VisionGraphImpl::local;
  g.max_seq_length = 64;
  g.buckets = {32, 64};
  const PaddedVisionCall exact = plan_padded_vision_call(v, g, {{1, 4, 4}, {1, 4, 4}}, 3);
  ASSERT_TRUE(exact.bucket.has_value());
  EXPECT_EQ(*exact.bucket, 32);
  EXPECT_EQ(exact.call.n_segments, 2);
  EXPECT_EQ(plan_vision_inputs(v, {{1, 4, 4}, {1, 4, 4}}, 32, 3).cu_seqlens,
            (std::vector<int32_t>{0, 16, 32, 32}));
  const PaddedVisionCall over = plan_padded_vision_call(v, g, {{1, 8, 8}, {1, 2, 2}}, 3);
  EXPECT_EQ(over.n_patches, 68);
  EXPECT_FALSE(over.bucket.has_value());
  // More segments than the capacity is an error, not a silent merge of images.
  EXPECT_THROW(plan_padded_vision_call(v, g, {{1, 2, 2}, {1, 2, 2}, {1, 2, 2}}, 3), Error);
  EXPECT_THROW(plan_padded_vision_call(v, g, {}, 3), Error);
}

// ---- the tiny fixture on the CPU ----

class CpuGraphs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    golden_ = new Golden();
    cpu_ = make_cpu_backend().release();
    const HostTensor pv = golden_->tensor("pixel_values");
    const std::vector<GridTHW> grids = grids_of(golden_->tensor("image_grid_thw"));
    pixels_ = new std::vector<float>(pv.data<float>(), pv.data<float>() + pv.numel());
    grids_ = new std::vector<GridTHW>(grids);
    Qwen3VLModel eager(*cpu_, test::fixture_dir(), fixture_limits());
    eager_mm_ = new std::vector<int32_t>(generate(eager, nullptr, true, 12));
    eager_text_ = new std::vector<int32_t>(generate(eager, nullptr, false, 12));
  }
  static void TearDownTestSuite() {
    delete eager_text_;
    delete eager_mm_;
    delete grids_;
    delete pixels_;
    delete cpu_;
    delete golden_;
  }

  static Images images(const std::vector<int>& which) {
    Images out;
    const int64_t pd = 1536;
    std::vector<int64_t> first(grids_->size() + 1, 0);
    for (size_t i = 0; i < grids_->size(); ++i)
      first[i + 1] = first[i] + count_patches({(*grids_)[i]});
    for (int k : which) {
      const auto& g = (*grids_)[static_cast<size_t>(k)];
      out.grids.push_back(g);
      out.merged_rows.push_back(count_patches({g}) / 4);
      out.pixels.insert(out.pixels.end(), pixels_->begin() + first[k] * pd,
                        pixels_->begin() + first[k + 1] * pd);
    }
    return out;
  }

  // Greedy tokens: the first from the prefill's logits, then one per decode step. When `head` is
  // given, the on-device argmax of each graph step must agree with the host's.
  static std::vector<int32_t> generate(Qwen3VLModel& m, VisionCudaGraphHelper* head, bool mm,
                                       int n) {
    if (mm) {
      m.encode_images(pixels_->data(), *grids_);
    } else {
      m.encode_images(nullptr, {});
    }
    m.prefill(ids_of(golden_->tensor(mm ? "input_ids" : "text_input_ids")));
    std::vector<int32_t> out{argmax(m.last_logits())};
    while (static_cast<int>(out.size()) < n) {
      m.decode(out.back());
      out.push_back(argmax(m.last_logits()));
      if (head != nullptr) EXPECT_EQ(head->greedy_token(), out.back()) << "step " << out.size();
    }
    return out;
  }

  static std::vector<float> rows_of(Backend& be, const Tensor& t, int64_t first, int64_t n) {
    return read_f32(be, t.slice(first, first + n));
  }

  static Golden* golden_;
  static Backend* cpu_;
  static std::vector<float>* pixels_;
  static std::vector<GridTHW>* grids_;
  static std::vector<int32_t>* eager_mm_;
  static std::vector<int32_t>* eager_text_;
};

Golden* CpuGraphs::golden_ = nullptr;
Backend* CpuGraphs::cpu_ = nullptr;
std::vector<float>* CpuGraphs::pixels_ = nullptr;
std::vector<GridTHW>* CpuGraphs::grids_ = nullptr;
std::vector<int32_t>* CpuGraphs::eager_mm_ = nullptr;
std::vector<int32_t>* CpuGraphs::eager_text_ = nullptr;

constexpr float kTight = 1e-6f;

TEST_F(CpuGraphs, PaddedEncoderEqualsTheUnpaddedEncoder) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  VisionEncoder& enc = m.vision();
  const auto eager = enc.encode(pixels_->data(), *grids_);
  const std::vector<float> want = read_f32(*cpu_, eager.embeds);
  std::vector<std::vector<float>> want_ds;
  for (const Tensor& d : eager.deepstack) want_ds.push_back(read_f32(*cpu_, d));

  const GraphConfigs cfg = make_configs("block", 0);
  const PaddedVisionCall call =
      plan_padded_vision_call(m.config().vision, cfg.vision, *grids_, enc.max_segments());
  ASSERT_EQ(call.n_patches, 560);
  ASSERT_EQ(*call.bucket, 640);
  enc.upload(pixels_->data(), *grids_, *call.bucket);
  const auto padded = enc.run(*call.bucket, enc.max_segments());
  ASSERT_EQ(padded.embeds.dim(0), 160);
  EXPECT_TRUE(all_close(rows_of(*cpu_, padded.embeds, 0, 140), want, kTight, kTight));
  ASSERT_EQ(padded.deepstack.size(), want_ds.size());
  for (size_t k = 0; k < want_ds.size(); ++k)
    EXPECT_TRUE(all_close(rows_of(*cpu_, padded.deepstack[k], 0, 140), want_ds[k], kTight, kTight))
        << "deepstack " << k;
}

TEST_F(CpuGraphs, BucketGraphsWarmUpCaptureOnceAndReplayTheEagerResult) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  const auto eager = m.vision().encode(pixels_->data(), *grids_);
  const std::vector<float> want = read_f32(*cpu_, eager.embeds);
  RecordingGraphApi api;
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 2), api);
  EXPECT_FALSE(h.capture_finished(GraphSet::vision));
  for (int call = 0; call < 5; ++call) {
    const auto out = h.encode(pixels_->data(), *grids_);
    EXPECT_EQ(h.last_bucket(), 640);
    EXPECT_EQ(out.embeds.dim(0), 140);
    EXPECT_TRUE(all_close(read_f32(*cpu_, out.embeds), want, kTight, kTight)) << "call " << call;
    // Two eager warmup calls, the third captures (and runs once), later ones replay.
    EXPECT_EQ(h.graphs_created(GraphSet::vision), call >= 2) << "call " << call;
    // Only a replay is a launch.
    EXPECT_EQ(h.last_launch_ms() > 0, call >= 3) << "call " << call;
  }
  const auto log = api.log();
  EXPECT_EQ(count_ops(log, Op::begin_capture), 1);
  EXPECT_EQ(count_ops(log, Op::launch, "vision bucket 640"), 2);
  // One bucket of three exists: graphs exist, but capture is not finished.
  EXPECT_TRUE(h.graphs_created(GraphSet::vision));
  EXPECT_FALSE(h.capture_finished(GraphSet::vision));
  EXPECT_EQ(h.graph_count(GraphSet::vision), 1u);
}

TEST_F(CpuGraphs, VisionLayerScopeCapturesOneGraphPerBlockAndReplaysTheEagerResult) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  const auto eager = m.vision().encode(pixels_->data(), *grids_);
  const std::vector<float> want = read_f32(*cpu_, eager.embeds);
  std::vector<std::vector<float>> want_ds;
  for (const Tensor& d : eager.deepstack) want_ds.push_back(read_f32(*cpu_, d));
  RecordingGraphApi api;
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0],
                          make_configs("block", 1, "280,640,1024", "eager", "layer"), api);
  for (int call = 0; call < 3; ++call) {
    const auto out = h.encode(pixels_->data(), *grids_);
    EXPECT_TRUE(all_close(read_f32(*cpu_, out.embeds), want, kTight, kTight)) << "call " << call;
    for (size_t k = 0; k < want_ds.size(); ++k)
      EXPECT_TRUE(all_close(read_f32(*cpu_, out.deepstack[k]), want_ds[k], kTight, kTight))
          << "call " << call << " deepstack " << k;
  }
  // One warmup call, then one graph per vision block for the 640-row bucket.
  EXPECT_EQ(h.graph_count(GraphSet::vision), static_cast<size_t>(m.config().vision.depth));
  EXPECT_EQ(count_ops(api.log(), Op::begin_capture), m.config().vision.depth);
  h.delete_graphs(GraphSet::vision);
  EXPECT_EQ(h.graph_count(GraphSet::vision), 0u);
}

TEST_F(CpuGraphs, EqualPatchCountsWithOtherImageBoundariesReplayFreshSegments) {
  // The same 560 pixel rows cut into images in three ways: one bucket (640), one graph, and
  // only the segment boundaries, RoPE and position tables tell the calls apart. A replay that
  // kept the first call's cu_seqlens (sglang #37043) would attend across the new boundaries.
  const std::vector<std::vector<GridTHW>> cuts = {
      {{1, 14, 20}, {1, 28, 10}}, {{1, 10, 8}, {1, 20, 24}}, {{1, 20, 24}, {1, 10, 8}}};
  Qwen3VLModel reference(*cpu_, test::fixture_dir(), fixture_limits());
  std::vector<std::vector<float>> want;
  for (const auto& grids : cuts)
    want.push_back(read_f32(*cpu_, reference.vision().encode(pixels_->data(), grids).embeds));
  ASSERT_FALSE(all_close(want[1], want[2], kTight, kTight));

  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  RecordingGraphApi api;
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 0), api);
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < cuts.size(); ++i) {
      const auto out = h.encode(pixels_->data(), cuts[i]);
      EXPECT_EQ(h.last_bucket(), 640);
      EXPECT_TRUE(all_close(read_f32(*cpu_, out.embeds), want[i], kTight, kTight))
          << "cut " << i << ", round " << round;
    }
  EXPECT_EQ(count_ops(api.log(), Op::begin_capture), 1);
  EXPECT_EQ(count_ops(api.log(), Op::launch), 5);
}

// Two image mixes of one bucket (640 rows): two images, then three of other sizes. The graph is
// captured on the first; a replay of it must compute the second's tables (the image count, the
// segments, the RoPE and position tables) from the grids uploaded before it, inside the replay,
// and give what an eager run of the second mix gives, bit for bit.
std::vector<GridTHW> other_mix_of_bucket_640() {
  return {{1, 10, 8}, {1, 12, 12}, {1, 14, 20}};  // 80 + 144 + 280 = 504 patches
}

// The real merged rows of an encoder output, embeddings then each DeepStack feature.
std::vector<float> merged_rows(Backend& be, const VisionEncoder::Output& out, int64_t rows) {
  std::vector<float> v = read_f32(be, out.embeds.slice(0, rows));
  for (const Tensor& d : out.deepstack) {
    const std::vector<float> ds = read_f32(be, d.slice(0, rows));
    v.insert(v.end(), ds.begin(), ds.end());
  }
  return v;
}

TEST_F(CpuGraphs, OneBucketGraphComputesEachImageMixsTablesInsideTheReplay) {
  RecordingGraphApi api;
  TracingBackend be(*cpu_, api);
  {
    Qwen3VLModel m(be, test::fixture_dir(), fixture_limits());
    VisionEncoder& enc = m.vision();
    const std::vector<std::vector<GridTHW>> mixes = {*grids_, other_mix_of_bucket_640()};
    std::vector<std::vector<float>> want;
    for (const auto& grids : mixes) {
      const VisionCall call = enc.upload(pixels_->data(), grids, 640);
      want.push_back(merged_rows(be, enc.run(640, enc.max_segments()), call.n_patches / 4));
    }
    ASSERT_NE(want[0].size(), want[1].size());

    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 0), api);
    for (int round = 0; round < 2; ++round)
      for (size_t i = 0; i < mixes.size(); ++i) {
        const auto out = h.encode(pixels_->data(), mixes[i]);
        EXPECT_EQ(h.last_bucket(), 640);
        EXPECT_EQ(merged_rows(be, out, out.embeds.dim(0)), want[i])
            << "mix " << i << ", round " << round;
      }
    // Captured on the first call, replayed for the other three, the three-image mix included.
    EXPECT_EQ(count_ops(api.log(), Op::begin_capture), 1);
    EXPECT_EQ(count_ops(api.log(), Op::launch, "vision bucket 640"), 3);
  }
  EXPECT_TRUE(be.violations.empty()) << be.violations.front();
}

TEST_F(CpuGraphs, AddingAnImageLeavesTheOtherImagesUnchanged) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  RecordingGraphApi api;
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 0), api);
  std::vector<std::vector<float>> alone;
  for (int k : {0, 1}) {
    const Images im = images({k});
    const auto out = h.encode(im.pixels.data(), im.grids);
    EXPECT_EQ(h.last_bucket(), 280);  // an exact fit: no padding segment
    alone.push_back(read_f32(*cpu_, out.embeds));
  }
  for (const auto& order : {std::vector<int>{0, 1}, std::vector<int>{1, 0}}) {
    const Images im = images(order);
    const auto out = h.encode(im.pixels.data(), im.grids);
    EXPECT_EQ(h.last_bucket(), 640);  // padded
    int64_t first = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      EXPECT_TRUE(all_close(rows_of(*cpu_, out.embeds, first, im.merged_rows[i]),
                            alone[static_cast<size_t>(order[i])], kTight, kTight))
          << "image " << order[i] << " at position " << i;
      first += im.merged_rows[i];
    }
  }
}

TEST_F(CpuGraphs, OverflowRunsEagerlyWithOneWarningOrFailsByConfig) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  const std::vector<float> want =
      read_f32(*cpu_, m.vision().encode(pixels_->data(), *grids_).embeds);
  RecordingGraphApi api;
  VisionCudaGraphHelper eager(m, split_stages(m.config(), 1)[0],
                              make_configs("block", 0, "256,512"), api);
  for (int call = 1; call <= 2; ++call) {
    const auto out = eager.encode(pixels_->data(), *grids_);  // 560 patches > 512
    EXPECT_EQ(eager.last_bucket(), 0);
    EXPECT_EQ(eager.overflow_calls(), call);
    EXPECT_TRUE(all_close(read_f32(*cpu_, out.embeds), want, kTight, kTight));
  }
  EXPECT_EQ(count_ops(api.log(), Op::begin_capture), 0);
  const Images one = images({0});
  eager.encode(one.pixels.data(), one.grids);  // 280 still fits a bucket
  EXPECT_EQ(eager.last_bucket(), 512);
  EXPECT_EQ(eager.overflow_calls(), 2);

  VisionCudaGraphHelper strict(m, split_stages(m.config(), 1)[0],
                               make_configs("block", 0, "256,512", "error"), api);
  try {
    strict.encode(pixels_->data(), *grids_);
    ADD_FAILURE() << "an overflowing call must fail with overflow: error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vision_cuda_graph_overflow"), std::string::npos)
        << e.what();
  }
}

TEST_F(CpuGraphs, HelperRejectsSetupsItCannotServe) {
  ModelLimits small = fixture_limits();
  small.max_vision_patches = 512;
  Qwen3VLModel m(*cpu_, test::fixture_dir(), small);
  const PipelineStage whole = split_stages(m.config(), 1)[0];
  RecordingGraphApi api;
  // A bucket larger than the encoder's planned rows would need new memory.
  EXPECT_THROW(VisionCudaGraphHelper(m, whole, make_configs("block", 0), api), Error);
  GraphConfigs unfinalized = parse_graph_configs({{"vision_cuda_graph_impl", "local"}});
  EXPECT_THROW(VisionCudaGraphHelper(m, whole, unfinalized, api), Error);
  PipelineStage wrong = whole;
  wrong.end_layer = 2;
  EXPECT_THROW(VisionCudaGraphHelper(m, wrong, make_configs("block", 0, "256,512"), api), Error);
  // Only one stage of two attached: a decode step cannot run.
  VisionCudaGraphHelper s0(m, split_stages(m.config(), 2)[0], make_configs("block", 0, "256,512"),
                           api);
  m.attach_graphs(&s0);
  m.encode_images(nullptr, {});
  m.prefill(ids_of(golden_->tensor("text_input_ids")));
  EXPECT_THROW(m.decode(1), Error);
  VisionCudaGraphHelper s1(m, split_stages(m.config(), 2)[1], make_configs("block", 0, "256,512"),
                           api);
  EXPECT_THROW(s1.encode(pixels_->data(), *grids_), Error);  // no encoder on stage 1
  EXPECT_THROW(s0.greedy_token(), Error);                    // no head on stage 0
}

struct DecodeCase {
  const char* scope;
  int stages;
};

class CpuDecodeGraphs : public CpuGraphs, public ::testing::WithParamInterface<DecodeCase> {};

TEST_P(CpuDecodeGraphs, GreedyTokensEqualTheEagerTokens) {
  const DecodeCase c = GetParam();
  RecordingGraphApi api;
  TracingBackend be(*cpu_, api);
  {
    Qwen3VLModel m(be, test::fixture_dir(), fixture_limits());
    std::vector<std::unique_ptr<VisionCudaGraphHelper>> helpers;
    for (const PipelineStage& s : split_stages(m.config(), c.stages)) {
      helpers.push_back(
          std::make_unique<VisionCudaGraphHelper>(m, s, make_configs(c.scope, 3), api));
      m.attach_graphs(helpers.back().get());
    }
    VisionCudaGraphHelper* head = helpers.back().get();
    EXPECT_EQ(generate(m, head, true, 12), *eager_mm_);
    EXPECT_EQ(generate(m, head, false, 12), *eager_text_);
    const bool block = std::string(c.scope) == "block";
    for (const auto& h : helpers) {
      EXPECT_TRUE(h->capture_finished(GraphSet::decoder));
      EXPECT_EQ(h->graph_count(GraphSet::decoder),
                block ? 1u : static_cast<size_t>(h->stage().n_layers()));
    }
    const auto log = api.log();
    // Captured once after 3 eager steps, replayed for the other 22 - 4 steps.
    const int graphs = block ? c.stages : m.config().text.num_hidden_layers;
    EXPECT_EQ(count_ops(log, Op::begin_capture, "decoder"), graphs);
    EXPECT_EQ(count_ops(log, Op::launch, "decoder"), graphs * (22 - 4));
  }
  EXPECT_TRUE(be.violations.empty()) << be.violations.front();
  EXPECT_TRUE(api.errors().empty());
  EXPECT_EQ(api.live_graphs(), 0u);
}

INSTANTIATE_TEST_SUITE_P(ScopesAndStages, CpuDecodeGraphs,
                         ::testing::Values(DecodeCase{"block", 1}, DecodeCase{"layer", 1},
                                           DecodeCase{"block", 2}, DecodeCase{"layer", 2}),
                         [](const auto& info) {
                           return std::string(info.param.scope) + "_" +
                                  std::to_string(info.param.stages) + "_stages";
                         });

TEST_F(CpuGraphs, TwoStagesCreateAndDeleteOnlyTheirOwnGraphs) {
  RecordingGraphApi api;
  TracingBackend be(*cpu_, api);
  const void* encoder_memory = nullptr;
  const void* decoder_memory = nullptr;
  std::set<uint64_t> stage0_graphs, stage1_graphs;
  {
    Qwen3VLModel m(be, test::fixture_dir(), fixture_limits());
    const auto stages = split_stages(m.config(), 2);
    VisionCudaGraphHelper s0(m, stages[0], make_configs("layer", 1), api);
    VisionCudaGraphHelper s1(m, stages[1], make_configs("layer", 1), api);
    m.attach_graphs(&s0);
    m.attach_graphs(&s1);

    // Stage 1 holds no encoder: nothing to capture there, so its capture is finished and no
    // vision graph is ever created; stage 0 has work left until every bucket exists.
    EXPECT_TRUE(s1.capture_finished(GraphSet::vision));
    EXPECT_FALSE(s1.graphs_created(GraphSet::vision));
    EXPECT_FALSE(s0.capture_finished(GraphSet::vision));
    EXPECT_FALSE(s0.graphs_created());

    EXPECT_EQ(generate(m, &s1, true, 12), *eager_mm_);  // encode warms up bucket 640
    EXPECT_FALSE(s0.graphs_created(GraphSet::vision));
    EXPECT_EQ(generate(m, &s1, true, 12), *eager_mm_);  // captures it
    EXPECT_TRUE(s0.graphs_created(GraphSet::vision));
    EXPECT_FALSE(s0.capture_finished(GraphSet::vision));  // 280 and 1024 not yet
    EXPECT_FALSE(s1.graphs_created(GraphSet::vision));
    EXPECT_TRUE(s0.graphs_created(GraphSet::decoder));
    EXPECT_TRUE(s1.graphs_created(GraphSet::decoder));
    EXPECT_EQ(s0.graph_count(GraphSet::decoder), 1u);
    EXPECT_EQ(s1.graph_count(GraphSet::decoder), 2u);
    encoder_memory = be.allocation_of(m.vision().encode(pixels_->data(), *grids_).embeds.data);
    decoder_memory = be.allocation_of(m.decoder().hidden(1).data);
    ASSERT_NE(encoder_memory, nullptr);
    ASSERT_NE(decoder_memory, nullptr);

    for (const auto& c : api.log()) {
      if (c.op != Op::end_capture) continue;
      (c.label.find("stage 0/2") != std::string::npos ? stage0_graphs : stage1_graphs)
          .insert(c.graph);
    }
    EXPECT_EQ(stage0_graphs.size(), 2u);  // bucket 640 and layer 0
    EXPECT_EQ(stage1_graphs.size(), 2u);  // layers 1 and 2

    // Deleting vision graphs on the stage without an encoder is a no-op, not an error.
    size_t before = api.log().size();
    s1.delete_graphs(GraphSet::vision);
    EXPECT_EQ(api.log().size(), before);
    EXPECT_TRUE(s1.graphs_created(GraphSet::decoder));

    // Stage 0 deletes its own graphs and leaves stage 1's alone; a second delete is harmless.
    s0.delete_graphs();
    EXPECT_FALSE(s0.graphs_created());
    EXPECT_TRUE(s0.capture_finished());
    EXPECT_EQ(api.live_graphs(), 2u);
    before = api.log().size();
    s0.delete_graphs();
    EXPECT_EQ(api.log().size(), before);
    EXPECT_TRUE(api.errors().empty());

    // Afterwards stage 0 runs eagerly and never captures again; generation is unchanged.
    const int captures = count_ops(api.log(), Op::begin_capture);
    EXPECT_EQ(generate(m, &s1, true, 12), *eager_mm_);
    s0.capture_now();
    EXPECT_EQ(count_ops(api.log(), Op::begin_capture), captures);
    EXPECT_EQ(s0.last_bucket(), 0);
    EXPECT_FALSE(s0.graphs_created());
    EXPECT_TRUE(s1.graphs_created());
  }  // s1, s0, then the model: graphs go before the buffers they read

  const auto log = api.log();
  const auto counts = counts_by_graph(log);
  for (const auto& ids : {stage0_graphs, stage1_graphs})
    for (uint64_t id : ids) {
      EXPECT_EQ(counts.at(id).at(Op::destroy_exec), 1) << "graph " << id;
      EXPECT_EQ(counts.at(id).at(Op::destroy_graph), 1) << "graph " << id;
    }
  size_t last_destroy = 0, encoder_freed = 0, decoder_freed = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].op == Op::destroy_exec || log[i].op == Op::destroy_graph) last_destroy = i;
    if (log[i].label == TracingBackend::free_note(encoder_memory)) encoder_freed = i;
    if (log[i].label == TracingBackend::free_note(decoder_memory)) decoder_freed = i;
  }
  EXPECT_GT(encoder_freed, last_destroy);
  EXPECT_GT(decoder_freed, last_destroy);
  EXPECT_EQ(api.live_graphs(), 0u);
  EXPECT_TRUE(api.errors().empty());
  EXPECT_TRUE(be.violations.empty()) << be.violations.front();
}

TEST_F(CpuGraphs, AModelDestroyedFirstDeletesTheAttachedGraphsBeforeItsBuffers) {
  RecordingGraphApi api;
  TracingBackend be(*cpu_, api);
  auto m = std::make_unique<Qwen3VLModel>(be, test::fixture_dir(), fixture_limits());
  VisionCudaGraphHelper h(*m, split_stages(m->config(), 1)[0], make_configs("block", 0), api,
                          GraphHelperOptions{true});
  m->attach_graphs(&h);
  EXPECT_TRUE(h.capture_finished());
  EXPECT_EQ(h.graph_count(GraphSet::vision), 3u);
  EXPECT_EQ(h.graph_count(GraphSet::decoder), 1u);
  const void* decoder_memory = be.allocation_of(m->decoder().hidden(1).data);
  m.reset();
  EXPECT_EQ(api.live_graphs(), 0u);
  EXPECT_FALSE(h.graphs_created());
  EXPECT_EQ(h.model(), nullptr);
  EXPECT_THROW(h.decode_stage(), Error);
  h.delete_graphs();  // still harmless
  const auto log = api.log();
  size_t last_destroy = 0, freed = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].op == Op::destroy_graph) last_destroy = i;
    if (log[i].label == TracingBackend::free_note(decoder_memory)) freed = i;
  }
  EXPECT_GT(freed, last_destroy);
  EXPECT_TRUE(api.errors().empty());
}

TEST_F(CpuGraphs, CaptureAtStartupOrMidGenerationKeepsEveryCachedToken) {
  RecordingGraphApi api;
  TracingBackend be(*cpu_, api);
  {
    Qwen3VLModel m(be, test::fixture_dir(), fixture_limits());
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 2), api,
                            GraphHelperOptions{true});
    EXPECT_TRUE(h.capture_finished());
    m.attach_graphs(&h);
    const int captures = count_ops(api.log(), Op::begin_capture);
    EXPECT_EQ(captures, 4);  // three buckets and the decoder block
    EXPECT_EQ(generate(m, &h, true, 12), *eager_mm_);
    EXPECT_EQ(generate(m, &h, false, 12), *eager_text_);
    EXPECT_EQ(count_ops(api.log(), Op::begin_capture), captures);
  }
  {
    // A helper that would only capture after 100 steps, told to capture in the middle of a
    // generation: the dummy step writes the cache's last row, which no prompt has read yet.
    Qwen3VLModel m(be, test::fixture_dir(), fixture_limits());
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("layer", 100), api);
    m.attach_graphs(&h);
    m.encode_images(nullptr, {});
    m.prefill(ids_of(golden_->tensor("text_input_ids")));
    std::vector<int32_t> out{argmax(m.last_logits())};
    for (int i = 0; i < 11; ++i) {
      if (i == 4) {
        EXPECT_FALSE(h.graphs_created());
        h.capture_now();
        EXPECT_TRUE(h.capture_finished());
      }
      m.decode(out.back());
      out.push_back(argmax(m.last_logits()));
    }
    EXPECT_EQ(out, *eager_text_);
  }
  EXPECT_TRUE(be.violations.empty()) << be.violations.front();
  EXPECT_EQ(api.live_graphs(), 0u);
}

TEST_F(CpuGraphs, GraphsOffMeansTheEagerPathThroughTheHelper) {
  Qwen3VLModel m(*cpu_, test::fixture_dir(), fixture_limits());
  RecordingGraphApi api;
  GraphConfigs off = parse_graph_configs({});
  finalize_graph_configs(off, GraphModelTraits{});
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], off, api, GraphHelperOptions{true});
  m.attach_graphs(&h);
  EXPECT_TRUE(h.capture_finished());
  EXPECT_EQ(generate(m, &h, true, 12), *eager_mm_);
  EXPECT_FALSE(h.graphs_created());
  EXPECT_TRUE(api.log().empty());
}

// ---- CUDA ----

class CudaGraphModel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    be_ = make_cuda_backend();
    golden_ = std::make_unique<Golden>();
    const HostTensor pv = golden_->tensor("pixel_values");
    pixels_.assign(pv.data<float>(), pv.data<float>() + pv.numel());
    grids_ = grids_of(golden_->tensor("image_grid_thw"));
  }

  std::vector<int32_t> greedy(Qwen3VLModel& m, VisionCudaGraphHelper* head,
                              const std::vector<int32_t>& prompt, int n) {
    m.prefill(prompt);
    std::vector<int32_t> out{argmax(m.last_logits())};
    while (static_cast<int>(out.size()) < n) {
      m.decode(out.back());
      out.push_back(argmax(m.last_logits()));
      if (head != nullptr) EXPECT_EQ(head->greedy_token(), out.back()) << "step " << out.size();
    }
    return out;
  }

  std::unique_ptr<Backend> be_;
  std::unique_ptr<Golden> golden_;
  std::vector<float> pixels_;
  std::vector<GridTHW> grids_;
};

TEST_F(CudaGraphModel, VisionReplayIsBitIdenticalToEagerOnTheSamePaddedInput) {
  Qwen3VLModel m(*be_, test::fixture_dir(), fixture_limits());
  VisionEncoder& enc = m.vision();
  const GraphConfigs cfg = make_configs("block", 1);
  const PaddedVisionCall call =
      plan_padded_vision_call(m.config().vision, cfg.vision, grids_, enc.max_segments());
  enc.upload(pixels_.data(), grids_, *call.bucket);
  const auto eager = enc.run(*call.bucket, enc.max_segments());
  const std::vector<float> want = read_f32(*be_, eager.embeds.slice(0, 140));
  std::vector<std::vector<float>> want_ds;
  for (const Tensor& d : eager.deepstack) want_ds.push_back(read_f32(*be_, d.slice(0, 140)));

  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], cfg);
  for (int call_no = 0; call_no < 4; ++call_no) {  // warmup, capture, replay, replay
    const auto out = h.encode(pixels_.data(), grids_);
    EXPECT_EQ(read_f32(*be_, out.embeds), want) << "call " << call_no;
    for (size_t k = 0; k < want_ds.size(); ++k)
      EXPECT_EQ(read_f32(*be_, out.deepstack[k]), want_ds[k]) << "call " << call_no;
  }
  EXPECT_TRUE(h.graphs_created(GraphSet::vision));
}

TEST_F(CudaGraphModel, OneBucketGraphReplaysAnotherImageMixBitForBit) {
  Qwen3VLModel m(*be_, test::fixture_dir(), fixture_limits());
  VisionEncoder& enc = m.vision();
  const std::vector<std::vector<GridTHW>> mixes = {grids_, other_mix_of_bucket_640()};
  std::vector<std::vector<float>> want;
  for (const auto& grids : mixes) {
    const VisionCall call = enc.upload(pixels_.data(), grids, 640);
    want.push_back(merged_rows(*be_, enc.run(640, enc.max_segments()), call.n_patches / 4));
  }
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs("block", 1));
  // Warm-up and capture on the first mix; then replays of the second, the first, the second.
  const size_t order[] = {0, 0, 1, 0, 1};
  for (size_t call_no = 0; call_no < std::size(order); ++call_no) {
    const size_t i = order[call_no];
    const auto out = h.encode(pixels_.data(), mixes[i]);
    EXPECT_EQ(h.last_bucket(), 640);
    EXPECT_EQ(merged_rows(*be_, out, out.embeds.dim(0)), want[i])
        << "call " << call_no << " (mix " << i << ")";
  }
  EXPECT_EQ(h.graph_count(GraphSet::vision), 1u);
}

TEST_F(CudaGraphModel, PaddedGraphsGiveTheTopOneTokensOfTheUnpaddedPath) {
  ModelLimits limits = fixture_limits();
  limits.all_logits = true;
  const auto ids = ids_of(golden_->tensor("input_ids"));
  Qwen3VLModel eager(*be_, test::fixture_dir(), limits);
  eager.encode_images(pixels_.data(), grids_);
  eager.prefill(ids);
  const std::vector<float> want = eager.prompt_logits();

  Qwen3VLModel graphed(*be_, test::fixture_dir(), limits);
  VisionCudaGraphHelper h(graphed, split_stages(graphed.config(), 1)[0], make_configs("block", 0));
  graphed.attach_graphs(&h);
  graphed.encode_images(pixels_.data(), grids_);
  ASSERT_EQ(h.last_bucket(), 640);
  graphed.prefill(ids);
  const std::vector<float>& got = graphed.prompt_logits();
  const size_t V = static_cast<size_t>(eager.config().text.vocab_size);
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    const auto row = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + r * V, v.begin() + (r + 1) * V);
    };
    EXPECT_EQ(argmax(row(got)), argmax(row(want))) << "prompt row " << r;
  }
}

TEST_F(CudaGraphModel, NoImageChangesWhenAnotherIsAddedAcrossBucketEdges) {
  ModelLimits limits = fixture_limits();
  limits.max_vision_patches = 256;
  Qwen3VLModel m(*be_, test::fixture_dir(), limits);
  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0],
                          make_configs("block", 0, "16,64,128,256"));
  // Synthetic images whose calls land exactly on bucket edges (16, 64, 128) or get padded.
  const std::vector<GridTHW> shapes = {{1, 4, 4}, {1, 8, 8}, {1, 4, 12}, {1, 6, 6}};
  std::vector<std::vector<float>> pix;
  uint32_t state = 12345;
  for (const GridTHW& g : shapes) {
    std::vector<float> p(static_cast<size_t>(count_patches({g}) * 1536));
    for (float& x : p) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
    }
    pix.push_back(std::move(p));
  }
  auto run = [&](const std::vector<int>& which) {
    std::vector<float> pixels;
    std::vector<GridTHW> grids;
    for (int k : which) {
      pixels.insert(pixels.end(), pix[static_cast<size_t>(k)].begin(),
                    pix[static_cast<size_t>(k)].end());
      grids.push_back(shapes[static_cast<size_t>(k)]);
    }
    const auto out = h.encode(pixels.data(), grids);
    std::vector<std::vector<float>> per_image;
    int64_t first = 0;
    for (int k : which) {
      const int64_t n = count_patches({shapes[static_cast<size_t>(k)]}) / 4;
      per_image.push_back(read_f32(*be_, out.embeds.slice(first, first + n)));
      for (const Tensor& d : out.deepstack) {
        const auto ds = read_f32(*be_, d.slice(first, first + n));
        per_image.back().insert(per_image.back().end(), ds.begin(), ds.end());
      }
      first += n;
    }
    return per_image;
  };
  std::vector<std::vector<float>> alone;
  for (int k = 0; k < 4; ++k) alone.push_back(run({k})[0]);
  const std::vector<std::pair<std::vector<int>, int64_t>> calls = {
      {{0, 2}, 64}, {{0, 1}, 128}, {{0, 1, 2}, 128}, {{3, 0, 1, 2}, 256}, {{2, 3}, 128}};
  for (const auto& [which, bucket] : calls) {
    const auto got = run(which);
    EXPECT_EQ(h.last_bucket(), bucket);
    for (size_t i = 0; i < which.size(); ++i) {
      const std::vector<float>& ref = alone[static_cast<size_t>(which[i])];
      double rms = 0;
      for (float x : ref) rms += double(x) * x;
      rms = std::sqrt(rms / static_cast<double>(ref.size()));
      // bf16 noise: different row counts may pick other GEMM tilings, so allow a few units in
      // the last place of bf16 (2^-8 relative) on top of each value.
      EXPECT_TRUE(all_close(got[i], ref, 1.0f / 32, static_cast<float>(rms) / 32))
          << "image " << which[i] << " in a call of " << which.size();
    }
  }
}

TEST_F(CudaGraphModel, SixtyFourGreedyStepsEqualEagerOnTheFixture) {
  const auto prompt = ids_of(golden_->tensor("text_input_ids"));
  Qwen3VLModel m(*be_, test::fixture_dir(), fixture_limits());
  m.encode_images(nullptr, {});
  const auto want = greedy(m, nullptr, prompt, 64);
  EXPECT_GT(std::set<int32_t>(want.begin(), want.end()).size(), 8u);
  for (const char* scope : {"block", "layer"}) {
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs(scope, 3));
    m.attach_graphs(&h);
    EXPECT_EQ(greedy(m, &h, prompt, 64), want) << scope;
    EXPECT_TRUE(h.graphs_created(GraphSet::decoder)) << scope;
  }
  // Two stages, layer graphs on each.
  std::vector<std::unique_ptr<VisionCudaGraphHelper>> stages;
  for (const PipelineStage& s : split_stages(m.config(), 2)) {
    stages.push_back(std::make_unique<VisionCudaGraphHelper>(m, s, make_configs("layer", 3)));
    m.attach_graphs(stages.back().get());
  }
  EXPECT_EQ(greedy(m, stages.back().get(), prompt, 64), want);
}

// A random model with Qwen3-VL-2B's widths (28 layers; GQA 16/8 heads of 128; vocab 151936),
// with short limits so that it stays around 4.5 GB.
ModelConfig qwen3vl_2b_shape() {
  ModelConfig c;
  TextConfig& t = c.text;
  t.vocab_size = 151936;
  t.hidden_size = 2048;
  t.intermediate_size = 6144;
  t.num_hidden_layers = 28;
  t.num_attention_heads = 16;
  t.num_key_value_heads = 8;
  t.head_dim = 128;
  t.rope_theta = 5000000.0f;
  t.mrope_section = {24, 20, 20};
  t.tie_word_embeddings = true;
  c.tie_word_embeddings = true;
  VisionConfig& v = c.vision;
  v.depth = 24;
  v.hidden_size = 1024;
  v.intermediate_size = 4096;
  v.num_heads = 16;
  v.out_hidden_size = 2048;
  v.num_position_embeddings = 2304;
  v.deepstack_visual_indexes = {5, 11, 17};
  return c;
}

void fill_random(Backend& be, ModelWeights& w) {
  std::vector<float> pool(size_t{1} << 22), ones(8192, 1.0f);
  uint32_t s = 2024;
  for (float& x : pool) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    x = (static_cast<float>(s >> 8) / 8388608.0f - 1.0f) * 0.04f;
  }
  size_t shift = 0;
  for (const WeightBinding& b : w.bindings) {
    const int64_t rows = b.hf_shape[0];
    const Tensor t = b.target->slice(b.row_offset, b.row_offset + rows);
    const Tensor flat = t.view({t.numel()});
    const bool norm = b.hf_name.find("norm") != std::string::npos &&
                      b.hf_name.find(".weight") != std::string::npos;
    for (int64_t i = 0; i < flat.numel();) {
      const int64_t m = std::min<int64_t>(flat.numel() - i, norm ? 8192 : (int64_t{1} << 21));
      shift = (shift + 7919) % (size_t{1} << 21);
      be.write(flat.slice(i, i + m), norm ? ones.data() : pool.data() + shift, DType::f32);
      i += m;
    }
  }
}

TEST_F(CudaGraphModel, SixtyFourGreedyStepsEqualEagerOnA2BShapedRandomModel) {
  const ModelConfig cfg = qwen3vl_2b_shape();
  auto weights = allocate_weights(*be_, cfg);
  fill_random(*be_, *weights);
  ModelLimits limits;
  limits.max_context = 256;
  limits.max_step_tokens = 64;
  limits.max_vision_patches = 256;
  limits.max_images = 1;
  Qwen3VLModel m(*be_, cfg, std::move(weights), limits);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 32; ++i) prompt.push_back((i * 7919 + 11) % cfg.text.vocab_size);
  m.encode_images(nullptr, {});
  const auto want = greedy(m, nullptr, prompt, 64);
  // A constant continuation would make the comparison below say little.
  EXPECT_GT(std::set<int32_t>(want.begin(), want.end()).size(), 8u);
  for (const char* scope : {"block", "layer"}) {
    VisionCudaGraphHelper h(m, split_stages(cfg, 1)[0], make_configs(scope, 3, "256"));
    m.attach_graphs(&h);
    EXPECT_EQ(greedy(m, &h, prompt, 64), want) << scope;
    EXPECT_EQ(h.graph_count(GraphSet::decoder), std::string(scope) == "block" ? 1u : 28u);
  }
}

// ---- Qwen3-VL-MoE: sparse layers in decode graphs ----
//
// The router, the routing metadata and the experts of a sparse layer run inside the captured
// decode step with no host traffic (the stand-in flags any), and replay gives the eager tokens;
// on CUDA, every decode step's logits bit for bit.

std::string moe_dir() {
  return test::data_dir() + "/qwen3vlmoe-tiny";
}

std::vector<std::vector<float>> moe_decode(Qwen3VLModel& m, const Golden& g, bool mm, int n,
                                           std::vector<int32_t>* tokens) {
  if (mm) {
    const HostTensor pv = g.tensor("pixel_values");
    m.encode_images(pv.data<float>(), grids_of(g.tensor("image_grid_thw")));
  } else {
    m.encode_images(nullptr, {});
  }
  m.prefill(ids_of(g.tensor(mm ? "input_ids" : "text_input_ids")));
  std::vector<std::vector<float>> logits{m.last_logits()};
  tokens->assign(1, argmax(logits.back()));
  while (static_cast<int>(tokens->size()) < n) {
    m.decode(tokens->back());
    logits.push_back(m.last_logits());
    tokens->push_back(argmax(logits.back()));
  }
  return logits;
}

class MoeDecodeGraphs : public ::testing::TestWithParam<const char*> {};

TEST_P(MoeDecodeGraphs, GreedyTokensEqualTheEagerTokensOnTheStandIn) {
  const Golden g(moe_dir());
  auto cpu = make_cpu_backend();
  std::vector<int32_t> want_mm, want_text, got;
  {
    Qwen3VLModel eager(*cpu, moe_dir(), fixture_limits());
    moe_decode(eager, g, true, 12, &want_mm);
    moe_decode(eager, g, false, 12, &want_text);
  }
  RecordingGraphApi api;
  TracingBackend be(*cpu, api);
  {
    Qwen3VLModel m(be, moe_dir(), fixture_limits());
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs(GetParam(), 3), api);
    m.attach_graphs(&h);
    moe_decode(m, g, true, 12, &got);
    EXPECT_EQ(got, want_mm);
    moe_decode(m, g, false, 12, &got);
    EXPECT_EQ(got, want_text);
    const bool block = std::string(GetParam()) == "block";
    EXPECT_EQ(count_ops(api.log(), Op::begin_capture, "decoder"),
              block ? 1 : m.config().text.num_hidden_layers);
    EXPECT_GT(count_ops(api.log(), Op::launch, "decoder"), 0);
  }
  EXPECT_TRUE(be.violations.empty()) << be.violations.front();
  EXPECT_TRUE(api.errors().empty());
  EXPECT_EQ(api.live_graphs(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Scopes, MoeDecodeGraphs, ::testing::Values("block", "layer"));

TEST(CudaMoeDecodeGraphs, EveryStepsLogitsEqualEagerBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const Golden g(moe_dir());
  auto be = make_cuda_backend();
  std::vector<int32_t> tokens;
  Qwen3VLModel eager(*be, moe_dir(), fixture_limits());
  const auto want = moe_decode(eager, g, true, 12, &tokens);
  for (const char* scope : {"block", "layer"}) {
    Qwen3VLModel m(*be, moe_dir(), fixture_limits());
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], make_configs(scope, 2));
    m.attach_graphs(&h);
    const auto got = moe_decode(m, g, true, 12, &tokens);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < got.size(); ++s) EXPECT_EQ(got[s], want[s]) << scope << " step " << s;
    EXPECT_TRUE(h.capture_finished(GraphSet::decoder)) << scope;
  }
}

}  // namespace
}  // namespace iris
