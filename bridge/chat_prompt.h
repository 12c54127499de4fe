// Conversations as the model saw them in training: the checkpoint's own chat template, rendered as
// transformers' apply_chat_template renders it (chat_template/jinja.h), for `iris generate`, the
// interactive chat and the training data alike, so that inference and training cannot drift.
//
// The template is looked up as transformers' processor and tokenizer look for it: the model
// directory's chat_template.jinja, else the "chat_template" of chat_template.json, else that of
// tokenizer_config.json. A checkpoint with none gets the built-in ChatML that Qwen3-VL Instruct's
// template writes for plain conversations (no default system prompt):
//   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
//
// The template writes each image as <|vision_start|><|image_pad|><|vision_end|>; encode_chat_text
// then gives image k grid_t * grid_h * grid_w / merge^2 pads, as HF's processor expands them.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bridge/rope_index.h"
#include "language/tokenizer.h"
#include "vision/vision_encoder.h"

namespace iris {

namespace jinja {
class Template;
}
struct ModelConfig;
struct VideoClip;

// llama-mtmd-cli's default media marker.
inline constexpr std::string_view kMediaMarker = "<__media__>";

struct ChatPart {
  enum class Kind { text, image, video };
  Kind kind = Kind::text;
  std::string text;  // text parts only; image (video) parts take the next image (video) in order

  static ChatPart make_text(std::string t) { return {Kind::text, std::move(t)}; }
  static ChatPart make_image() { return {Kind::image, {}}; }
  static ChatPart make_video() { return {Kind::video, {}}; }
};

// A message as transformers takes it: content without images is a string, content with images a
// list of {"type": "image"} and {"type": "text", "text": ...} items.
struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::vector<ChatPart> content;
};

// A user message from a command-line prompt: the images before the text (as HF's processor renders
// content [image..., text]), or, as in llama-mtmd-cli, image i where the text's marker i is
// (content [text, image, text, ...]). Markers, when present, must be exactly one per image.
ChatMessage user_message(const std::string& text, size_t n_images);
// The same with images and videos: `media` lists their kinds (ChatPart::Kind::image or video) in
// the order they were given; marker i takes media i.
ChatMessage user_message(const std::string& text, const std::vector<ChatPart::Kind>& media);

// <|image_pad|> tokens one image expands to.
int64_t image_token_count(const GridTHW& grid, int merge_size = 2);

class ChatFormat {
 public:
  // The built-in ChatML.
  ChatFormat();
  ~ChatFormat();
  ChatFormat(const ChatFormat&);
  ChatFormat& operator=(const ChatFormat&);

  // The template of a checkpoint or tokenizer directory, and the special tokens (bos_token,
  // eos_token, pad_token, unk_token) of its tokenizer_config.json, which transformers also passes
  // to the template. No template there: the built-in ChatML.
  static ChatFormat from_dir(const std::string& dir);
  // The first of `dirs` that has a template (training looks in model.hf_dir, then beside the
  // tokenizer); the special tokens from the first with a tokenizer_config.json.
  static ChatFormat from_dirs(const std::vector<std::string>& dirs);
  // A template file given by the user (--chat-template-file, data.chat_template): Jinja text, or
  // a JSON file with a "chat_template" string (chat_template.json, tokenizer_config.json). The
  // special tokens come from `special_tokens_dirs` as for from_dirs. `what` names the option in
  // errors.
  static ChatFormat from_file(const std::string& path, const std::string& what,
                              const std::vector<std::string>& special_tokens_dirs = {});
  // Template text given on the command line (llama.cpp's --chat-template JINJA); `what` names it
  // in errors.
  static ChatFormat from_text(const std::string& text, const std::string& what,
                              const std::vector<std::string>& special_tokens_dirs = {});
  // A template Iris carries, by name: "chatml" (the built-in ChatML, as llama.cpp names it) and
  // the Qwen families' own, as Hugging Face ships them (qwen2-vl, qwen3-vl, ...: builtin_names());
  // nothing when `name` is none of them.
  static std::optional<ChatFormat> builtin(
      const std::string& name, const std::vector<std::string>& special_tokens_dirs = {});
  // The names builtin() takes, each with the models whose template it is.
  static std::vector<std::pair<std::string, std::string>> builtin_names();

  bool has_template() const { return template_ != nullptr; }
  // Where the template came from ("DIR/tokenizer_config.json"); empty for the built-in ChatML.
  const std::string& source() const { return source_; }
  const std::string& template_text() const { return text_; }
  // One line for verbose output: the template's source, or that the built-in ChatML is used and
  // where no template was found.
  std::string describe() const;

  // Extra template variables, as apply_chat_template's keyword arguments (enable_thinking,
  // add_vision_id, ...): a JSON object. `what` names where they came from in errors.
  void set_kwargs(const nlohmann::ordered_json& kwargs, const std::string& what);
  const nlohmann::ordered_json& kwargs() const { return kwargs_; }

  // The conversation as text, each image written once as <|image_pad|> between
  // <|vision_start|> and <|vision_end|>, then (add_generation_prompt) the start of the reply.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  std::shared_ptr<const jinja::Template> template_;
  std::string source_, text_;
  std::string searched_;  // where no template was found (for describe())
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  nlohmann::ordered_json kwargs_ = nlohmann::ordered_json::object();
};

// Tokenizes rendered chat text and expands the k-th <|image_pad|> to grid k's token count, as
// HF's processor does before tokenizing. The pads must be one per grid: a template that drops
// or repeats an image (or text that spells <|image_pad|>) is an error.
std::vector<int32_t> encode_chat_text(const Tokenizer& tokenizer, const std::string& text,
                                      const std::vector<GridTHW>& image_grids, int merge_size);

// A prompt with images and videos, as HF's processor makes it: each video's block in the rendered
// text (<|vision_start|><|video_pad|><|vision_end|>) rewritten as its family writes videos
// (Architecture::video_prompt_text), the text tokenized, then each <|image_pad|> expanded to its
// image's tokens and each <|video_pad|> to its run's. `media_order` lists the images and videos
// as their pads come in the prompt (the order their pixel rows go to the vision tower), `runs`
// their pad runs in that order.
struct MediaPrompt {
  std::vector<int32_t> ids;
  std::vector<VisionRun> runs;
  struct Item {
    bool video = false;
    size_t index = 0;  // into the images or the videos
  };
  std::vector<Item> media_order;
};
MediaPrompt encode_media_prompt(const Tokenizer& tokenizer, const std::string& text,
                                const ModelConfig& cfg, const std::vector<GridTHW>& image_grids,
                                const std::vector<const VideoClip*>& videos);

// The tokenizer writes the vision tokens (<|image_pad|>, <|video_pad|>, <|vision_start|>,
// <|vision_end|>) with the ids config.json gives the model (image_token_id, ...): a mismatch is
// an error naming both files, which otherwise surfaces as a template or pad-count error.
void check_vision_token_ids(const Tokenizer& tokenizer, const std::string& tokenizer_name,
                            int32_t image_token_id, int32_t video_token_id,
                            int32_t vision_start_token_id, int32_t vision_end_token_id,
                            const std::string& config_name);

// The prompt for one user message (with an optional system message) and the generation prompt:
// what `iris generate -p` and the shapes evaluation feed the model.
std::vector<int32_t> build_generation_prompt(const Tokenizer& tokenizer, const ChatFormat& format,
                                             const std::vector<GridTHW>& image_grids,
                                             const std::string& user_text,
                                             const std::string& system_text,
                                             int spatial_merge_size = 2);

}  // namespace iris
