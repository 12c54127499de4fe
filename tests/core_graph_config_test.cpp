// CUDA graph configuration: parsing, deprecated-input migration, every rejection, defaults, YAML
// and CLI adapters, bucket choice. Runs on the CPU: this layer must fail the same everywhere.
#include <gtest/gtest.h>

#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/graph_config.h"

namespace iris {
namespace {

using Modules = std::vector<GraphModule>;

GraphModelTraits dense_model(int64_t max_vision = 0) {
  GraphModelTraits t;
  t.max_vision_seq_length = max_vision;
  return t;
}

GraphModelTraits moe_model() {
  GraphModelTraits t;
  t.has_moe = true;
  return t;
}

// The error message, or a test failure when there is none.
std::string parse_error(const GraphConfigInput& input) {
  try {
    parse_graph_configs(input);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse_graph_configs accepted an input it should reject";
  return {};
}

std::string finalize_error(const GraphConfigInput& input, const GraphModelTraits& model) {
  GraphConfigs cfg = parse_graph_configs(input);
  try {
    finalize_graph_configs(cfg, model);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "finalize_graph_configs accepted a config it should reject";
  return {};
}

void expect_mentions(const std::string& message, std::initializer_list<const char*> parts) {
  for (const char* p : parts)
    EXPECT_NE(message.find(p), std::string::npos) << "'" << p << "' missing from: " << message;
}

void expect_one_warning(const GraphConfigs& cfg, std::initializer_list<const char*> parts) {
  ASSERT_EQ(cfg.warnings.size(), 1u);
  expect_mentions(cfg.warnings[0], parts);
}

// ---------------------------------------------------------------------------------------------
// Defaults and case-insensitivity

TEST(GraphConfigDefaults, EmptyInputIsAllOff) {
  const GraphConfigs cfg = parse_graph_configs({});
  EXPECT_EQ(cfg.language.impl, GraphImpl::none);
  EXPECT_TRUE(cfg.language.modules.empty());
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::none);
  EXPECT_EQ(cfg.language.warmup_steps, 3);
  EXPECT_EQ(cfg.vision.impl, VisionGraphImpl::none);
  EXPECT_TRUE(cfg.vision.modules.empty());
  EXPECT_EQ(cfg.vision.inference_scope, VisionGraphScope::block);
  EXPECT_EQ(cfg.vision.max_seq_length, 0);
  EXPECT_TRUE(cfg.vision.buckets.empty());
  EXPECT_EQ(cfg.vision.overflow, VisionGraphOverflow::eager);
  EXPECT_TRUE(cfg.warnings.empty());
}

TEST(GraphConfigDefaults, LocalDefaultsToLayerInferenceScope) {
  const GraphConfigs cfg = parse_graph_configs({{"cuda_graph_impl", "local"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::layer);
  EXPECT_EQ(cfg.language.warmup_steps, 3);
}

TEST(GraphConfigDefaults, FullIterationDefaultsToNoInferenceScope) {
  const GraphConfigs cfg = parse_graph_configs({{"cuda_graph_impl", "full_iteration"}});
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::none);
}

TEST(GraphConfigDefaults, AllKeysParsed) {
  const GraphConfigs cfg = parse_graph_configs({
      {"cuda_graph_impl", "local"},
      {"cuda_graph_modules", "mlp,attn"},
      {"inference_cuda_graph_scope", "block"},
      {"cuda_graph_warmup_steps", "0"},
      {"vision_cuda_graph_impl", "local"},
      {"vision_cuda_graph_modules", "attn"},
      {"vision_inference_cuda_graph_scope", "layer"},
      {"max_vision_cuda_graph_seq_length", "4608"},
      {"vision_cuda_graph_buckets", "1024,4608"},
      {"vision_cuda_graph_overflow", "error"},
  });
  EXPECT_EQ(cfg.language.modules, (Modules{GraphModule::attn, GraphModule::mlp}));
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::block);
  EXPECT_EQ(cfg.language.warmup_steps, 0);
  EXPECT_EQ(cfg.vision.impl, VisionGraphImpl::local);
  EXPECT_EQ(cfg.vision.modules, (Modules{GraphModule::attn}));
  EXPECT_EQ(cfg.vision.inference_scope, VisionGraphScope::layer);
  EXPECT_EQ(cfg.vision.max_seq_length, 4608);
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{1024, 4608}));
  EXPECT_EQ(cfg.vision.overflow, VisionGraphOverflow::error);
  EXPECT_TRUE(cfg.warnings.empty());
}

TEST(GraphConfigParse, ValuesAndKeysAreCaseInsensitive) {
  const GraphConfigs cfg = parse_graph_configs({
      {"CUDA_Graph_Impl", " LOCAL "},
      {"cuda_graph_modules", "[Attn, MLP]"},
      {"Inference_CUDA_Graph_Scope", "Block"},
      {"vision_cuda_graph_impl", "Local"},
      {"vision_cuda_graph_overflow", "ERROR"},
      {"vision_inference_cuda_graph_scope", "LAYER"},
      {"ENABLE_CUDA_GRAPH", "False"},
  });
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.modules, (Modules{GraphModule::attn, GraphModule::mlp}));
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::block);
  EXPECT_EQ(cfg.vision.impl, VisionGraphImpl::local);
  EXPECT_EQ(cfg.vision.overflow, VisionGraphOverflow::error);
  EXPECT_EQ(cfg.vision.inference_scope, VisionGraphScope::layer);
}

TEST(GraphConfigParse, LastValueOfARepeatedKeyWins) {
  // A caller appends CLI input after recipe input to override it.
  const GraphConfigs cfg =
      parse_graph_configs({{"cuda_graph_impl", "local"}, {"--cuda-graph-impl", "none"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::none);
}

TEST(GraphConfigParse, EmptyModuleListMeansWholeLayer) {
  for (const char* empty : {"", "[]", " [ ] "}) {
    const GraphConfigs cfg =
        parse_graph_configs({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", empty}});
    EXPECT_TRUE(cfg.language.modules.empty()) << "'" << empty << "'";
    EXPECT_TRUE(cfg.warnings.empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Migrations of deprecated inputs: accepted, one warning each

TEST(GraphConfigMigration, EnableCudaGraphTrueBecomesLocal) {
  const GraphConfigs cfg = parse_graph_configs({{"enable_cuda_graph", "true"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::layer);
  expect_one_warning(cfg, {"enable_cuda_graph", "deprecated", "cuda_graph_impl: local"});
}

TEST(GraphConfigMigration, EnableCudaGraphFalseOnlyWarns) {
  const GraphConfigs cfg = parse_graph_configs({{"enable_cuda_graph", "false"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::none);
  expect_one_warning(cfg, {"enable_cuda_graph", "no effect"});
}

TEST(GraphConfigMigration, ExternalCudaGraphTrueBecomesLocal) {
  const GraphConfigs cfg = parse_graph_configs({{"external_cuda_graph", "true"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::layer);
  expect_one_warning(cfg, {"external_cuda_graph", "deprecated", "cuda_graph_impl: local"});
}

TEST(GraphConfigMigration, ImplTransformerEngineBecomesLocal) {
  const GraphConfigs cfg = parse_graph_configs({{"cuda_graph_impl", "Transformer_Engine"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::layer);
  expect_one_warning(cfg, {"transformer_engine", "deprecated", "local"});
}

TEST(GraphConfigMigration, CudaGraphScopeBecomesModules) {
  const GraphConfigs cfg =
      parse_graph_configs({{"cuda_graph_impl", "local"}, {"cuda_graph_scope", "mlp,attn"}});
  EXPECT_EQ(cfg.language.modules, (Modules{GraphModule::attn, GraphModule::mlp}));
  expect_one_warning(cfg, {"cuda_graph_scope", "deprecated", "cuda_graph_modules: [attn, mlp]"});
}

TEST(GraphConfigMigration, CudaGraphScopeMoeValuesBecomeModules) {
  GraphConfigs cfg = parse_graph_configs(
      {{"cuda_graph_impl", "local"}, {"cuda_graph_scope", "attn,moe_router,moe_preprocess"}});
  finalize_graph_configs(cfg, moe_model());
  EXPECT_EQ(cfg.language.modules,
            (Modules{GraphModule::attn, GraphModule::moe_router, GraphModule::moe_preprocess}));
  expect_one_warning(cfg, {"cuda_graph_scope", "attn, moe_router, moe_preprocess"});
}

TEST(GraphConfigMigration, ScopeFullIterationBecomesImplFullIteration) {
  // Megatron-LM accepts it with impl none, local or full_iteration, and with the legacy boolean.
  for (const GraphConfigInput& input : std::vector<GraphConfigInput>{
           {{"cuda_graph_scope", "full_iteration"}},
           {{"cuda_graph_impl", "none"}, {"cuda_graph_scope", "full_iteration"}},
           {{"cuda_graph_impl", "local"}, {"cuda_graph_scope", "full_iteration"}},
           {{"cuda_graph_impl", "full_iteration"}, {"cuda_graph_scope", "full_iteration"}},
       }) {
    const GraphConfigs cfg = parse_graph_configs(input);
    EXPECT_EQ(cfg.language.impl, GraphImpl::full_iteration);
    EXPECT_TRUE(cfg.language.modules.empty());
    EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::none);
    expect_one_warning(cfg, {"cuda_graph_scope", "cuda_graph_impl: full_iteration"});
  }
}

TEST(GraphConfigMigration, ScopeFullIterationAfterEnableCudaGraph) {
  const GraphConfigs cfg =
      parse_graph_configs({{"enable_cuda_graph", "true"}, {"cuda_graph_scope", "full_iteration"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::full_iteration);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::none);
  EXPECT_EQ(cfg.warnings.size(), 2u);  // one per deprecated input
}

TEST(GraphConfigMigration, ScopeFullIterationInferenceWithLocalBecomesBlock) {
  const GraphConfigs cfg = parse_graph_configs(
      {{"cuda_graph_impl", "local"}, {"cuda_graph_scope", "full_iteration_inference"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::block);
  EXPECT_TRUE(cfg.language.modules.empty());
  expect_one_warning(cfg, {"full_iteration_inference", "inference_cuda_graph_scope: block"});
}

TEST(GraphConfigMigration, ScopeFullIterationInferenceKeepsOtherModules) {
  const GraphConfigs cfg = parse_graph_configs(
      {{"enable_cuda_graph", "true"}, {"cuda_graph_scope", "attn,full_iteration_inference"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::block);
  EXPECT_EQ(cfg.language.modules, (Modules{GraphModule::attn}));
}

TEST(GraphConfigMigration, ScopeFullIterationInferenceWithImplNoneIsNoOp) {
  const GraphConfigs cfg = parse_graph_configs({{"cuda_graph_scope", "full_iteration_inference"}});
  EXPECT_EQ(cfg.language.impl, GraphImpl::none);
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::none);
  expect_one_warning(cfg, {"full_iteration_inference", "no effect"});
}

TEST(GraphConfigMigration, ScopeFullBecomesEmptyModules) {
  const GraphConfigs cfg =
      parse_graph_configs({{"cuda_graph_impl", "local"}, {"cuda_graph_scope", "FULL"}});
  EXPECT_TRUE(cfg.language.modules.empty());
  expect_one_warning(cfg, {"cuda_graph_scope", "'full'", "whole layer"});
}

TEST(GraphConfigMigration, ModulesValueFullBecomesEmptyModules) {
  // Megatron-LM's old default value of the renamed key.
  const GraphConfigs cfg =
      parse_graph_configs({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "full"}});
  EXPECT_TRUE(cfg.language.modules.empty());
  expect_one_warning(cfg, {"cuda_graph_modules", "'full'", "whole layer"});
}

TEST(GraphConfigMigration, VisionTransformerEngineBecomesLocal) {
  const GraphConfigs cfg = parse_graph_configs({{"vision_cuda_graph_impl", "transformer_engine"}});
  EXPECT_EQ(cfg.vision.impl, VisionGraphImpl::local);
  expect_one_warning(cfg, {"vision_cuda_graph_impl", "transformer_engine", "local"});
}

TEST(GraphConfigMigration, VisionCudaGraphScopeBecomesVisionModules) {
  const GraphConfigs cfg = parse_graph_configs({{"vision_cuda_graph_scope", "[mlp, attn]"}});
  EXPECT_EQ(cfg.vision.modules, (Modules{GraphModule::attn, GraphModule::mlp}));
  expect_one_warning(cfg, {"vision_cuda_graph_scope", "vision_cuda_graph_modules: [attn, mlp]"});
}

// ---------------------------------------------------------------------------------------------
// Rejections

TEST(GraphConfigReject, DeprecatedFlagWithExplicitImpl) {
  expect_mentions(parse_error({{"enable_cuda_graph", "true"}, {"cuda_graph_impl", "local"}}),
                  {"enable_cuda_graph", "cuda_graph_impl", "'local'"});
  expect_mentions(parse_error({{"external_cuda_graph", "yes"}, {"cuda_graph_impl", "none"}}),
                  {"external_cuda_graph", "cuda_graph_impl", "'none'"});
}

TEST(GraphConfigReject, BothLegacyBooleans) {
  expect_mentions(parse_error({{"enable_cuda_graph", "true"}, {"external_cuda_graph", "true"}}),
                  {"enable_cuda_graph", "external_cuda_graph", "both"});
}

TEST(GraphConfigReject, ScopeAndModulesBothSet) {
  expect_mentions(parse_error({{"cuda_graph_scope", "attn"}, {"cuda_graph_modules", "mlp"}}),
                  {"cuda_graph_scope", "cuda_graph_modules", "both set"});
  // Even an empty list counts as set: the two sources would disagree on which one wins.
  expect_mentions(parse_error({{"cuda_graph_scope", "attn"}, {"cuda_graph_modules", "[]"}}),
                  {"cuda_graph_scope", "cuda_graph_modules"});
  expect_mentions(
      parse_error({{"vision_cuda_graph_scope", "attn"}, {"vision_cuda_graph_modules", "mlp"}}),
      {"vision_cuda_graph_scope", "vision_cuda_graph_modules", "both set"});
}

TEST(GraphConfigReject, FullWithOtherValues) {
  expect_mentions(parse_error({{"cuda_graph_scope", "full,attn"}}),
                  {"cuda_graph_scope", "'full'", "other values"});
  expect_mentions(parse_error({{"cuda_graph_modules", "mlp,full"}}),
                  {"cuda_graph_modules", "'full'", "other values"});
  expect_mentions(parse_error({{"cuda_graph_scope", "full,full_iteration"}}),
                  {"cuda_graph_scope", "'full'"});
}

TEST(GraphConfigReject, TwoDeprecatedValuesAtOnce) {
  expect_mentions(parse_error({{"cuda_graph_scope", "full_iteration,full_iteration_inference"}}),
                  {"cuda_graph_scope", "two deprecated values", "full_iteration_inference"});
}

TEST(GraphConfigReject, FullIterationWithNonEmptyModules) {
  expect_mentions(
      parse_error({{"cuda_graph_impl", "full_iteration"}, {"cuda_graph_modules", "attn"}}),
      {"full_iteration", "cuda_graph_modules", "[attn]"});
  expect_mentions(parse_error({{"cuda_graph_scope", "full_iteration,mlp"}}),
                  {"full_iteration", "cuda_graph_modules", "[mlp]"});
}

TEST(GraphConfigReject, FullIterationWithInferenceScope) {
  expect_mentions(
      parse_error({{"cuda_graph_impl", "full_iteration"}, {"inference_cuda_graph_scope", "layer"}}),
      {"inference_cuda_graph_scope", "'layer'", "full_iteration", "none"});
  expect_mentions(parse_error({{"cuda_graph_scope", "full_iteration"},
                               {"inference_cuda_graph_scope", "block"}}),
                  {"full_iteration", "inference_cuda_graph_scope", "'block'"});
}

TEST(GraphConfigReject, DeprecatedFullIterationWithTransformerEngine) {
  expect_mentions(parse_error({{"cuda_graph_impl", "transformer_engine"},
                               {"cuda_graph_scope", "full_iteration"}}),
                  {"full_iteration", "transformer_engine"});
  expect_mentions(
      parse_error({{"external_cuda_graph", "true"}, {"cuda_graph_scope", "full_iteration"}}),
      {"full_iteration", "external_cuda_graph"});
  expect_mentions(parse_error({{"cuda_graph_impl", "transformer_engine"},
                               {"cuda_graph_scope", "full_iteration_inference"}}),
                  {"full_iteration_inference", "transformer_engine", "none, local"});
}

TEST(GraphConfigReject, FullIterationInferenceWithFullIterationImpl) {
  expect_mentions(parse_error({{"cuda_graph_impl", "full_iteration"},
                               {"cuda_graph_scope", "full_iteration_inference"}}),
                  {"full_iteration_inference", "cuda_graph_impl full_iteration", "none, local"});
}

TEST(GraphConfigReject, FullIterationInferenceWithOtherInferenceScope) {
  expect_mentions(parse_error({{"cuda_graph_impl", "local"},
                               {"cuda_graph_scope", "full_iteration_inference"},
                               {"inference_cuda_graph_scope", "layer"}}),
                  {"full_iteration_inference", "inference_cuda_graph_scope", "'layer'"});
  // Agreeing explicit values are fine.
  const GraphConfigs ok = parse_graph_configs({{"cuda_graph_impl", "local"},
                                               {"cuda_graph_scope", "full_iteration_inference"},
                                               {"inference_cuda_graph_scope", "block"}});
  EXPECT_EQ(ok.language.inference_scope, InferenceGraphScope::block);
}

TEST(GraphConfigReject, InferenceScopeNotAllowedForImpl) {
  expect_mentions(parse_error({{"inference_cuda_graph_scope", "layer"}}),
                  {"inference_cuda_graph_scope", "'layer'", "cuda_graph_impl 'none'", "none"});
  expect_mentions(
      parse_error({{"cuda_graph_impl", "local"}, {"inference_cuda_graph_scope", "none"}}),
      {"inference_cuda_graph_scope", "'none'", "local", "layer, block"});
}

TEST(GraphConfigReject, MoeWithMoeRouter) {
  expect_mentions(
      parse_error({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "moe,moe_router"}}),
      {"cuda_graph_modules", "'moe'", "'moe_router'"});
}

TEST(GraphConfigReject, MoePreprocessWithoutMoeRouter) {
  expect_mentions(
      parse_error({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "attn,moe_preprocess"}}),
      {"cuda_graph_modules", "'moe_preprocess'", "moe_router"});
}

TEST(GraphConfigReject, MoeModulesOnModelWithoutMoe) {
  for (const char* modules : {"moe", "moe_router", "moe_router,moe_preprocess"}) {
    const GraphConfigInput input = {{"cuda_graph_impl", "local"}, {"cuda_graph_modules", modules}};
    expect_mentions(finalize_error(input, dense_model()),
                    {"cuda_graph_modules", "'moe", "no", "MoE", "attn, mlp"});
    GraphConfigs cfg = parse_graph_configs(input);
    GraphModelTraits padded = moe_model();
    padded.moe_static_capacity = true;
    EXPECT_NO_THROW(finalize_graph_configs(cfg, padded)) << modules;
  }
}

// Megatron's rule: the whole MoE layer is capturable only with drop-and-pad.
TEST(GraphConfigReject, MoeWithoutAStaticCapacity) {
  const GraphConfigInput input = {{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "attn,moe"}};
  expect_mentions(finalize_error(input, moe_model()),
                  {"cuda_graph_modules", "'moe'", "model.moe_expert_capacity_factor",
                   "model.moe_pad_expert_input_to_capacity", "moe_router,moe_preprocess"});
  for (const char* dropless : {"moe_router", "moe_router,moe_preprocess", "attn,mlp"}) {
    GraphConfigs cfg =
        parse_graph_configs({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", dropless}});
    EXPECT_NO_THROW(finalize_graph_configs(cfg, moe_model())) << dropless;
  }
}

// And the dense MLP module of a model whose every layer is MoE would graph nothing.
TEST(GraphConfigReject, MlpWhenEveryLayerIsMoe) {
  GraphModelTraits all_moe = moe_model();
  all_moe.has_dense_mlp = false;
  expect_mentions(
      finalize_error({{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "attn,mlp"}}, all_moe),
      {"cuda_graph_modules", "'mlp'", "every decoder layer", "moe_router,moe_preprocess"});
  GraphConfigs cfg = parse_graph_configs(
      {{"cuda_graph_impl", "local"}, {"cuda_graph_modules", "attn,moe_router"}});
  EXPECT_NO_THROW(finalize_graph_configs(cfg, all_moe));
}

TEST(GraphConfigReject, Mamba) {
  expect_mentions(parse_error({{"cuda_graph_modules", "attn,mamba"}}),
                  {"cuda_graph_modules", "'mamba'", "no Mamba layers",
                   "attn, mlp, moe, moe_router, moe_preprocess"});
  expect_mentions(parse_error({{"cuda_graph_scope", "mamba"}}), {"cuda_graph_scope", "'mamba'"});
}

TEST(GraphConfigReject, VisionMaxNotDivisibleWithDeepstack) {
  GraphModelTraits deepstack;
  deepstack.has_deepstack = true;
  const GraphConfigInput input = {{"vision_cuda_graph_impl", "local"},
                                  {"vision_inference_cuda_graph_scope", "layer"},
                                  {"max_vision_cuda_graph_seq_length", "1001"}};
  expect_mentions(
      finalize_error(input, deepstack),
      {"max_vision_cuda_graph_seq_length", "1001", "divisible by 4", "deepstack", "1000 or 1004"});
  // A maximum derived from the model is held to the same rule.
  expect_mentions(
      finalize_error({{"vision_cuda_graph_impl", "local"}}, dense_model(/*max_vision=*/1002)),
      {"max_vision_cuda_graph_seq_length", "1002", "derived from the model"});
  // Without deepstack and with layer scope no merger runs inside a graph.
  GraphModelTraits plain;
  plain.has_deepstack = false;
  GraphConfigs cfg = parse_graph_configs(input);
  finalize_graph_configs(cfg, plain);
  EXPECT_EQ(cfg.vision.max_seq_length, 1001);
}

TEST(GraphConfigReject, VisionMaxNotDivisibleWithBlockScope) {
  GraphModelTraits plain;
  plain.has_deepstack = false;
  expect_mentions(finalize_error({{"vision_cuda_graph_impl", "local"},
                                  {"vision_inference_cuda_graph_scope", "block"},
                                  {"max_vision_cuda_graph_seq_length", "1001"}},
                                 plain),
                  {"max_vision_cuda_graph_seq_length", "1001", "divisible by 4", "block"});
  // Merge size 3 makes the window 9 patches.
  plain.spatial_merge_size = 3;
  expect_mentions(finalize_error({{"max_vision_cuda_graph_seq_length", "1000"}}, plain),
                  {"1000", "divisible by 9", "spatial_merge_size 3"});
}

TEST(GraphConfigReject, VisionBucketsAboveMax) {
  expect_mentions(finalize_error({{"vision_cuda_graph_impl", "local"},
                                  {"max_vision_cuda_graph_seq_length", "1000"},
                                  {"vision_cuda_graph_buckets", "512,2048"}},
                                 dense_model()),
                  {"vision_cuda_graph_buckets", "2048", "above", "1000"});
  // Against a maximum derived from the model too.
  expect_mentions(finalize_error({{"vision_cuda_graph_buckets", "4096"}}, dense_model(2304)),
                  {"vision_cuda_graph_buckets", "4096", "above", "2304"});
}

TEST(GraphConfigReject, VisionBucketsNotAscending) {
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "512,256"}}),
                  {"vision_cuda_graph_buckets", "not ascending", "512 before 256"});
}

TEST(GraphConfigReject, VisionBucketsDuplicate) {
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "256,512,512"}}),
                  {"vision_cuda_graph_buckets", "512 twice"});
}

TEST(GraphConfigReject, VisionBucketsNotPositive) {
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "0,256"}}),
                  {"vision_cuda_graph_buckets", "entry 0", "not positive"});
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "-4,256"}}),
                  {"vision_cuda_graph_buckets", "entry -4", "not positive"});
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "256,x"}}),
                  {"vision_cuda_graph_buckets", "'x'", "not an integer"});
  expect_mentions(parse_error({{"vision_cuda_graph_buckets", "256,,512"}}),
                  {"vision_cuda_graph_buckets", "empty entry"});
}

TEST(GraphConfigReject, VisionBucketsNotDivisibleWithDeepstack) {
  expect_mentions(finalize_error({{"vision_cuda_graph_impl", "local"},
                                  {"vision_inference_cuda_graph_scope", "layer"},
                                  {"max_vision_cuda_graph_seq_length", "1024"},
                                  {"vision_cuda_graph_buckets", "258,1024"}},
                                 dense_model()),
                  {"vision_cuda_graph_buckets", "entry 258", "divisible by 4", "deepstack"});
}

TEST(GraphConfigReject, VisionBucketsNotDivisibleWithBlockScope) {
  GraphModelTraits plain;
  plain.has_deepstack = false;
  const GraphConfigInput block = {{"vision_cuda_graph_impl", "local"},
                                  {"max_vision_cuda_graph_seq_length", "1024"},
                                  {"vision_cuda_graph_buckets", "258,1024"}};
  expect_mentions(finalize_error(block, plain),
                  {"vision_cuda_graph_buckets", "entry 258", "divisible by 4", "block"});
  GraphConfigInput layer = block;
  layer.emplace_back("vision_inference_cuda_graph_scope", "layer");
  GraphConfigs cfg = parse_graph_configs(layer);
  finalize_graph_configs(cfg, plain);
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{258, 1024}));
}

TEST(GraphConfigReject, VisionLocalWithoutAnyMaximum) {
  expect_mentions(finalize_error({{"vision_cuda_graph_impl", "local"}}, dense_model()),
                  {"vision_cuda_graph_impl", "max_vision_cuda_graph_seq_length", "0"});
  // With vision graphs off there is nothing to size.
  GraphConfigs cfg = parse_graph_configs({});
  finalize_graph_configs(cfg, dense_model());
  EXPECT_TRUE(cfg.vision.buckets.empty());
}

TEST(GraphConfigReject, VisionMoeModules) {
  expect_mentions(parse_error({{"vision_cuda_graph_modules", "attn,moe"}}),
                  {"vision_cuda_graph_modules", "'moe'", "no MoE layers", "attn, mlp"});
  expect_mentions(parse_error({{"vision_cuda_graph_modules", "full_iteration"}}),
                  {"vision_cuda_graph_modules", "'full_iteration'", "attn, mlp"});
}

TEST(GraphConfigReject, DuplicateModules) {
  expect_mentions(parse_error({{"cuda_graph_modules", "attn,attn"}}),
                  {"cuda_graph_modules", "'attn' twice"});
}

// Every enum error names the key and the bad value and lists the valid values.
TEST(GraphConfigReject, InvalidEnumValuesListValidValues) {
  struct Case {
    const char* key;
    const char* value;
    const char* valid;
  };
  for (const Case& c : {
           Case{"cuda_graph_impl", "loca", "none, local, full_iteration"},
           Case{"cuda_graph_modules", "attention", "attn, mlp, moe, moe_router, moe_preprocess"},
           Case{"cuda_graph_scope", "router", "attn, mlp, moe, moe_router, moe_preprocess"},
           Case{"inference_cuda_graph_scope", "graph", "none, layer, block"},
           Case{"vision_cuda_graph_impl", "full_iteration", "none, local"},
           Case{"vision_cuda_graph_modules", "ffn", "attn, mlp"},
           Case{"vision_inference_cuda_graph_scope", "none", "layer, block"},
           Case{"vision_cuda_graph_overflow", "drop", "eager, error"},
       }) {
    const std::string msg = parse_error({{c.key, c.value}});
    expect_mentions(msg, {c.key, c.value, "valid values", c.valid});
  }
  expect_mentions(parse_error({{"cuda_graph_impl", ""}}), {"cuda_graph_impl", "needs a value"});
}

TEST(GraphConfigReject, ScopeValueInModuleListGetsAHint) {
  expect_mentions(parse_error({{"cuda_graph_modules", "block"}}),
                  {"cuda_graph_modules", "'block'", "inference_cuda_graph_scope"});
  expect_mentions(parse_error({{"vision_cuda_graph_scope", "layer"}}),
                  {"vision_cuda_graph_scope", "'layer'", "vision_inference_cuda_graph_scope"});
}

TEST(GraphConfigReject, InvalidScalars) {
  expect_mentions(parse_error({{"enable_cuda_graph", "maybe"}}),
                  {"enable_cuda_graph", "'maybe'", "true, false"});
  expect_mentions(parse_error({{"cuda_graph_warmup_steps", "-1"}}),
                  {"cuda_graph_warmup_steps", "-1", ">= 0"});
  expect_mentions(parse_error({{"cuda_graph_warmup_steps", "3.5"}}),
                  {"cuda_graph_warmup_steps", "'3.5'", "not an integer"});
  expect_mentions(parse_error({{"max_vision_cuda_graph_seq_length", "-8"}}),
                  {"max_vision_cuda_graph_seq_length", "-8"});
  expect_mentions(parse_error({{"cuda_graph_modules", "[attn"}}),
                  {"cuda_graph_modules", "unclosed"});
}

TEST(GraphConfigReject, UnknownKeySuggestsClosest) {
  expect_mentions(
      parse_error({{"cuda_graph_imp", "local"}}),
      {"unknown key 'cuda_graph_imp'", "did you mean 'cuda_graph_impl'", "--cuda-graph-impl"});
  expect_mentions(parse_error({{"vision_cuda_graph_bucket", "256"}}),
                  {"did you mean 'vision_cuda_graph_buckets'"});
  expect_mentions(parse_error({{"max_vision_seq_len", "256"}}),
                  {"did you mean 'max_vision_cuda_graph_seq_length'"});
}

// ---------------------------------------------------------------------------------------------
// Finalization: derived maximum and default buckets

TEST(GraphConfigFinalize, DefaultBucketsForMax1000WithDeepstack) {
  GraphConfigs cfg = parse_graph_configs(
      {{"vision_cuda_graph_impl", "local"}, {"max_vision_cuda_graph_seq_length", "1000"}});
  finalize_graph_configs(cfg, dense_model());
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{256, 512, 1000}));
}

TEST(GraphConfigFinalize, DefaultBucketsForMax4096) {
  GraphConfigs cfg = parse_graph_configs(
      {{"vision_cuda_graph_impl", "local"}, {"max_vision_cuda_graph_seq_length", "4096"}});
  finalize_graph_configs(cfg, dense_model());
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{256, 512, 1024, 2048, 4096}));
}

TEST(GraphConfigFinalize, DefaultBucketsForSmallMaxima) {
  for (const auto& [max, expected] : std::vector<std::pair<int64_t, std::vector<int64_t>>>{
           {256, {256}}, {200, {200}}, {260, {256, 260}}, {512, {256, 512}}}) {
    GraphConfigs cfg =
        parse_graph_configs({{"vision_cuda_graph_impl", "local"},
                             {"max_vision_cuda_graph_seq_length", std::to_string(max)}});
    finalize_graph_configs(cfg, dense_model());
    EXPECT_EQ(cfg.vision.buckets, expected) << "max " << max;
  }
}

TEST(GraphConfigFinalize, DefaultBucketsForHugeMaximumDoNotOverflow) {
  const int64_t max = std::numeric_limits<int64_t>::max() - 3;  // divisible by 4
  GraphConfigs cfg =
      parse_graph_configs({{"vision_cuda_graph_impl", "local"},
                           {"max_vision_cuda_graph_seq_length", std::to_string(max)}});
  finalize_graph_configs(cfg, dense_model());
  ASSERT_EQ(cfg.vision.buckets.size(), 56u);  // 2^8 .. 2^62, then the maximum
  EXPECT_EQ(cfg.vision.buckets[54], int64_t(1) << 62);
  EXPECT_EQ(cfg.vision.buckets.back(), max);
}

TEST(GraphConfigFinalize, MaximumDerivedFromModelWhenZero) {
  GraphConfigs cfg = parse_graph_configs({{"vision_cuda_graph_impl", "local"}});
  finalize_graph_configs(cfg, dense_model(/*max_vision=*/2304));
  EXPECT_EQ(cfg.vision.max_seq_length, 2304);
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{256, 512, 1024, 2048, 2304}));
  // An explicit maximum wins over the model's.
  GraphConfigs explicit_max = parse_graph_configs(
      {{"vision_cuda_graph_impl", "local"}, {"max_vision_cuda_graph_seq_length", "4608"}});
  finalize_graph_configs(explicit_max, dense_model(2304));
  EXPECT_EQ(explicit_max.vision.max_seq_length, 4608);
}

TEST(GraphConfigFinalize, ExplicitBucketsAreKeptAndFinalizeIsIdempotent) {
  GraphConfigs cfg = parse_graph_configs({{"vision_cuda_graph_impl", "local"},
                                          {"max_vision_cuda_graph_seq_length", "4608"},
                                          {"vision_cuda_graph_buckets", "[784, 2304, 4608]"}});
  finalize_graph_configs(cfg, dense_model());
  finalize_graph_configs(cfg, dense_model());
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{784, 2304, 4608}));
  EXPECT_EQ(cfg.vision.max_seq_length, 4608);
}

TEST(GraphConfigFinalize, ConfigBuiltInCodeIsValidatedToo) {
  GraphConfigs cfg;
  cfg.language.impl = GraphImpl::full_iteration;
  cfg.language.modules = {GraphModule::attn};
  try {
    finalize_graph_configs(cfg, dense_model());
    ADD_FAILURE() << "full_iteration with modules was accepted";
  } catch (const Error& e) {
    expect_mentions(e.what(), {"full_iteration", "cuda_graph_modules"});
  }
  GraphConfigs vision;
  vision.vision.modules = {GraphModule::moe};
  EXPECT_THROW(finalize_graph_configs(vision, dense_model()), Error);
}

// ---------------------------------------------------------------------------------------------
// Adapters and printing

TEST(GraphConfigValues, RoundTripThroughTheKeyValueInput) {
  GraphConfigs cfg = parse_graph_configs({{"enable_cuda_graph", "true"},
                                          {"cuda_graph_scope", "attn,moe_router,moe_preprocess"},
                                          {"inference_cuda_graph_scope", "block"},
                                          {"cuda_graph_warmup_steps", "5"},
                                          {"vision_cuda_graph_impl", "local"},
                                          {"vision_cuda_graph_modules", "mlp"},
                                          {"vision_inference_cuda_graph_scope", "layer"},
                                          {"vision_cuda_graph_overflow", "error"}});
  finalize_graph_configs(cfg, [] {
    GraphModelTraits t = moe_model();
    t.max_vision_seq_length = 1000;
    return t;
  }());
  const auto values = graph_config_values(cfg);
  GraphConfigInput input;
  for (const auto& [key, value] : values) input.emplace_back(key, graph_value_text(value));
  GraphConfigs back = parse_graph_configs(input);
  EXPECT_TRUE(back.warnings.empty()) << "graph_config_values named a deprecated key";
  EXPECT_EQ(graph_config_values(back), values);
  EXPECT_EQ(back.language.impl, GraphImpl::local);
  EXPECT_EQ(back.language.modules, cfg.language.modules);
  EXPECT_EQ(back.language.inference_scope, InferenceGraphScope::block);
  EXPECT_EQ(back.language.warmup_steps, 5);
  EXPECT_EQ(back.vision.modules, (Modules{GraphModule::mlp}));
  EXPECT_EQ(back.vision.max_seq_length, 1000);
  EXPECT_EQ(back.vision.buckets, (std::vector<int64_t>{256, 512, 1000}));
  EXPECT_EQ(back.vision.overflow, VisionGraphOverflow::error);
}

TEST(GraphConfigValues, ListEveryResolvedKeyTyped) {
  const auto values = graph_config_values(parse_graph_configs({{"cuda_graph_impl", "local"}}));
  std::vector<std::string> names;
  for (const auto& [key, value] : values) names.push_back(key);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "cuda_graph_impl", "cuda_graph_modules", "inference_cuda_graph_scope",
                "cuda_graph_warmup_steps", "vision_cuda_graph_impl", "vision_cuda_graph_modules",
                "vision_inference_cuda_graph_scope", "max_vision_cuda_graph_seq_length",
                "vision_cuda_graph_buckets", "vision_cuda_graph_overflow"}));
  EXPECT_EQ(std::get<std::string>(values[0].second), "local");
  EXPECT_TRUE(std::get<std::vector<std::string>>(values[1].second).empty());
  EXPECT_EQ(std::get<std::string>(values[2].second), "layer");
  EXPECT_EQ(std::get<int64_t>(values[3].second), 3);
  EXPECT_EQ(std::get<int64_t>(values[7].second), 0);
  EXPECT_EQ(graph_value_text(GraphValue{std::vector<int64_t>{256, 512}}), "256,512");
  EXPECT_EQ(graph_config_key_doc("cuda_graph_modules").default_value, "[]");
  EXPECT_EQ(std::get<int64_t>(graph_config_key_doc("cuda_graph_warmup_steps").typed_default), 3);
}

TEST(GraphConfigFlags, BothSpellingsAndBareBooleans) {
  const GraphConfigInput input = graph_config_input_from_flags({
      {"--cuda-graph-modules", "attn,mlp"},
      {"inference_cuda_graph_scope", "block"},
      {"--enable-cuda-graph", ""},
      {"--vision-cuda-graph-impl=local", ""},
      {"--max-vision-cuda-graph-seq-length", "2048"},
  });
  GraphConfigs cfg = parse_graph_configs(input);
  finalize_graph_configs(cfg, dense_model());
  EXPECT_EQ(cfg.language.impl, GraphImpl::local);
  EXPECT_EQ(cfg.language.modules, (Modules{GraphModule::attn, GraphModule::mlp}));
  EXPECT_EQ(cfg.language.inference_scope, InferenceGraphScope::block);
  EXPECT_EQ(cfg.vision.impl, VisionGraphImpl::local);
  EXPECT_EQ(cfg.vision.buckets, (std::vector<int64_t>{256, 512, 1024, 2048}));
  expect_one_warning(cfg, {"enable_cuda_graph"});
}

TEST(GraphConfigFlags, ValueRequiredExceptForDeprecatedBooleans) {
  try {
    graph_config_input_from_flags({{"--cuda-graph-impl", ""}});
    ADD_FAILURE() << "a flag without value was accepted";
  } catch (const Error& e) {
    expect_mentions(e.what(), {"--cuda-graph-impl", "needs a value"});
  }
  try {
    graph_config_input_from_flags({{"--cuda-graph-imlp", "local"}});
    ADD_FAILURE() << "an unknown flag was accepted";
  } catch (const Error& e) {
    expect_mentions(e.what(), {"--cuda-graph-imlp", "did you mean 'cuda_graph_impl'"});
  }
  const GraphConfigInput external = graph_config_input_from_flags({{"--external-cuda-graph", ""}});
  ASSERT_EQ(external.size(), 1u);
  EXPECT_EQ(external[0], (std::pair<std::string, std::string>{"external_cuda_graph", "true"}));
}

TEST(GraphConfigFlags, KeysAndFlagNames) {
  const auto& keys = graph_config_keys();
  EXPECT_EQ(keys.size(), 14u);
  for (const auto& k : keys) {
    EXPECT_EQ(graph_config_flag_name(k).rfind("--", 0), 0u);
    EXPECT_EQ(graph_config_flag_name(k).find('_'), std::string::npos);
  }
  EXPECT_EQ(graph_config_flag_name("max_vision_cuda_graph_seq_length"),
            "--max-vision-cuda-graph-seq-length");
  EXPECT_FALSE(is_deprecated_graph_config_key("cuda_graph_modules"));
  EXPECT_TRUE(is_deprecated_graph_config_key("cuda_graph_scope"));
  EXPECT_TRUE(is_deprecated_graph_config_key("--enable-cuda-graph"));
  EXPECT_THROW(is_deprecated_graph_config_key("cuda_graph"), Error);
}

TEST(GraphConfigFlags, HelpNamesValuesAndDefaults) {
  for (const auto& k : graph_config_keys()) {
    const std::string help = graph_config_key_help(k);
    EXPECT_EQ(help.rfind("deprecated", 0) == 0, is_deprecated_graph_config_key(k))
        << k << ": " << help;
    // Every value a doc's type names parses.
    const GraphKeyDoc doc = graph_config_key_doc(k);
    if (doc.type.rfind("one of ", 0) == 0 && !is_deprecated_graph_config_key(k)) {
      std::string values = doc.type.substr(7);
      for (size_t at = 0; at <= values.size();) {
        const size_t bar = std::min(values.find('|', at), values.size());
        const std::string value = values.substr(at, bar - at);
        GraphConfigInput in = {{k, value}};
        // A decoder scope other than none needs impl local.
        if (k == "inference_cuda_graph_scope" && value != "none")
          in.insert(in.begin(), {"cuda_graph_impl", "local"});
        EXPECT_NO_THROW(parse_graph_configs(in)) << k << "=" << value;
        at = bar + 1;
      }
    }
  }
  auto expect_mentions = [](const std::string& key, std::vector<std::string> words) {
    const std::string help = graph_config_key_help(key);
    for (const auto& w : words) EXPECT_NE(help.find(w), std::string::npos) << key << ": " << help;
  };
  expect_mentions("cuda_graph_impl", {"one of none|local|full_iteration, default none"});
  expect_mentions("--vision-cuda-graph-impl", {"one of none|local, default none"});
  expect_mentions("cuda_graph_modules", {"list of attn|mlp|moe|moe_router|moe_preprocess"});
  expect_mentions("vision_cuda_graph_modules", {"list of attn|mlp, default []"});
  expect_mentions("inference_cuda_graph_scope", {"one of none|layer|block"});
  expect_mentions("vision_inference_cuda_graph_scope", {"one of layer|block, default block"});
  expect_mentions("vision_cuda_graph_overflow", {"one of eager|error, default eager"});
  expect_mentions("vision_cuda_graph_buckets", {"powers of two from 256"});
  expect_mentions("cuda_graph_warmup_steps", {"integer, default 3"});
  EXPECT_THROW(graph_config_key_help("cuda_graph"), Error);
}

// ---------------------------------------------------------------------------------------------
// Bucket choice at run time

TEST(GraphConfigBuckets, ChooseVisionBucketEdges) {
  GraphConfigs cfg = parse_graph_configs(
      {{"vision_cuda_graph_impl", "local"}, {"max_vision_cuda_graph_seq_length", "1000"}});
  finalize_graph_configs(cfg, dense_model());
  const VisionGraphConfig& v = cfg.vision;
  EXPECT_EQ(choose_vision_bucket(v, 1), 256);
  EXPECT_EQ(choose_vision_bucket(v, 256), 256);  // exact bucket
  EXPECT_EQ(choose_vision_bucket(v, 257), 512);  // one above
  EXPECT_EQ(choose_vision_bucket(v, 512), 512);
  EXPECT_EQ(choose_vision_bucket(v, 513), 1000);
  EXPECT_EQ(choose_vision_bucket(v, 1000), 1000);             // the maximum itself
  EXPECT_EQ(choose_vision_bucket(v, 1001), std::nullopt);     // above the maximum
  EXPECT_EQ(choose_vision_bucket(v, 1 << 20), std::nullopt);  // far above
}

TEST(GraphConfigBuckets, ChooseVisionBucketNeedsFinalizedBucketsAndPositiveCount) {
  const GraphConfigs raw = parse_graph_configs({{"vision_cuda_graph_impl", "local"}});
  try {
    choose_vision_bucket(raw.vision, 100);
    ADD_FAILURE() << "unfinalized buckets were accepted";
  } catch (const Error& e) {
    expect_mentions(e.what(), {"finalize_graph_configs"});
  }
  GraphConfigs cfg = parse_graph_configs({{"vision_cuda_graph_buckets", "256"}});
  EXPECT_THROW(choose_vision_bucket(cfg.vision, 0), Error);
}

}  // namespace
}  // namespace iris
