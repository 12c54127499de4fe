// iris generate: images + text in, text out, streamed (flags follow llama.cpp's multimodal CLI).
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <future>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "apps/chat_input.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "bridge/architecture.h"
#include "bridge/chat_prompt.h"
#include "bridge/chat_session.h"
#include "bridge/generator.h"
#include "bridge/peft.h"
#include "bridge/pipeline_stage.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "core/fs.h"
#include "core/graph_config.h"
#include "core/json_read.h"
#include "core/safetensors.h"
#include "language/tokenizer.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/video.h"
#include "vision/video_decode.h"

namespace iris {
namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct GenerateOptions {
  std::string model_dir;
  std::string lora_dir;     // --lora: a PEFT adapter on the model of -m
  float lora_scale = 1.0f;  // multiplies the adapter's own scale
  bool lora_merge = false;  // merge the adapter into the weights at load
  std::vector<std::string> images;
  std::vector<std::string> videos;
  std::vector<ChatPart::Kind> media_order;  // --image and --video in the order given
  double video_fps = -1;                    // < 0: the checkpoint's video processor's
  int video_max_frames = 0;                 // 0: the checkpoint's video processor's
  std::string prompt;
  std::string prompt_file;
  std::string system;
  bool conversation = false;                 // -cnv: chat, with -p as the first message
  bool single_turn = false;                  // -st: a chat of one message
  std::vector<std::string> reverse_prompts;  // -r: a reply stops once it writes one
  int n_predict = 128;
  float temp = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;
  int64_t seed = -1;
  int ctx_size = 4096;
  int threads = 0;  // 0: OpenMP's default (OMP_NUM_THREADS, else every core)
  int64_t image_min_tokens = 0, image_max_tokens = 0;  // 0: the preprocessor config's bounds
  std::string n_gpu_layers, mmproj;                    // llama.cpp flags that mean nothing here
  std::string device = "auto";
  bool json = false;
  bool ignore_eos = false;
  bool no_cuda_graphs = false;
  bool tune = false;
  std::string logits_out;
  int64_t max_image_pixels = kDefaultMaxImagePixels;
  std::vector<std::pair<std::string, std::string>> graph_flags;
  std::string chat_template;  // --chat-template: a built-in name, a file or Jinja text
  std::string chat_template_file;
  std::string chat_template_kwargs;  // a JSON object
  std::string reasoning;             // on, off, or empty: the template's default
  bool verbose = false;
};

// --logits-out names a file to create or replace; it must not be one of the files this run reads
// (a typo such as -m DIR --logits-out DIR/model.safetensors would destroy the checkpoint).
void check_logits_out(const std::string& out, const std::string& model_dir,
                      const std::string& adapter_dir, const std::vector<std::string>& images) {
  namespace fs = std::filesystem;
  std::error_code ec;
  IRIS_CHECK(!fs::is_directory(out, ec), "--logits-out ", out, " is a directory; name a file");
  if (!fs::exists(out, ec)) return;
  for (const auto& [dir, what] : {std::pair{model_dir, "model"}, {adapter_dir, "adapter"}}) {
    if (dir.empty()) continue;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      IRIS_CHECK(!same_file(out, entry.path().string()), "--logits-out ", out, " is ",
                 entry.path().string(), ", a file of the ", what,
                 " directory; choose another path");
  }
  for (const std::string& image : images)
    IRIS_CHECK(!same_file(out, image), "--logits-out ", out, " is the input image ", image,
               "; choose another path");
}

// llama.cpp spells some flags with one dash and several letters (-sys, -ngl, -mm), which CLI11
// would split into a short flag and a value (-cnv read as -c nv). They become their long names
// here; any other word of that shape is an unknown flag rather than a mis-split one.
const std::map<std::string, std::string> kLlamaSpellings = {{"-sys", "--system-prompt"},
                                                            {"-ngl", "--n-gpu-layers"},
                                                            {"-mm", "--mmproj"},
                                                            {"-cnv", "--conversation"},
                                                            {"-st", "--single-turn"}};

bool is_multi_letter_short_flag(const std::string& a) {
  if (a.size() < 3 || a[0] != '-' || a[1] == '-') return false;
  return std::all_of(a.begin() + 1, a.end(), [](char c) { return std::isalpha(uint8_t(c)); });
}

// Every flag name a user may mean, for "did you mean": the names help lists, plus the llama.cpp
// spellings above.
std::vector<std::string> suggestable_flags(const CLI::App& app) {
  std::vector<std::string> names = flag_names(app);
  for (const auto& [spelling, _] : kLlamaSpellings) names.push_back(spelling);
  return names;
}

// True when `dir` holds the vision encoder's weights, so that llama.cpp's separate projector
// file (--mmproj) has nothing to add.
bool has_vision_weights(const std::string& dir) {
  const SafetensorsCheckpoint ckpt(dir);
  for (const std::string& name : ckpt.names())
    if (name.rfind("model.visual.", 0) == 0) return true;
  return false;
}

// The -m value, read ahead of CLI11 so that the checkpoint's sampling defaults are in place when
// CLI11 prints --help or fills the flags not given. Empty when there is none.
std::string model_dir_in(const std::vector<std::string>& args) {
  std::string dir;
  for (size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if ((args[i] == "-m" || args[i] == "--model") && i + 1 < args.size()) dir = args[i + 1];
    if (args[i].rfind("--model=", 0) == 0) dir = args[i].substr(8);
  }
  return dir;
}

// What iris generate captures on a GPU unless told otherwise: whole-step decode graphs and
// bucketed vision graphs. Each default applies to a key the user did not set, so that a flag
// changes one setting and the help can show each key's default on its own line. The language
// defaults stay out when the user spoke in the deprecated language keys (their migration would
// clash) or chose an impl other than local (only local has a decode scope).
GraphConfigInput with_generate_graph_defaults(const std::map<std::string, std::string>& given) {
  GraphConfigInput input;
  const bool legacy = given.count("enable_cuda_graph") || given.count("external_cuda_graph") ||
                      given.count("cuda_graph_scope");
  auto impl = given.find("cuda_graph_impl");
  if (!legacy && impl == given.end()) input.emplace_back("cuda_graph_impl", "local");
  std::string impl_value = impl == given.end() ? "local" : impl->second;
  std::transform(impl_value.begin(), impl_value.end(), impl_value.begin(),
                 [](char c) { return static_cast<char>(std::tolower(uint8_t(c))); });
  if (!legacy && !given.count("inference_cuda_graph_scope") && impl_value == "local")
    input.emplace_back("inference_cuda_graph_scope", "block");
  if (!given.count("vision_cuda_graph_impl")) input.emplace_back("vision_cuda_graph_impl", "local");
  for (const auto& [k, v] : given) input.emplace_back(k, v.empty() ? "true" : v);
  return input;
}

// One short line per graph key that matters to inference. The training-only keys (which parts of
// a layer a training graph captures) and the deprecated spellings are accepted, with their
// warnings, but not listed.
const std::map<std::string, std::string> kGraphFlagHelp = {
    {"cuda_graph_impl", "decoder graphs: none or local"},
    {"inference_cuda_graph_scope", "decode graphs: block (one per step) or layer"},
    {"cuda_graph_warmup_steps", "eager calls before a graph is captured"},
    {"vision_cuda_graph_impl", "vision encoder graphs: none or local"},
    {"vision_inference_cuda_graph_scope", "block (the whole encoder) or layer"},
    {"max_vision_cuda_graph_seq_length", "most patches per encoder call; 0: from the images"},
    {"vision_cuda_graph_buckets", "padded patch counts; \"\": powers of 2 from 256"},
    {"vision_cuda_graph_overflow", "calls above the largest bucket: eager or error"},
};
const std::set<std::string> kTrainingOnlyGraphKeys = {"cuda_graph_modules",
                                                      "vision_cuda_graph_modules"};

// CLI11's option column without the validators' ranges and the exclusion notes, so that every
// flag fits one line: the name, its value type and the default.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string out;
    if (opt->get_type_size() == 0) return out;
    out += " " + get_label(opt->get_type_name());
    if (!opt->get_default_str().empty()) out += "=" + opt->get_default_str();
    if (opt->get_expected_max() == CLI::detail::expected_max_vector_size) out += " ...";
    if (opt->get_required()) out += " " + get_label("REQUIRED");
    return out;
  }
};

// What --json prints for one generation (the load and preprocess times are the caller's).
nlohmann::json generation_json(const GenerationResult& res, const GenerationRequest& req,
                               const Tokenizer& tokenizer, const Backend& backend,
                               bool cuda_graphs) {
  std::vector<int32_t> shown = res.tokens;
  if (res.stopped) shown.pop_back();
  const GenerationTimings& t = res.timings;
  nlohmann::json j;
  j["prompt_tokens"] = t.prompt_tokens;
  j["tokens"] = shown;
  j["text"] = tokenizer.decode(shown);
  j["stopped_at_eos"] = res.stopped;
  j["seed"] = req.sampling.seed;
  j["sampling"] = {{"temperature", req.sampling.temperature},
                   {"top_k", req.sampling.top_k},
                   {"top_p", req.sampling.top_p},
                   {"min_p", req.sampling.min_p},
                   {"repetition_penalty", req.sampling.repetition_penalty},
                   {"presence_penalty", req.sampling.presence_penalty},
                   {"frequency_penalty", req.sampling.frequency_penalty}};
  j["device"] = backend.name();
  j["threads"] = omp_get_max_threads();
  j["cuda_graphs"] = cuda_graphs;
  j["timings"] = {{"load_ms", 0.0},
                  {"read_media_ms", 0.0},
                  {"preprocess_ms", 0.0},
                  {"vision_encode_ms", t.vision_ms},
                  {"image_patches", t.image_patches},
                  {"prefill_ms", t.prefill_ms},
                  {"prefill_tokens_per_s", t.prefill_tokens_per_s()},
                  {"decode_ms", t.decode_ms},
                  {"decode_tokens_per_s", t.decode_tokens_per_s()},
                  {"generated_tokens", t.generated_tokens}};
  return j;
}

// Where the load's time went: the parts a user can act on (a faster disk, a smaller tokenizer) or
// that a first call would otherwise pay.
struct LoadTimes {
  double total_ms = 0;
  double device_init_ms = 0;  // the backend: the CUDA context, streams, library handles
  double tokenizer_ms = 0;    // parsing tokenizer.json, beside the weights
  WeightLoadTimes weights;
};

void add_load_json(nlohmann::json& timings, const LoadTimes& load) {
  timings["load_ms"] = load.total_ms;
  timings["device_init_ms"] = load.device_init_ms;
  timings["tokenizer_ms"] = load.tokenizer_ms;
  timings["weights_read_ms"] = load.weights.read_ms;
  timings["weights_upload_ms"] = load.weights.upload_ms;
}

// Media times on the host: the files read and decoded (a video's frames also sampled and resized,
// which its decoder does frame by frame), then the images' preprocessing: the resize where an
// image needs one (the vision encode normalises and patchifies on the backend).
struct MediaTimes {
  double read_ms = 0, preprocess_ms = 0;
};

void print_timings(const LoadTimes& load, const MediaTimes& media, size_t n_images,
                   const GenerationTimings& t, double decode_tokens_per_s,
                   const std::string& device, uint64_t seed) {
  std::fprintf(stderr,
               "\n%-16s %10.2f ms (device init %.2f ms; weights read and uploaded %.2f ms, last "
               "copies %.2f ms; tokenizer %.2f ms beside them)\n"
               "%-16s %10.2f ms (%zu files)\n"
               "%-16s %10.2f ms\n"
               "%-16s %10.2f ms (%lld patches)\n"
               "%-16s %10.2f ms / %lld tokens (%.2f tok/s)\n"
               "%-16s %10.2f ms / %lld tokens (%.2f tok/s)\n"
               "%-16s %s, seed %llu\n",
               "load", load.total_ms, load.device_init_ms, load.weights.read_ms,
               load.weights.upload_ms, load.tokenizer_ms, "read media", media.read_ms, n_images,
               "preprocess", media.preprocess_ms, "vision encode", t.vision_ms,
               static_cast<long long>(t.image_patches), "prefill", t.prefill_ms,
               static_cast<long long>(t.prompt_tokens), t.prefill_tokens_per_s(), "decode",
               t.decode_ms, static_cast<long long>(t.generated_tokens), decode_tokens_per_s,
               "device", device.c_str(), static_cast<unsigned long long>(seed));
}

// The flags that set the image token bounds, for errors about them.
std::string image_bound_flags(const GenerateOptions& o) {
  if (o.image_min_tokens > 0 && o.image_max_tokens > 0)
    return str_cat("--image-min-tokens ", o.image_min_tokens, " and --image-max-tokens ",
                   o.image_max_tokens);
  if (o.image_min_tokens > 0) return str_cat("--image-min-tokens ", o.image_min_tokens);
  if (o.image_max_tokens > 0) return str_cat("--image-max-tokens ", o.image_max_tokens);
  return "the model's preprocessor_config.json (size.shortest_edge)";
}

// Bounds under which no image at all fits the context are refused before anything is loaded
// (a 200000-token minimum once took 5.6 GB of pixels before the prompt was found too long).
void check_image_budget_can_fit(const GenerateOptions& o, const PreprocessorConfig& pre) {
  const int64_t fewest = fewest_image_tokens(pre);
  IRIS_CHECK(fewest <= o.ctx_size, image_bound_flags(o), " gives every image at least ", fewest,
             " tokens, more than the context holds (-c/--ctx-size ", o.ctx_size,
             "), so no image can fit; lower --image-min-tokens (or --image-max-tokens) or raise "
             "-c/--ctx-size");
}

// An image's tokens from the grid smart_resize gives it: no pixel is resized yet.
int64_t image_tokens_of(const ImageRGB8& image, const std::string& path,
                        const PreprocessorConfig& pre) {
  try {
    return image_token_count(image_grid(image.height, image.width, pre), pre);
  } catch (const Error& e) {
    IRIS_FAIL(path, ": ", e.what());
  }
}

// Images whose tokens cannot fit the `room` left in the context are an error before the pixel
// work, which takes memory in proportion to the tokens.
void check_images_fit(const std::vector<std::string>& paths, const std::vector<int64_t>& tokens,
                      int64_t room, const std::string& room_name) {
  int64_t total = 0;
  std::string each;
  for (size_t i = 0; i < tokens.size(); ++i) {
    total += tokens[i];
    if (i < 4) each += str_cat(i > 0 ? ", " : "", paths[i], ": ", tokens[i]);
  }
  if (tokens.size() > 4) each += ", ...";
  IRIS_CHECK(total <= room, tokens.size() == 1 ? "the image needs " : "the images need ", total,
             " tokens at their resized sizes (", each, "), more than the ", room, " ", room_name,
             "; lower --image-max-tokens, pass smaller or fewer images, or raise -c/--ctx-size");
}

// The checkpoint's video processor under --video-fps and --video-max-frames.
VideoProcessorConfig video_processor(const GenerateOptions& o, const ModelConfig& cfg) {
  VideoProcessorConfig vpre = model_video_preprocessor(o.model_dir, cfg);
  if (o.video_fps >= 0) vpre.fps = o.video_fps;
  if (o.video_max_frames > 0) {
    vpre.max_frames = o.video_max_frames;
    vpre.min_frames = std::min(vpre.min_frames, vpre.max_frames);
  }
  vpre.validate("--video-fps and --video-max-frames");
  return vpre;
}

// What a video may take: tokens of the context (`context_note` says what was taken from it
// already), and, in a chat, the vision encoder's attention segments (one per frame pair) and
// patch rows left beside the media attached.
struct VideoRoom {
  int64_t tokens = 0;
  std::string context_note;
  int64_t segments = std::numeric_limits<int64_t>::max();
  int64_t patches = std::numeric_limits<int64_t>::max();
};

// One video file decoded (only the frames its family's sampling keeps) and resized as the
// checkpoint's video processor does, kept as bytes for the backend to patchify. Its tokens are
// known from the container's metadata, so a video that cannot fit `room` is refused before any
// frame is decoded. Errors name the file.
VideoClip load_video(const std::string& path, const GenerateOptions& o, const ModelConfig& cfg,
                     const VideoProcessorConfig& vpre, const VideoRoom& room) {
  const int64_t unit = cfg.vision.merge_unit();
  try {
    return load_model_video(
        path, cfg, vpre,
        [&](const VideoPlan& plan) {
          const int64_t tp = vpre.frame.temporal_patch_size, p = vpre.frame.patch_size;
          const int64_t slices = (static_cast<int64_t>(plan.keep.size()) + tp - 1) / tp;
          const int64_t patches = slices * (plan.size.height / p) * (plan.size.width / p);
          const int64_t tokens = patches / unit;
          const std::string shape = str_cat("the video's ", plan.keep.size(), " kept frames at ",
                                            plan.size.width, "x", plan.size.height);
          const char* lower = "; lower --video-fps or --video-max-frames, or raise -c/--ctx-size";
          IRIS_CHECK(tokens <= room.tokens, shape, " need ", tokens, " tokens, more than the ",
                     std::max<int64_t>(room.tokens, 0), " left of the context (-c/--ctx-size ",
                     o.ctx_size, room.context_note, ")", lower);
          IRIS_CHECK(slices <= room.segments, shape, " make ", slices,
                     " frame pairs, each encoded as an image is, more than the ",
                     std::max<int64_t>(room.segments, 0),
                     " the vision encoder was planned for beside the media attached", lower,
                     " (with vision CUDA graphs a chat plans for videos only when started with "
                     "--video or --video-max-frames)");
          IRIS_CHECK(patches <= room.patches, shape, " have ", patches, " patches, more than the ",
                     std::max<int64_t>(room.patches, 0),
                     " the vision encoder was planned for beside the media attached", lower);
        },
        VideoOutput::frames);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    IRIS_FAIL(path, ": ", what);
  }
}

// A video's tokens in the prompt (its pads).
int64_t video_tokens(const VideoClip& c, const ModelConfig& cfg) {
  return c.grid_thw[0] * c.grid_thw[1] * c.grid_thw[2] / cfg.vision.merge_unit();
}

// The fewest context tokens one frame pair of a video can take under `vpre`, for planning the
// encoder: its pads at the smallest size the family's resize gives a frame (with the most frames,
// over the aspect ratios it accepts; one pad where frames are not resized) and the text the family
// writes per pair (Qwen3-VL's "<t seconds>" block: each special token one, the rest one at least).
int64_t fewest_frame_pair_tokens(const ModelConfig& cfg, const VideoProcessorConfig& vpre) {
  const int f = vpre.frame.patch_size * vpre.frame.merge_size;
  const int tp = vpre.frame.temporal_patch_size;
  int64_t pads = std::numeric_limits<int64_t>::max();
  if (vpre.frame.do_resize) {
    const int64_t frames = std::max<int64_t>(vpre.max_frames, tp);
    for (int k = 1; k <= 200; ++k) {
      try {
        const ResizedSize r = cfg.arch->video_frame_size(frames, f, k * f, vpre);
        pads = std::min<int64_t>(pads, int64_t{r.height} * r.width / (int64_t{f} * f));
      } catch (const Error&) {
        // Not a size the family takes.
      }
    }
  }
  pads = pads == std::numeric_limits<int64_t>::max() ? 1 : std::max<int64_t>(pads, 1);
  // The family's text for clips of one and of two pairs: what a pair adds.
  auto text_tokens = [&](int64_t pairs) {
    VideoClip clip;
    clip.grid_thw = {pairs, cfg.vision.spatial_merge_size, cfg.vision.spatial_merge_size};
    for (int64_t i = 0; i < pairs * tp; ++i) clip.frame_indices.push_back(i);
    clip.total_frames = pairs * tp;
    clip.video_fps = 1;
    const std::string text = cfg.arch->video_prompt_text(clip);
    int64_t specials = 0, chars = 0;
    for (size_t at = 0; at < text.size();) {
      const size_t open = text.find("<|", at);
      const size_t close = open == std::string::npos ? open : text.find("|>", open);
      if (close == std::string::npos) {
        chars += static_cast<int64_t>(text.size() - at);
        break;
      }
      chars += static_cast<int64_t>(open - at);
      specials += text.compare(open, close + 2 - open, "<|video_pad|>") != 0;
      at = close + 2;
    }
    return std::make_pair(specials, chars);
  };
  const auto one = text_tokens(1), two = text_tokens(2);
  return pads + std::max<int64_t>(0, two.first - one.first) + (two.second > one.second ? 1 : 0);
}

// The --video files (beside the images' `image_patches`), each as load_video reads it: one that
// cannot fit the context is refused before any frame is decoded.
std::vector<VideoClip> load_videos(const GenerateOptions& o, const ModelConfig& cfg,
                                   int64_t image_patches) {
  std::vector<VideoClip> clips;
  if (o.videos.empty()) return clips;
  const VideoProcessorConfig vpre = video_processor(o, cfg);
  int64_t tokens_before = image_patches / cfg.vision.merge_unit();
  for (const std::string& path : o.videos) {
    VideoRoom room;
    room.tokens = o.ctx_size - tokens_before;
    clips.push_back(load_video(path, o, cfg, vpre, room));
    tokens_before += video_tokens(clips.back(), cfg);
  }
  return clips;
}

// Images and videos one chat message may carry (/image and /video, or --image and --video for
// the first); the encoder is planned for them up front.
constexpr int kChatMaxImagesPerMessage = 16;

// What the chat loop needs from the command beyond the model and the request settings.
struct ChatRun {
  const GenerateOptions& options;
  const Tokenizer& tokenizer;
  const ChatFormat& chat_format;
  const PreprocessorConfig& preprocessor;
  const ModelConfig& config;
  const Backend& backend;
  bool cuda_graphs = false;
  LoadTimes load;
  MediaTimes media;  // of the --image and --video files, counted with the first turn
  std::optional<std::string> first_message;  // -cnv with -p or -f: sent before stdin is read
};

// -r/--reverse-prompt as llama-cli applies it: a reply stops once its text holds one of the
// texts, the token that completed it kept (it has been shown).
class ReversePrompts {
 public:
  ReversePrompts(const std::vector<std::string>& texts, const Tokenizer& tokenizer)
      : texts_(texts), decoder_(tokenizer) {
    for (const std::string& t : texts) longest_ = std::max(longest_, t.size());
  }
  // After each token of the reply.
  void push(int32_t token) {
    if (texts_.empty() || !found_.empty()) return;
    const size_t before = tail_.size();
    tail_ += decoder_.push(token);
    for (const std::string& t : texts_) {
      // Only a match that the new text completes is new.
      const size_t from = before >= t.size() ? before - t.size() + 1 : 0;
      if (tail_.find(t, from) != std::string::npos) {
        found_ = t;
        return;
      }
    }
    // A long reply keeps only what a match could still begin in.
    if (tail_.size() > 4 * longest_ + 64) tail_.erase(0, tail_.size() - longest_);
  }
  bool seen() const { return !found_.empty(); }
  const std::string& found() const { return found_; }

 private:
  const std::vector<std::string>& texts_;
  StreamingDecoder decoder_;
  std::string tail_;
  size_t longest_ = 0;
  std::string found_;
};

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

const char* const kChatHelp =
    "/image PATH or /video PATH attaches an image or a video to the next message, /clear forgets "
    "the conversation, /quit (or the end of input) exits";
const char* const kChatTerminalHelp = "; Ctrl-C stops a reply, and exits at an empty prompt";

// The exit status of a chat ended by Ctrl-C at its prompt, as a shell reports a command that
// SIGINT ended (and llama-mtmd-cli exits).
constexpr int kExitInterrupted = 128 + SIGINT;

// Multi-turn chat on stdin, as llama-mtmd-cli without -p: one line is one user message; the KV
// cache keeps the conversation, so a turn prefills only its new tokens. Replies stream to stdout
// one per line (with --json, one JSON object per turn instead); the input prompt, notes and
// errors go to stderr, the prompt only when stdin is a terminal, so piped use gives clean stdout.
// A failed command or turn is reported and the chat goes on; the exit code is then 1. On a
// terminal Ctrl-C stops the reply in flight, and ends the chat at an empty prompt; lines are read
// through TerminalLineReader (libedit's editing and history where the build has it), while piped
// input is read as it always was, with Ctrl-C left to end the process.
int run_chat(const ChatRun& run, Qwen3VLModel& model, const GenerationRequest& settings,
             SizedImages first_images, std::vector<VideoClip> first_videos) {
  const GenerateOptions& o = run.options;
  const ModelConfig& cfg = run.config;
  ChatSession session(model, run.tokenizer, run.chat_format, o.system, settings);
  // Each message's images and videos go to the backend as bytes. A video processor config that
  // does not load leaves the chat to images: /video reports it.
  std::optional<PixelTable> video_table;
  try {
    video_table = pixel_table(video_processor(o, cfg).frame);
  } catch (const Error&) {
  }
  session.send_pixels_as_bytes(pixel_table(run.preprocessor), video_table);
  const bool tty = ::isatty(STDIN_FILENO) != 0;
  std::optional<ChatInterrupts> interrupts;
  std::optional<TerminalLineReader> terminal;
  if (tty) {
    interrupts.emplace();
    terminal.emplace(*interrupts);
  }
  std::fprintf(stderr, "chat: each line is a message; %s%s\n", kChatHelp,
               tty ? kChatTerminalHelp : "");
  // The media of the next message: the --image and --video files for the first, then each
  // /image and /video, decoded and preprocessed when given so that a bad file is reported at
  // once. The images at their grids' sizes, the videos, and both kinds in the order attached.
  std::vector<ImageRGB8> images = std::move(first_images.images);
  std::vector<GridTHW> grids(first_images.grid_thw.begin(), first_images.grid_thw.end());
  std::vector<VideoClip> videos = std::move(first_videos);
  std::vector<ChatPart::Kind> media = o.media_order;
  if (media.size() != grids.size() + videos.size()) {
    media.assign(grids.size(), ChatPart::Kind::image);
    media.insert(media.end(), videos.size(), ChatPart::Kind::video);
  }
  // What the attached media take: tokens of the context, and the vision encoder's attention
  // segments (one per image, one per frame pair of a video) and patch rows.
  auto attached_grids = [&] {
    std::vector<GridTHW> all = grids;
    for (const VideoClip& v : videos) all.push_back(v.grid_thw);
    return all;
  };
  auto attached_tokens = [&] {
    int64_t n = 0;
    for (const GridTHW& g : grids) n += image_token_count(g, run.preprocessor);
    for (const VideoClip& v : videos) n += video_tokens(v, cfg);
    return n;
  };
  auto attached_segments = [&] {
    int64_t n = 0;
    for (const GridTHW& g : attached_grids()) n += g[0];
    return n;
  };
  auto clear_attached = [&] {
    images.clear();
    grids.clear();
    videos.clear();
    media.clear();
  };
  // This turn's (for --json) and the whole chat's.
  MediaTimes media_times = run.media, media_total = run.media;
  bool failed = false;
  GenerationTimings total;
  int64_t decode_steps = 0;
  size_t images_sent = 0;
  auto report = [&](const std::string& what) {
    std::fprintf(stderr, "iris generate: error: %s\n", what.c_str());
    failed = true;
  };
  std::optional<std::string> first_message = run.first_message;
  bool quit_by_interrupt = false;
  for (;;) {
    std::string line;
    const bool given = first_message.has_value();
    if (given) {
      line = *first_message;
      first_message.reset();
    } else if (terminal) {
      const TerminalLineReader::Status status = terminal->read(line);
      if (status == TerminalLineReader::Status::end) {
        std::fputs("\n", stderr);
        break;
      }
      if (status == TerminalLineReader::Status::interrupted) {
        std::fputs("\n", stderr);
        // Ctrl-C drops a line being typed, as a shell does; at an empty prompt it ends the chat.
        if (terminal->had_text()) continue;
        quit_by_interrupt = true;
        break;
      }
      if (!trim(line).empty()) terminal->remember(line);
    } else {
      std::fflush(stderr);
      if (!std::getline(std::cin, line)) break;
    }
    if (!given && !line.empty() && line.back() == '\r') line.pop_back();
    // -cnv's prompt is the first message as it stands, whatever it says: no command.
    const std::string command = given ? std::string() : trim(line);
    if (command.empty() && !given) continue;
    if (command == "/quit" || command == "/exit") break;
    if (command == "/clear") {
      session.clear();
      clear_attached();
      std::fputs("(conversation cleared)\n", stderr);
      continue;
    }
    const std::string word = command.substr(0, command.find_first_of(" \t"));
    if (word == "/image") {
      const std::string path = trim(command.substr(word.size()));
      if (path.empty()) {
        report("/image needs a file: /image PATH");
        continue;
      }
      if (static_cast<int>(media.size()) >= kChatMaxImagesPerMessage) {
        report(str_cat("a message may carry ", kChatMaxImagesPerMessage,
                       videos.empty() ? " images" : " images and videos", " at most; ", path,
                       " was not attached"));
        continue;
      }
      try {
        const auto t_pre = std::chrono::steady_clock::now();
        const ImageRGB8 decoded = load_image(path, o.max_image_pixels);
        const double read_ms = ms_since(t_pre);
        const int64_t room =
            o.ctx_size - static_cast<int64_t>(session.conversation().size()) - attached_tokens();
        check_images_fit({path}, {image_tokens_of(decoded, path, run.preprocessor)}, room,
                         str_cat("tokens left in the context (-c/--ctx-size ", o.ctx_size,
                                 ", less the conversation so far and the media attached)"));
        // The message's media are encoded in one call, planned for a number of patches and
        // attention segments.
        const GridTHW grid = image_grid(decoded.height, decoded.width, run.preprocessor);
        const int64_t patches = count_patches(attached_grids()) + grid[0] * grid[1] * grid[2];
        IRIS_CHECK(patches <= model.limits().max_vision_patches, path,
                   " would bring the message's ", videos.empty() ? "images" : "images and videos",
                   " to ", patches, " patches, more than the ", model.limits().max_vision_patches,
                   " the vision encoder was planned for; send the message with the media "
                   "attached so far first, or lower --image-max-tokens");
        IRIS_CHECK(attached_segments() + 1 <= model.limits().max_images, path,
                   " would bring the message's images and video frame pairs to ",
                   attached_segments() + 1, ", more than the ", model.limits().max_images,
                   " the vision encoder was planned for; send the message with the media "
                   "attached so far first");
        SizedImages sized = size_images({decoded}, run.preprocessor);
        for (MediaTimes* m : {&media_times, &media_total}) {
          m->read_ms += read_ms;
          m->preprocess_ms += ms_since(t_pre) - read_ms;
        }
        images.push_back(std::move(sized.images[0]));
        grids.push_back(sized.grid_thw[0]);
        media.push_back(ChatPart::Kind::image);
        std::fprintf(stderr, "(%s attached to the next message)\n", path.c_str());
      } catch (const Error& e) {
        report(e.what());
      }
      continue;
    }
    if (word == "/video") {
      const std::string path = trim(command.substr(word.size()));
      if (path.empty()) {
        report("/video needs a file: /video PATH");
        continue;
      }
      if (static_cast<int>(media.size()) >= kChatMaxImagesPerMessage) {
        report(str_cat("a message may carry ", kChatMaxImagesPerMessage,
                       " images and videos at most; ", path, " was not attached"));
        continue;
      }
      try {
        const auto t_pre = std::chrono::steady_clock::now();
        // Decoded with the family's rules; one that cannot fit what is left of the context or
        // of the encoder's plan is refused from its metadata, before any frame is decoded.
        VideoRoom room;
        room.tokens =
            o.ctx_size - static_cast<int64_t>(session.conversation().size()) - attached_tokens();
        room.context_note = ", less the conversation so far and the media attached";
        room.segments = model.limits().max_images - attached_segments();
        room.patches = model.limits().max_vision_patches - count_patches(attached_grids());
        VideoClip clip = load_video(path, o, cfg, video_processor(o, cfg), room);
        for (MediaTimes* m : {&media_times, &media_total}) m->read_ms += ms_since(t_pre);
        videos.push_back(std::move(clip));
        media.push_back(ChatPart::Kind::video);
        std::fprintf(stderr, "(%s attached to the next message)\n", path.c_str());
      } catch (const Error& e) {
        report(e.what());
      }
      continue;
    }
    if (!command.empty() && command[0] == '/') {
      report(str_cat("unknown chat command ", word, "; ", kChatHelp));
      continue;
    }

    UserMessage message;
    message.text = line;
    for (const ImageRGB8& im : images) message.images.push_back(&im);
    message.grids = grids;
    for (const VideoClip& v : videos) message.videos.push_back(&v);
    message.media = media;
    StreamingDecoder stream(run.tokenizer);
    bool streamed = false;
    ReversePrompts reverse(o.reverse_prompts, run.tokenizer);
    // A reply stops between tokens at a Ctrl-C or a reverse prompt.
    const auto stop = [&] { return (interrupts && interrupts->pending()) || reverse.seen(); };
    try {
      const ChatReply reply = session.send(
          message,
          [&](int32_t tok) {
            reverse.push(tok);
            if (o.json) return;
            std::fputs(stream.push(tok).c_str(), stdout);
            std::fflush(stdout);
            streamed = true;
          },
          stop);
      const GenerationResult& res = reply.result;
      const bool interrupted = res.halted && interrupts && interrupts->pending();
      if (o.json) {
        nlohmann::json j =
            generation_json(res, settings, run.tokenizer, run.backend, run.cuda_graphs);
        j["turn"] = session.turns();
        j["context_tokens"] = session.conversation().size();
        j["context_full"] = reply.context_full;
        j["interrupted"] = interrupted;
        j["reverse_prompt"] = reverse.seen() ? nlohmann::json(reverse.found()) : nullptr;
        add_load_json(j["timings"], session.turns() == 1 ? run.load : LoadTimes{});
        j["timings"]["read_media_ms"] = media_times.read_ms;
        j["timings"]["preprocess_ms"] = media_times.preprocess_ms;
        std::cout << j.dump() << std::endl;
      } else {
        std::fputs(stream.flush().c_str(), stdout);
        std::fputs("\n", stdout);
        std::fflush(stdout);
      }
      if (interrupted)
        std::fprintf(stderr,
                     "(reply stopped by Ctrl-C after %zu token%s; it stays in the conversation)\n",
                     res.tokens.size(), res.tokens.size() == 1 ? "" : "s");
      if (reply.context_full)
        std::fprintf(stderr,
                     "note: the reply stopped at the end of the context (%d tokens, "
                     "-c/--ctx-size); /clear starts a new conversation\n",
                     o.ctx_size);
      const GenerationTimings& t = res.timings;
      total.vision_ms += t.vision_ms;
      total.prefill_ms += t.prefill_ms;
      total.decode_ms += t.decode_ms;
      total.prompt_tokens += t.prompt_tokens;
      total.generated_tokens += t.generated_tokens;
      total.image_patches += t.image_patches;
      images_sent += message.grids.size() + message.videos.size();
      decode_steps += std::max<int64_t>(0, t.generated_tokens - 1);
    } catch (const Error& e) {
      if (streamed) std::fputs((stream.flush() + "\n").c_str(), stdout);
      std::fflush(stdout);
      report(e.what());
    }
    // The media went with this message, whether or not it was answered.
    clear_attached();
    media_times = MediaTimes{};
    if (o.single_turn) break;
  }
  if (!o.json && total.prompt_tokens > 0)
    print_timings(run.load, media_total, images_sent, total,
                  total.decode_ms > 0 ? 1000.0 * double(decode_steps) / total.decode_ms : 0.0,
                  run.backend.name(), settings.sampling.seed);
  if (quit_by_interrupt) return kExitInterrupted;
  return failed ? kExitFailure : 0;
}

// --chat-template as llama.cpp takes it: a template name (here those that apply to Qwen-VL
// models: llama.cpp's chatml and the Qwen families' own), else the template itself; a file is
// taken too, as --chat-template-file.
ChatFormat named_chat_format(const std::string& value, const std::string& model_dir) {
  if (std::optional<ChatFormat> builtin = ChatFormat::builtin(value, {model_dir}))
    return *std::move(builtin);
  std::error_code not_a_file;  // the text of a template is no path (too long, say)
  if (std::filesystem::is_regular_file(value, not_a_file))
    return ChatFormat::from_file(value, "--chat-template", {model_dir});
  if (value.find("{%") != std::string::npos || value.find("{{") != std::string::npos)
    return ChatFormat::from_text(value, "--chat-template", {model_dir});
  std::vector<std::string> names;
  std::string list;
  for (const auto& [name, models] : ChatFormat::builtin_names()) {
    names.push_back(name);
    list += str_cat(list.empty() ? "" : ", ", name, " (", models, ")");
  }
  const std::string near = closest_name(value, names, 2);
  IRIS_USAGE_FAIL("--chat-template '", value, "' is not a template name, a file or Jinja text",
                  near.empty() ? std::string(".") : "; did you mean '" + near + "'?",
                  " The names are ", list,
                  "; llama.cpp's other names are formats of other model families");
}

// The checkpoint's chat template, or --chat-template's or --chat-template-file's, with
// --chat-template-kwargs and --reasoning as its variables.
ChatFormat generate_chat_format(const GenerateOptions& o) {
  ChatFormat chat =
      !o.chat_template.empty() ? named_chat_format(o.chat_template, o.model_dir)
      : o.chat_template_file.empty()
          ? ChatFormat::from_dir(o.model_dir)
          : ChatFormat::from_file(o.chat_template_file, "--chat-template-file", {o.model_dir});
  if (!o.chat_template_kwargs.empty()) {
    IRIS_USAGE_CHECK(json_nesting_depth(o.chat_template_kwargs, kMaxJsonDepth) <= kMaxJsonDepth,
                     "--chat-template-kwargs nests deeper than ", kMaxJsonDepth, " levels");
    nlohmann::ordered_json kwargs;
    try {
      kwargs = nlohmann::ordered_json::parse(o.chat_template_kwargs);
    } catch (const std::exception& e) {
      IRIS_USAGE_FAIL("--chat-template-kwargs is not JSON (", json_error_text(e),
                      "); give an object such as '{\"enable_thinking\": false}'");
    }
    try {
      chat.set_kwargs(kwargs, "--chat-template-kwargs");
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      throw UsageError(e.what());  // the flag's JSON is not an object of template variables
    }
  }
  if (!o.reasoning.empty()) {
    IRIS_USAGE_CHECK(!chat.kwargs().contains("enable_thinking"),
                     "--reasoning and --chat-template-kwargs both set enable_thinking; give one");
    chat.set_kwargs({{"enable_thinking", o.reasoning == "on"}}, "--reasoning");
  }
  if (o.verbose) std::fprintf(stderr, "%s\n", chat.describe().c_str());
  if (!chat.has_template() && !chat.kwargs().empty()) {
    const std::string flag = o.reasoning.empty() ? "--chat-template-kwargs" : "--reasoning";
    if (o.chat_template.empty())
      std::fprintf(stderr,
                   "note: %s has no effect: %s has no chat template, so the built-in ChatML is "
                   "used\n",
                   flag.c_str(), o.model_dir.c_str());
    else
      std::fprintf(stderr,
                   "note: %s has no effect: --chat-template chatml writes the conversation "
                   "alone and takes no template variables\n",
                   flag.c_str());
  }
  return chat;
}

}  // namespace

int run_generate_command(int argc, char** argv) {
  CLI::App app{"Generate text from images and a prompt with a Qwen3-VL checkpoint.",
               "iris generate"};
  app.formatter(std::make_shared<HelpFormatter>());
  app.get_formatter()->column_width(50);
  app.footer(str_cat("Images: ", kImageFormats,
                     "; turned upright by their EXIF orientation\nas transformers' load_image "
                     "turns them. Videos: what OpenCV's FFmpeg backend reads."));
  GenerateOptions o;
  std::vector<std::string> args(argv + 1, argv + argc);
  // Sampling defaults: the checkpoint's generation_config.json, else llama.cpp's; flags win.
  const std::string prescanned_dir = model_dir_in(args);
  const CheckpointSampling ckpt = std::filesystem::is_directory(prescanned_dir)
                                      ? checkpoint_sampling(prescanned_dir)
                                      : CheckpointSampling{};
  auto apply_sampling_defaults = [](GenerateOptions& to, const CheckpointSampling& c) {
    const GenerateOptions fallback;
    to.temp = c.temperature.value_or(fallback.temp);
    to.top_k = c.top_k.value_or(fallback.top_k);
    to.top_p = c.top_p.value_or(fallback.top_p);
    to.min_p = c.min_p.value_or(fallback.min_p);
    to.repeat_penalty = c.repetition_penalty.value_or(fallback.repeat_penalty);
  };
  apply_sampling_defaults(o, ckpt);
  auto from_ckpt = [](const auto& v) {
    return v ? std::string(" (from generation_config.json)") : std::string();
  };
  // Everyday flags first (CLI11's default group), then the rarer ones, the llama.cpp flags that
  // do nothing here, and the graph settings. Descriptions fit one 100-column line beside the name.
  const auto quiet = [](CLI::Validator v) { return v.description(""); };
  app.add_option("-m,--model", o.model_dir, "Hugging Face checkpoint directory")
      ->type_name("DIR")
      ->required();
  auto* lora_opt = app.add_option("--lora", o.lora_dir, "a PEFT LoRA adapter on -m, run unmerged")
                       ->type_name("DIR");
  auto* lora_scale_opt =
      app.add_option("--lora-scale", o.lora_scale, "multiplies the adapter's alpha / r")
          ->capture_default_str();
  auto* lora_merge_opt =
      app.add_flag("--lora-merge", o.lora_merge, "merge it at load: faster, bf16-rounded on a GPU");
  app.add_option("--image", o.images, "formats below; placed at <__media__>, else first")
      ->type_name("FILE");
  app.add_option("--video", o.videos, "repeatable; placed as --image files are")->type_name("FILE");
  auto* prompt_opt =
      app.add_option("-p,--prompt", o.prompt, "the user's text; none: chat on stdin");
  app.add_option("-f,--file", o.prompt_file, "read the user's text from FILE")
      ->type_name("FILE")
      ->excludes(prompt_opt);
  app.add_option("--system-prompt,--system", o.system, "system prompt, also -sys (default none)");
  app.add_option("-n,--n-predict", o.n_predict,
                 "tokens to generate; -1 = until the context is full")
      ->capture_default_str();
  std::vector<CLI::Option*> sampling_opts;
  sampling_opts.push_back(
      app.add_option("--temp,--temperature", o.temp, "0 = greedy" + from_ckpt(ckpt.temperature))
          ->capture_default_str());
  sampling_opts.push_back(
      app.add_option("--top-k", o.top_k, "0 = off" + from_ckpt(ckpt.top_k))->capture_default_str());
  sampling_opts.push_back(
      app.add_option("--top-p", o.top_p, "1 = off" + from_ckpt(ckpt.top_p))->capture_default_str());
  sampling_opts.push_back(
      app.add_option("--min-p", o.min_p, "0 = off" + from_ckpt(ckpt.min_p))->capture_default_str());
  sampling_opts.push_back(app.add_option("--repeat-penalty", o.repeat_penalty,
                                         "1 = off" + from_ckpt(ckpt.repetition_penalty))
                              ->capture_default_str());
  app.add_option("--presence-penalty", o.presence_penalty, "0 = off; per token in the reply, once")
      ->capture_default_str();
  app.add_option("--frequency-penalty", o.frequency_penalty,
                 "0 = off; per time a token is in the reply")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "-1 = random")->capture_default_str();
  app.add_option("-c,--ctx-size", o.ctx_size, "most tokens, prompt and reply together")
      ->capture_default_str();
  app.add_option("-t,--threads", o.threads, "CPU threads; on a GPU only for host work")
      ->default_str(std::to_string(omp_get_max_threads()))
      ->check(quiet(CLI::Range(1, 4096)));
  app.add_option("--image-min-tokens", o.image_min_tokens,
                 "fewest tokens per image (default: the model's)")
      ->check(quiet(CLI::Range(int64_t{1}, int64_t{1} << 30)));
  app.add_option("--image-max-tokens", o.image_max_tokens,
                 "most tokens per image (default: the model's)")
      ->check(quiet(CLI::Range(int64_t{1}, int64_t{1} << 30)));
  app.add_option("--video-fps", o.video_fps, "frames a second, 0 = all (default: the model's)")
      ->check(quiet(CLI::Range(0.0, 1000.0)));
  app.add_option("--video-max-frames", o.video_max_frames,
                 "most frames kept a video (default: the model's)")
      ->check(quiet(CLI::Range(1, 1 << 20)));
  app.add_option("--device", o.device, "cpu, cuda, cuda:N, auto (cuda if there is a GPU)")
      ->capture_default_str();
  app.add_flag("--json", o.json, "one JSON object, not a stream (a chat: one a turn)");
  app.add_option("-r,--reverse-prompt", o.reverse_prompts,
                 "repeatable; a reply stops once it writes TEXT")
      ->type_name("TEXT");
  app.add_option("--reasoning", o.reasoning, "on|off: the template's enable_thinking")
      ->type_name("on|off")
      ->check(quiet(CLI::IsMember({"on", "off"})));

  const std::string more = "Less common";
  app.add_flag("--ignore-eos", o.ignore_eos, "keep generating past end-of-sequence tokens")
      ->group(more);
  app.add_option("--logits-out", o.logits_out, "write the logits after the prompt (safetensors)")
      ->type_name("FILE")
      ->group(more);
  app.add_flag("--tune", o.tune, "time GEMM algorithms and keep them (GPU)")->group(more);
  app.add_option("--max-image-pixels", o.max_image_pixels,
                 "refuse larger images, from the file's header")
      ->check(quiet(CLI::Range(int64_t{1}, int64_t{1} << 40)))
      ->capture_default_str()
      ->group(more);
  app.add_flag("--conversation", o.conversation, "also -cnv; chat, -p/-f the first message")
      ->group(more);
  app.add_flag("--single-turn", o.single_turn, "also -st; chat one message, then exit")
      ->group(more);
  app.add_option("--chat-template", o.chat_template,
                 "chatml, qwen2-vl, qwen3-vl, ...; a FILE; Jinja")
      ->type_name("NAME")
      ->group(more);
  app.add_option("--chat-template-file", o.chat_template_file,
                 "Jinja chat template instead of the model's own")
      ->type_name("FILE")
      ->group(more);
  app.add_option("--chat-template-kwargs", o.chat_template_kwargs,
                 "template variables, e.g. {\"enable_thinking\":false}")
      ->type_name("JSON")
      ->group(more);
  app.add_flag("-v,--verbose", o.verbose, "print the chat template's source and the prompt")
      ->group(more);

  const std::string llama = "llama-mtmd-cli flags with no effect here";
  auto* ngl_opt = app.add_option("--n-gpu-layers,--gpu-layers", o.n_gpu_layers,
                                 "also -ngl; the whole model runs on --device")
                      ->type_name("N")
                      ->group(llama);
  bool jinja = false, no_warmup = false;
  auto* jinja_opt =
      app.add_flag("--jinja", jinja, "templates are always rendered as Jinja")->group(llama);
  auto* warmup_opt =
      app.add_flag("--no-warmup", no_warmup, "there is no warm-up run to skip")->group(llama);
  app.add_flag("--verbose-prompt", o.verbose, "as -v: print the prompt")->group(llama);
  auto* mmproj_opt = app.add_option("--mmproj", o.mmproj, "also -mm; vision weights come from -m")
                         ->type_name("FILE")
                         ->group(llama);

  const std::string graphs_group =
      cuda_available() ? "CUDA graphs (each default holds unless its flag is given)"
                       : "CUDA graphs (GPU only: this machine has none, so they are only checked)";
  app.add_flag("--no-cuda-graphs", o.no_cuda_graphs, "run eagerly; graphs are on by default")
      ->group(graphs_group);
  // Every CUDA graph config key is a flag of the same name (lists comma-separated); they are
  // validated on every backend so a bad combination fails the same way everywhere. The default
  // shown is what this command resolves to when no graph flag is given.
  std::map<std::string, std::string> graph_defaults;
  for (const auto& [key, value] :
       graph_config_values(parse_graph_configs(with_generate_graph_defaults({}))))
    graph_defaults[key] = graph_value_text(value);
  std::map<std::string, std::string> graph_values;
  for (const std::string& key : graph_config_keys()) {
    const std::string flag = graph_config_flag_name(key);
    const auto help = kGraphFlagHelp.find(key);
    const bool listed = help != kGraphFlagHelp.end();
    auto* opt = app.add_option_function<std::string>(
        flag, [&graph_values, key](const std::string& v) { graph_values[key] = v; },
        listed ? help->second : graph_config_key_help(key));
    if (key == "enable_cuda_graph" || key == "external_cuda_graph") opt->expected(0, 1);
    if (!listed) {
      // A new inference key must get a help line; only these may stay out of the help.
      IRIS_CHECK(is_deprecated_graph_config_key(key) || kTrainingOnlyGraphKeys.count(key),
                 "graph key ", key, " has no help line in iris generate");
      opt->group("");
      continue;
    }
    opt->group(graphs_group)
        ->type_name(graph_config_key_doc(key).type.rfind("list", 0) == 0 ? "LIST"
                    : graph_config_key_doc(key).type == "integer"        ? "INT"
                                                                         : "TEXT");
    const std::string d = graph_defaults.at(key);
    opt->default_str(d.empty() ? "\"\"" : d);
  }
  for (size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if (!is_multi_letter_short_flag(args[i])) continue;
    // The value of a text flag may look like one ("-p -abc" is odd but not ours to refuse).
    static const std::set<std::string> kTextFlags = {
        "-p", "--prompt",         "-sys",           "--system", "--system-prompt",
        "-r", "--reverse-prompt", "--chat-template"};
    if (i > 0 && kTextFlags.count(args[i - 1])) continue;
    const auto known = kLlamaSpellings.find(args[i]);
    if (known == kLlamaSpellings.end())
      fail_unknown_flag(args[i], suggestable_flags(app), "iris generate");
    args[i] = known->second;
  }
  // --image and --video may alternate; the media markers take them in the order given.
  for (size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if (args[i] == "--image" || args[i].rfind("--image=", 0) == 0)
      o.media_order.push_back(ChatPart::Kind::image);
    else if (args[i] == "--video" || args[i].rfind("--video=", 0) == 0)
      o.media_order.push_back(ChatPart::Kind::video);
  }
  std::vector<std::string> llama_spellings;
  for (const auto& [spelling, _] : kLlamaSpellings) llama_spellings.push_back(spelling);
  if (!parse_command_line(
          app, args, "iris generate", llama_spellings,
          "quote text with spaces (-p \"two words\") and give each image with --image"))
    return 0;
  // "-mDIR" and other spellings the look-ahead does not read: the defaults follow the directory
  // CLI11 settled on, for the sampling flags not given.
  if (o.model_dir != prescanned_dir && std::filesystem::is_directory(o.model_dir)) {
    GenerateOptions given = o;
    apply_sampling_defaults(o, checkpoint_sampling(o.model_dir));
    if (sampling_opts[0]->count()) o.temp = given.temp;
    if (sampling_opts[1]->count()) o.top_k = given.top_k;
    if (sampling_opts[2]->count()) o.top_p = given.top_p;
    if (sampling_opts[3]->count()) o.min_p = given.min_p;
    if (sampling_opts[4]->count()) o.repeat_penalty = given.repeat_penalty;
  }
  // Without a prompt the command chats, as llama-mtmd-cli does: messages come from stdin. With
  // -cnv it chats anyway, and a prompt given is its first message (llama-cli's conversation).
  const bool chat = (o.prompt_file.empty() && prompt_opt->count() == 0) || o.conversation;
  const bool first_message_given = !o.prompt_file.empty() || prompt_opt->count() > 0;
  if (!o.prompt_file.empty()) {
    o.prompt = read_text_file(o.prompt_file, "prompt file (-f)");
    if (!o.prompt.empty() && o.prompt.back() == '\n') o.prompt.pop_back();
  }
  IRIS_USAGE_CHECK(lora_opt->count() == 0 || !o.lora_dir.empty(),
                   "--lora needs the adapter's directory (adapter_config.json and "
                   "adapter_model.safetensors)");
  IRIS_USAGE_CHECK(!o.lora_dir.empty() || (lora_scale_opt->count() == 0 && !o.lora_merge),
                   lora_merge_opt->count() > 0 ? "--lora-merge" : "--lora-scale",
                   " applies to an adapter: give it with --lora DIR");
  IRIS_USAGE_CHECK(std::isfinite(o.lora_scale), "--lora-scale must be a finite number, got ",
                   o.lora_scale);
  // The logits after "the prompt" name one prompt; a chat has one per turn.
  IRIS_USAGE_CHECK(!chat || o.logits_out.empty(),
                   "--logits-out needs a one-shot prompt (-p TEXT or -f FILE, without "
                   "-cnv/--conversation); a chat has one per turn");
  if (o.threads > 0) omp_set_num_threads(o.threads);
  IRIS_USAGE_CHECK(o.image_min_tokens == 0 || o.image_max_tokens == 0 ||
                       o.image_min_tokens <= o.image_max_tokens,
                   "--image-min-tokens ", o.image_min_tokens, " is above --image-max-tokens ",
                   o.image_max_tokens);
  IRIS_USAGE_CHECK(o.n_predict >= -1, "-n/--n-predict ", o.n_predict,
                   " must be -1 (until the context is full) or at least 0");
  for (const std::string& r : o.reverse_prompts)
    IRIS_USAGE_CHECK(!r.empty(),
                     "-r/--reverse-prompt needs text: an empty one would stop every reply at "
                     "once");
  IRIS_USAGE_CHECK(o.chat_template.empty() || o.chat_template_file.empty(),
                   "--chat-template and --chat-template-file both give a template; give one");
  if (jinja_opt->count() > 0)
    std::fprintf(stderr,
                 "note: --jinja has no effect: iris always renders the checkpoint's Jinja chat "
                 "template\n");
  if (warmup_opt->count() > 0)
    std::fprintf(stderr, "note: --no-warmup has no effect: iris generate runs no warm-up\n");
  if (ngl_opt->count() > 0)
    std::fprintf(stderr,
                 "note: -ngl/--n-gpu-layers has no effect: iris generate runs every layer on "
                 "--device (the GPU when there is one)\n");

  const auto t_load = std::chrono::steady_clock::now();
  LoadTimes load;
  // Graph configs first: a bad combination is an error before anything is loaded.
  // The defaults join the user's settings on every device (they are only used on a GPU), so that
  // a combination is judged the same way with or without one.
  GraphConfigInput graph_input;
  if (o.no_cuda_graphs)
    for (const auto& [k, v] : graph_values) graph_input.emplace_back(k, v.empty() ? "true" : v);
  else
    graph_input = with_generate_graph_defaults(graph_values);
  const std::string device = o.device == "auto" ? (cuda_available() ? "cuda" : "cpu") : o.device;
  const bool on_gpu = device.rfind("cuda", 0) == 0;
  if (on_gpu && o.threads > 0)
    std::fprintf(stderr,
                 "note: -t/--threads sets the CPU threads of host work (image preprocessing, "
                 "weight conversion); the model itself runs on the GPU\n");
  // Every graph key here came from a flag, so a setting refused is a usage error.
  GraphConfigs graphs = [&] {
    try {
      return parse_graph_configs(graph_input);
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      throw UsageError(e.what());
    }
  }();
  for (const std::string& w : graphs.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());

  namespace fs = std::filesystem;
  IRIS_CHECK(!fs::is_regular_file(o.model_dir), "-m ", o.model_dir,
             " is a file; iris reads a Hugging Face checkpoint directory (config.json, "
             "safetensors, tokenizer.json), not a GGUF file");
  IRIS_CHECK(fs::is_directory(o.model_dir), "model directory '", o.model_dir,
             "' does not exist (pass -m with a Hugging Face checkpoint directory)");
  // An adapter where the model belongs, or a LoRA run's checkpoint (adapters beside the base
  // weights), would otherwise fail on a missing config.json or on tensors config.json does not
  // describe; what to do instead is known.
  if (fs::is_regular_file(fs::path(o.model_dir) / "adapter_config.json")) {
    IRIS_CHECK(fs::is_regular_file(fs::path(o.model_dir) / "config.json"), "-m ", o.model_dir,
               " holds a PEFT adapter (adapter_config.json), not a model: pass the base model "
               "with -m and the adapter with --lora ",
               o.model_dir);
    bool adapters = false;
    if (o.lora_dir.empty() &&
        (fs::is_regular_file(fs::path(o.model_dir) / "model.safetensors") ||
         fs::is_regular_file(fs::path(o.model_dir) / "model.safetensors.index.json")))
      for (const std::string& name : SafetensorsCheckpoint(o.model_dir).names())
        adapters = adapters || is_lora_tensor(name);
    IRIS_CHECK(!adapters, "-m ", o.model_dir,
               " is a LoRA run's checkpoint (LoRA adapters beside the base weights): export its "
               "adapter with iris export ",
               o.model_dir,
               " OUT --peft and run -m BASE --lora OUT, or export the merged model "
               "with iris export ",
               o.model_dir, " OUT --merge and run -m OUT");
  }
  if (mmproj_opt->count() > 0) {
    IRIS_CHECK(has_vision_weights(o.model_dir), "--mmproj ", o.mmproj,
               ": iris reads the vision encoder from the checkpoint given with -m, and ",
               o.model_dir, " has no model.visual.* weights; pass the whole Qwen3-VL checkpoint");
    std::fprintf(stderr,
                 "note: --mmproj has no effect: the vision encoder is read from %s, which has "
                 "its weights\n",
                 o.model_dir.c_str());
  }
  if (!o.logits_out.empty()) {
    std::vector<std::string> inputs = o.images;
    inputs.insert(inputs.end(), o.videos.begin(), o.videos.end());
    check_logits_out(o.logits_out, o.model_dir, o.lora_dir, inputs);
  }
  const fs::path tok_path = fs::path(o.model_dir) / "tokenizer.json";
  IRIS_CHECK(fs::exists(tok_path), "no tokenizer.json in ", o.model_dir,
             " (copy the checkpoint's tokenizer.json there)");
  // Parsing tokenizer.json (a JSON of some 11 MB for Qwen) takes longer than creating the device
  // and reading a small model's weights, and needs neither: it runs beside both.
  std::future<Tokenizer> tokenizer_loading =
      std::async(std::launch::async, [path = tok_path.string(), &load] {
        const auto t0 = std::chrono::steady_clock::now();
        Tokenizer tokenizer = Tokenizer::from_file(path);
        load.tokenizer_ms = ms_since(t0);
        return tokenizer;
      });
  const auto t_device = std::chrono::steady_clock::now();
  std::unique_ptr<Backend> backend = make_backend(device);
  load.device_init_ms = ms_since(t_device);
  // Without --tune a GEMM shape takes the tuning cache's algorithm, or cuBLASLt's first choice at
  // once: timing candidates costs a one-shot run more than it saves.
  if (o.tune) {
    if (on_gpu)
      backend->set_gemm_tuning(GemmTuning::tune);
    else
      std::fprintf(stderr, "note: --tune has no effect on the CPU: only GPU GEMMs are tuned\n");
  }
  // The picks timed under --tune go to the cache once the run is done.
  auto save_tuning = [&] {
    if (!o.tune || !on_gpu) return;
    const GemmTuningReport r = backend->gemm_tuning_report();
    // A failed save has said why already (a warning).
    if (backend->save_gemm_tuning())
      std::fprintf(stderr, "note: --tune: %lld GEMM shapes timed, saved to %s\n",
                   static_cast<long long>(r.plans.timed), r.cache_path.c_str());
    else if (r.plans.timed == 0)
      std::fprintf(stderr, "note: --tune: no GEMM shape of this run had candidates to time\n");
  };

  const ChatFormat chat_format = generate_chat_format(o);
  const ModelConfig cfg = ModelConfig::from_file((fs::path(o.model_dir) / "config.json").string());
  GraphModelTraits traits;
  traits.has_deepstack = !cfg.vision.deepstack_visual_indexes.empty();
  traits.spatial_merge_size = cfg.vision.spatial_merge_size;
  PreprocessorConfig pre = model_preprocessor(o.model_dir, cfg);
  // One image token covers a (patch * merge)^2 pixel square, so a token budget is a pixel budget
  // for smart_resize. A single bound given by the user wins over the file's other one when the two
  // would cross.
  const int64_t token_pixels =
      int64_t{pre.patch_size} * pre.merge_size * pre.patch_size * pre.merge_size;
  if (o.image_max_tokens > 0) {
    pre.max_pixels = o.image_max_tokens * token_pixels;
    pre.min_pixels = std::min(pre.min_pixels, pre.max_pixels);
  }
  if (o.image_min_tokens > 0) {
    pre.min_pixels = o.image_min_tokens * token_pixels;
    pre.max_pixels = std::max(pre.max_pixels, pre.min_pixels);
  }
  // A chat may bring images later (/image), but need not: without bounds of the user's own, a
  // small context is left to text.
  const bool image_bounds_given = o.image_min_tokens > 0 || o.image_max_tokens > 0;
  if (!o.images.empty() || (chat && image_bounds_given)) check_image_budget_can_fit(o, pre);

  // Images are decoded before the model is sized so that the vision buffers fit them exactly.
  MediaTimes media_times;
  auto t_media = std::chrono::steady_clock::now();
  std::vector<ImageRGB8> images;
  for (const std::string& path : o.images) images.push_back(load_image(path, o.max_image_pixels));
  const size_t n_images = images.size();
  media_times.read_ms = ms_since(t_media);
  t_media = std::chrono::steady_clock::now();
  {
    std::vector<int64_t> tokens;
    for (size_t i = 0; i < images.size(); ++i)
      tokens.push_back(image_tokens_of(images[i], o.images[i], pre));
    check_images_fit(o.images, tokens, o.ctx_size,
                     str_cat("tokens of the context (-c/--ctx-size ", o.ctx_size, ")"));
  }
  // The images are brought to their grids' sizes here; the backend normalises and patchifies them
  // in the vision encode (VisionPixels).
  SizedImages sized;
  if (!images.empty()) sized = size_images(std::move(images), pre);
  const PixelTable table = pixel_table(pre);
  std::vector<GridTHW> grids(sized.grid_thw.begin(), sized.grid_thw.end());
  media_times.preprocess_ms = ms_since(t_media);
  t_media = std::chrono::steady_clock::now();
  std::vector<VideoClip> clips = load_videos(o, cfg, count_patches(grids));
  media_times.read_ms += ms_since(t_media);
  const double media_ms = media_times.read_ms + media_times.preprocess_ms;
  int64_t patches = count_patches(grids);
  for (const VideoClip& c : clips) patches += c.grid_thw[0] * c.grid_thw[1] * c.grid_thw[2];
  ModelLimits limits;
  limits.max_context = o.ctx_size;
  limits.max_step_tokens = std::min<int64_t>(o.ctx_size, 2048);
  // Each frame pair of a video is an attention segment of its own, as an image is.
  int64_t segments = static_cast<int64_t>(n_images);
  for (const VideoClip& c : clips) segments += c.grid_thw[0];
  limits.max_images = static_cast<int>(std::max<int64_t>(1, segments));
  limits.max_vision_patches = std::max<int64_t>(cfg.vision.merge_unit(), patches);
  if (chat) {
    // A chat's images arrive later (/image), so the encoder is planned for the most one message
    // can bring: its image tokens fit in the context, and each image in the resize budget.
    limits.max_images = std::max(limits.max_images, kChatMaxImagesPerMessage);
    const int64_t per_image = pre.max_pixels / (int64_t{pre.patch_size} * pre.patch_size);
    const int64_t bound =
        std::min(int64_t{o.ctx_size} * cfg.vision.merge_unit(), per_image * limits.max_images);
    limits.max_vision_patches = std::max(limits.max_vision_patches, bound);
    // Vision graphs run every call with the planned segments and the attention kernels pay for
    // the empty ones, so where they run (a GPU, graphs on) a chat plans for video frame pairs
    // only when asked to (--video files, --video-max-frames); elsewhere a larger plan costs
    // nothing per call.
    const bool vision_graphs =
        on_gpu && !o.no_cuda_graphs && graphs.vision.impl != VisionGraphImpl::none;
    const bool videos_asked = !o.videos.empty() || o.video_max_frames > 0;
    if (video_decoding_available() && (!vision_graphs || videos_asked)) {
      // A video (/video) brings one segment per frame pair and patches for every token it takes:
      // the encoder is planned for the most that a message fitting the context can bring, no
      // more frame pairs than kChatMaxImagesPerMessage videos of the video processor's most
      // frames have.
      try {
        const VideoProcessorConfig vpre = video_processor(o, cfg);
        const int64_t tp = vpre.frame.temporal_patch_size;
        const int64_t most = std::min<int64_t>(
            o.ctx_size / fewest_frame_pair_tokens(cfg, vpre),
            int64_t{kChatMaxImagesPerMessage} * ((vpre.max_frames + tp - 1) / tp));
        limits.max_images = static_cast<int>(std::max<int64_t>(limits.max_images, most));
        limits.max_vision_patches =
            std::max(limits.max_vision_patches, int64_t{o.ctx_size} * cfg.vision.merge_unit());
      } catch (const Error&) {
        // A video processor config that does not load is reported at /video.
      }
    }
    if (o.verbose)
      std::fprintf(stderr,
                   "chat: the vision encoder is planned for %d images and video frame pairs, %lld "
                   "patches, a message\n",
                   limits.max_images, static_cast<long long>(limits.max_vision_patches));
  }
  traits.max_vision_seq_length = chat          ? limits.max_vision_patches
                                 : patches > 0 ? patches
                                               : cfg.vision.merge_unit();
  finalize_graph_configs(graphs, traits);
  // Graph buffers are sized only where graphs run: on the CPU the configs were only checked.
  if (on_gpu && !o.no_cuda_graphs && graphs.vision.impl != VisionGraphImpl::none)
    limits.max_vision_patches = std::max(limits.max_vision_patches, graphs.vision.max_seq_length);
  // With --lora the base loads as it would without, then the adapter goes into it (or into its
  // weights, with --lora-merge); cfg stays the base's, which every other part here reads.
  WeightLoadTimes adapter_load;
  std::unique_ptr<Qwen3VLModel> loaded;
  if (o.lora_dir.empty()) {
    loaded = std::make_unique<Qwen3VLModel>(*backend, o.model_dir, limits);
  } else {
    ModelConfig adapted = cfg;
    auto weights = load_weights_with_adapter(*backend, adapted, o.model_dir, o.lora_dir,
                                             o.lora_scale, o.lora_merge, &adapter_load);
    loaded = std::make_unique<Qwen3VLModel>(*backend, adapted, std::move(weights), limits);
  }
  Qwen3VLModel& model = *loaded;
  std::unique_ptr<VisionCudaGraphHelper> graph_helper;
  if (on_gpu && !o.no_cuda_graphs &&
      (graphs.language.impl != GraphImpl::none || graphs.vision.impl != VisionGraphImpl::none)) {
    graph_helper = std::make_unique<VisionCudaGraphHelper>(model, split_stages(cfg, 1)[0], graphs);
    model.attach_graphs(graph_helper.get());
  }
  const Tokenizer tokenizer = tokenizer_loading.get();
  // Prompt ids index the embedding table: a tokenizer larger than the model's vocabulary would
  // read past it.
  IRIS_CHECK(tokenizer.vocab_size() <= cfg.text.vocab_size, tok_path.string(), " has ",
             tokenizer.vocab_size(), " token ids but config.json's text_config.vocab_size is ",
             cfg.text.vocab_size, "; the tokenizer belongs to another model");
  check_vision_token_ids(tokenizer, tok_path.string(), cfg.image_token_id, cfg.video_token_id,
                         cfg.vision_start_token_id, cfg.vision_end_token_id,
                         (fs::path(o.model_dir) / "config.json").string());
  load.total_ms = ms_since(t_load) - media_ms;
  load.weights = o.lora_dir.empty() ? model.weight_load_times() : adapter_load;

  GenerationRequest req;
  // -1: as many as the context holds (a chat clamps each turn to the room left).
  req.max_new_tokens = o.n_predict < 0 ? o.ctx_size : o.n_predict;
  if (!o.ignore_eos)
    req.stop_ids =
        default_stop_ids(o.model_dir, [&](const std::string& t) { return tokenizer.token_id(t); });
  req.sampling.temperature = o.temp;
  req.sampling.top_k = o.top_k;
  req.sampling.top_p = o.top_p;
  req.sampling.min_p = o.min_p;
  req.sampling.repetition_penalty = o.repeat_penalty;
  req.sampling.presence_penalty = o.presence_penalty;
  req.sampling.frequency_penalty = o.frequency_penalty;
  req.sampleable = sampleable_ids(tokenizer, cfg.text.vocab_size);
  req.sampling.seed = o.seed >= 0 ? static_cast<uint64_t>(o.seed) : std::random_device{}();
  if (chat) {
    ChatRun run{o,    tokenizer,  chat_format, pre, cfg, *backend, graph_helper != nullptr,
                load, media_times};
    if (first_message_given) run.first_message = o.prompt;
    const int rc = run_chat(run, model, req, std::move(sized), std::move(clips));
    save_tuning();
    return rc;
  }

  std::vector<ChatMessage> messages;
  if (!o.system.empty()) messages.push_back({"system", {ChatPart::make_text(o.system)}});
  std::vector<ChatPart::Kind> media = o.media_order;
  if (media.size() != n_images + clips.size()) {
    media.assign(n_images, ChatPart::Kind::image);
    media.insert(media.end(), clips.size(), ChatPart::Kind::video);
  }
  messages.push_back(user_message(o.prompt, media));
  const std::string prompt_text = chat_format.render(messages, true);
  if (o.verbose) std::fprintf(stderr, "prompt:\n%s\n", prompt_text.c_str());
  // A video's bytes normalise with its own processor's statistics. Both tables outlive req.
  const PixelTable video_table =
      clips.empty() ? PixelTable{} : pixel_table(video_processor(o, cfg).frame);
  if (clips.empty()) {
    req.prompt_ids = encode_chat_text(tokenizer, prompt_text, grids, cfg.vision.spatial_merge_size);
    if (patches > 0) req.pixel_values = VisionPixels(sized.images, table);
    req.grids = grids;
  } else {
    std::vector<const VideoClip*> videos;
    for (const VideoClip& c : clips) videos.push_back(&c);
    MediaPrompt mp = encode_media_prompt(tokenizer, prompt_text, cfg, grids, videos);
    VisionPixels pixels;
    for (const MediaPrompt::Item& item : mp.media_order) {
      VisionMedia m;
      if (item.video) {
        const VideoClip& c = clips[item.index];
        for (const ImageRGB8& f : c.frames) m.frames.push_back(&f);
        m.table = &video_table;
        req.grids.push_back(c.grid_thw);
      } else {
        m.frames = {&sized.images[item.index]};
        m.table = &table;
        req.grids.push_back(grids[item.index]);
      }
      pixels.media.push_back(std::move(m));
    }
    req.prompt_ids = std::move(mp.ids);
    req.runs = std::move(mp.runs);
    req.pixel_values = std::move(pixels);
  }
  req.keep_prompt_logits = !o.logits_out.empty();
  StreamingDecoder stream(tokenizer);
  if (o.n_predict < 0)
    req.max_new_tokens = static_cast<int>(
        std::max<int64_t>(0, int64_t{o.ctx_size} - static_cast<int64_t>(req.prompt_ids.size())));
  ReversePrompts reverse(o.reverse_prompts, tokenizer);
  const GenerationResult res = generate(
      model, req,
      [&](int32_t tok) {
        reverse.push(tok);
        if (o.json) return;
        std::fputs(stream.push(tok).c_str(), stdout);
        std::fflush(stdout);
      },
      [&] { return reverse.seen(); });
  const GenerationTimings& t = res.timings;
  if (!o.logits_out.empty())
    write_safetensors(o.logits_out, {{"logits",
                                      DType::f32,
                                      {static_cast<int64_t>(res.prompt_logits.size())},
                                      res.prompt_logits.data()}});
  if (o.json) {
    nlohmann::json j = generation_json(res, req, tokenizer, *backend, graph_helper != nullptr);
    j["reverse_prompt"] = reverse.seen() ? nlohmann::json(reverse.found()) : nullptr;
    add_load_json(j["timings"], load);
    j["timings"]["read_media_ms"] = media_times.read_ms;
    j["timings"]["preprocess_ms"] = media_times.preprocess_ms;
    std::cout << j.dump() << std::endl;
  } else {
    std::fputs(stream.flush().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    print_timings(load, media_times, n_images + clips.size(), t, t.decode_tokens_per_s(),
                  backend->name(), req.sampling.seed);
  }
  save_tuning();
  return 0;
}

}  // namespace iris
