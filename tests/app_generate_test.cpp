// `iris generate` end to end through the binary: HF greedy tokens, and clear errors (non-zero
// exit, a message naming the problem, never a crash) for bad models and bad images.
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "bridge/chat_prompt.h"
#include "bridge/generator.h"
#include "bridge/model_config.h"
#include "core/backend.h"
#include "core/safetensors.h"
#include "core/tuning_cache.h"
#include "language/tokenizer.h"
#include "test_util.h"
#include "video_test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/video_decode.h"

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

// `input` is the run's stdin (a chat's messages when there is no -p); empty: end of input at once.
RunResult run_iris(const std::string& args, const std::string& input = "") {
  const fs::path dir = test::scratch_dir();
  const std::string out = (dir / "out").string(), err = (dir / "err").string(),
                    in = (dir / "in").string();
  std::ofstream(in, std::ios::binary) << input;
  // The time limit turns a run that blocks (on a FIFO, say) into a failure instead of a hang.
  const std::string cmd =
      "timeout 120 " + std::string(IRIS_BINARY) + " " + args + " <" + in + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// Runs a shell command (not iris), for facts the tests compare iris's output with.
RunResult run_iris_shell(const std::string& cmd) {
  const fs::path dir = test::scratch_dir();
  const std::string out = (dir / "shell_out").string();
  const int status = std::system((cmd + " >" + out + " 2>/dev/null").c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
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

std::string fixture_generate() {
  return "generate -m " + q(test::fixture_dir());
}
const std::string kCudaPrompt = " -p 'Write one sentence about CUDA graphs.'";

void expect_error(const RunResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.exit_code, 128) << "crashed: " << r.err;
  EXPECT_NE(r.exit_code, 124) << "timed out (blocked on input?): " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  // Messages are for users: no source paths of the build, no library exception codes.
  EXPECT_EQ(r.err.find(".cpp:"), std::string::npos) << "stderr: " << r.err;
  EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << "stderr: " << r.err;
}

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

// Qwen2.5-VL and Qwen2-VL end to end: the PNGs through Iris's preprocessing (CLIP
// normalisation, 14-pixel patches), the checkpoint's Qwen2-VL chat template with its default
// system prompt, and the model, against HF's greedy ids from the processor's pixel values.
TEST(AppGenerate, OtherFamiliesMultimodalGreedyMatchesHF) {
  for (const char* family : {"qwen25vl-tiny", "qwen2vl-tiny"}) {
    SCOPED_TRACE(family);
    const std::string dir = test::data_dir() + "/" + family;
    const test::Golden g(dir);
    const RunResult r = run_iris(
        "generate -m " + q(dir) + " --image " + q(dir + "/images/image0.png") + " --image " +
        q(dir + "/images/image1.png") + " -p 'Describe these two pictures.'" + kGreedy);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(tokens_of(r.out), g.json()["mm_greedy_ids"].get<std::vector<int32_t>>());
    const RunResult t =
        run_iris("generate -m " + q(dir) + " -p 'Write one sentence about CUDA graphs.'" + kGreedy);
    ASSERT_EQ(t.exit_code, 0) << t.err;
    EXPECT_EQ(tokens_of(t.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
  }
}

// tools/make_video_golden.py's frames, written to a lossless file that iris generate decodes.
std::string write_formula_video(const fs::path& dir) {
  const std::string path = (dir / "clip.mkv").string();
  write_lossless_video(path, test::formula_frames(), test::kFormulaFps);
  return path;
}

// HF's greedy ids up to the first one the tokenizer has no token for: HF's argmax may pick one of
// the embedding table's padding rows (151,936 rows for 151,669 tokens), which iris generate
// never samples (sampleable_ids), so the runs part there.
std::vector<int32_t> sampleable_prefix(const std::vector<int32_t>& ids, const std::string& dir) {
  const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  std::vector<int32_t> out;
  for (int32_t id : ids) {
    if (id >= tok.vocab_size()) break;
    out.push_back(id);
  }
  return out;
}

std::vector<int32_t> first_n(std::vector<int32_t> ids, size_t n) {
  if (ids.size() > n) ids.resize(n);
  return ids;
}

TEST(AppGenerate, VideoAndMixedPromptsGreedyMatchHFForEveryFamily) {
  if (!video_decoding_available()) GTEST_SKIP() << "this build has no video decoding (OpenCV)";
  const fs::path tmp = fs::temp_directory_path() / ("iris_app_video_" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const std::string video = write_formula_video(tmp);
  for (const char* family : {"qwen3vl-tiny", "qwen25vl-tiny", "qwen2vl-tiny"}) {
    SCOPED_TRACE(family);
    const std::string dir = test::data_dir() + "/" + family;
    const auto g = nlohmann::json::parse(read_text_file(dir + "/golden_video.json"));
    const std::string greedy = " --temp 0 -n 8 --ignore-eos --json --device cpu";
    const RunResult r = run_iris("generate -m " + q(dir) + " --video " + q(video) +
                                 " -p 'Describe this video.'" + greedy);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto want_video = sampleable_prefix(g["video.greedy_ids"], dir);
    EXPECT_GE(want_video.size(), 4u);
    EXPECT_EQ(first_n(tokens_of(r.out), want_video.size()), want_video);
    // Markers take the media in the order given on the command line.
    const RunResult m = run_iris(
        "generate -m " + q(dir) + " --image " + q(dir + "/images/image0.png") + " --video " +
        q(video) + " -p '<__media__><__media__>Compare the picture with the video.'" + greedy);
    ASSERT_EQ(m.exit_code, 0) << m.err;
    const auto want_mixed = sampleable_prefix(g["mixed.greedy_ids"], dir);
    EXPECT_GE(want_mixed.size(), 4u);
    EXPECT_EQ(first_n(tokens_of(m.out), want_mixed.size()), want_mixed);
    const RunResult m2 =
        run_iris("generate -m " + q(dir) + " --image " + q(dir + "/images/image0.png") +
                 " --video " + q(video) + " -p 'Compare the picture with the video.'" + greedy);
    ASSERT_EQ(m2.exit_code, 0) << m2.err;
    EXPECT_EQ(first_n(tokens_of(m2.out), want_mixed.size()), want_mixed);
  }
  fs::remove_all(tmp);
}

TEST(AppGenerate, BadVideosAreErrorsNamingTheFile) {
  const std::string dir = test::data_dir() + "/qwen25vl-tiny";
  const RunResult missing =
      run_iris("generate -m " + q(dir) + " --video /nonexistent/clip.mp4 -p hi --device cpu");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("/nonexistent/clip.mp4"), std::string::npos) << missing.err;
  const fs::path tmp =
      fs::temp_directory_path() / ("iris_app_badvideo_" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const std::string text = (tmp / "notes.mp4").string();
  std::ofstream(text) << "not a video\n";
  const RunResult bad = run_iris("generate -m " + q(dir) + " --video " + q(text) + " -p hi");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find(text), std::string::npos) << bad.err;
  EXPECT_EQ(bad.err.find("Aborted"), std::string::npos) << bad.err;
  if (video_decoding_available()) {
    // More tokens than the context: refused from the metadata, before any frame is decoded.
    const std::string video = write_formula_video(tmp);
    const RunResult big = run_iris("generate -m " + q(dir) + " --video " + q(video) +
                                   " --video-fps 12 -c 64 -p hi --device cpu");
    EXPECT_NE(big.exit_code, 0);
    EXPECT_NE(big.err.find("--video-fps"), std::string::npos) << big.err;
    EXPECT_NE(big.err.find(video), std::string::npos) << big.err;
  }
  fs::remove_all(tmp);
}

// iris bench's --config: a file, or a name in bench/configs/ looked for from the working
// directory and from the source tree beside the binary's build folder.
TEST(AppBench, ConfigNamesAreLookedForInBenchConfigs) {
  const RunResult r = run_iris("bench --config qwen3vl_no_such --device cpu");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--config qwen3vl_no_such does not exist (looked for "
                       "bench/configs/qwen3vl_no_such.json, "),
            std::string::npos)
      << r.err;
  const std::string beside =
      (fs::path(IRIS_BINARY).parent_path().parent_path() / "bench/configs/qwen3vl_2b.json")
          .lexically_normal()
          .string();
  EXPECT_TRUE(fs::is_regular_file(beside)) << beside;
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
  // The load's parts: the tokenizer parses beside the weights, so neither exceeds the whole.
  const auto& t = j["timings"];
  for (const char* part : {"device_init_ms", "tokenizer_ms", "weights_read_ms"}) {
    ASSERT_TRUE(t.contains(part)) << part;
    EXPECT_GE(t[part].get<double>(), 0.0) << part;
    EXPECT_LE(t[part].get<double>(), t["load_ms"].get<double>()) << part;
  }
  EXPECT_GT(t["tokenizer_ms"].get<double>(), 0.0);
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
  EXPECT_NE(r.out.find("Images: PNG, JPEG, WebP, TIFF, BMP, GIF, TGA, PNM; turned upright by their "
                       "EXIF orientation"),
            std::string::npos)
      << r.out;
}

// A lossless WebP, a WebP stored turned with EXIF orientation 6 and a PNG stored transposed with
// orientation 5 (fuzz seeds: tools/make_image_format_golden.py's formula image) reach the model
// as the same upright pixels: the same logits after the prompt, bit for bit. (Turned or not, the
// three give the same token count; the logits tell the pixels apart.)
TEST(AppGenerate, ImageFormatsAndOrientationGiveTheSameLogits) {
  ScratchModel m;
  const std::string seeds = test::data_dir() + "/fuzz/image/";
  std::vector<std::string> logits;
  for (const char* file : {"small.webp", "exif_orient6.webp", "exif_orient5.png"}) {
    const std::string out = m.path(std::string(file) + ".logits.safetensors");
    const RunResult r =
        run_iris(fixture_generate() + " --image " + q(seeds + file) + " --logits-out " + q(out) +
                 " -p 'Describe this picture.' --temp 0 -n 1 --json --device cpu");
    ASSERT_EQ(r.exit_code, 0) << file << ": " << r.err;
    logits.push_back(slurp(out));
  }
  ASSERT_FALSE(logits[0].empty());
  EXPECT_TRUE(logits[1] == logits[0]);
  EXPECT_TRUE(logits[2] == logits[0]);
}

// Everyday flags first, then groups; one line per flag, within 100 columns.
TEST(AppGenerate, HelpIsGroupedOneLineEach) {
  const std::string help = run_iris("generate --help").out;
  size_t last = 0;
  for (const char* in_order :
       {"--model", "--prompt", "--temp", "--json", "Less common:", "--max-image-pixels",
        "llama-mtmd-cli flags with no effect here:", "--n-gpu-layers", "CUDA graphs",
        "--no-cuda-graphs"}) {
    const size_t at = help.find(in_order);
    ASSERT_NE(at, std::string::npos) << in_order << "\n" << help;
    EXPECT_GT(at, last) << in_order << " is out of order\n" << help;
    last = at;
  }
  std::istringstream lines(help);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_LE(line.size(), 100u) << line;
    EXPECT_NE(line.rfind("        ", 0), 0u) << "a flag's help runs onto a second line: " << line;
  }
  // Graph flags show the default that applies when none of them is given.
  for (const char* shown :
       {"--cuda-graph-impl TEXT=local ", "--inference-cuda-graph-scope TEXT=block ",
        "--vision-cuda-graph-impl TEXT=local ", "--cuda-graph-warmup-steps INT=3 ",
        "--vision-cuda-graph-overflow TEXT=eager "})
    EXPECT_NE(help.find(shown), std::string::npos) << shown << "\n" << help;
  // Deprecated and training-only keys are not listed but still accepted (with a warning).
  for (const char* hidden :
       {"--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-scope",
        "--vision-cuda-graph-scope", "--cuda-graph-modules", "--vision-cuda-graph-modules"})
    EXPECT_EQ(help.find(hidden), std::string::npos) << hidden;
  const RunResult deprecated =
      run_iris(fixture_generate() + " -p hi -n 1 --json --device cpu --enable-cuda-graph");
  EXPECT_EQ(deprecated.exit_code, 0) << deprecated.err;
  EXPECT_NE(deprecated.err.find("deprecated"), std::string::npos) << deprecated.err;
  const RunResult training =
      run_iris(fixture_generate() + " -p hi -n 1 --json --device cpu --cuda-graph-modules attn");
  EXPECT_EQ(training.exit_code, 0) << training.err;
}

// A graph flag changes its own key; the other defaults stay (they are checked on every device).
TEST(AppGenerate, GraphFlagsKeepTheOtherDefaults) {
  const std::string base = fixture_generate() + " -p hi -n 1 --json --device cpu ";
  // With the default impl local, a decode scope of none is refused as it would be on a GPU.
  expect_error(run_iris(base + "--inference-cuda-graph-scope none"),
               "inference_cuda_graph_scope 'none' is not allowed with cuda_graph_impl 'local'");
  for (const char* fine : {"--cuda-graph-impl full_iteration", "--cuda-graph-impl none",
                           "--vision-cuda-graph-overflow error", "--no-cuda-graphs"}) {
    const RunResult r = run_iris(base + fine);
    EXPECT_EQ(r.exit_code, 0) << fine << ": " << r.err;
  }
}

TEST(AppCli, VersionPrintsCommitAndBuild) {
  const RunResult r = run_iris("--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("iris ", 0), 0u) << r.out;
  EXPECT_TRUE(r.out.find("CUDA off (CPU only)") != std::string::npos ||
              r.out.find("CUDA on (toolkit") != std::string::npos)
      << r.out;
  // The commit the binary was built from: one of this tree's history (HEAD itself in CI, where
  // nothing is committed between the build and the tests; an ancestor of it when a developer has
  // committed since building).
  const std::string src = fs::path(IRIS_TEST_DATA_DIR).parent_path().parent_path().string();
  if (run_iris_shell("git -C " + q(src) + " rev-parse HEAD").exit_code != 0) return;
  const size_t at = r.out.find("commit ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string commit = r.out.substr(at + 7, 12);
  EXPECT_EQ(commit.find_first_not_of("0123456789abcdef"), std::string::npos) << r.out;
  EXPECT_EQ(run_iris_shell("git -C " + q(src) + " merge-base --is-ancestor " + commit + " HEAD")
                .exit_code,
            0)
      << commit << " is not in this tree's history";
}

TEST(AppCli, MistypedCommandSuggestsTheClosest) {
  const RunResult r = run_iris("genrate -m x");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown command 'genrate'; did you mean 'generate'?"), std::string::npos)
      << r.err;
  EXPECT_EQ(run_iris("xyzzy").err.find("did you mean"), std::string::npos);
}

// Edits the scratch model's config.json.
void edit_config(const ScratchModel& m, const std::function<void(nlohmann::json&)>& edit) {
  auto j = nlohmann::json::parse(slurp(m.path("config.json")));
  edit(j);
  std::ofstream(m.path("config.json"), std::ios::trunc) << j.dump(2);
}

// A PNG whose header claims width x height; its (absent) pixel data never gets read when the size
// is refused from the header.
std::string png_header_only(uint32_t width, uint32_t height) {
  std::string s = "\x89PNG\r\n\x1a\n";
  auto be32 = [&](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>(v >> shift));
  };
  be32(13);
  s += "IHDR";
  be32(width);
  be32(height);
  s += std::string("\x08\x00\x00\x00\x00", 5);  // 8-bit grey
  be32(0);                                      // CRC (stb does not check it)
  return s;
}

// llama-mtmd-cli's <__media__> marker: markers ahead of the text give HF's images-first prompt.
TEST(AppGenerate, MediaMarkersPlaceTheImages) {
  test::Golden g;
  const std::string img = test::fixture_dir() + "/images/";
  const std::string images =
      " --image " + q(img + "image0.png") + " --image " + q(img + "image1.png");
  const RunResult r =
      run_iris("generate -m " + q(test::fixture_dir()) + images +
               " -p '<__media__><__media__>Describe these two pictures.'" + kGreedy);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["mm_greedy_ids"].get<std::vector<int32_t>>());
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + images +
                        " -p 'Compare <__media__>.' --device cpu"),
               "the prompt has 1 <__media__> marker but 2 images were given");
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

// A weights file that is a symbolic link loop names the file and the system's reason, with exit
// code 1, not an "unexpected error" from the library.
TEST(AppGenerateErrors, WeightsThatAreALinkLoop) {
  ScratchModel m;
  fs::remove(m.path("model.safetensors"));
  fs::create_symlink(m.path("model.safetensors"), m.path("model.safetensors"));
  const RunResult r = run_iris("generate -m " + q(m.path()) + " -p hi --device cpu");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.find("unexpected"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(m.path("model.safetensors") + ": Too many levels of symbolic links"),
            std::string::npos)
      << r.err;
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

TEST(AppGenerateErrors, DeeplyNestedConfigIsAnErrorNotACrash) {
  ScratchModel m;
  std::string cfg = slurp(m.path("config.json"));
  const std::string key = "\"hidden_size\": 64";
  cfg.replace(cfg.find(key), key.size(),
              "\"hidden_size\": " + std::string(200000, '[') + std::string(200000, ']'));
  std::ofstream(m.path("config.json"), std::ios::trunc) << cfg;
  const RunResult r = run_iris("generate -m " + q(m.path()) + " -p hi --device cpu");
  expect_error(r, "levels deep");
  EXPECT_LT(r.err.size(), 400u) << "the message quotes the document";
}

TEST(AppGenerateErrors, FifosAreRefusedNotWaitedOn) {
  for (const char* name : {"config.json", "model.safetensors", "tokenizer.json"}) {
    ScratchModel m;
    fs::remove(m.path(name));
    ASSERT_EQ(::mkfifo(m.path(name).c_str(), 0600), 0);
    expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), "FIFO");
  }
  ScratchModel m;
  ASSERT_EQ(::mkfifo(m.path("image.png").c_str(), 0600), 0);
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                        q(m.path("image.png")) + " -p hi --device cpu"),
               "FIFO");
}

TEST(AppGenerateErrors, HugeImagesAreRefusedFromTheirHeader) {
  ScratchModel m;
  // 30,000 x 30,000 once took 17 s and 4.6 GB before an unrelated error.
  std::ofstream(m.path("huge.png"), std::ios::binary) << png_header_only(30000, 30000);
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                        q(m.path("huge.png")) + " -p hi --device cpu"),
               "900000000 pixels, more than the limit of 178956970");
  // The limit is a setting.
  expect_error(run_iris("generate -m " + q(test::fixture_dir()) + " --image " +
                        q(test::fixture_dir() + "/images/image0.png") +
                        " -p hi --device cpu --max-image-pixels 100"),
               "--max-image-pixels");
}

TEST(AppGenerateErrors, ConfigValuesAreTypedAndRangeChecked) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string needle;
  };
  const std::vector<Case> cases{
      {[](auto& j) { j["text_config"]["intermediate_size"] = 0; },
       "text_config.intermediate_size = 0 is out of range"},
      {[](auto& j) { j["text_config"]["hidden_size"] = 64.9; },
       "text_config.hidden_size must be an integer, got 64.9"},
      {[](auto& j) { j["text_config"]["vocab_size"] = 1e12; },
       "text_config.vocab_size = 1000000000000.0 is out of range"},
      {[](auto& j) { j["text_config"]["rope_parameters"]["rope_theta"] = 0; },
       "rope_theta = 0 is out of range"},
      {[](auto& j) { j["text_config"]["rms_norm_eps"] = -1e-6; }, "rms_norm_eps = -1e-06"},
      {[](auto& j) { j["text_config"]["num_hidden_layers"] = 2; },
       "does not describe, e.g. 'model.language_model.layers.2."},
      {[](auto& j) {
         j["vision_config"]["deepstack_visual_indexes"] = {0, 0};
       },
       "deepstack_visual_indexes must be strictly increasing"},
      // Once reported as a CUDA graph setting on the CPU.
      {[](auto& j) { j["vision_config"]["spatial_merge_size"] = 0; },
       "vision_config.spatial_merge_size = 0 is out of range"},
      {[](auto& j) { j["text_config"]["hidden_act"] = 1; },
       "text_config.hidden_act must be a string"},
  };
  for (const Case& c : cases) {
    ScratchModel m;
    edit_config(m, c.edit);
    const RunResult r = run_iris("generate -m " + q(m.path()) + " -p hi --device cpu");
    expect_error(r, c.needle);
    EXPECT_NE(r.err.find("config.json"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("cuda_graph"), std::string::npos) << r.err;
  }
}

TEST(AppGenerateErrors, PreprocessorDisagreeingWithTheModelIsAnError) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, int>>{
           {"patch_size", 8}, {"patch_size", 32}, {"temporal_patch_size", 1}, {"merge_size", 1}}) {
    ScratchModel m;
    auto p = nlohmann::json::parse(slurp(m.path("preprocessor_config.json")));
    p[key] = value;
    std::ofstream(m.path("preprocessor_config.json"), std::ios::trunc) << p.dump();
    expect_error(run_iris("generate -m " + q(m.path()) + " --image " +
                          q(test::fixture_dir() + "/images/image0.png") + " -p hi --device cpu"),
                 key + " is " + std::to_string(value) + " but");
  }
}

TEST(AppGenerateErrors, MistypedSideFilesNameTheFileAndKey) {
  ScratchModel m;
  std::ofstream(m.path("generation_config.json"), std::ios::trunc)
      << R"({"eos_token_id": [151645, "x"]})";
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"),
               "generation_config.json: eos_token_id.[1] must be an integer");
}

// llama-mtmd-cli's spellings of what iris does, and its flags that mean nothing here.

TEST(AppGenerateLlamaFlags, TemperatureIsTemp) {
  test::Golden g;
  const RunResult r =
      run_iris(fixture_generate() + kCudaPrompt + " --temperature 0 -n 12 --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
}

TEST(AppGenerateLlamaFlags, TheLastOfARepeatedFlagWins) {
  test::Golden g;
  const RunResult r = run_iris(fixture_generate() + kCudaPrompt +
                               " --temp 0.9 --temp 0 -n 5 -n 12 --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
}

TEST(AppGenerateLlamaFlags, MinusOneTokensRunsUntilTheContextIsFull) {
  const RunResult r = run_iris(fixture_generate() + kCudaPrompt +
                               " -n -1 -c 40 --temp 0 --ignore-eos --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_tokens"].get<int64_t>() + static_cast<int64_t>(tokens_of(r.out).size()), 40);
  expect_error(run_iris(fixture_generate() + kCudaPrompt + " -n -2 --device cpu"),
               "-n/--n-predict -2 must be -1 (until the context is full) or at least 0");
}

TEST(AppGenerateLlamaFlags, PresencePenaltyChangesTheGreedyReplyAndJinjaIsANote) {
  // The Qwen2-VL fixture's greedy text reply repeats tokens (37848 five times).
  const std::string dir = test::data_dir() + "/qwen2vl-tiny";
  const test::Golden g(dir);
  const std::vector<int32_t> plain = g.json()["text_greedy_ids"].get<std::vector<int32_t>>();
  std::vector<int32_t> plain_sorted = plain;
  std::sort(plain_sorted.begin(), plain_sorted.end());
  ASSERT_NE(std::adjacent_find(plain_sorted.begin(), plain_sorted.end()), plain_sorted.end());
  const RunResult r = run_iris("generate -m " + q(dir) + kCudaPrompt +
                               " --presence-penalty 100 --jinja --no-warmup --temp 0 -n 12 "
                               "--ignore-eos --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<int32_t> got = tokens_of(r.out);
  ASSERT_EQ(got.size(), 12u);
  // A penalty of 100 forbids any repeat within the reply; the first token is the plain one.
  EXPECT_EQ(got[0], plain[0]);
  std::vector<int32_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_EQ(nlohmann::json::parse(r.out)["sampling"]["presence_penalty"], 100.0);
  EXPECT_NE(r.err.find("note: --jinja has no effect"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("note: --no-warmup has no effect"), std::string::npos) << r.err;
}

TEST(AppGenerateLlamaFlags, SystemPromptSpellings) {
  const std::string base = fixture_generate() + " -p hi -n 3 --temp 0 --json --device cpu ";
  const RunResult plain = run_iris(base);
  const RunResult system = run_iris(base + "--system 'Be brief.'");
  ASSERT_EQ(system.exit_code, 0) << system.err;
  const auto prompt_tokens = [](const RunResult& r) {
    return nlohmann::json::parse(r.out)["prompt_tokens"].get<int>();
  };
  EXPECT_GT(prompt_tokens(system), prompt_tokens(plain));
  for (const char* spelling : {"-sys", "--system-prompt"}) {
    const RunResult r = run_iris(base + spelling + " 'Be brief.'");
    ASSERT_EQ(r.exit_code, 0) << spelling << ": " << r.err;
    EXPECT_EQ(prompt_tokens(r), prompt_tokens(system)) << spelling;
    EXPECT_EQ(tokens_of(r.out), tokens_of(system.out)) << spelling;
  }
}

TEST(AppGenerateLlamaFlags, PromptFromFile) {
  test::Golden g;
  ScratchModel m;
  std::ofstream(m.path("prompt.txt")) << "Write one sentence about CUDA graphs.\n";
  const RunResult r = run_iris(fixture_generate() + " -f " + q(m.path("prompt.txt")) +
                               " --temp 0 -n 12 --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
  expect_error(run_iris(fixture_generate() + " -f /nonexistent/prompt.txt --device cpu"),
               "/nonexistent/prompt.txt");
  expect_error(run_iris(fixture_generate() + " -f " + q(m.path("prompt.txt")) + " -p hi"),
               "excludes");
  // No prompt is a chat on stdin, which here ends at once: nothing to answer, nothing printed.
  const RunResult chat = run_iris(fixture_generate() + " --device cpu");
  EXPECT_EQ(chat.exit_code, 0) << chat.err;
  EXPECT_EQ(chat.out, "");
}

TEST(AppGenerateLlamaFlags, ContextSizeIsC) {
  expect_error(run_iris(fixture_generate() + kCudaPrompt + " -c 8 --device cpu"),
               "exceed the context of 8");
}

TEST(AppGenerateLlamaFlags, ThreadsSetTheCpuThreads) {
  test::Golden g;
  for (const char* spelling : {"-t", "--threads"}) {
    const RunResult r = run_iris(fixture_generate() + kCudaPrompt + " " + spelling +
                                 " 1 --temp 0 -n 12 --json --device cpu");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["threads"], 1);
    EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
  }
  expect_error(run_iris(fixture_generate() + " -p hi -t 0 --device cpu"), "--threads");
}

// The prompt's length says how many tokens the image took: the text-only prompt plus
// <|vision_start|>, the image's tokens and <|vision_end|>.
TEST(AppGenerateLlamaFlags, ImageTokenBudgetsBoundSmartResize) {
  const std::string image = test::fixture_dir() + "/images/image0.png";  // 200 x 150
  const std::string base = fixture_generate() + " -p hi -n 1 --temp 0 --json --device cpu";
  const RunResult text = run_iris(base);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  const int text_tokens = nlohmann::json::parse(text.out)["prompt_tokens"];
  const auto image_tokens = [&](const std::string& flags) {
    const RunResult r = run_iris(base + " --image " + q(image) + " " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["prompt_tokens"].get<int>() - text_tokens - 2;
  };
  // One token per 32x32 pixels (patch 16, merge 2); the fixture's bounds are [65536, 16777216].
  const auto expected = [](int64_t min_pixels, int64_t max_pixels) {
    const ResizedSize s = smart_resize(150, 200, 32, min_pixels, max_pixels);
    return static_cast<int>(s.height * s.width / 1024);
  };
  EXPECT_EQ(image_tokens(""), expected(65536, 16777216));
  const int at_most_4 = image_tokens("--image-max-tokens 4");
  EXPECT_EQ(at_most_4, expected(4096, 4096));
  EXPECT_LE(at_most_4, 4);
  const int at_least_100 = image_tokens("--image-min-tokens 100");
  EXPECT_EQ(at_least_100, expected(102400, 16777216));
  EXPECT_GE(at_least_100, 100);
  EXPECT_EQ(image_tokens("--image-min-tokens 6 --image-max-tokens 12"), expected(6144, 12288));
  expect_error(run_iris(base + " --image-min-tokens 12 --image-max-tokens 6"),
               "--image-min-tokens 12 is above --image-max-tokens 6");
}

// Token budgets are checked from the grid smart_resize gives, before any pixel is resized: an
// --image-min-tokens of 200000 with a 4096 context once took 5.6 GB, then said the prompt was too
// long.
TEST(AppGenerateLlamaFlags, ImageBudgetsAreCheckedBeforeAnyPixelWork) {
  const std::string image = test::fixture_dir() + "/images/image0.png";  // 200 x 150
  const std::string base = fixture_generate() + " -p hi -n 1 --temp 0 --device cpu";
  // No image can fit: refused up front, naming the flags (a quarter of the minimum is the most
  // smart_resize can take off an image, so 50000 tokens at least).
  RunResult r = run_iris(base + " -c 4096 --image " + q(image) + " --image-min-tokens 200000");
  expect_error(r,
               "--image-min-tokens 200000 gives every image at least 50000 tokens, more than "
               "the context holds (-c/--ctx-size 4096)");
  r = run_iris(base + " -c 8 --image " + q(image) + " --image-min-tokens 40 --image-max-tokens 60");
  expect_error(r,
               "--image-min-tokens 40 and --image-max-tokens 60 gives every image at least 15 "
               "tokens, more than the context holds (-c/--ctx-size 8)");
  // The chat plans for images that arrive later, so the same holds without --image.
  r = run_iris(fixture_generate() + " -n 1 --device cpu -c 4096 --image-min-tokens 200000", "hi\n");
  expect_error(r, "--image-min-tokens 200000 gives every image at least 50000 tokens");
  // Text-only runs are left alone.
  EXPECT_EQ(run_iris(base + " -c 4096 --image-min-tokens 200000").exit_code, 0);

  // Each image fits, both do not: the resized grids' tokens, image by image.
  const ResizedSize s = smart_resize(150, 200, 32, 40 * 1024, 16777216);
  const int tokens = s.height * s.width / 1024;
  ASSERT_LE(tokens, 64);
  r = run_iris(base + " -c 64 --image-min-tokens 40 --image " + q(image) + " --image " + q(image));
  expect_error(r, "the images need " + std::to_string(2 * tokens) +
                      " tokens at their resized sizes (" + image + ": " + std::to_string(tokens) +
                      ", " + image + ": " + std::to_string(tokens) +
                      "), more than the 64 tokens of the context (-c/--ctx-size 64)");
  // In a chat, an /image that cannot fit what is left is not attached; the chat goes on.
  r = run_iris(fixture_generate() + " -n 1 --temp 0 --device cpu -c 64 --image-min-tokens 40",
               "/image " + image + "\n/image " + image + "\nhi\n");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(
      r.err.find("the image needs " + std::to_string(tokens) + " tokens at their resized sizes (" +
                 image + ": " + std::to_string(tokens) + "), more than the " +
                 std::to_string(64 - tokens) + " tokens left in the context (-c/--ctx-size 64"),
      std::string::npos)
      << r.err;
}

TEST(AppGenerateLlamaFlags, GpuLayersAreAcceptedWithANote) {
  for (const char* spelling : {"-ngl 99", "--n-gpu-layers 99", "--gpu-layers 99"}) {
    const RunResult r =
        run_iris(fixture_generate() + " -p hi -n 1 --device cpu --json " + spelling);
    ASSERT_EQ(r.exit_code, 0) << spelling << ": " << r.err;
    EXPECT_NE(r.err.find("-ngl/--n-gpu-layers has no effect"), std::string::npos) << r.err;
  }
}

// The GEMM tuning cache's directory for the life of the object (the runs inherit it), so that the
// tests never touch the user's own cache.
class ScratchCacheDir {
 public:
  explicit ScratchCacheDir(const std::string& name) : dir_((test::scratch_dir() / name).string()) {
    fs::remove_all(dir_);
    if (const char* old = std::getenv("IRIS_CACHE_DIR")) old_ = old;
    ::setenv("IRIS_CACHE_DIR", dir_.c_str(), 1);
  }
  ~ScratchCacheDir() {
    if (old_)
      ::setenv("IRIS_CACHE_DIR", old_->c_str(), 1);
    else
      ::unsetenv("IRIS_CACHE_DIR");
  }
  std::string file() const { return dir_ + "/" + kGemmTuningFileName; }

 private:
  std::string dir_;
  std::optional<std::string> old_;
};

TEST(AppGenerate, TuneOnTheCpuIsANoteAndWritesNothing) {
  const ScratchCacheDir cache("tune_cpu");
  const RunResult plain = run_iris(fixture_generate() + kCudaPrompt + kGreedy);
  const RunResult r = run_iris(fixture_generate() + kCudaPrompt + kGreedy + " --tune");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--tune has no effect on the CPU"), std::string::npos) << r.err;
  EXPECT_EQ(tokens_of(r.out), tokens_of(plain.out));
  EXPECT_FALSE(fs::exists(cache.file()));
}

// On a GPU: --tune fills the cache, a later run takes its algorithms (the same tokens), and a
// damaged cache is one warning, then replaced by the next --tune.
TEST(AppGenerate, TuneFillsTheGemmTuningCacheThatLaterRunsRead) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GEMMs are tuned on GPUs only";
  const ScratchCacheDir cache("tune_gpu");
  const std::string run = fixture_generate() + kCudaPrompt + " --temp 0 -n 12 --json --device cuda";
  const RunResult tuned = run_iris(run + " --tune");
  ASSERT_EQ(tuned.exit_code, 0) << tuned.err;
  EXPECT_NE(tuned.err.find("GEMM shapes timed, saved to " + cache.file()), std::string::npos)
      << tuned.err;
  ASSERT_TRUE(fs::exists(cache.file()));
  const RunResult cached = run_iris(run);
  ASSERT_EQ(cached.exit_code, 0) << cached.err;
  EXPECT_EQ(tokens_of(cached.out), tokens_of(tuned.out));
  EXPECT_EQ(cached.err.find("warning"), std::string::npos) << cached.err;

  std::ofstream(cache.file(), std::ios::trunc) << "{\"format\": \"iris GEMM tun";
  const RunResult damaged = run_iris(run);
  ASSERT_EQ(damaged.exit_code, 0) << damaged.err;
  EXPECT_NE(damaged.err.find("warning: ignoring the GEMM tuning cache " + cache.file()),
            std::string::npos)
      << damaged.err;
  EXPECT_EQ(damaged.err.find("warning", damaged.err.find("warning") + 1), std::string::npos)
      << "one warning: " << damaged.err;
  EXPECT_EQ(damaged.err.find(".cpp:"), std::string::npos) << damaged.err;
  ASSERT_EQ(run_iris(run + " --tune").exit_code, 0);
  // Rewritten whole: a valid file of this GPU's identity, which the test cannot name; seen with
  // another identity, it is foreign rather than damaged.
  const GemmTuningFile f = parse_gemm_tuning(slurp(cache.file()), cache.file(), {});
  EXPECT_EQ(f.state, GemmTuningFile::State::foreign) << f.problem;
  const RunResult after = run_iris(run);
  EXPECT_EQ(after.err.find("warning"), std::string::npos) << after.err;
}

TEST(AppGenerateLlamaFlags, MmprojIsIgnoredOnlyWhenTheModelHasTheVisionWeights) {
  const RunResult r = run_iris(fixture_generate() +
                               " -p hi -n 1 --device cpu --json --mmproj mmproj-model-f16.gguf");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("note: --mmproj has no effect"), std::string::npos) << r.err;
  ScratchModel m;
  m.rewrite_weights([](std::vector<SafetensorsWriteItem>& items) {
    std::erase_if(items, [](const auto& it) { return it.name.rfind("model.visual.", 0) == 0; });
  });
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu -mm proj.gguf"),
               "has no model.visual.* weights");
  expect_error(run_iris("generate -m " + q(m.path("model.safetensors")) + " -p hi --device cpu"),
               "not a GGUF file");
}

TEST(AppGenerateLlamaFlags, UnknownFlagsSuggestTheClosest) {
  const std::string base = fixture_generate() + " -p hi --device cpu ";
  for (const auto& [typed, meant] : std::vector<std::pair<std::string, std::string>>{
           {"--temprature 0", "did you mean --temperature?"},
           {"--top_k 5", "did you mean --top-k?"},
           {"--n-predic=4", "did you mean --n-predict?"},
           {"-ngll 99", "did you mean -ngl?"},
           {"--tmep 1", "did you mean --temp?"},
           {"--promt hi", "did you mean --prompt?"}}) {
    const RunResult r = run_iris(base + typed);
    expect_error(r, "unknown flag " + typed.substr(0, typed.find_first_of(" =")));
    EXPECT_NE(r.err.find(meant), std::string::npos) << typed << ": " << r.err;
  }
  // llama.cpp's one-dash spellings are not split into a short flag and a value ("-cnvx" as
  // "-c nvx"): an unknown one is an unknown flag, answered with the nearest spelling; one that
  // nothing is near gets no suggestion.
  expect_error(run_iris(base + "-cnvx"), "unknown flag -cnvx; did you mean -cnv?");
  const RunResult far = run_iris(base + "-qqqq");
  expect_error(far, "unknown flag -qqqq");
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;
  expect_error(run_iris(base + "stray"), "unexpected argument 'stray'");
  // The command line's mistakes exit with 2, a run that fails with 1.
  EXPECT_EQ(run_iris(base + "--tmep 1").exit_code, 2);
  EXPECT_EQ(run_iris(base + "stray").exit_code, 2);
  EXPECT_EQ(run_iris("generate -m /nonexistent -p hi --device cpu").exit_code, 1);
}

// Sampling defaults come from the checkpoint's generation_config.json; flags override them.
void write_generation_config(const ScratchModel& m, const std::string& json) {
  std::ofstream(m.path("generation_config.json"), std::ios::trunc) << json;
}

TEST(AppGenerateDefaults, SamplingDefaultsComeFromGenerationConfig) {
  ScratchModel m;
  write_generation_config(m, R"({"do_sample": true, "temperature": 0.25, "top_k": 7,
      "top_p": 0.5, "min_p": 0.125, "repetition_penalty": 1.25, "eos_token_id": 151645})");
  const std::string base = "generate -m " + q(m.path()) + " -p hi -n 1 --json --device cpu";
  const RunResult r = run_iris(base);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto s = nlohmann::json::parse(r.out)["sampling"];
  EXPECT_EQ(s["temperature"], 0.25);
  EXPECT_EQ(s["top_k"], 7);
  EXPECT_EQ(s["top_p"], 0.5);
  EXPECT_EQ(s["min_p"], 0.125);
  EXPECT_EQ(s["repetition_penalty"], 1.25);
  // Flags win, the other keys stay the checkpoint's; -mDIR (read by CLI11 alone) works too.
  const RunResult o = run_iris("generate -m" + q(m.path()) +
                               " -p hi -n 1 --json --device cpu --temperature 0.75 --top-k 3");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto so = nlohmann::json::parse(o.out)["sampling"];
  EXPECT_EQ(so["temperature"], 0.75);
  EXPECT_EQ(so["top_k"], 3);
  EXPECT_EQ(so["top_p"], 0.5);
  EXPECT_EQ(so["repetition_penalty"], 1.25);
  // Without the keys, llama.cpp's defaults.
  const RunResult plain = run_iris(fixture_generate() + " -p hi -n 1 --json --device cpu");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto sp = nlohmann::json::parse(plain.out)["sampling"];
  EXPECT_NEAR(sp["temperature"].get<double>(), 0.8, 1e-6);
  EXPECT_EQ(sp["top_k"], 40);
  // --help with -m shows the defaults that apply to that model.
  const RunResult help = run_iris("generate -m " + q(m.path()) + " --help");
  EXPECT_EQ(help.exit_code, 0);
  for (const char* shown : {"FLOAT=0.25", "INT=7", "FLOAT=0.5", "FLOAT=0.125", "FLOAT=1.25"})
    EXPECT_NE(help.out.find(shown), std::string::npos) << shown << "\n" << help.out;
  EXPECT_NE(help.out.find("generation_config.json"), std::string::npos);
  EXPECT_EQ(run_iris("generate --help").out.find("FLOAT=0.25"), std::string::npos);
}

// do_sample: false is greedy in transformers; here too, unless a flag asks for sampling.
TEST(AppGenerateDefaults, DoSampleFalseIsGreedy) {
  test::Golden g;
  ScratchModel m;
  write_generation_config(m, R"({"do_sample": false, "temperature": 0.7})");
  const RunResult r =
      run_iris("generate -m " + q(m.path()) + kCudaPrompt + " -n 12 --json --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(tokens_of(r.out), g.json()["text_greedy_ids"].get<std::vector<int32_t>>());
  const RunResult hot =
      run_iris("generate -m " + q(m.path()) + " -p hi -n 1 --json --device cpu --temp 1");
  ASSERT_EQ(hot.exit_code, 0) << hot.err;
  EXPECT_EQ(nlohmann::json::parse(hot.out)["sampling"]["temperature"], 1.0);
}

TEST(AppGenerateDefaults, BadGenerationConfigValuesNameTheKey) {
  for (const auto& [json, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"({"top_p": 0})", "generation_config.json.top_p"},
           {R"({"temperature": -1})", "generation_config.json.temperature"},
           {R"({"top_k": 2.5})", "generation_config.json.top_k must be an integer"},
           {R"({"do_sample": "yes"})", "generation_config.json.do_sample"}}) {
    ScratchModel m;
    write_generation_config(m, json);
    expect_error(run_iris("generate -m " + q(m.path()) + " -p hi --device cpu"), needle);
  }
}

TEST(AppGenerate, LogitsOutRefusesToOverwriteTheModel) {
  ScratchModel m;
  const auto before = fs::file_size(m.path("model.safetensors"));
  expect_error(run_iris("generate -m " + q(m.path()) + " -p hi -n 1 --device cpu --logits-out " +
                        q(m.path("model.safetensors"))),
               "a file of the model directory");
  EXPECT_EQ(fs::file_size(m.path("model.safetensors")), before);
  const std::string out = m.path("logits.safetensors");
  const RunResult r = run_iris("generate -m " + q(m.path()) + " -p hi -n 1 --temp 0 --device cpu " +
                               "--logits-out " + q(out));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(SafetensorsFile(out).at("logits").shape, (std::vector<int64_t>{151936}));
}

TEST(AppGenerate, HotSamplingNeverPicksPaddingAndJsonPrints) {
  // At temperature 50 with top-k off the untrained fixture samples almost uniformly over its
  // 151,936 rows, 267 of which no text decodes to. Without the mask, seed 7 picks row 151806
  // within these 64 tokens and the run ended in an error with nothing printed.
  const RunResult r = run_iris("generate -m " + q(test::fixture_dir()) +
                               " -p hi -n 64 --temp 50 --top-k 0 --top-p 1 --min-p 0 --seed 7 "
                               "--json --ignore-eos --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<int32_t> tokens = tokens_of(r.out);
  EXPECT_EQ(tokens.size(), 64u);
  for (int32_t t : tokens) EXPECT_LT(t, 151669);
}

// ---- chat (no -p): messages on stdin ----

std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

const std::string kChatFlags = " -sys 'You are terse.' --temp 0 -n 12 --device cpu";
const std::string kTurn1 = "Write one sentence about CUDA graphs.";
const std::string kTurn2 = "What is in this picture?";
const std::string kTurn3 = "Describe a cat.";

std::string chat_input() {
  return kTurn1 + "\n/image " + test::fixture_dir() + "/images/image1.png\n" + kTurn2 +
         "\n/clear\n" + kTurn3 + "\n";
}

// Piped chat gives clean stdout: the replies, one after the other, each ending its line; the first
// turn and the one after /clear print what one-shot runs of their prompts print.
TEST(AppGenerateChat, PipedRepliesMatchOneShotRunsAndStdoutIsClean) {
  const RunResult chat = run_iris(fixture_generate() + kChatFlags, chat_input());
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  const RunResult one1 = run_iris(fixture_generate() + kChatFlags + " -p " + q(kTurn1));
  const RunResult one3 = run_iris(fixture_generate() + kChatFlags + " -p " + q(kTurn3));
  ASSERT_EQ(one1.exit_code, 0) << one1.err;
  ASSERT_EQ(one3.exit_code, 0) << one3.err;
  EXPECT_TRUE(starts_with(chat.out, one1.out)) << chat.out << "\n---\n" << one1.out;
  EXPECT_TRUE(ends_with(chat.out, one3.out)) << chat.out << "\n---\n" << one3.out;
  // The second reply sits between them, on its own line.
  ASSERT_GT(chat.out.size(), one1.out.size() + one3.out.size());
  EXPECT_EQ(chat.out[chat.out.size() - one3.out.size() - 1], '\n');
  // Notes go to stderr; the input prompt only to a terminal.
  EXPECT_NE(chat.err.find("image1.png attached"), std::string::npos) << chat.err;
  EXPECT_NE(chat.err.find("conversation cleared"), std::string::npos) << chat.err;
  EXPECT_EQ(chat.err.find("> "), std::string::npos) << chat.err;
  EXPECT_NE(chat.err.find("decode"), std::string::npos) << chat.err;  // the timings, once
}

// With --json each turn prints one JSON object. The second turn's ids are those of a one-shot
// generate() over the whole conversation so far (system, message 1, reply 1 as its ids, message
// 2 with the image, the generation prompt), built here independently of the chat code.
TEST(AppGenerateChat, JsonTurnsEqualOneShotRunsOverTheWholeConversation) {
  const RunResult chat = run_iris(fixture_generate() + kChatFlags + " --json", chat_input());
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  const std::vector<nlohmann::json> turns = json_lines(chat.out);
  ASSERT_EQ(turns.size(), 3u) << chat.out;
  const RunResult one1 = run_iris(fixture_generate() + kChatFlags + " --json -p " + q(kTurn1));
  const RunResult one3 = run_iris(fixture_generate() + kChatFlags + " --json -p " + q(kTurn3));
  EXPECT_EQ(turns[0]["tokens"], nlohmann::json::parse(one1.out)["tokens"]);
  EXPECT_EQ(turns[2]["tokens"], nlohmann::json::parse(one3.out)["tokens"]);
  EXPECT_EQ(turns[0]["prompt_tokens"], nlohmann::json::parse(one1.out)["prompt_tokens"]);
  EXPECT_EQ(turns[2]["prompt_tokens"], nlohmann::json::parse(one3.out)["prompt_tokens"]);
  EXPECT_EQ(turns[1]["turn"], 2);
  EXPECT_EQ(turns[2]["turn"], 1);  // counted from /clear

  const std::string dir = test::fixture_dir();
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  const PreprocessedImage image =
      preprocess_image(load_image(dir + "/images/image1.png"), model_preprocessor(dir, cfg));
  std::string turn2 = "<|im_end|>\n<|im_start|>user\n<|vision_start|>";
  const GridTHW& g = image.grid_thw;
  for (int64_t i = 0; i < g[0] * g[1] * g[2] / 4; ++i) turn2 += "<|image_pad|>";
  turn2 += "<|vision_end|>" + kTurn2 + "<|im_end|>\n<|im_start|>assistant\n";
  GenerationRequest req;
  req.prompt_ids = tok.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n" +
                              kTurn1 + "<|im_end|>\n<|im_start|>assistant\n");
  for (int32_t id : turns[0]["tokens"].get<std::vector<int32_t>>()) req.prompt_ids.push_back(id);
  for (int32_t id : tok.encode(turn2)) req.prompt_ids.push_back(id);
  req.pixel_values = image.pixel_values.data<float>();
  req.grids = {g};
  req.max_new_tokens = 12;
  req.sampling.temperature = 0;
  req.stop_ids = default_stop_ids(dir, [&](const std::string& t) { return tok.token_id(t); });
  req.sampleable = sampleable_ids(tok, cfg.text.vocab_size);
  auto be = make_cpu_backend();
  ModelLimits limits;
  limits.max_context = 1024;
  limits.max_step_tokens = 256;
  Qwen3VLModel model(*be, dir, limits);
  GenerationResult want = generate(model, req);
  if (want.stopped) want.tokens.pop_back();
  EXPECT_EQ(turns[1]["tokens"].get<std::vector<int32_t>>(), want.tokens);
  // The chat prefilled only the new part: the conversation minus what turn 1 cached.
  EXPECT_LT(turns[1]["prompt_tokens"].get<int64_t>(), static_cast<int64_t>(req.prompt_ids.size()));
  EXPECT_EQ(turns[1]["context_tokens"].get<int64_t>(),
            static_cast<int64_t>(req.prompt_ids.size() + want.tokens.size() + 2));
}

// A message the context cannot hold is refused with a pointer to /clear; the chat goes on, and
// the exit code says a turn failed. Never a crash.
TEST(AppGenerateChat, ContextOverflowIsReportedAndTheChatGoesOn) {
  // The first message takes 15 tokens and its reply 12, leaving too little for a second.
  const std::string flags = " --temp 0 -n 12 -c 30 --device cpu";
  const RunResult chat =
      run_iris(fixture_generate() + flags, kTurn1 + "\nAnd another one, please.\n/clear\nhi\n");
  EXPECT_EQ(chat.exit_code, 1) << chat.err;
  EXPECT_NE(chat.err.find("/clear starts a new conversation"), std::string::npos) << chat.err;
  EXPECT_EQ(chat.err.find(".cpp:"), std::string::npos) << chat.err;
  const RunResult one1 = run_iris(fixture_generate() + flags + " -p " + q(kTurn1));
  const RunResult one3 = run_iris(fixture_generate() + flags + " -p hi");
  ASSERT_EQ(one1.exit_code, 0) << one1.err;
  EXPECT_EQ(chat.out, one1.out + one3.out);
}

TEST(AppGenerateChat, BadCommandsAreReportedAndQuitEndsTheChat) {
  const RunResult chat = run_iris(fixture_generate() + " --temp 0 -n 4 --device cpu",
                                  "/claer\n/image /nonexistent/cat.png\n/image\n/quit\nhello\n");
  EXPECT_EQ(chat.exit_code, 1);
  EXPECT_NE(chat.err.find("unknown chat command /claer"), std::string::npos) << chat.err;
  EXPECT_NE(chat.err.find("/nonexistent/cat.png"), std::string::npos) << chat.err;
  EXPECT_NE(chat.err.find("/image needs a file"), std::string::npos) << chat.err;
  EXPECT_EQ(chat.out, "");  // /quit came before the message
  expect_error(run_iris(fixture_generate() + " --device cpu --logits-out /tmp/x.safetensors"),
               "--logits-out needs a one-shot prompt");
}

// /video attaches a video to the next message as /image does, and --video files go with the first
// message: the reply is the one-shot `iris generate --video` reply to the same message. Markers
// take images and videos in the order they were attached.
TEST(AppGenerateChat, VideoMessagesGiveTheOneShotReplies) {
  if (!video_decoding_available()) GTEST_SKIP() << "this build has no video decoding (OpenCV)";
  const fs::path tmp =
      fs::temp_directory_path() / ("iris_app_chat_video_" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const std::string video = write_formula_video(tmp);
  const std::string greedy = " --temp 0 --ignore-eos -n 8 --json --device cpu";
  const std::string text = "Describe this video.";
  for (const char* family : {"qwen3vl-tiny", "qwen25vl-tiny"}) {
    SCOPED_TRACE(family);
    const std::string gen = "generate -m " + q(test::data_dir() + "/" + family);
    const RunResult one = run_iris(gen + " --video " + q(video) + " -p " + q(text) + greedy);
    ASSERT_EQ(one.exit_code, 0) << one.err;
    const auto want = nlohmann::json::parse(one.out);

    const RunResult chat =
        run_iris(gen + greedy, "/video " + video + "\n" + text + "\nAnd in one word?\n");
    ASSERT_EQ(chat.exit_code, 0) << chat.err;
    EXPECT_NE(chat.err.find("/video PATH"), std::string::npos) << chat.err;  // the help line
    EXPECT_NE(chat.err.find("clip.mkv attached"), std::string::npos) << chat.err;
    const std::vector<nlohmann::json> turns = json_lines(chat.out);
    ASSERT_EQ(turns.size(), 2u) << chat.out;
    EXPECT_EQ(turns[0]["tokens"], want["tokens"]);
    EXPECT_EQ(turns[0]["prompt_tokens"], want["prompt_tokens"]);
    EXPECT_EQ(turns[0]["timings"]["image_patches"], want["timings"]["image_patches"]);
    // The second turn continues the cache: the video is not encoded again.
    EXPECT_EQ(turns[1]["timings"]["image_patches"], 0);
    EXPECT_LT(turns[1]["prompt_tokens"].get<int64_t>(), want["prompt_tokens"].get<int64_t>());

    const RunResult flag = run_iris(gen + " --video " + q(video) + greedy, text + "\n");
    ASSERT_EQ(flag.exit_code, 0) << flag.err;
    ASSERT_EQ(json_lines(flag.out).size(), 1u) << flag.out;
    EXPECT_EQ(json_lines(flag.out)[0]["tokens"], want["tokens"]);

    // A video then an image, placed by markers in that order.
    const std::string image = test::data_dir() + "/" + family + "/images/image0.png";
    const std::string mixed = "<__media__><__media__>Compare the video with the picture.";
    const RunResult one_mixed = run_iris(gen + " --video " + q(video) + " --image " + q(image) +
                                         " -p " + q(mixed) + greedy);
    ASSERT_EQ(one_mixed.exit_code, 0) << one_mixed.err;
    const RunResult chat_mixed =
        run_iris(gen + greedy, "/video " + video + "\n/image " + image + "\n" + mixed + "\n");
    ASSERT_EQ(chat_mixed.exit_code, 0) << chat_mixed.err;
    ASSERT_EQ(json_lines(chat_mixed.out).size(), 1u) << chat_mixed.out;
    EXPECT_EQ(json_lines(chat_mixed.out)[0]["tokens"],
              nlohmann::json::parse(one_mixed.out)["tokens"]);
  }
  fs::remove_all(tmp);
}

// A video that cannot be read, or that cannot fit the context, is reported naming the file (and,
// for its size, the flags that shrink it) when given; the chat goes on to answer the next message.
TEST(AppGenerateChat, ABadVideoIsReportedAndTheChatGoesOn) {
  const std::string gen = "generate -m " + q(test::data_dir() + "/qwen25vl-tiny");
  const std::string flags = " --temp 0 -n 4 --json --device cpu";
  const RunResult one = run_iris(gen + flags + " -p hello");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const RunResult chat = run_iris(gen + flags, "/video /nonexistent.mp4\n/video\nhello\n");
  EXPECT_EQ(chat.exit_code, 1) << chat.err;
  EXPECT_NE(chat.err.find("/nonexistent.mp4"), std::string::npos) << chat.err;
  EXPECT_NE(chat.err.find("/video needs a file"), std::string::npos) << chat.err;
  EXPECT_EQ(chat.err.find(".cpp:"), std::string::npos) << chat.err;
  const std::vector<nlohmann::json> turns = json_lines(chat.out);
  ASSERT_EQ(turns.size(), 1u) << chat.out;
  EXPECT_EQ(turns[0]["tokens"], nlohmann::json::parse(one.out)["tokens"]);
  if (!video_decoding_available()) return;
  // Every frame of the video is more than a 64-token context holds: refused from its metadata.
  const fs::path tmp =
      fs::temp_directory_path() / ("iris_app_chat_bigvideo_" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const std::string video = write_formula_video(tmp);
  const std::string small = " --video-fps 12 -c 64";
  const RunResult one_small = run_iris(gen + flags + small + " -p hello");
  ASSERT_EQ(one_small.exit_code, 0) << one_small.err;
  const RunResult big = run_iris(gen + flags + small, "/video " + video + "\nhello\n");
  EXPECT_EQ(big.exit_code, 1) << big.err;
  EXPECT_NE(big.err.find(video), std::string::npos) << big.err;
  for (const char* flag : {"--video-fps", "--video-max-frames", "-c/--ctx-size"})
    EXPECT_NE(big.err.find(flag), std::string::npos) << flag << ": " << big.err;
  ASSERT_EQ(json_lines(big.out).size(), 1u) << big.out;
  EXPECT_EQ(json_lines(big.out)[0]["tokens"], nlohmann::json::parse(one_small.out)["tokens"]);
  fs::remove_all(tmp);
}

// ---- llama.cpp's chat flags: -cnv, -st, -r ----

std::vector<int32_t> json_tokens(const nlohmann::json& j) {
  return j.at("tokens").get<std::vector<int32_t>>();
}

// -cnv chats: without -p it is the chat there is anyway; with -p (or -f) the prompt is the first
// message, answered as the one-shot run answers it, then stdin is read.
TEST(AppGenerateLlamaFlags, ConversationChatsWithThePromptAsItsFirstMessage) {
  const std::string flags = kChatFlags + " --json";
  const RunResult plain = run_iris(fixture_generate() + flags, chat_input());
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const std::vector<nlohmann::json> plain_turns = json_lines(plain.out);
  ASSERT_EQ(plain_turns.size(), 3u) << plain.out;
  for (const char* spelling : {" -cnv", " --conversation"}) {
    const RunResult cnv = run_iris(fixture_generate() + flags + spelling, chat_input());
    ASSERT_EQ(cnv.exit_code, 0) << spelling << ": " << cnv.err;
    const std::vector<nlohmann::json> turns = json_lines(cnv.out);
    ASSERT_EQ(turns.size(), 3u) << spelling << ": " << cnv.out;
    for (size_t i = 0; i < turns.size(); ++i) {
      EXPECT_EQ(json_tokens(turns[i]), json_tokens(plain_turns[i])) << spelling << " turn " << i;
      EXPECT_EQ(turns[i]["prompt_tokens"], plain_turns[i]["prompt_tokens"]) << spelling;
    }
  }
  // The prompt, even one that reads as a chat command, is the first message.
  const RunResult one1 = run_iris(fixture_generate() + flags + " -p " + q(kTurn1));
  const RunResult one_slash = run_iris(fixture_generate() + flags + " -p /clear");
  const RunResult first =
      run_iris(fixture_generate() + flags + " -cnv -p " + q(kTurn1), kTurn3 + "\n");
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const std::vector<nlohmann::json> turns = json_lines(first.out);
  ASSERT_EQ(turns.size(), 2u) << first.out;
  EXPECT_EQ(json_tokens(turns[0]), json_tokens(nlohmann::json::parse(one1.out)));
  EXPECT_EQ(turns[1]["turn"], 2);
  const RunResult slash = run_iris(fixture_generate() + flags + " -cnv -p /clear");
  ASSERT_EQ(slash.exit_code, 0) << slash.err;
  ASSERT_EQ(json_lines(slash.out).size(), 1u) << slash.out;
  EXPECT_EQ(json_tokens(json_lines(slash.out)[0]),
            json_tokens(nlohmann::json::parse(one_slash.out)));
  // -f too, and the --image files go with that first message.
  ScratchModel m;
  std::ofstream(m.path("prompt.txt")) << kTurn2 << "\n";
  const std::string img = " --image " + q(test::fixture_dir() + "/images/image1.png");
  const RunResult one2 = run_iris(fixture_generate() + flags + img + " -p " + q(kTurn2));
  const RunResult file =
      run_iris(fixture_generate() + flags + img + " -cnv -f " + q(m.path("prompt.txt")));
  ASSERT_EQ(file.exit_code, 0) << file.err;
  ASSERT_EQ(json_lines(file.out).size(), 1u) << file.out;
  EXPECT_EQ(json_tokens(json_lines(file.out)[0]), json_tokens(nlohmann::json::parse(one2.out)));
}

// -st answers one message and exits: the commands before it are no turn, and the lines after it
// are not read. With -p it is the one-shot run.
TEST(AppGenerateLlamaFlags, SingleTurnAnswersOneMessage) {
  const std::string flags = kChatFlags + " --json";
  for (const char* spelling : {" -st", " --single-turn"}) {
    const RunResult r = run_iris(fixture_generate() + flags + spelling, chat_input());
    ASSERT_EQ(r.exit_code, 0) << spelling << ": " << r.err;
    const std::vector<nlohmann::json> turns = json_lines(r.out);
    ASSERT_EQ(turns.size(), 1u) << spelling << ": " << r.out;
    const RunResult one1 = run_iris(fixture_generate() + flags + " -p " + q(kTurn1));
    EXPECT_EQ(json_tokens(turns[0]), json_tokens(nlohmann::json::parse(one1.out)));
    EXPECT_EQ(r.err.find("image1.png attached"), std::string::npos) << r.err;
  }
  const RunResult commands = run_iris(
      fixture_generate() + flags + " -st",
      "/image " + test::fixture_dir() + "/images/image1.png\n" + kTurn2 + "\n" + kTurn3 + "\n");
  ASSERT_EQ(commands.exit_code, 0) << commands.err;
  ASSERT_EQ(json_lines(commands.out).size(), 1u) << commands.out;
  const RunResult one2 =
      run_iris(fixture_generate() + flags + " --image " +
               q(test::fixture_dir() + "/images/image1.png") + " -p " + q(kTurn2));
  EXPECT_EQ(json_tokens(json_lines(commands.out)[0]), json_tokens(nlohmann::json::parse(one2.out)));
  const RunResult prompt = run_iris(fixture_generate() + flags + " -st -p " + q(kTurn1));
  const RunResult one1 = run_iris(fixture_generate() + flags + " -p " + q(kTurn1));
  ASSERT_EQ(prompt.exit_code, 0) << prompt.err;
  EXPECT_EQ(json_tokens(nlohmann::json::parse(prompt.out)),
            json_tokens(nlohmann::json::parse(one1.out)));
}

// A shell word for `s`, whatever it holds.
std::string shell_word(const std::string& s) {
  std::string w = "'";
  for (char c : s) w += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return w + "'";
}

// -r stops the reply once its text holds the reverse prompt, the token that completed it kept,
// as llama.cpp does; several may be given. In a chat the next message is read after it.
TEST(AppGenerateLlamaFlags, ReversePromptStopsTheReply) {
  const std::string flags = " --temp 0 -n 12 --ignore-eos --json --device cpu";
  const RunResult full = run_iris(fixture_generate() + kCudaPrompt + flags);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  const std::vector<int32_t> tokens = tokens_of(full.out);
  ASSERT_EQ(tokens.size(), 12u);
  // The text through token k, as the reply streams it, first whole after token k.
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  StreamingDecoder stream(tok);
  std::string text, reverse;
  size_t k = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string piece = stream.push(tokens[i]);
    text += piece;
    if (i >= 4 && !piece.empty()) {
      reverse = text;
      k = i + 1;
      break;
    }
  }
  ASSERT_FALSE(reverse.empty()) << "no token of the reply adds text";
  ASSERT_LT(k, tokens.size());
  const std::vector<int32_t> want(tokens.begin(), tokens.begin() + static_cast<long>(k));
  for (const std::string& r : {" -r " + shell_word(reverse),
                               " --reverse-prompt " + shell_word(reverse) + " -r 'never written'",
                               " -r 'never written' -r " + shell_word(reverse)}) {
    const RunResult stopped = run_iris(fixture_generate() + kCudaPrompt + flags + r);
    ASSERT_EQ(stopped.exit_code, 0) << r << ": " << stopped.err;
    EXPECT_EQ(tokens_of(stopped.out), want) << r;
    EXPECT_EQ(nlohmann::json::parse(stopped.out)["reverse_prompt"], reverse) << r;
  }
  // Streamed, the text ends with the reverse prompt.
  const RunResult streamed =
      run_iris(fixture_generate() + kCudaPrompt + " --temp 0 -n 12 --ignore-eos --device cpu -r " +
               shell_word(reverse));
  ASSERT_EQ(streamed.exit_code, 0) << streamed.err;
  EXPECT_EQ(streamed.out, reverse + "\n");
  // Never written: the reply runs to -n.
  const RunResult never =
      run_iris(fixture_generate() + kCudaPrompt + flags + " -r 'never written'");
  EXPECT_EQ(tokens_of(never.out), tokens);
  EXPECT_TRUE(nlohmann::json::parse(never.out)["reverse_prompt"].is_null());
  // In a chat the reply stops there and the chat goes on to the next message.
  const RunResult chat = run_iris(fixture_generate() + flags + " -r " + shell_word(reverse),
                                  "Write one sentence about CUDA graphs.\n" + kTurn3 + "\n");
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  const std::vector<nlohmann::json> turns = json_lines(chat.out);
  ASSERT_EQ(turns.size(), 2u) << chat.out;
  EXPECT_EQ(json_tokens(turns[0]), want);
  EXPECT_EQ(turns[0]["reverse_prompt"], reverse);
  EXPECT_FALSE(turns[0]["context_full"].get<bool>());
  expect_error(run_iris(fixture_generate() + kCudaPrompt + " -r ''"),
               "-r/--reverse-prompt needs text");
}

// ---- Chat templates ----

std::string template_file(const std::string& name) {
  return test::data_dir() + "/chat_templates/" + name;
}

// The fixture carries Qwen3-VL Instruct's chat template; -v says so and shows the prompt it
// renders, which the HF greedy tokens above were made with.
TEST(AppGenerateChatTemplate, TheModelsOwnTemplateBuildsThePrompt) {
  const RunResult r = run_iris(fixture_generate() + kCudaPrompt + kGreedy + " -v");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("chat template: " + test::fixture_dir() + "/tokenizer_config.json"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("prompt:\n<|im_start|>user\nWrite one sentence about CUDA graphs."
                       "<|im_end|>\n<|im_start|>assistant\n\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(tokens_of(r.out), test::Golden().json()["text_greedy_ids"].get<std::vector<int32_t>>());
}

// A Thinking template's generation prompt opens the reasoning: two more prompt tokens
// (<think>, "\n") than the Instruct template's, and so other greedy tokens.
TEST(AppGenerateChatTemplate, AChatTemplateFileOverridesTheModels) {
  const RunResult plain = run_iris(fixture_generate() + kCudaPrompt + kGreedy);
  const RunResult thinking =
      run_iris(fixture_generate() + kCudaPrompt + kGreedy + " -v --chat-template-file " +
               q(template_file("qwen3_vl_thinking.jinja")));
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(thinking.exit_code, 0) << thinking.err;
  EXPECT_EQ(nlohmann::json::parse(thinking.out)["prompt_tokens"],
            nlohmann::json::parse(plain.out)["prompt_tokens"].get<int>() + 2);
  EXPECT_NE(thinking.err.find("chat template: " + template_file("qwen3_vl_thinking.jinja")),
            std::string::npos)
      << thinking.err;
  EXPECT_NE(thinking.err.find("<|im_start|>assistant\n<think>\n\n"), std::string::npos)
      << thinking.err;
  EXPECT_NE(tokens_of(thinking.out), tokens_of(plain.out));
  // With an image, the template writes the image block and iris expands its pads.
  const std::string img = " --image " + q(test::fixture_dir() + "/images/image0.png");
  const RunResult image =
      run_iris(fixture_generate() + img + " -p 'What is it?'" + kGreedy + " --chat-template-file " +
               q(template_file("qwen2_vl.jinja")) + " -v");
  ASSERT_EQ(image.exit_code, 0) << image.err;
  EXPECT_NE(image.err.find("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                           "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                           "What is it?<|im_end|>\n<|im_start|>assistant\n"),
            std::string::npos)
      << image.err;
}

// enable_thinking as llama.cpp spells it (--chat-template-kwargs) and as --reasoning: Qwen3's
// template closes an empty reasoning block in the generation prompt when it is false.
TEST(AppGenerateChatTemplate, EnableThinkingReachesTheTemplate) {
  const std::string base = fixture_generate() + kCudaPrompt + kGreedy +
                           " -v --chat-template-file " + q(template_file("qwen3.jinja"));
  const RunResult on = run_iris(base);
  const RunResult off = run_iris(base + " --reasoning off");
  const RunResult kwargs = run_iris(base + " --chat-template-kwargs '{\"enable_thinking\":false}'");
  ASSERT_EQ(on.exit_code, 0) << on.err;
  ASSERT_EQ(off.exit_code, 0) << off.err;
  ASSERT_EQ(kwargs.exit_code, 0) << kwargs.err;
  EXPECT_EQ(on.err.find("<think>"), std::string::npos) << on.err;
  EXPECT_NE(off.err.find("<|im_start|>assistant\n<think>\n\n</think>\n\n"), std::string::npos)
      << off.err;
  EXPECT_EQ(nlohmann::json::parse(off.out)["prompt_tokens"],
            nlohmann::json::parse(on.out)["prompt_tokens"].get<int>() + 4);
  EXPECT_EQ(tokens_of(kwargs.out), tokens_of(off.out));
  EXPECT_EQ(nlohmann::json::parse(kwargs.out)["prompt_tokens"],
            nlohmann::json::parse(off.out)["prompt_tokens"]);
  const RunResult explicit_on = run_iris(base + " --reasoning on");  // true: Qwen3's default
  EXPECT_EQ(tokens_of(explicit_on.out), tokens_of(on.out));
  EXPECT_NE(tokens_of(off.out), tokens_of(on.out));
  expect_error(
      run_iris(base + " --reasoning off --chat-template-kwargs '{\"enable_thinking\":true}'"),
      "--reasoning and --chat-template-kwargs both set enable_thinking; give one");
  expect_error(run_iris(base + " --chat-template-kwargs '{enable_thinking: false}'"),
               "--chat-template-kwargs is not JSON");
  expect_error(run_iris(base + " --chat-template-kwargs '[1]'"),
               "--chat-template-kwargs must be a JSON object");
  expect_error(run_iris(base + " --reasoning maybe"), "--reasoning");
}

// A checkpoint without a template gets the built-in ChatML, which -v says in one line: the same
// prompt as the fixture's Instruct template, so HF's greedy tokens.
TEST(AppGenerateChatTemplate, NoTemplateFallsBackToChatMLAndSaysSo) {
  ScratchModel m;
  auto cfg = nlohmann::ordered_json::parse(slurp(m.path("tokenizer_config.json")));
  cfg.erase("chat_template");
  std::ofstream(m.path("tokenizer_config.json")) << cfg.dump(2);
  const RunResult r = run_iris("generate -m " + q(m.path()) + kCudaPrompt + kGreedy + " -v");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("chat template: none in " + m.path() +
                       " (chat_template.jinja, chat_template.json, tokenizer_config.json); using "
                       "the built-in ChatML"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(tokens_of(r.out), test::Golden().json()["text_greedy_ids"].get<std::vector<int32_t>>());
  // Without -v, nothing is said about it; a template variable that cannot apply gets a note.
  EXPECT_EQ(
      run_iris("generate -m " + q(m.path()) + kCudaPrompt + kGreedy).err.find("chat template"),
      std::string::npos);
  const RunResult note =
      run_iris("generate -m " + q(m.path()) + kCudaPrompt + kGreedy + " --reasoning off");
  EXPECT_EQ(note.exit_code, 0) << note.err;
  EXPECT_NE(note.err.find("note: --reasoning has no effect: " + m.path() +
                          " has no chat template, so the built-in ChatML is used"),
            std::string::npos)
      << note.err;
  // A chat_template.jinja beside it is the model's template from then on.
  std::ofstream(m.path("chat_template.jinja"))
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
         "{% endfor %}<|im_start|>assistant\nSure:";
  const RunResult own = run_iris("generate -m " + q(m.path()) + kCudaPrompt + kGreedy + " -v");
  ASSERT_EQ(own.exit_code, 0) << own.err;
  EXPECT_NE(own.err.find("chat template: " + m.path("chat_template.jinja")), std::string::npos)
      << own.err;
  EXPECT_NE(own.err.find("<|im_start|>assistant\nSure:"), std::string::npos) << own.err;
}

TEST(AppGenerateChatTemplate, ABadTemplateNamesTheFileAndLine) {
  const std::string path = (test::scratch_dir() / "bad.jinja").string();
  std::ofstream(path) << "{%- for m in messages %}\n{{ m.content | wordwrap(10) }}\n{% endfor %}";
  expect_error(
      run_iris(fixture_generate() + kCudaPrompt + kGreedy + " --chat-template-file " + q(path)),
      "--chat-template-file " + path + ", line 2: the filter 'wordwrap' is not supported");
  // Qwen3's text-only template cannot take an image, as in transformers.
  expect_error(
      run_iris(fixture_generate() + " --image " + q(test::fixture_dir() + "/images/image0.png") +
               kCudaPrompt + kGreedy + " --chat-template-file " + q(template_file("qwen3.jinja"))),
      "'list object' has no attribute 'startswith'");
  expect_error(run_iris(fixture_generate() + kCudaPrompt + kGreedy +
                        " --chat-template-file /nonexistent/t.jinja"),
               "/nonexistent/t.jinja");
}

// An interactive chat with a template that rewrites earlier replies: each turn gives the tokens
// of a one-shot run over the whole conversation as the template renders it.
TEST(AppGenerateChatTemplate, ChatTurnsFollowTheTemplate) {
  const std::string flags = kChatFlags + std::string(" --json --chat-template-file ") +
                            q(template_file("qwen3_vl_thinking.jinja"));
  const RunResult chat = run_iris(fixture_generate() + flags, kTurn1 + "\n" + kTurn3 + "\n");
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  const std::vector<nlohmann::json> turns = json_lines(chat.out);
  ASSERT_EQ(turns.size(), 2u) << chat.out;
  const RunResult one1 = run_iris(fixture_generate() + flags + " -p " + q(kTurn1));
  EXPECT_EQ(turns[0]["tokens"], nlohmann::json::parse(one1.out)["tokens"]);

  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  const ChatFormat thinking = ChatFormat::from_file(template_file("qwen3_vl_thinking.jinja"), "t");
  const std::vector<ChatMessage> conversation = {
      {"system", {ChatPart::make_text("You are terse.")}},
      {"user", {ChatPart::make_text(kTurn1)}},
      {"assistant",
       {ChatPart::make_text(tok.decode(turns[0]["tokens"].get<std::vector<int32_t>>()))}},
      {"user", {ChatPart::make_text(kTurn3)}}};
  const std::string dir = test::fixture_dir();
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  GenerationRequest req;
  req.prompt_ids = encode_chat_text(tok, thinking.render(conversation, true), {}, 2);
  req.max_new_tokens = 12;
  req.sampling.temperature = 0;
  req.stop_ids = default_stop_ids(dir, [&](const std::string& t) { return tok.token_id(t); });
  req.sampleable = sampleable_ids(tok, cfg.text.vocab_size);
  auto be = make_cpu_backend();
  ModelLimits limits;
  limits.max_context = 1024;
  limits.max_step_tokens = 256;
  Qwen3VLModel model(*be, dir, limits);
  GenerationResult want = generate(model, req);
  if (want.stopped) want.tokens.pop_back();
  EXPECT_EQ(turns[1]["tokens"].get<std::vector<int32_t>>(), want.tokens);
}

// --chat-template as llama.cpp takes it: a name (chatml, or a Qwen family's template, as the
// files here), the template text itself, or (as --chat-template-file) a file. Other names are
// refused with the list and the closest.
TEST(AppGenerateChatTemplate, BuiltInTemplatesByName) {
  const RunResult own = run_iris(fixture_generate() + kCudaPrompt + kGreedy);
  ASSERT_EQ(own.exit_code, 0) << own.err;
  // The fixture's own template is Qwen3-VL Instruct's, which writes a text prompt as ChatML does.
  for (const char* name : {"qwen3-vl", "chatml"}) {
    const RunResult r =
        run_iris(fixture_generate() + kCudaPrompt + kGreedy + " -v --chat-template " + name);
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_EQ(tokens_of(r.out), tokens_of(own.out)) << name;
    EXPECT_NE(r.err.find(std::string("chat template: the built-in ") +
                         (std::string(name) == "chatml" ? "ChatML" : name)),
              std::string::npos)
        << r.err;
  }
  // Qwen2-VL's writes a default system prompt; the name, the file and the text agree.
  const std::string file = template_file("qwen2_vl.jinja");
  const RunResult by_file =
      run_iris(fixture_generate() + kCudaPrompt + kGreedy + " --chat-template-file " + q(file));
  ASSERT_EQ(by_file.exit_code, 0) << by_file.err;
  EXPECT_GT(nlohmann::json::parse(by_file.out)["prompt_tokens"].get<int>(),
            nlohmann::json::parse(own.out)["prompt_tokens"].get<int>());
  for (const std::string& given :
       {std::string("qwen2-vl"), std::string("qwen2.5-vl"), q(file), shell_word(slurp(file))}) {
    const RunResult r =
        run_iris(fixture_generate() + kCudaPrompt + kGreedy + " --chat-template " + given);
    ASSERT_EQ(r.exit_code, 0) << given << ": " << r.err;
    EXPECT_EQ(tokens_of(r.out), tokens_of(by_file.out)) << given;
    EXPECT_EQ(nlohmann::json::parse(r.out)["prompt_tokens"],
              nlohmann::json::parse(by_file.out)["prompt_tokens"])
        << given;
  }
  const RunResult llama = run_iris(fixture_generate() + kCudaPrompt + " --chat-template llama3");
  EXPECT_EQ(llama.exit_code, 2) << llama.err;
  expect_error(llama,
               "--chat-template 'llama3' is not a template name, a file or Jinja text. The names "
               "are chatml (");
  EXPECT_NE(llama.err.find("qwen3-vl-thinking (Qwen3-VL Thinking)"), std::string::npos)
      << llama.err;
  expect_error(run_iris(fixture_generate() + kCudaPrompt + " --chat-template qwen3vl"),
               "did you mean 'qwen3-vl'?");
  expect_error(run_iris(fixture_generate() + kCudaPrompt + " --chat-template chatml " +
                        "--chat-template-file " + q(file)),
               "--chat-template and --chat-template-file both give a template; give one");
  // The ChatML has no variables to take.
  const RunResult kwargs = run_iris(fixture_generate() + kCudaPrompt + kGreedy +
                                    " --chat-template chatml --reasoning off");
  ASSERT_EQ(kwargs.exit_code, 0) << kwargs.err;
  EXPECT_NE(kwargs.err.find("note: --reasoning has no effect: --chat-template chatml"),
            std::string::npos)
      << kwargs.err;
}

}  // namespace
}  // namespace iris
