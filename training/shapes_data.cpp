#include "training/shapes_data.h"

#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/splitmix.h"

#include <stb_image_write.h>  // the implementation is compiled into vision/image.cpp

namespace iris {

namespace {

struct Colour {
  const char* name;
  std::array<uint8_t, 3> rgb;
};
// Saturated enough to stand apart from any grey background, light or dark.
constexpr std::array<Colour, 4> kColours = {{{"red", {220, 40, 40}},
                                             {"green", {40, 170, 60}},
                                             {"blue", {40, 90, 230}},
                                             {"yellow", {240, 210, 40}}}};
constexpr std::array<const char*, 3> kShapes = {"circle", "square", "triangle"};
constexpr std::array<const char*, 4> kRelations = {"above", "below", "left", "right"};

bool inside(const ShapeInstance& s, int px, int py) {
  const double u = px + 0.5, v = py + 0.5;
  const double half = s.size / 2.0;
  const double cx = s.x + half, cy = s.y + half;
  if (s.shape == "square") return u >= s.x && u < s.x + s.size && v >= s.y && v < s.y + s.size;
  if (s.shape == "circle") return (u - cx) * (u - cx) + (v - cy) * (v - cy) <= half * half;
  // Triangle: apex at the top middle, base along the bottom edge.
  return v >= s.y && v <= s.y + s.size && std::fabs(u - cx) <= (v - s.y) / 2.0;
}

void draw(ImageRGB8& img, const ShapeInstance& s, const std::array<uint8_t, 3>& rgb) {
  for (int py = s.y; py < s.y + s.size; ++py) {
    for (int px = s.x; px < s.x + s.size; ++px) {
      if (!inside(s, px, py)) continue;
      uint8_t* p = &img.pixels[(static_cast<size_t>(py) * img.width + px) * 3];
      p[0] = rgb[0];
      p[1] = rgb[1];
      p[2] = rgb[2];
    }
  }
}

// write_png fsyncs every file, which makes thousands of small images take many seconds; a generated
// dataset is cheap to recreate, so only the JSONL files (written last) are made durable. The file
// is new (O_EXCL, no link followed) in a directory this process made.
void write_png_fast(const std::string& path, const ImageRGB8& img) {
  std::string png;
  const int ok = stbi_write_png_to_func(
      [](void* ctx, void* data, int size) {
        static_cast<std::string*>(ctx)->append(static_cast<const char*>(data),
                                               static_cast<size_t>(size));
      },
      &png, img.width, img.height, 3, img.pixels.data(), img.width * 3);
  IRIS_CHECK(ok != 0 && !png.empty(), "PNG encoding of ", path, " failed");
  write_new_file(path, png);
}

std::string describe(const ShapeInstance& s) {
  return "a " + s.colour + " " + s.shape;
}

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::string cur;
  for (char c : text) {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      cur += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!cur.empty()) {
      words.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

template <size_t N>
std::vector<std::string> keep(const std::vector<std::string>& words,
                              const std::array<const char*, N>& vocab) {
  std::vector<std::string> out;
  for (const std::string& w : words)
    for (const char* v : vocab)
      if (w == v) out.push_back(w);
  return out;
}

void match(const std::vector<std::string>& pred, const std::vector<std::string>& ref, int& hits,
           int& total) {
  total += static_cast<int>(ref.size());
  for (size_t i = 0; i < ref.size() && i < pred.size(); ++i) hits += pred[i] == ref[i];
}

}  // namespace

ShapesScene make_shapes_scene(uint64_t seed, int64_t index, int image_size) {
  IRIS_CHECK(image_size >= 32 && image_size <= 1024, "shapes image_size = ", image_size,
             " must be in [32, 1024] px");
  IRIS_CHECK(index >= 0, "shapes scene index ", index, " must not be negative");
  SplitMix64 base(seed);
  SplitMix64 rng(base.next() ^ (static_cast<uint64_t>(index) * 0xD1B54A32D192ED03ull));
  const int S = image_size;
  ShapesScene scene;
  scene.image.width = scene.image.height = S;
  scene.image.pixels.resize(static_cast<size_t>(S) * S * 3);
  const bool dark = rng.uniform_int(0, 1) == 1;
  const int grey = dark ? rng.uniform_int(20, 60) : rng.uniform_int(190, 235);
  for (int c = 0; c < 3; ++c) {
    const auto v = static_cast<uint8_t>(grey + rng.uniform_int(-8, 8));
    for (size_t i = static_cast<size_t>(c); i < scene.image.pixels.size(); i += 3)
      scene.image.pixels[i] = v;
  }

  auto pick_shape = [&](int colour, int lo, int hi) {
    ShapeInstance s;
    s.colour = kColours[static_cast<size_t>(colour)].name;
    s.shape = kShapes[static_cast<size_t>(rng.uniform_int(0, 2))];
    s.size = rng.uniform_int(lo, hi);
    return s;
  };

  if (rng.uniform_int(0, 1) == 0) {
    const int colour = rng.uniform_int(0, 3);
    ShapeInstance s = pick_shape(colour, S * 3 / 10, S * 11 / 20);
    s.x = rng.uniform_int(0, S - s.size);
    s.y = rng.uniform_int(0, S - s.size);
    draw(scene.image, s, kColours[static_cast<size_t>(colour)].rgb);
    scene.caption = describe(s);
    scene.shapes.push_back(std::move(s));
    return scene;
  }

  // Two shapes in opposite halves; the one of the earlier colour is named first.
  int c0 = rng.uniform_int(0, 3), c1 = rng.uniform_int(0, 2);
  if (c1 >= c0) ++c1;
  if (c1 < c0) std::swap(c0, c1);
  const bool vertical = rng.uniform_int(0, 1) == 0;
  const bool first_in_first_half = rng.uniform_int(0, 1) == 0;
  const int half = S / 2;
  std::array<ShapeInstance, 2> two = {pick_shape(c0, S * 22 / 100, S * 42 / 100),
                                      pick_shape(c1, S * 22 / 100, S * 42 / 100)};
  for (int k = 0; k < 2; ++k) {
    ShapeInstance& s = two[static_cast<size_t>(k)];
    const bool in_first_half = (k == 0) == first_in_first_half;
    const int along =
        in_first_half ? rng.uniform_int(0, half - s.size) : rng.uniform_int(half, S - s.size);
    const int across = rng.uniform_int(0, S - s.size);
    s.x = vertical ? across : along;
    s.y = vertical ? along : across;
    draw(scene.image, s, kColours[static_cast<size_t>(k == 0 ? c0 : c1)].rgb);
  }
  scene.relation = vertical ? (first_in_first_half ? "above" : "below")
                            : (first_in_first_half ? "left of" : "right of");
  scene.caption = describe(two[0]) + " " + scene.relation + " " + describe(two[1]);
  scene.shapes = {two[0], two[1]};
  return scene;
}

void write_shapes_dataset(const std::string& out_dir, int n, uint64_t seed, double heldout_fraction,
                          int image_size, bool replace) {
  IRIS_CHECK(!out_dir.empty(), "the output directory is empty; name one with --out");
  IRIS_CHECK(n >= 1, "shapes dataset size n = ", n, " must be at least 1");
  IRIS_CHECK(heldout_fraction >= 0.0 && heldout_fraction < 1.0,
             "heldout_fraction = ", heldout_fraction, " must be in [0, 1)");
  const auto heldout = static_cast<int>(std::llround(n * heldout_fraction));
  IRIS_CHECK(heldout < n, "heldout_fraction ", heldout_fraction, " of ", n,
             " scenes leaves nothing to train on; lower it or raise n");
  namespace fs = std::filesystem;
  const fs::path dir(out_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  IRIS_CHECK(!ec, "cannot create --out ", out_dir, ": ", ec.message());
  // One writer at a time: two at once would mix one seed's images with the other's captions.
  const DirectoryLock lock(out_dir, kShapesLockFile, "--out",
                           "another iris data shapes is writing a dataset there: wait for it to "
                           "end, or choose another --out");
  // Checked under the lock, so that a writer that finished a moment ago counts.
  const auto present = [&](const char* part) {
    std::error_code ignored;
    return fs::exists(fs::symlink_status(dir / part, ignored));
  };
  if (!replace)
    for (const char* part : {"train.jsonl", "heldout.jsonl", "images"})
      IRIS_CHECK(!present(part), out_dir, " already holds a dataset (", part,
                 "); choose another --out, or pass --force to replace it");
  remove_abandoned_temp_dirs(out_dir);

  // The images go into a fresh directory that replaces images/ whole: nothing in the old one
  // (a symbolic link planted among the PNGs included) is ever written through.
  OwnedTempDir images((dir / "images").string());
  std::string train, held;
  for (int i = 0; i < n; ++i) {
    const ShapesScene scene = make_shapes_scene(seed, i, image_size);
    char file[16];
    std::snprintf(file, sizeof(file), "%06d.png", i);
    write_png_fast((fs::path(images.path()) / file).string(), scene.image);
    const std::string name = std::string("images/") + file;
    nlohmann::ordered_json shapes = nlohmann::ordered_json::array();
    for (const ShapeInstance& s : scene.shapes)
      shapes.push_back(
          {{"shape", s.shape}, {"colour", s.colour}, {"x", s.x}, {"y", s.y}, {"size", s.size}});
    const nlohmann::ordered_json line = {
        {"messages",
         {{{"role", "user"},
           {"content",
            {{{"type", "image"}, {"image", name}}, {{"type", "text"}, {"text", kShapesPrompt}}}}},
          {{"role", "assistant"}, {"content", scene.caption}}}},
        {"shapes", shapes}};
    (i < n - heldout ? train : held) += line.dump() + "\n";
  }
  // The old lists go before the old images: a kill from here on leaves a folder without
  // train.jsonl, never one whose lines describe other images. A link is removed, not its target.
  if (replace)
    for (const char* list : {"train.jsonl", "heldout.jsonl"}) {
      fs::remove(dir / list, ec);
      IRIS_CHECK(!ec, "cannot remove the old ", (dir / list).string(), ": ", ec.message());
    }
  images.commit(replace);
  write_file_atomic((dir / "heldout.jsonl").string(), held);
  write_file_atomic((dir / "train.jsonl").string(), train);
}

int64_t shapes_vision_tokens(int image_size, const PreprocessorConfig& pp) {
  pp.validate();
  int h = image_size, w = image_size;
  if (pp.do_resize) {
    const ResizedSize s =
        smart_resize(h, w, pp.patch_size * pp.merge_size, pp.min_pixels, pp.max_pixels);
    h = s.height;
    w = s.width;
  }
  const int64_t m2 = int64_t{pp.merge_size} * pp.merge_size;
  return int64_t{h / pp.patch_size} * (w / pp.patch_size) / m2;
}

ShapesScore& ShapesScore::operator+=(const ShapesScore& o) {
  colour_hits += o.colour_hits;
  colours += o.colours;
  shape_hits += o.shape_hits;
  shapes += o.shapes;
  relation_hits += o.relation_hits;
  relations += o.relations;
  exact += o.exact;
  captions += o.captions;
  return *this;
}

ShapesScore score_shapes_caption(const std::string& predicted, const std::string& reference) {
  const std::vector<std::string> pw = words_of(predicted), rw = words_of(reference);
  std::array<const char*, kColours.size()> colour_names{};
  for (size_t i = 0; i < kColours.size(); ++i) colour_names[i] = kColours[i].name;
  ShapesScore s;
  match(keep(pw, colour_names), keep(rw, colour_names), s.colour_hits, s.colours);
  match(keep(pw, kShapes), keep(rw, kShapes), s.shape_hits, s.shapes);
  match(keep(pw, kRelations), keep(rw, kRelations), s.relation_hits, s.relations);
  s.exact = pw == rw;
  s.captions = 1;
  return s;
}

}  // namespace iris
