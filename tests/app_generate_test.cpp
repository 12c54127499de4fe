// `iris generate` end to end through the binary: HF greedy tokens, and clear errors (non-zero
// exit, a message naming the problem, never a crash) for bad models and bad images.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "test_util.h"
#include "vision/image.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

RunResult run_iris(const std::string& args) {
  const fs::path dir = test::scratch_dir();
  const std::string out = (dir / "out").string(), err = (dir / "err").string();
  const std::string cmd = std::string(IRIS_BINARY) + " " + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

std::string q(const std::string& s) {
  return "'" + s + "'";
}

std::vector<int32_t> tokens_of(const std::string& json_line) {
  const auto j = nlohmann::json::parse(json_line);
  return j.at("tokens").get<std::vector<int32_t>>();
}

// A scratch copy of the fixture whose files a test may break.
class ScratchModel {
 public:
  ScratchModel() {
    dir_ = fs::temp_directory_path() /
           ("iris_model_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* f : {"config.json", "preprocessor_config.json", "tokenizer_config.json",
                          "generation_config.json", "model.safetensors", "tokenizer.json"})
      fs::copy_file(fs::path(test::fixture_dir()) / f, dir_ / f);
  }
  ~ScratchModel() { fs::remove_all(dir_); }
  std::string path(const std::string& f = "") const { return (dir_ / f).string(); }

  // Rewrites model.safetensors with `edit` applied to the list of tensors.
  void rewrite_weights(const std::function<void(std::vector<SafetensorsWriteItem>&)>& edit) {
    const std::string src = (fs::path(test::fixture_dir()) / "model.safetensors").string();
    SafetensorsFile f(src);
    std::vector<SafetensorsWriteItem> items;
    for (const auto& [name, e] : f.entries()) items.push_back({name, e.dtype, e.shape, e.data});
    edit(items);
    write_safetensors(path("model.safetensors"), items);
  }

 private:
  fs::path dir_;
  static inline int counter_ = 0;
};

const std::string kGreedy = " --temp 0 -n 12 --json --device cpu";

TEST(AppGenerate, MultimodalGreedyMatchesHF) {
  test::Golden g;
  const std::string img = test::fixture_dir() + "/images/";
  const RunResult r = run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                               q(img + "image0.png") + " --image " + q(img + "image1.png") +
                               " -p 'Describe these two pictures.'" + kGreedy);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["mm_greedy_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(nlohmann::json::parse(r.out)["text"], g.json()["mm_greedy_text"]);
}

TEST(AppGenerate, TextGreedyMatchesHF) {
  test::Golden g;
  const RunResult r = run_iris("generate -m " + q(test::fixture_dir()) +
                               " -p 'Write one sentence about CUDA graphs.'" + kGreedy);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_tokens"], 15);
  EXPECT_TRUE(j["timings"].contains("decode_tokens_per_s"));
}

TEST(AppGenerate, StreamsTextAndPrintsTimings) {
  const RunResult r =
      run_iris("generate -m " + q(test::fixture_dir()) +
               " -p 'Write one sentence about CUDA graphs.' --temp 0 -n 4 --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  for (const char* field : {"load", "preprocess", "vision encode", "prefill", "decode"})
    EXPECT_NE(r.err.find(field), std::string::npos) << field;
}

TEST(AppGenerate, SeededSamplingIsReproducible) {
  const std::string args = "generate -m " + q(test::fixture_dir()) +
                           " -p 'hello' -n 8 --temp 1.0 --seed 7 --json --device cpu";
  const RunResult a = run_iris(args), b = run_iris(args);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(tokens_of(a.out), tokens_of(b.out));
}

TEST(AppGenerate, HelpListsFlagsWithDefaults) {
  const RunResult r = run_iris("generate --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag :
       {"--model", "--image", "--prompt", "--n-predict", "--temp", "--top-k", "--top-p", "--seed",
        "--json", "--cuda-graph-impl", "--vision-cuda-graph-buckets", "--no-cuda-graphs"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  EXPECT_NE(r.out.find("INT=128"), std::string::npos);
  // Graph flags say what they take, not only that they are graph settings.
  EXPECT_NE(r.out.find("one of none|local|full_iteration"), std::string::npos) << r.out;
}

void expect_error(const RunResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.exit_code, 128) << "crashed: " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
}

TEST(AppGenerateErrors, MissingModelDirectory) {
  expect_error(run_iris("generate -m /nonexistent/model -p hi --device cpu"), "does not exist");
}

TEST(AppGenerateErrors, UnknownModelType) {
  ScratchModel m;
  std::string cfg = slurp(m.path("config.json"));
  cfg.replace(cfg.find("\"qwen3_vl\""), 10, "\"llama_xx\"");
  std::ofstream(m.path("config.json")) << cfg;
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "llama_xx");
}

TEST(AppGenerateErrors, TruncatedSafetensors) {
  ScratchModel m;
  fs::resize_file(m.path("model.safetensors"), fs::file_size(m.path("model.safetensors")) / 2);
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "truncated");
}

TEST(AppGenerateErrors, HeaderOffsetsOverlap) {
  ScratchModel m;
  // Two tensors pointing at the same bytes: a corrupt header.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  std::string blob(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(blob.data(), &n, 8);
  blob += header + std::string(12, '\0');
  std::ofstream(m.path("model.safetensors"), std::ios::binary) << blob;
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "overlap");
}

TEST(AppGenerateErrors, HeaderOffsetsPastTheFile) {
  ScratchModel m;
  const std::string header = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  std::string blob(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(blob.data(), &n, 8);
  blob += header + std::string(8, '\0');
  std::ofstream(m.path("model.safetensors"), std::ios::binary) << blob;
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "run past");
}

TEST(AppGenerateErrors, WrongShape) {
  ScratchModel m;
  m.rewrite_weights([](std::vector<SafetensorsWriteItem>& items) {
    for (auto& it : items)
      if (it.name == "model.language_model.norm.weight") it.shape = {32};  // half the bytes
  });
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"),
               "model.language_model.norm.weight");
}

TEST(AppGenerateErrors, WrongDtype) {
  ScratchModel m;
  std::vector<int32_t> ints(64, 1);
  m.rewrite_weights([&](std::vector<SafetensorsWriteItem>& items) {
    for (auto& it : items)
      if (it.name == "model.language_model.norm.weight") {
        it.dtype = DType::i32;
        it.data = ints.data();
      }
  });
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "dtype");
}

TEST(AppGenerateErrors, MissingTensor) {
  ScratchModel m;
  m.rewrite_weights([](std::vector<SafetensorsWriteItem>& items) {
    std::erase_if(
        items, [](const auto& it) { return it.name == "model.visual.blocks.1.attn.qkv.weight"; });
  });
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"),
               "missing tensor 'model.visual.blocks.1.attn.qkv.weight'");
}

TEST(AppGenerateErrors, ImageDoesNotExist) {
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) +
                        " --image /nonexistent.png -p hi --device cpu"),
               "/nonexistent.png");
}

TEST(AppGenerateErrors, CorruptImage) {
  ScratchModel m;
  std::ofstream(m.path("bad.png"), std::ios::binary) << "\x89PNG\r\n\x1a\n garbage garbage";
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                        q(m.path("bad.png")) + " -p hi --device cpu"),
               "bad.png");
}

TEST(AppGenerateErrors, ExtremeAspectRatio) {
  ScratchModel m;
  ImageRGB8 img;
  img.width = 402;
  img.height = 2;
  img.pixels.assign(static_cast<size_t>(img.width * img.height * 3), 128);
  write_png(m.path("wide.png"), img);
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                        q(m.path("wide.png")) + " -p hi --device cpu"),
               "aspect ratio");
}

TEST(AppGenerateErrors, BadGraphConfigFailsOnCpuToo) {
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) +
                        " -p hi --device cpu --cuda-graph-impl bogus"),
               "bogus");
}

}  // namespace
}  // namespace iris
