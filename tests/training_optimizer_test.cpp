// AdamW against torch.optim.AdamW on the tiny fixture (3 steps, golden.json "adamw"), the backward
// ops against finite differences, freezing, learning-rate schedules and optimizer state resume.
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>

#include <unistd.h>

#include "bridge/hf_weights.h"
#include "core/cpu/cpu_train_ops.h"
#include "core/safetensors.h"
#include "test_util.h"
#include "training/lr_schedule.h"
#include "training/optimizer.h"
#include "training/param_spec.h"
#include "training/train_model.h"
#include "training_test_util.h"

namespace iris {
namespace {

using test::Golden;

constexpr double kLossRel = 1e-5;
constexpr double kParamRel = 1e-5, kParamAbs = 1e-5;
// Adam moves a parameter by about lr per step whatever the gradient's size, so an element whose
// gradient is at the fp32 noise floor can step either way. Measured against an f64 run of the
// same torch AdamW: the fp32 goldens deviate by up to 4.2e-5 and ours by up to 1.4e-5, both only
// at elements whose step-1 gradient is below 4.2e-6 of its tensor's largest (the gradients' own
// fp32 noise is 2.7e-6 of that). So every element must lie within 1e-5 rel + 1e-5 abs of torch,
// except at most kMaxOutliers elements whose first-step golden gradient is non-zero and below
// kNoiseFloor of the tensor's largest; those are held to 3 steps' worth of lr. (The count
// matters: the embedding rows of unused tokens also have tiny, but exact, gradients.)
constexpr int kMaxOutliers = 16;
constexpr double kNoiseFloor = 1e-5;
constexpr const char* kEmbedName = "model.language_model.embed_tokens.weight";

using test::golden_sample;

Tensor bound(const WeightBinding& b) {
  return b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]);
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.as<float>(), t.as<float>() + t.numel());
}

// Every parameter (or gradient, or moment) of a ModelWeights, in binding order.
std::vector<std::vector<float>> snapshot(const ModelWeights& w) {
  std::vector<std::vector<float>> out;
  for (const WeightBinding& b : w.bindings) out.push_back(values(bound(b)));
  return out;
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class TinyModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    golden_ = new Golden();
    backend_ = make_cpu_backend().release();
    cfg_ = new ModelConfig(ModelConfig::from_file(test::fixture_dir() + "/config.json"));
    sample_ = new TrainSample(golden_sample(*golden_));
  }
  static void TearDownTestSuite() {
    delete sample_;
    delete cfg_;
    delete backend_;
    delete golden_;
  }
  static std::unique_ptr<ModelWeights> fresh_params() {
    return load_weights(*backend_, *cfg_, test::fixture_dir());
  }
  static TrainLimits limits() {
    TrainLimits l;
    l.max_seq_len = 256;
    l.max_patches = 1024;
    l.max_images = 4;
    return l;
  }
  static AdamWConfig golden_adamw(float* lr) {
    const auto& a = golden_->json()["adamw"];
    AdamWConfig c;
    c.beta1 = a["betas"][0].get<float>();
    c.beta2 = a["betas"][1].get<float>();
    c.eps = a["eps"].get<float>();
    c.weight_decay = a["weight_decay"].get<float>();
    c.clip_grad_norm = a["clip_grad"].get<float>();
    *lr = a["lr"].get<float>();
    return c;
  }
  // One optimizer step on the golden sample with HF's mean-loss gradient; returns the mean loss.
  static double train_step(TrainableQwen3VL& model, AdamW& opt, float lr) {
    model.zero_grads();
    const LossStats st =
        model.forward_backward(*sample_, 1.0f / float(labelled_positions(sample_->labels)));
    opt.step(lr, model.frozen());
    return st.loss_sum / double(st.n_tokens);
  }

  static Golden* golden_;
  static Backend* backend_;
  static ModelConfig* cfg_;
  static TrainSample* sample_;
};

Golden* TinyModel::golden_ = nullptr;
Backend* TinyModel::backend_ = nullptr;
ModelConfig* TinyModel::cfg_ = nullptr;
TrainSample* TinyModel::sample_ = nullptr;

TEST_F(TinyModel, ThreeAdamWStepsReproduceTorch) {
  auto params = fresh_params();
  TrainableQwen3VL model(*backend_, *cfg_, *params, limits());
  float lr = 0;
  const AdamWConfig ac = golden_adamw(&lr);
  AdamW opt(*backend_, *cfg_, params.get(), model.grads(), ac);
  const auto& want_losses = golden_->json()["adamw_losses"];
  ASSERT_EQ(want_losses.size(), 3u);
  double worst_loss = 0;
  for (int step = 0; step < 3; ++step) {
    const double loss = train_step(model, opt, lr);
    const double want = want_losses[step].get<double>();
    EXPECT_NEAR(loss, want, kLossRel * want) << "loss before step " << step;
    worst_loss = std::max(worst_loss, std::fabs(loss - want) / want);
  }
  EXPECT_EQ(opt.steps(), 3);

  const HostTensor emb_rows = golden_->tensor("grad_rows_of_embedding");
  double worst = 0, worst_outlier = 0;
  size_t compared = 0;
  int outliers = 0;
  std::string worst_name;
  for (const WeightBinding& b : params->bindings) {
    const Tensor p = bound(b);
    std::vector<float> got;
    if (b.hf_name == kEmbedName) {
      const int64_t H = p.cols();
      for (int64_t i = 0; i < emb_rows.numel(); ++i) {
        const float* row = p.as<float>() + emb_rows.data<int64_t>()[i] * H;
        got.insert(got.end(), row, row + H);
      }
    } else {
      got = values(p);
    }
    const std::vector<float> want = golden_->tensor("after_adamw." + b.hf_name).to_f32();
    const std::vector<float> grad = golden_->tensor("grad." + b.hf_name).to_f32();
    ASSERT_EQ(got.size(), want.size()) << b.hf_name;
    ASSERT_EQ(grad.size(), want.size()) << b.hf_name;
    double gmax = 0;
    for (float g : grad) gmax = std::max(gmax, std::fabs(double(g)));
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(double(got[i]) - double(want[i]));
      const bool noisy = grad[i] != 0.0f && std::fabs(double(grad[i])) < kNoiseFloor * gmax;
      const bool close = d <= kParamRel * std::fabs(double(want[i])) + kParamAbs;
      if (!close && !(noisy && d <= 3.0 * lr)) {
        if (bad < 3)
          ADD_FAILURE() << b.hf_name << "[" << i << "] = " << got[i] << ", torch " << want[i];
        ++bad;
      }
      if (!close && noisy) {
        ++outliers;
        worst_outlier = std::max(worst_outlier, d);
        std::printf("  outlier %s[%zu]: %.8g, torch %.8g, step-1 gradient %.3g (tensor max %.3g)\n",
                    b.hf_name.c_str(), i, got[i], want[i], grad[i], gmax);
      } else if (d > worst) {
        worst = d;
        worst_name = b.hf_name + "[" + std::to_string(i) + "]";
      }
      ++compared;
    }
    EXPECT_EQ(bad, 0u) << b.hf_name;
  }
  EXPECT_LE(outliers, kMaxOutliers);
  std::printf("%zu elements: max |param - torch| %.3g (%s); %d noise-floor outliers (max %.3g)\n",
              compared, worst, worst_name.c_str(), outliers, worst_outlier);
  std::printf("max loss rel err %.3g\n", worst_loss);
}

TEST_F(TinyModel, FrozenPartsStayBitIdenticalAndTrainablePartsMatchTheFullBackward) {
  // Reference: every part trainable.
  auto full_params = fresh_params();
  TrainableQwen3VL full(*backend_, *cfg_, *full_params, limits());
  full.zero_grads();
  const float scale = 1.0f / float(labelled_positions(sample_->labels));
  full.forward_backward(*sample_, scale);
  const auto full_grads = snapshot(full.grads());

  const bool configs[][3] = {{true, false, true}, {false, true, false}, {true, true, false}};
  for (const auto& c : configs) {
    SCOPED_TRACE(str_cat("frozen vision_tower=", c[0], " merger=", c[1], " language_model=", c[2]));
    auto params = fresh_params();
    const auto before = snapshot(*params);
    TrainableQwen3VL model(*backend_, *cfg_, *params, limits());
    model.set_frozen(c[0], c[1], c[2]);
    float lr = 0;
    AdamW opt(*backend_, *cfg_, params.get(), model.grads(), golden_adamw(&lr));
    model.zero_grads();
    model.forward_backward(*sample_, scale);
    const auto grads = snapshot(model.grads());
    opt.step(lr, model.frozen());
    const auto after = snapshot(*params);
    const auto m = snapshot(opt.exp_avg());
    for (size_t i = 0; i < params->bindings.size(); ++i) {
      const std::string& name = params->bindings[i].hf_name;
      if (model.frozen().frozen(name)) {
        EXPECT_TRUE(bit_identical(after[i], before[i])) << name << " changed while frozen";
        for (float g : grads[i]) ASSERT_EQ(g, 0.0f) << name << " got a gradient while frozen";
        for (float x : m[i]) ASSERT_EQ(x, 0.0f) << name << " got a moment while frozen";
      } else {
        // Skipping frozen weight GEMMs leaves the backpropagated gradients untouched.
        EXPECT_TRUE(bit_identical(grads[i], full_grads[i])) << name;
        EXPECT_FALSE(bit_identical(after[i], before[i])) << name << " did not train";
      }
    }
  }
}

// Elements of the tensors a buffer holds (its allocated bindings, a fused target once).
int64_t held_elements(const ModelWeights& w) {
  std::set<const Tensor*> targets;
  int64_t n = 0;
  for (const WeightBinding& b : w.bindings)
    if (b.allocated() && targets.insert(b.target).second) n += b.target->numel();
  return n;
}

TEST_F(TinyModel, FrozenPartsHoldNoF32StateAndTrainAsWithWholeModelBuffers) {
  const FreezeSpec frozen{true, true, false};  // vision tower and mergers frozen
  // The language model's parameter count, from the config's bindings by name alone.
  int64_t language_params = 0, all_params = 0;
  const auto layout = fresh_params();
  for (const WeightBinding& b : layout->bindings) {
    int64_t n = 1;
    for (int64_t d : b.hf_shape) n *= d;
    all_params += n;
    if (b.hf_name.rfind("model.language_model.", 0) == 0 || b.hf_name.rfind("lm_head.", 0) == 0)
      language_params += n;
  }
  ASSERT_GT(language_params, 0);
  ASSERT_LT(language_params, all_params);
  const ParamSpecs specs(*cfg_, frozen, DType::f32);
  EXPECT_EQ(specs.parameters(), all_params);
  EXPECT_EQ(specs.trainable_parameters(), language_params);

  const float scale = 1.0f / float(labelled_positions(sample_->labels));
  float lr = 0;
  const AdamWConfig ac = golden_adamw(&lr);

  // Buffers by spec: gradients, master weights and moments of the trainable tensors only.
  auto params = fresh_params();
  TrainLimits planned = limits();
  planned.frozen = frozen;
  TrainableQwen3VL model(*backend_, *cfg_, *params, planned);
  auto master = allocate_state(*backend_, *cfg_, specs);
  for (size_t i = 0; i < master->bindings.size(); ++i)
    if (master->bindings[i].allocated())
      std::memcpy(bound(master->bindings[i]).data, bound(params->bindings[i]).data,
                  size_t(bound(params->bindings[i]).numel()) * sizeof(float));
  AdamW opt(*backend_, *cfg_, master.get(), model.grads(), ac, params.get());
  for (const ModelWeights* w : {&model.grads(), master.get(), &opt.exp_avg(), &opt.exp_avg_sq()}) {
    for (const WeightBinding& b : w->bindings)
      EXPECT_EQ(b.allocated(), model_part(b.hf_name) == ModelPart::language_model) << b.hf_name;
    EXPECT_EQ(held_elements(*w) * int64_t(sizeof(float)), language_params * 4);
    // Only the arena's alignment (256 bytes per tensor at most) beyond the tensors themselves.
    EXPECT_GE(allocated_bytes(*w), size_t(language_params * 4));
    EXPECT_LT(allocated_bytes(*w), size_t(language_params * 4) + 256 * w->bindings.size());
  }
  EXPECT_EQ(opt.state_bytes(), 2 * allocated_bytes(*master));
  // Planned frozen parts have no gradient to train with.
  EXPECT_THROW(model.set_frozen(false, true, false), Error);

  // The same run with whole-model buffers (the parts frozen after planning).
  auto ref_params = fresh_params();
  TrainableQwen3VL ref(*backend_, *cfg_, *ref_params, limits());
  ref.set_frozen(true, true, false);
  AdamW ref_opt(*backend_, *cfg_, ref_params.get(), ref.grads(), ac);
  for (int step = 0; step < 2; ++step) {
    model.zero_grads();
    ref.zero_grads();
    const LossStats a = model.forward_backward(*sample_, scale);
    const LossStats b = ref.forward_backward(*sample_, scale);
    EXPECT_EQ(a.loss_sum, b.loss_sum) << "step " << step;
    opt.step(lr, model.frozen());
    ref_opt.step(lr, ref.frozen());
  }
  EXPECT_EQ(opt.take_grad_norms(), ref_opt.take_grad_norms());
  const auto got = snapshot(*params), want = snapshot(*ref_params);
  const auto got_m = opt.exp_avg().bindings, want_m = ref_opt.exp_avg().bindings;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bit_identical(got[i], want[i])) << params->bindings[i].hf_name;
    if (got_m[i].allocated())
      EXPECT_TRUE(bit_identical(values(bound(got_m[i])), values(bound(want_m[i]))))
          << params->bindings[i].hf_name;
  }

  // The state file keeps its format for the tensors that have state and names the parts that
  // have none; a resume that unfreezes them starts their moments at zero.
  const std::string path = (std::filesystem::temp_directory_path() /
                            str_cat("iris_frozen_state_", ::getpid(), ".safetensors"))
                               .string();
  opt.save(path);
  {
    SafetensorsFile file(path);
    EXPECT_TRUE(file.contains("exp_avg." + std::string(kEmbedName)));
    EXPECT_FALSE(file.contains("exp_avg.model.visual.patch_embed.proj.weight"));
    EXPECT_EQ(file.metadata().at("stateless_parts"), "vision_tower,merger");
  }
  auto all_params_again = fresh_params();
  TrainableQwen3VL whole(*backend_, *cfg_, *all_params_again, limits());
  AdamW resumed(*backend_, *cfg_, all_params_again.get(), whole.grads(), ac);
  resumed.load(path);
  EXPECT_EQ(resumed.reinitialised_parts(), (std::vector<std::string>{"vision_tower", "merger"}));
  const auto rm = snapshot(resumed.exp_avg());
  for (size_t i = 0; i < rm.size(); ++i) {
    const WeightBinding& b = resumed.exp_avg().bindings[i];
    if (model_part(b.hf_name) == ModelPart::language_model)
      EXPECT_TRUE(bit_identical(rm[i], values(bound(got_m[i])))) << b.hf_name;
    else
      for (float x : rm[i]) ASSERT_EQ(x, 0.0f) << b.hf_name;
  }
  // A resume that freezes more simply leaves the extra state unread.
  auto lm_params = fresh_params();
  TrainLimits lm_frozen = limits();
  lm_frozen.frozen = FreezeSpec{true, false, true};
  TrainableQwen3VL merger_only(*backend_, *cfg_, *lm_params, lm_frozen);
  auto merger_master =
      allocate_state(*backend_, *cfg_, ParamSpecs(*cfg_, lm_frozen.frozen, DType::f32));
  AdamW merger_opt(*backend_, *cfg_, merger_master.get(), merger_only.grads(), ac, lm_params.get());
  merger_opt.load(path);
  EXPECT_EQ(merger_opt.reinitialised_parts(), std::vector<std::string>{"merger"});
  std::filesystem::remove(path);
}

TEST_F(TinyModel, EachPartStepsWithItsOwnLearningRate) {
  // A part with lr scale k moves as the reference run with k times the learning rate would;
  // the other parts move as in the run without scales, bit for bit.
  float lr = 0;
  auto step_with = [&](float vision_scale, float merger_scale, float lr_factor) {
    auto params = fresh_params();
    TrainableQwen3VL model(*backend_, *cfg_, *params, limits());
    AdamWConfig ac = golden_adamw(&lr);
    ac.vision_tower_lr_scale = vision_scale;
    ac.merger_lr_scale = merger_scale;
    AdamW opt(*backend_, *cfg_, params.get(), model.grads(), ac);
    model.zero_grads();
    model.forward_backward(*sample_, 1.0f / float(labelled_positions(sample_->labels)));
    opt.step(lr * lr_factor);
    return snapshot(*params);
  };
  const auto plain = step_with(1.0f, 1.0f, 1.0f);
  const auto quad = step_with(1.0f, 1.0f, 4.0f);
  const auto half = step_with(1.0f, 1.0f, 0.5f);
  const auto mixed = step_with(4.0f, 0.5f, 1.0f);
  std::vector<std::string> names_of;
  const auto layout = fresh_params();
  for (const WeightBinding& b : layout->bindings) names_of.push_back(b.hf_name);
  int per_part[3] = {};
  for (size_t i = 0; i < names_of.size(); ++i) {
    const ModelPart part = model_part(names_of[i]);
    const auto& expected = part == ModelPart::vision_tower ? quad[i]
                           : part == ModelPart::merger     ? half[i]
                                                           : plain[i];
    ++per_part[static_cast<int>(part)];
    EXPECT_TRUE(bit_identical(mixed[i], expected)) << names_of[i];
  }
  for (int n : per_part) EXPECT_GT(n, 0);
}

TEST_F(TinyModel, OptimizerStateSaveLoadResumesBitExactly) {
  namespace fs = std::filesystem;
  const std::string path =
      (fs::temp_directory_path() / ("iris_adamw_state_" + std::to_string(::getpid()) + ".st"))
          .string();
  float lr = 0;
  const AdamWConfig ac = golden_adamw(&lr);
  // Run A: two steps, save, a third step.
  auto pa = fresh_params();
  TrainableQwen3VL ma(*backend_, *cfg_, *pa, limits());
  AdamW oa(*backend_, *cfg_, pa.get(), ma.grads(), ac);
  train_step(ma, oa, lr);
  train_step(ma, oa, 0.5f * lr);
  oa.save(path);
  const auto saved_params = snapshot(*pa);
  const double loss_a = train_step(ma, oa, 0.25f * lr);

  // Run B: a fresh process state holding the saved parameters and optimizer file.
  auto pb = fresh_params();
  for (size_t i = 0; i < pb->bindings.size(); ++i)
    std::memcpy(bound(pb->bindings[i]).data, saved_params[i].data(),
                saved_params[i].size() * sizeof(float));
  TrainableQwen3VL mb(*backend_, *cfg_, *pb, limits());
  AdamW ob(*backend_, *cfg_, pb.get(), mb.grads(), ac);
  ob.load(path);
  EXPECT_EQ(ob.steps(), 2);
  const double loss_b = train_step(mb, ob, 0.25f * lr);
  EXPECT_EQ(loss_a, loss_b);
  EXPECT_EQ(ob.steps(), 3);
  const auto a = snapshot(*pa), b = snapshot(*pb);
  const auto am = snapshot(oa.exp_avg()), bm = snapshot(ob.exp_avg());
  const auto av = snapshot(oa.exp_avg_sq()), bv = snapshot(ob.exp_avg_sq());
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string& name = pa->bindings[i].hf_name;
    EXPECT_TRUE(bit_identical(a[i], b[i])) << name;
    EXPECT_TRUE(bit_identical(am[i], bm[i])) << "exp_avg " << name;
    EXPECT_TRUE(bit_identical(av[i], bv[i])) << "exp_avg_sq " << name;
  }

  // A damaged state is refused before anything is overwritten: each case rewrites the saved file
  // with one value changed, as a corrupted or hand-edited file would hold it.
  {
    const std::string emb = "model.language_model.embed_tokens.weight";
    const auto damaged = [&](const std::string& tensor, double value, const std::string& steps) {
      SafetensorsFile file(path);
      std::vector<std::vector<char>> store;
      std::vector<SafetensorsWriteItem> items;
      store.reserve(file.entries().size());
      for (const auto& [name, e] : file.entries()) {
        store.emplace_back(static_cast<const char*>(e.data),
                           static_cast<const char*>(e.data) + e.nbytes);
        if (name == tensor) {
          if (e.dtype == DType::i64) {
            const int64_t v = static_cast<int64_t>(value);
            std::memcpy(store.back().data(), &v, sizeof v);
          } else {
            const float v = static_cast<float>(value);
            std::memcpy(store.back().data(), &v, sizeof v);
          }
        }
        items.push_back({name, e.dtype, e.shape, store.back().data()});
      }
      std::map<std::string, std::string> meta = file.metadata();
      if (!steps.empty()) meta["steps"] = steps;
      const std::string out = path + ".damaged";
      write_safetensors(out, items, meta);
      return out;
    };
    struct Case {
      std::string tensor;
      double value;
      std::string steps, want;
    };
    const double inf = std::numeric_limits<double>::infinity();
    const Case cases[] = {
        {"exp_avg_sq." + emb, inf, "", "holds inf"},
        {"exp_avg_sq." + emb, -1.0, "", "holds -1"},
        {"exp_avg." + emb, std::nan(""), "", "holds nan"},
        {"step." + emb, 0, "", "a step count of 0"},
        {"step." + emb, -3, "", "is -3, outside 0"},
        {"step." + emb, 3, "", "is 3, outside 0 .. the state's 2"},
        {"", 0, "4611686018427387904", "'steps' 4611686018427387904"},
    };
    for (const Case& c : cases) {
      const std::string file = damaged(c.tensor, c.value, c.steps);
      const std::string msg = test::error_of([&] { oa.load(file); });
      EXPECT_NE(msg.find(c.want), std::string::npos) << msg;
      EXPECT_NE(msg.find("damaged"), std::string::npos) << msg;
      fs::remove(file);
    }
    EXPECT_EQ(oa.steps(), 3);
  }

  // A state file of another model is refused before anything is overwritten.
  ModelConfig other = *cfg_;
  other.text.num_hidden_layers = 2;
  auto po = allocate_weights(*backend_, other);
  auto go = allocate_weights(*backend_, other);
  for (const WeightBinding& wb : po->bindings) backend_->fill_zero(bound(wb));
  AdamW oo(*backend_, other, po.get(), *go, ac);
  oa.save(path);
  EXPECT_NO_THROW(oo.save(path + ".other"));
  EXPECT_THROW(oa.load(path + ".other"), Error);
  EXPECT_EQ(oa.steps(), 3);
  fs::remove(path);
  fs::remove(path + ".other");
}

TEST(AdamW, ClipsToTheGlobalNormAndReturnsThePreClipNorm) {
  auto be = make_cpu_backend();
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto params = allocate_weights(*be, cfg);
  auto grads = allocate_weights(*be, cfg);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  double ss = 0;
  for (size_t i = 0; i < params->bindings.size(); ++i) {
    const Tensor p = bound(params->bindings[i]), g = bound(grads->bindings[i]);
    for (int64_t k = 0; k < p.numel(); ++k) {
      p.as<float>()[k] = 0.0f;
      g.as<float>()[k] = nd(rng) * 1e-2f;
      ss += double(g.as<float>()[k]) * g.as<float>()[k];
    }
  }
  AdamWConfig ac;
  ac.clip_grad_norm = 1.0f;
  AdamW opt(*be, cfg, params.get(), *grads, ac);
  opt.step(1e-3f);
  const std::vector<float> norms = opt.take_grad_norms();
  ASSERT_EQ(norms.size(), 1u);
  const double norm = norms[0];
  EXPECT_EQ(opt.last_grad_norm(), norm);
  // Summed in f64, returned as f32 (as torch's clip_grad_norm_ returns it): one f32 rounding.
  EXPECT_NEAR(norm, std::sqrt(ss), 6e-8 * std::sqrt(ss));
  ASSERT_GT(norm, 1.0);
  // The clipping scales the gradients as the update reads them; the gradients stay as they were.
  EXPECT_NEAR(grad_norm(*grads), std::sqrt(ss), 1e-12 * std::sqrt(ss));
  // Frozen parts are left out of the norm.
  FreezeSpec lm_only{true, true, false};
  double ss_lm = 0;
  for (const WeightBinding& b : grads->bindings)
    if (!lm_only.frozen(b.hf_name))
      for (float x : values(bound(b))) ss_lm += double(x) * x;
  EXPECT_NEAR(grad_norm(*grads, lm_only), std::sqrt(ss_lm), 1e-9 * std::sqrt(ss_lm));
}

// A step whose gradient is not finite changes no weight and no moment, and its norm is reported
// when the host next reads the norms, in step order. On any backend (CUDA: f32 master weights
// and a bf16 working copy, as the trainer runs it).
void expect_non_finite_step_changes_nothing(Backend& be) {
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto params = allocate_weights(be, cfg, DType::f32);
  auto grads = allocate_weights(be, cfg, DType::f32);
  std::unique_ptr<ModelWeights> working;
  if (be.compute_dtype() != DType::f32) working = allocate_weights(be, cfg);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < params->bindings.size(); ++i) {
    const Tensor p = params->bindings[i].tensor();
    std::vector<float> v(static_cast<size_t>(p.numel()));
    for (float& x : v) x = nd(rng);
    be.write(p, v.data(), DType::f32);
    if (working) be.write(working->bindings[i].tensor(), v.data(), DType::f32);
    for (float& x : v) x = nd(rng) * 1e-2f;
    be.write(grads->bindings[i].tensor(), v.data(), DType::f32);
  }
  AdamW opt(be, cfg, params.get(), *grads, AdamWConfig{}, working.get());
  const Tensor p0 = params->bindings[0].tensor(), g0 = grads->bindings[0].tensor().slice(0, 1);
  const Tensor m0 = opt.exp_avg().bindings[0].tensor();
  auto read = [&](const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    be.read(v.data(), DType::f32, t);
    return v;
  };
  std::vector<float> first_row = read(g0);
  opt.step(1e-3f);
  const std::vector<float> before = read(p0), m_before = read(m0);
  std::vector<float> poisoned = first_row;
  poisoned[0] = std::numeric_limits<float>::quiet_NaN();
  be.write(g0, poisoned.data(), DType::f32);
  opt.step(1e-3f);
  EXPECT_EQ(read(p0), before);
  EXPECT_EQ(read(m0), m_before);
  be.write(g0, first_row.data(), DType::f32);
  opt.step(1e-3f);
  EXPECT_NE(read(p0), before);
  const std::vector<float> norms = opt.take_grad_norms();
  ASSERT_EQ(norms.size(), 3u);
  EXPECT_TRUE(std::isfinite(norms[0]));
  EXPECT_TRUE(std::isnan(norms[1]));
  EXPECT_TRUE(std::isfinite(norms[2]));
  EXPECT_TRUE(opt.take_grad_norms().empty());
}

TEST(AdamW, NonFiniteGradientChangesNothingAndIsReported) {
  auto be = make_cpu_backend();
  expect_non_finite_step_changes_nothing(*be);
}

TEST(AdamW, NonFiniteGradientChangesNothingOnCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto be = make_cuda_backend(0);
  expect_non_finite_step_changes_nothing(*be);
}

// parallel.sharding=optimizer_grads_params keeps no working copy of the decoder layers: each
// gather rounds the master weights with `convert` (training/sharded_weights.h). That gives the
// bits of the unsharded run only where convert rounds as the update's own write does, ties and
// subnormals included.
TEST(AdamW, TheWorkingCopyIsTheMasterWeightsConvertedOnCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto be = make_cuda_backend(0);
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto params = allocate_weights(*be, cfg, DType::f32);
  auto grads = allocate_weights(*be, cfg, DType::f32);
  auto working = allocate_weights(*be, cfg);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < params->bindings.size(); ++i) {
    const Tensor p = params->bindings[i].tensor();
    std::vector<float> v(static_cast<size_t>(p.numel()));
    for (float& x : v) x = nd(rng);
    // Exact bf16 ties and subnormals, which a rounding that differs would split.
    if (v.size() >= 4) {
      v[0] = std::bit_cast<float>(uint32_t{0x3f808000});
      v[1] = std::bit_cast<float>(uint32_t{0x3f818000});
      v[2] = std::bit_cast<float>(uint32_t{0x00012345});
      v[3] = -std::bit_cast<float>(uint32_t{0x0000ffff});
    }
    be->write(p, v.data(), DType::f32);
    for (float& x : v) x = nd(rng) * 1e-2f;
    be->write(grads->bindings[i].tensor(), v.data(), DType::f32);
  }
  AdamW opt(*be, cfg, params.get(), *grads, AdamWConfig{}, working.get());
  auto bits = [&](const Tensor& t) {
    std::vector<uint16_t> v(static_cast<size_t>(t.numel()));
    be->read(v.data(), DType::bf16, t);
    return v;
  };
  auto converted = allocate_weights(*be, cfg);
  for (int step = 0; step < 3; ++step) {
    opt.step(1e-2f);
    for (size_t i = 0; i < params->bindings.size(); ++i) {
      be->convert(converted->bindings[i].tensor(), params->bindings[i].tensor());
      ASSERT_EQ(bits(converted->bindings[i].tensor()), bits(working->bindings[i].tensor()))
          << params->bindings[i].hf_name << " after step " << step;
    }
  }
}

// ---- Schedules ---------------------------------------------------------------------------------

TEST(LrSchedule, ConstantAndWarmupCosineFollowMegatron) {
  const LrSchedule constant(LrScheduleKind::constant, 3e-4f, 0.0f, 0, 100);
  EXPECT_FLOAT_EQ(constant.at(0), 3e-4f);
  EXPECT_FLOAT_EQ(constant.at(10000), 3e-4f);
  const LrSchedule warm_constant(LrScheduleKind::constant, 1e-3f, 0.0f, 10, 100);
  EXPECT_FLOAT_EQ(warm_constant.at(0), 0.0f);
  EXPECT_FLOAT_EQ(warm_constant.at(5), 5e-4f);
  EXPECT_FLOAT_EQ(warm_constant.at(10), 1e-3f);
  EXPECT_FLOAT_EQ(warm_constant.at(500), 1e-3f);

  const LrSchedule cos(LrScheduleKind::cosine, 1e-3f, 1e-5f, 10, 110);
  EXPECT_FLOAT_EQ(cos.at(0), 0.0f);
  EXPECT_FLOAT_EQ(cos.at(1), 1e-4f);
  EXPECT_FLOAT_EQ(cos.at(10), 1e-3f);
  EXPECT_FLOAT_EQ(cos.at(60), 1e-5f + 0.5f * (1e-3f - 1e-5f));
  // A quarter of the decay: 0.5 * (cos(pi / 4) + 1).
  EXPECT_NEAR(cos.at(35), 1e-5 + 0.5 * (std::cos(M_PI / 4) + 1) * (1e-3 - 1e-5), 1e-10);
  EXPECT_FLOAT_EQ(cos.at(110), 1e-5f);
  EXPECT_FLOAT_EQ(cos.at(111), 1e-5f);
  for (int64_t s = 11; s <= 110; ++s) EXPECT_LE(cos.at(s), cos.at(s - 1)) << s;

  EXPECT_EQ(parse_lr_schedule_kind("cosine"), LrScheduleKind::cosine);
  EXPECT_EQ(parse_lr_schedule_kind("constant"), LrScheduleKind::constant);
  EXPECT_THROW(parse_lr_schedule_kind("linear"), Error);
  EXPECT_THROW(LrSchedule(LrScheduleKind::cosine, 1e-3f, 1e-2f, 0, 10), Error);    // min > max
  EXPECT_THROW(LrSchedule(LrScheduleKind::cosine, 1e-3f, 0.0f, 10, 10), Error);    // no decay
  EXPECT_THROW(LrSchedule(LrScheduleKind::constant, 1e-3f, 0.0f, -1, 10), Error);  // warmup < 0
}

// ---- Finite differences of the backward ops ----------------------------------------------------
// Each op's output y is reduced to L = sum(r * y) with random r; the backward is fed dy = r and
// its gradients are compared with central differences of L (computed in f64 from the f32 op).
// Accumulating gradients start from random values (their increment is compared), overwritten
// ones from NaN (an element the op forgets to write fails).

// About 5x the largest error measured over every op below (7.8e-5, layernorm dx: the f32
// rounding of L at eps = 1e-2); a wrong term moves a gradient by 1e-2 or more.
constexpr double kFiniteDifferenceTolerance = 4e-4;

class OpGradients : public ::testing::Test {
 protected:
  std::vector<float> randn(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> nd(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng_);
    return v;
  }
  static std::vector<float> nans(size_t n) {
    return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
  }
  static double dot(const std::vector<float>& r, const std::vector<float>& y) {
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += double(r[i]) * double(y[i]);
    return s;
  }
  // Compares ana (the analytic gradient of loss w.r.t. x, minus `base` for accumulated ones) with
  // central differences at up to 48 positions.
  static void expect_gradient(const char* what, std::vector<float>& x,
                              const std::vector<float>& ana, const std::function<double()>& loss,
                              const std::vector<float>* base = nullptr, double eps = 1e-2) {
    ASSERT_EQ(x.size(), ana.size()) << what;
    const size_t step = std::max<size_t>(1, x.size() / 48);
    double worst = 0;
    for (size_t i = 0; i < x.size(); i += step) {
      const float keep = x[i];
      x[i] = keep + float(eps);
      const double lp = loss();
      x[i] = keep - float(eps);
      const double lm = loss();
      x[i] = keep;
      const double num = (lp - lm) / (double(keep + float(eps)) - double(keep - float(eps)));
      const double a = double(ana[i]) - (base ? double((*base)[i]) : 0.0);
      EXPECT_NEAR(a, num, kFiniteDifferenceTolerance) << what << "[" << i << "]";
      worst = std::max(worst, std::fabs(a - num));
    }
    std::printf("  %-28s max |analytic - numeric| %.2e\n", what, worst);
  }
  std::mt19937 rng_{1234};
};

TEST_F(OpGradients, Linear) {
  const int64_t M = 5, K = 7, N = 6;
  auto x = randn(M * K), w = randn(N * K), b = randn(N), r = randn(M * N);
  auto loss = [&] {
    std::vector<float> y(M * N);
    train::linear_forward(y.data(), x.data(), w.data(), b.data(), M, K, N, false);
    return dot(r, y);
  };
  auto dx = nans(M * K);
  auto dw0 = randn(N * K), db0 = randn(N);
  auto dw = dw0, db = db0;
  train::linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), M, K, N,
                         false);
  expect_gradient("linear dx", x, dx, loss);
  expect_gradient("linear dw", w, dw, loss, &dw0);
  expect_gradient("linear db", b, db, loss, &db0);
  // accumulate_dx adds to what is there.
  auto dx2 = dx;
  train::linear_backward(dx2.data(), nullptr, nullptr, r.data(), x.data(), w.data(), M, K, N, true);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_FLOAT_EQ(dx2[i], 2 * dx[i]);
}

TEST_F(OpGradients, LayerNormAndRmsNorm) {
  const int64_t R = 4, C = 24;
  auto x = randn(R * C, 2.0f), w = randn(C), b = randn(C), r = randn(R * C);
  std::vector<float> mean(R), rstd(R), y(R * C);
  auto ln = [&] {
    train::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), R, C,
                             1e-6f);
    return dot(r, y);
  };
  ln();
  auto dx0 = randn(R * C), dw0 = randn(C), db0 = randn(C);
  auto dx = dx0, dw = dw0, db = db0;
  train::layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), mean.data(),
                            rstd.data(), w.data(), R, C);
  expect_gradient("layernorm dx", x, dx, ln, &dx0);
  expect_gradient("layernorm dw", w, dw, ln, &dw0);
  expect_gradient("layernorm db", b, db, ln, &db0);

  auto rms = [&] {
    train::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), R, C, 1e-6f);
    return dot(r, y);
  };
  rms();
  dx = dx0;
  dw = dw0;
  train::rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), rstd.data(), w.data(), R, C);
  expect_gradient("rmsnorm dx", x, dx, rms, &dx0);
  expect_gradient("rmsnorm dw", w, dw, rms, &dw0);
}

TEST_F(OpGradients, QkNormRope) {
  const int64_t T = 3;
  const int nq = 4, nkv = 2, hd = 8, width = (nq + 2 * nkv) * hd;
  auto in = randn(T * width), qn = randn(hd), kn = randn(hd), r = randn(T * width);
  std::vector<float> cos(T * hd), sin(T * hd);
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < hd / 2; ++i) {
      const float a = 0.7f * float(t + 1) * float(i + 1);
      cos[t * hd + i] = cos[t * hd + hd / 2 + i] = std::cos(a);
      sin[t * hd + i] = sin[t * hd + hd / 2 + i] = std::sin(a);
    }
  std::vector<float> out(T * width), rstd(T * (nq + nkv));
  auto loss = [&] {
    train::qk_norm_rope_forward(out.data(), rstd.data(), in.data(), qn.data(), kn.data(),
                                cos.data(), sin.data(), T, nq, nkv, hd, 1e-6f);
    return dot(r, out);
  };
  loss();
  auto din = nans(T * width);
  auto dqn0 = randn(hd), dkn0 = randn(hd);
  auto dqn = dqn0, dkn = dkn0;
  train::qk_norm_rope_backward(din.data(), dqn.data(), dkn.data(), r.data(), in.data(), rstd.data(),
                               qn.data(), kn.data(), cos.data(), sin.data(), T, nq, nkv, hd);
  expect_gradient("qk_norm_rope din", in, din, loss);
  expect_gradient("qk_norm_rope dq_norm", qn, dqn, loss, &dqn0);
  expect_gradient("qk_norm_rope dk_norm", kn, dkn, loss, &dkn0);
  // Without norms (the vision RoPE), in place.
  auto rope_only = [&] {
    out = in;
    train::qk_norm_rope_forward(out.data(), nullptr, out.data(), nullptr, nullptr, cos.data(),
                                sin.data(), T, nq, nkv, hd, 0.0f);
    return dot(r, out);
  };
  din = r;
  train::qk_norm_rope_backward(din.data(), nullptr, nullptr, din.data(), nullptr, nullptr, nullptr,
                               nullptr, cos.data(), sin.data(), T, nq, nkv, hd);
  expect_gradient("rope (in place) din", in, din, rope_only);
}

// Both forms of attention: over a segment's [n, n] scores with GEMMs (segments up to
// kAttentionGemmMaxSegment rows) and query row by query row (longer segments).
struct AttentionForm {
  const char* name;
  decltype(&train::attention_forward) forward;
  decltype(&train::attention_backward) backward;
};
const AttentionForm kAttentionForms[] = {
    {"gemm", &train::attention_forward, &train::attention_backward},
    {"rows", &train::attention_forward_by_rows, &train::attention_backward_by_rows}};

TEST_F(OpGradients, AttentionCausalGqaAndSegments) {
  const int nq = 4, nkv = 2, hd = 8;
  const int64_t T = 9, width = (nq + 2 * nkv) * hd, D = nq * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  // Two packed sequences and a padding row past the last segment.
  const std::vector<int32_t> cu = {0, 5, 8};
  for (const AttentionForm& form : kAttentionForms) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::string(form.name) + (causal ? " causal" : " bidirectional"));
      auto qkv = randn(T * width), r = randn(T * D);
      auto out = nans(T * D), lse = nans(T * nq);
      auto loss = [&] {
        form.forward(out.data(), lse.data(), qkv.data(), T, nq, nkv, hd, scale, cu.data(), 2,
                     causal);
        return dot(r, out);
      };
      loss();
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[8 * D + d], 0.0f) << "padding row output";
      auto dqkv = nans(T * width);
      std::vector<float> dsum(T * nq);
      form.backward(dqkv.data(), dsum.data(), r.data(), out.data(), lse.data(), qkv.data(), T, nq,
                    nkv, hd, scale, cu.data(), 2, causal);
      expect_gradient(causal ? "attention causal dqkv" : "attention segments dqkv", qkv, dqkv,
                      loss);
    }
  }
}

TEST_F(OpGradients, AttentionGemmFormEqualsTheRowForm) {
  // Segment lengths as the models see them (a 16x16-patch image, a text sequence), an empty
  // segment, GQA and head dims 16 and 32.
  const int nq = 4, nkv = 2;
  const std::vector<int32_t> cu = {0, 256, 256, 368, 371};
  const int64_t T = 375;
  for (int hd : {16, 32}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::to_string(hd) + (causal ? " causal" : " bidirectional"));
      const int64_t width = (nq + 2 * nkv) * hd, D = int64_t(nq) * hd;
      const float scale = 1.0f / std::sqrt(float(hd));
      auto qkv = randn(T * width, 2.0f), dout = randn(T * D);
      std::vector<float> out[2], lse[2], dqkv[2], dsum[2];
      for (int k = 0; k < 2; ++k) {
        const AttentionForm& form = kAttentionForms[k];
        out[k] = nans(T * D);
        lse[k] = nans(T * nq);
        dqkv[k] = nans(T * width);
        dsum[k] = nans(T * nq);
        form.forward(out[k].data(), lse[k].data(), qkv.data(), T, nq, nkv, hd, scale, cu.data(), 4,
                     causal);
        form.backward(dqkv[k].data(), dsum[k].data(), dout.data(), out[k].data(), lse[k].data(),
                      qkv.data(), T, nq, nkv, hd, scale, cu.data(), 4, causal);
      }
      auto expect_close = [](const char* what, const std::vector<float>& a,
                             const std::vector<float>& b) {
        float max_ref = 0, max_err = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_TRUE(std::isfinite(a[i])) << what << "[" << i << "]";
          max_ref = std::max(max_ref, std::fabs(b[i]));
          max_err = std::max(max_err, std::fabs(a[i] - b[i]));
        }
        EXPECT_LE(max_err, 1e-5f * max_ref) << what << ": max |gemm - rows| " << max_err;
      };
      expect_close("out", out[0], out[1]);
      expect_close("lse", lse[0], lse[1]);
      expect_close("dqkv", dqkv[0], dqkv[1]);
    }
  }
}

TEST_F(OpGradients, Activations) {
  const int64_t n = 40, M = 4, I = 5;
  auto x = randn(n, 2.0f), r = randn(n);
  std::vector<float> y(n);
  auto tanh_loss = [&] {
    train::gelu_tanh_forward(y.data(), x.data(), n);
    return dot(r, y);
  };
  auto dx = nans(n);
  train::gelu_tanh_backward(dx.data(), r.data(), x.data(), n);
  expect_gradient("gelu_tanh", x, dx, tanh_loss);
  auto erf_loss = [&] {
    train::gelu_erf_forward(y.data(), x.data(), n);
    return dot(r, y);
  };
  dx = r;  // in place
  train::gelu_erf_backward(dx.data(), dx.data(), x.data(), n);
  expect_gradient("gelu_erf (in place)", x, dx, erf_loss);

  auto gu = randn(M * 2 * I, 2.0f), rs = randn(M * I);
  std::vector<float> ys(M * I);
  auto swiglu_loss = [&] {
    train::swiglu_forward(ys.data(), gu.data(), M, I);
    return dot(rs, ys);
  };
  auto dgu = nans(M * 2 * I);
  train::swiglu_backward(dgu.data(), rs.data(), gu.data(), M, I);
  expect_gradient("swiglu", gu, dgu, swiglu_loss);
}

TEST_F(OpGradients, EmbeddingAndPositionEmbedding) {
  const int64_t V = 6, H = 5, T = 7;
  const std::vector<int32_t> ids = {1, 3, 1, 5, 0, 3, 2};
  auto table = randn(V * H), r = randn(T * H);
  std::vector<float> y(T * H);
  // Rows holding token 5 are replaced after the lookup (as image pads are) and get no gradient.
  auto loss = [&] {
    train::embedding_forward(y.data(), table.data(), ids.data(), T, H, V);
    for (int64_t t = 0; t < T; ++t)
      if (ids[t] == 5) std::fill(y.begin() + t * H, y.begin() + (t + 1) * H, 0.0f);
    return dot(r, y);
  };
  auto dt0 = randn(V * H);
  auto dt = dt0;
  train::embedding_backward(dt.data(), r.data(), ids.data(), T, H, 5);
  expect_gradient("embedding dtable", table, dt, loss, &dt0);

  const int64_t S = 6, D = 4, G = 9;
  std::vector<int32_t> index(S * 4);
  std::vector<float> weight(S * 4);
  std::uniform_int_distribution<int32_t> pick(0, G - 1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t i = 0; i < S * 4; ++i) {
    index[i] = pick(rng_);
    weight[i] = u(rng_);
  }
  auto pos = randn(G * D), rp = randn(S * D);
  std::vector<float> yp(S * D);
  auto pos_loss = [&] {
    std::fill(yp.begin(), yp.end(), 0.0f);
    train::pos_embed_forward(yp.data(), pos.data(), index.data(), weight.data(), S, D);
    return dot(rp, yp);
  };
  auto dp0 = randn(G * D);
  auto dp = dp0;
  train::pos_embed_backward(dp.data(), rp.data(), index.data(), weight.data(), S, D);
  expect_gradient("pos_embed dtable", pos, dp, pos_loss, &dp0);
}

TEST_F(OpGradients, LmHeadCrossEntropyInChunks) {
  // H = 16 takes the fused AVX2 kernels where the CPU has them, H = 6 the GEMM path.
  for (const int64_t H : {6, 16}) {
    SCOPED_TRACE(str_cat("H = ", H));
    const int64_t N = 5, V = 50;
    auto x = randn(N * H), w = randn(V * H);
    const std::vector<int32_t> targets = {3, 49, 0, 3, 17};
    std::vector<float> scratch(train::lm_head_scratch_floats(2, H, V));  // chunks: 2 + 2 + 1
    const float grad_scale = 0.37f;
    auto loss = [&] {
      return grad_scale * train::lm_head_cross_entropy(nullptr, nullptr, x.data(), w.data(),
                                                       targets.data(), N, H, V, 0.0f,
                                                       scratch.data(), int64_t(scratch.size()), 2);
    };
    // The loss against a direct f64 evaluation.
    double want = 0;
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> l(V);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        for (int64_t h = 0; h < H; ++h) l[v] += double(x[i * H + h]) * w[v * H + h];
        mx = std::max(mx, l[v]);
      }
      double s = 0;
      for (double lv : l) s += std::exp(lv - mx);
      want += mx + std::log(s) - l[targets[i]];
    }
    EXPECT_NEAR(loss() / grad_scale, want, 1e-5 * want);
    auto dx = nans(N * H);
    auto dw0 = randn(V * H);
    auto dw = dw0;
    const double l2 =
        train::lm_head_cross_entropy(dx.data(), dw.data(), x.data(), w.data(), targets.data(), N, H,
                                     V, grad_scale, scratch.data(), int64_t(scratch.size()), 2);
    EXPECT_NEAR(l2, want, 1e-5 * want);
    expect_gradient("lm_head ce dx", x, dx, loss);
    expect_gradient("lm_head ce dw", w, dw, loss, &dw0);
  }
}

}  // namespace
}  // namespace iris
