// A synthetic captioning task small enough for a tiny model to learn in minutes on a CPU:
// one or two flat-coloured shapes on a plain background, captioned "a red circle" or
// "a red circle above a blue square".
//
// Vocabulary: colours red, green, blue, yellow; shapes circle, square, triangle; relations above,
// below, left of, right of. Two shapes always have different colours and sit in opposite halves of
// the image (top/bottom or left/right), so the relation is never ambiguous, and the shape whose
// colour comes first in the order red, green, blue, yellow is named first: every image has exactly
// one correct caption, which is what makes the task learnable rather than a coin toss.
//
// Vision tokens: images are square, image_size px a side. smart_resize raises every image to at
// least min_pixels, and Qwen3-VL's default (size.shortest_edge = 65536) turns a 64 px image into
// 256x256, i.e. 64 vision tokens. With min_pixels <= image_size^2 (e.g. shortest_edge 4096 for
// 64 px), a multiple of 32 is kept as is: 64 px -> 4 tokens, 96 -> 9, 128 -> 16.
// shapes_vision_tokens() computes the count for any preprocessor config.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {

inline constexpr const char* kShapesPrompt = "Describe the image.";
inline constexpr const char* kShapesLockFile = ".iris-data.lock";

struct ShapeInstance {
  std::string shape;   // circle, square or triangle
  std::string colour;  // red, green, blue or yellow
  int x = 0, y = 0;    // top-left of the bounding square
  int size = 0;        // side of the bounding square, px
  int centre_x() const { return x + size / 2; }
  int centre_y() const { return y + size / 2; }
};

struct ShapesScene {
  ImageRGB8 image;
  std::vector<ShapeInstance> shapes;  // in caption order
  std::string relation;               // empty for one shape; else "above", "left of", ...
  std::string caption;
};

// Scene `index` of the dataset drawn from `seed`; it depends on nothing else, so a dataset's first
// k scenes are the same whatever its size.
ShapesScene make_shapes_scene(uint64_t seed, int64_t index, int image_size = 64);

// Writes out_dir/images/NNNNNN.png and out_dir/train.jsonl + out_dir/heldout.jsonl in the HF
// messages format (user: the image, then kShapesPrompt; assistant: the caption). The last
// round(n * heldout_fraction) scenes are held out. Each line also carries a "shapes" list
// (shape, colour, x, y, size), which the loader ignores. Image paths are relative to out_dir.
// A directory that already holds a dataset (train.jsonl, heldout.jsonl or images/) is an error
// unless `replace` is set. One writer at a time: out_dir/kShapesLockFile is locked while it
// writes, and a second writer fails at once naming the first one's pid. The images are written
// into a fresh directory that then replaces images/, so no file of the old dataset is written to.
void write_shapes_dataset(const std::string& out_dir, int n, uint64_t seed, double heldout_fraction,
                          int image_size = 64, bool replace = false);

// <|image_pad|> tokens a shapes image of this size becomes under `pp`.
int64_t shapes_vision_tokens(int image_size, const PreprocessorConfig& pp);

// Colour, shape and relation words of a predicted caption compared with the reference, position
// by position in order of appearance ("a blue square above a red circle" against "a red circle
// above a blue square" matches neither colour nor shape). Sum scores with += for an accuracy.
struct ShapesScore {
  int colour_hits = 0, colours = 0;
  int shape_hits = 0, shapes = 0;
  int relation_hits = 0, relations = 0;
  int exact = 0, captions = 0;  // same words, ignoring case, spacing and punctuation

  ShapesScore& operator+=(const ShapesScore& o);
  double colour_accuracy() const { return colours ? double(colour_hits) / colours : 0.0; }
  double shape_accuracy() const { return shapes ? double(shape_hits) / shapes : 0.0; }
  double relation_accuracy() const { return relations ? double(relation_hits) / relations : 0.0; }
  double exact_accuracy() const { return captions ? double(exact) / captions : 0.0; }
};
ShapesScore score_shapes_caption(const std::string& predicted, const std::string& reference);

}  // namespace iris
