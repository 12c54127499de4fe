// Pipeline costs from a profiled step (training/pipeline_costs.h): the layer hook labels each op
// by the model part it runs in, the labelled time adds up into the costs a split balances, and
// the costs file round-trips with errors that name parallel.pipeline_costs.
#include "training/pipeline_costs.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"

namespace iris {
namespace {

using Pass = TrainableQwen3VL::LayerPass;

// One training micro-batch of a two-layer model as the model calls its layer hook, with one op
// after every event: each op carries the part it ran in, and the hook hands every event on.
TEST(PipelineCosts, ThePartHookLabelsEachOpByTheModelPartItRunsIn) {
  auto cpu = make_cpu_backend();
  ProfilingBackend prof(*cpu);
  Arena a(prof, size_t(1) << 12);
  const Tensor x = a.alloc(DType::f32, {16});
  int64_t backward_layers = 0;
  std::vector<int> seen;
  const auto hook = pipeline_part_hook(prof, 2, &backward_layers,
                                       [&](int layer, Pass, bool) { seen.push_back(layer); });
  struct Event {
    int layer;
    Pass pass;
    bool begin;
    const char* part;  // of the op that follows it
  };
  const int head = TrainableQwen3VL::kLmHeadGradient, embed = TrainableQwen3VL::kEmbeddingGradient;
  const std::vector<Event> events = {
      {0, Pass::forward, true, kPartLayer},      {0, Pass::forward, false, kPartLayer},
      {1, Pass::forward, true, kPartLayer},      {1, Pass::forward, false, kPartLast},
      {head, Pass::forward, true, kPartLast},    {head, Pass::forward, false, kPartLast},
      {1, Pass::backward, true, kPartLayer},     {1, Pass::backward, false, kPartLayer},
      {0, Pass::backward, true, kPartLayer},     {0, Pass::backward, false, kPartFirst},
      {embed, Pass::backward, true, kPartFirst}, {embed, Pass::backward, false, kPartFirst},
      {-1, Pass::backward, false, kPartFirst}};
  prof.start();
  prof.set_part(kPartFirst);
  prof.fill_zero(x);  // the vision encoder and the embedding
  for (const Event& e : events) {
    hook(e.layer, e.pass, e.begin);
    prof.fill_zero(x);
  }
  const std::vector<OpRecord> records = prof.stop();
  ASSERT_EQ(records.size(), events.size() + 1);
  EXPECT_EQ(records[0].part, kPartFirst);
  for (size_t i = 0; i < events.size(); ++i)
    EXPECT_EQ(records[i + 1].part, events[i].part) << "after event " << i;
  EXPECT_EQ(backward_layers, 2);
  std::vector<int> want;
  for (const Event& e : events) want.push_back(e.layer);
  EXPECT_EQ(seen, want);
  // start() clears the label.
  prof.start();
  prof.fill_zero(x);
  EXPECT_EQ(prof.stop().at(0).part, "");
}

TEST(PipelineCosts, TheCostsAreTheLabelledTimeWithLayersPerLayer) {
  const std::vector<OpRecord> records = {
      {"linear", 2.0, 0, 0, kPartFirst}, {"linear", 3.0, 0, 0, kPartLayer},
      {"linear", 5.0, 0, 0, kPartLayer}, {"rms_norm", 1.5, 0, 0, kPartLast},
      {"linear", 4.0, 0, 0, kPartLast},  {"adamw_step", 100.0, 0, 0, ""},
      {"linear", 0.5, 0, 0, kPartFirst}};
  const PipelineCosts c = measured_pipeline_costs(records, 4);
  EXPECT_DOUBLE_EQ(c.layer, 2.0);  // 8 ms over 4 layers
  EXPECT_DOUBLE_EQ(c.first, 2.5);
  EXPECT_DOUBLE_EQ(c.last, 5.5);
  EXPECT_THROW(measured_pipeline_costs(records, 0), Error);
}

TEST(PipelineCosts, TheCostsFileRoundTripsAndABadOneNamesTheKey) {
  const std::string path = (test::scratch_dir() / "pipeline_costs.json").string();
  write_file_atomic(path, pipeline_costs_json({1.25, 7.5, 0.0}, 28).dump());
  const PipelineCosts c = read_pipeline_costs(path);
  EXPECT_EQ(c.layer, 1.25);
  EXPECT_EQ(c.first, 7.5);
  EXPECT_EQ(c.last, 0.0);
  auto error_with = [&](const std::string& text) {
    write_file_atomic(path, text);
    return test::error_of([&] { read_pipeline_costs(path); });
  };
  for (const std::string& e :
       {error_with("{\"layer_ms\": 1"), error_with("{\"first_ms\": 1, \"last_ms\": 1}"),
        error_with("{\"layer_ms\": 0, \"first_ms\": 1, \"last_ms\": 1}"),
        error_with("{\"layer_ms\": 1, \"first_ms\": -1, \"last_ms\": 1}"), error_with("[1, 2]"),
        test::error_of([&] { read_pipeline_costs(path + ".missing"); })})
    EXPECT_NE(e.find("parallel.pipeline_costs"), std::string::npos) << e;
  EXPECT_NE(error_with("{\"layer_ms\": 0, \"first_ms\": 1, \"last_ms\": 1}").find("layer_ms is 0"),
            std::string::npos);
}

}  // namespace
}  // namespace iris
