#include "bridge/chat_prompt.h"

#include "core/error.h"

namespace iris {

namespace {

void append_image(std::string& s, const GridTHW& g, int m) {
  const int64_t n = g[0] * g[1] * g[2] / (int64_t(m) * m);
  s += "<|vision_start|>";
  s.reserve(s.size() + static_cast<size_t>(n) * 13 + 64);
  for (int64_t i = 0; i < n; ++i) s += "<|image_pad|>";
  s += "<|vision_end|>";
}

size_t count_markers(const std::string& text) {
  size_t n = 0;
  for (size_t at = text.find(kMediaMarker); at != std::string::npos;
       at = text.find(kMediaMarker, at + kMediaMarker.size()))
    ++n;
  return n;
}

}  // namespace

std::string render_generation_prompt(const std::vector<GridTHW>& grids, const std::string& user,
                                     const std::string& system, int m) {
  std::string s;
  if (!system.empty()) s += "<|im_start|>system\n" + system + "<|im_end|>\n";
  return s + render_user_turn(grids, user, m);
}

std::string render_user_turn(const std::vector<GridTHW>& grids, const std::string& user, int m) {
  std::string s = "<|im_start|>user\n";
  const size_t markers = count_markers(user);
  if (markers == 0) {
    for (const GridTHW& g : grids) append_image(s, g, m);
    s += user;
  } else {
    IRIS_CHECK(
        markers == grids.size(), "the prompt has ", markers, " ", kMediaMarker, " marker",
        markers == 1 ? "" : "s", " but ", grids.size(), " image",
        grids.size() == 1 ? " was" : "s were",
        " given (--image or /image); write one marker per image, or none to put the images before "
        "the text");
    size_t pos = 0;
    for (const GridTHW& g : grids) {
      const size_t at = user.find(kMediaMarker, pos);
      s.append(user, pos, at - pos);
      append_image(s, g, m);
      pos = at + kMediaMarker.size();
    }
    s.append(user, pos, std::string::npos);
  }
  s += "<|im_end|>\n<|im_start|>assistant\n";
  return s;
}

std::vector<int32_t> build_generation_prompt(const Tokenizer& tok,
                                             const std::vector<GridTHW>& grids,
                                             const std::string& user, const std::string& system,
                                             int m) {
  return tok.encode(render_generation_prompt(grids, user, system, m));
}

}  // namespace iris
