// The synthetic shapes dataset: files and splits, determinism, captions that agree with the pixels
// (checked by classifying colours and shapes from the image itself), and the caption scorer.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"
#include "training/dataset.h"
#include "training/shapes_data.h"
#include "vision/image.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using test::scratch_dir;

using test::error_of;

std::vector<json> read_jsonl(const fs::path& p) {
  std::vector<json> out;
  std::istringstream in(read_text_file(p.string()));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

// Colour of a pixel judged from its channels alone, independently of the generator's palette;
// "" for the grey background.
std::string colour_name(const uint8_t* p) {
  const int r = p[0], g = p[1], b = p[2];
  if (r > 150 && g > 150 && b < 100) return "yellow";
  if (r > 150 && g < 100 && b < 100) return "red";
  if (g > 120 && r < 100 && b < 100) return "green";
  if (b > 150 && r < 100 && g < 150) return "blue";
  return "";
}

struct Blob {
  int count = 0, x0 = 1 << 30, y0 = 1 << 30, x1 = -1, y1 = -1;  // inclusive bounds
  double fill() const { return double(count) / ((x1 - x0 + 1) * (y1 - y0 + 1)); }
};

std::map<std::string, Blob> blobs(const ImageRGB8& img) {
  std::map<std::string, Blob> out;
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width; ++x) {
      const uint8_t* p = &img.pixels[(static_cast<size_t>(y) * img.width + x) * 3];
      const std::string c = colour_name(p);
      if (c.empty()) {
        EXPECT_LE(std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}), 16)
            << "background pixel (" << x << ", " << y << ") is not grey";
        continue;
      }
      Blob& b = out[c];
      ++b.count;
      b.x0 = std::min(b.x0, x);
      b.y0 = std::min(b.y0, y);
      b.x1 = std::max(b.x1, x);
      b.y1 = std::max(b.y1, y);
    }
  }
  return out;
}

// The shape a blob of one colour is, from how much of its bounding box it fills: a square all of
// it, a circle pi/4 of it, a triangle half.
std::string shape_of(const Blob& b) {
  const double f = b.fill();
  if (f > 0.97) return "square";
  if (f > 0.68 && f < 0.88) return "circle";
  if (f > 0.40 && f < 0.62) return "triangle";
  return "unknown (fill " + std::to_string(f) + ")";
}

struct Parsed {
  std::vector<std::pair<std::string, std::string>> shapes;  // colour, shape
  std::string relation;
};

// "a C S" or "a C S REL a C S", nothing else.
Parsed parse_caption(const std::string& caption) {
  std::istringstream in(caption);
  std::vector<std::string> w;
  for (std::string s; in >> s;) w.push_back(s);
  Parsed p;
  auto shape_at = [&](size_t i) {
    EXPECT_EQ(w.at(i), "a") << caption;
    p.shapes.emplace_back(w.at(i + 1), w.at(i + 2));
  };
  if (w.size() == 3) {
    shape_at(0);
  } else if (w.size() == 7 && (w[3] == "above" || w[3] == "below")) {
    shape_at(0);
    p.relation = w[3];
    shape_at(4);
  } else if (w.size() == 8 && w[4] == "of" && (w[3] == "left" || w[3] == "right")) {
    shape_at(0);
    p.relation = w[3] + " of";
    shape_at(5);
  } else {
    ADD_FAILURE() << "caption '" << caption << "' is not of the form 'a C S [REL a C S]'";
  }
  return p;
}

const std::vector<std::string> kColourOrder = {"red", "green", "blue", "yellow"};

int colour_rank(const std::string& c) {
  return static_cast<int>(std::find(kColourOrder.begin(), kColourOrder.end(), c) -
                          kColourOrder.begin());
}

// Everything a caption claims, checked against the pixels; returns the relation for coverage.
std::string check_scene(const ImageRGB8& img, const std::string& caption, const json* meta) {
  SCOPED_TRACE(caption);
  const Parsed p = parse_caption(caption);
  const auto found = blobs(img);
  EXPECT_EQ(found.size(), p.shapes.size()) << "colours in the image do not match the caption";
  for (const auto& [colour, shape] : p.shapes) {
    auto it = found.find(colour);
    if (it == found.end()) {
      ADD_FAILURE() << "no " << colour << " pixels";
      continue;
    }
    EXPECT_EQ(shape_of(it->second), shape);
    EXPECT_GE(it->second.x1 - it->second.x0 + 1, img.width / 5) << "shape too small to see";
  }
  if (meta) {
    EXPECT_EQ(meta->size(), p.shapes.size());
    for (size_t i = 0; i < meta->size() && i < p.shapes.size(); ++i) {
      const json& m = (*meta)[i];
      EXPECT_EQ(m["colour"], p.shapes[i].first);
      EXPECT_EQ(m["shape"], p.shapes[i].second);
      const int cx = m["x"].get<int>() + m["size"].get<int>() / 2;
      const int cy = m["y"].get<int>() + m["size"].get<int>() / 2;
      EXPECT_EQ(colour_name(&img.pixels[(static_cast<size_t>(cy) * img.width + cx) * 3]),
                p.shapes[i].first)
          << "the pixel at the centre of shape " << i << " is not its colour";
    }
  }
  if (p.shapes.size() == 2) {
    const std::string &a = p.shapes[0].first, &b = p.shapes[1].first;
    EXPECT_LT(colour_rank(a), colour_rank(b)) << "the earlier colour must be named first";
    if (found.count(a) && found.count(b)) {
      const Blob &A = found.at(a), &B = found.at(b);
      if (p.relation == "above") EXPECT_LT(A.y1, B.y0);
      if (p.relation == "below") EXPECT_GT(A.y0, B.y1);
      if (p.relation == "left of") EXPECT_LT(A.x1, B.x0);
      if (p.relation == "right of") EXPECT_GT(A.x0, B.x1);
    }
  }
  return p.relation;
}

// ---------------------------------------------------------------------------------------------

TEST(TrainingShapes, WritesImagesAndSplits) {
  const fs::path dir = scratch_dir() / "split";
  write_shapes_dataset(dir.string(), 40, 5, 0.25);
  const std::vector<json> train = read_jsonl(dir / "train.jsonl"),
                          held = read_jsonl(dir / "heldout.jsonl");
  ASSERT_EQ(train.size(), 30u);
  ASSERT_EQ(held.size(), 10u);
  std::set<std::string> images;
  for (const auto* split : {&train, &held}) {
    for (const json& j : *split) {
      const json& user = j["messages"][0];
      ASSERT_EQ(user["role"], "user");
      ASSERT_EQ(user["content"][0]["type"], "image");
      ASSERT_EQ(user["content"][1]["text"], kShapesPrompt);
      ASSERT_EQ(j["messages"][1]["role"], "assistant");
      const std::string path = user["content"][0]["image"];
      EXPECT_FALSE(fs::path(path).is_absolute()) << path;
      ASSERT_TRUE(fs::exists(dir / path)) << path;
      const ImageRGB8 img = load_image((dir / path).string());
      EXPECT_EQ(img.width, 64);
      EXPECT_EQ(img.height, 64);
      images.insert(path);
    }
  }
  EXPECT_EQ(images.size(), 40u);
  EXPECT_EQ(images.count("images/000000.png"), 1u);
  EXPECT_EQ(images.count("images/000039.png"), 1u);
  EXPECT_EQ(held.back()["messages"][0]["content"][0]["image"], "images/000039.png");

  write_shapes_dataset((scratch_dir() / "small").string(), 7, 5, 0.1);
  EXPECT_EQ(read_jsonl(scratch_dir() / "small" / "heldout.jsonl").size(), 1u);  // round(0.7)
  write_shapes_dataset((scratch_dir() / "none").string(), 3, 5, 0.0);
  EXPECT_EQ(read_text_file((scratch_dir() / "none" / "heldout.jsonl").string()), "");
}

TEST(TrainingShapes, DeterministicFromTheSeed) {
  const fs::path a = scratch_dir() / "det_a", b = scratch_dir() / "det_b",
                 c = scratch_dir() / "det_c", d = scratch_dir() / "det_d";
  write_shapes_dataset(a.string(), 12, 42, 0.25);
  write_shapes_dataset(b.string(), 12, 42, 0.25);
  write_shapes_dataset(c.string(), 12, 43, 0.25);
  write_shapes_dataset(d.string(), 5, 42, 0.0);
  for (const char* f : {"train.jsonl", "heldout.jsonl", "images/000000.png", "images/000011.png"})
    EXPECT_EQ(read_text_file((a / f).string()), read_text_file((b / f).string())) << f;
  EXPECT_NE(read_text_file((a / "train.jsonl").string()),
            read_text_file((c / "train.jsonl").string()));
  // A scene depends on the seed and its index, not on the dataset size.
  for (const char* f : {"images/000000.png", "images/000004.png"})
    EXPECT_EQ(read_text_file((a / f).string()), read_text_file((d / f).string())) << f;
  const ShapesScene s1 = make_shapes_scene(42, 3), s2 = make_shapes_scene(42, 3),
                    s3 = make_shapes_scene(42, 4);
  EXPECT_EQ(s1.image.pixels, s2.image.pixels);
  EXPECT_EQ(s1.caption, s2.caption);
  EXPECT_NE(s1.image.pixels, s3.image.pixels);
}

TEST(TrainingShapes, CaptionsAgreeWithPixels) {
  // The written files, through PNG and back.
  const fs::path dir = scratch_dir() / "check";
  write_shapes_dataset(dir.string(), 30, 9, 0.2);
  for (const char* split : {"train.jsonl", "heldout.jsonl"}) {
    for (const json& j : read_jsonl(dir / split)) {
      const ImageRGB8 img =
          load_image((dir / j["messages"][0]["content"][0]["image"].get<std::string>()).string());
      check_scene(img, j["messages"][1]["content"].get<std::string>(), &j["shapes"]);
    }
  }
  // Many scenes in memory, at several sizes: every word of the vocabulary occurs.
  std::map<std::string, int> words;
  int light = 0, dark = 0;
  for (int size : {64, 96, 128}) {
    for (int i = 0; i < 150; ++i) {
      const ShapesScene s = make_shapes_scene(1, i, size);
      ASSERT_EQ(s.image.width, size);
      json meta = json::array();
      for (const ShapeInstance& sh : s.shapes)
        meta.push_back({{"shape", sh.shape},
                        {"colour", sh.colour},
                        {"x", sh.x},
                        {"y", sh.y},
                        {"size", sh.size}});
      const std::string rel = check_scene(s.image, s.caption, &meta);
      EXPECT_EQ(rel, s.relation);
      std::istringstream in(s.caption);
      for (std::string w; in >> w;) ++words[w];
      ++words[s.shapes.size() == 1 ? "<one>" : "<two>"];
      (s.image.pixels[0] > 128 ? light : dark)++;
    }
  }
  for (const char* w : {"red", "green", "blue", "yellow", "circle", "square", "triangle", "above",
                        "below", "left", "right", "<one>", "<two>"})
    EXPECT_GT(words[w], 5) << w;
  EXPECT_GT(light, 50);
  EXPECT_GT(dark, 50);
  EXPECT_EQ(words.size(), 15u) << "unexpected vocabulary";  // the 13 above, "a" and "of"
}

TEST(TrainingShapes, FewVisionTokensAndLoadable) {
  const PreprocessorConfig fixture =
      PreprocessorConfig::from_file(test::fixture_dir() + "/preprocessor_config.json");
  EXPECT_EQ(shapes_vision_tokens(64, fixture), 64);  // upscaled to 256x256 by min_pixels
  PreprocessorConfig small = fixture;
  small.min_pixels = 64 * 64;
  EXPECT_EQ(shapes_vision_tokens(64, small), 4);
  EXPECT_EQ(shapes_vision_tokens(96, small), 9);
  EXPECT_EQ(shapes_vision_tokens(128, small), 16);

  const fs::path dir = scratch_dir() / "load";
  write_shapes_dataset(dir.string(), 6, 3, 0.0);
  DataConfig c;
  c.train_files = {(dir / "train.jsonl").string()};
  c.shuffle = false;
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  Dataset ds(c, tok, small, ChatFormat::from_dir(test::fixture_dir()));
  ASSERT_EQ(ds.size(), 6);
  const std::vector<json> lines = read_jsonl(dir / "train.jsonl");
  for (int i = 0; i < 6; ++i) {
    const Sample s = ds.next();
    EXPECT_EQ(s.grids, (std::vector<GridTHW>{{1, 4, 4}}));
    EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), tok.token_id("<|image_pad|>")), 4);
    std::vector<int32_t> learned;
    for (int32_t l : s.labels)
      if (l != -100) learned.push_back(l);
    ASSERT_GE(learned.size(), 2u);
    learned.resize(learned.size() - 2);  // <|im_end|> and "\n"
    EXPECT_EQ(tok.decode(learned),
              lines[static_cast<size_t>(i)]["messages"][1]["content"].get<std::string>());
  }
}

TEST(TrainingShapes, Scorer) {
  const std::string ref = "a red circle above a blue square";
  ShapesScore s = score_shapes_caption(ref, ref);
  EXPECT_EQ(s.colour_hits, 2);
  EXPECT_EQ(s.colours, 2);
  EXPECT_EQ(s.shape_hits, 2);
  EXPECT_EQ(s.shapes, 2);
  EXPECT_EQ(s.relation_hits, 1);
  EXPECT_EQ(s.relations, 1);
  EXPECT_EQ(s.exact, 1);

  s = score_shapes_caption(" A red circle ABOVE a blue square.", ref);
  EXPECT_EQ(s.exact, 1);
  EXPECT_EQ(s.colour_hits + s.shape_hits + s.relation_hits, 5);

  // Same words, wrong order: position by position nothing but the relation matches.
  s = score_shapes_caption("a blue square above a red circle", ref);
  EXPECT_EQ(s.colour_hits, 0);
  EXPECT_EQ(s.shape_hits, 0);
  EXPECT_EQ(s.relation_hits, 1);
  EXPECT_EQ(s.exact, 0);

  s = score_shapes_caption("a red square below a blue square", ref);
  EXPECT_EQ(s.colour_hits, 2);
  EXPECT_EQ(s.shape_hits, 1);
  EXPECT_EQ(s.relation_hits, 0);

  s = score_shapes_caption("a red circle", ref);  // stopped early
  EXPECT_EQ(s.colour_hits, 1);
  EXPECT_EQ(s.colours, 2);
  EXPECT_EQ(s.shape_hits, 1);
  EXPECT_EQ(s.relation_hits, 0);
  EXPECT_EQ(s.relations, 1);

  s = score_shapes_caption("a green triangle left of a red circle",
                           "a green triangle left of a "
                           "yellow circle");
  EXPECT_EQ(s.colour_hits, 1);
  EXPECT_EQ(s.shape_hits, 2);
  EXPECT_EQ(s.relation_hits, 1);

  s = score_shapes_caption("a red circle right of a blue square", "a red circle");  // says more
  EXPECT_EQ(s.colour_hits, 1);
  EXPECT_EQ(s.colours, 1);
  EXPECT_EQ(s.relations, 0);
  EXPECT_EQ(s.exact, 0);

  s = score_shapes_caption("", ref);
  EXPECT_EQ(s.colour_hits + s.shape_hits + s.relation_hits + s.exact, 0);
  EXPECT_EQ(s.captions, 1);

  ShapesScore total;
  total += score_shapes_caption(ref, ref);
  total += score_shapes_caption("a blue square", "a red square");
  EXPECT_EQ(total.colours, 3);
  EXPECT_EQ(total.colour_hits, 2);
  EXPECT_DOUBLE_EQ(total.colour_accuracy(), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(total.shape_accuracy(), 1.0);
  EXPECT_DOUBLE_EQ(total.exact_accuracy(), 0.5);
  EXPECT_DOUBLE_EQ(ShapesScore().colour_accuracy(), 0.0);
}

TEST(TrainingShapes, Errors) {
  const std::string dir = (scratch_dir() / "err").string();
  EXPECT_NE(error_of([&] { write_shapes_dataset(dir, 0, 1, 0.1); }).find("at least 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { write_shapes_dataset(dir, 10, 1, 1.0); }).find("heldout_fraction"),
            std::string::npos);
  EXPECT_NE(error_of([&] { write_shapes_dataset(dir, 2, 1, 0.9); }).find("nothing to train"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_shapes_scene(1, 0, 16); }).find("image_size"), std::string::npos);
}

TEST(TrainingShapes, AnExistingDatasetIsReplacedOnlyWhenAsked) {
  const fs::path dir = scratch_dir() / "existing";
  write_shapes_dataset(dir.string(), 4, 1, 0.25);
  const std::string train = read_text_file((dir / "train.jsonl").string());
  const std::string msg = error_of([&] { write_shapes_dataset(dir.string(), 6, 2, 0.25); });
  EXPECT_NE(msg.find("already holds a dataset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--force"), std::string::npos) << msg;
  EXPECT_EQ(read_text_file((dir / "train.jsonl").string()), train);
  write_shapes_dataset(dir.string(), 6, 2, 0.25, 64, /*replace=*/true);
  EXPECT_NE(read_text_file((dir / "train.jsonl").string()), train);
  // A folder with only the user's own files is not a dataset.
  const fs::path mine = scratch_dir() / "mine";
  fs::create_directories(mine);
  std::ofstream((mine / "notes.txt").string()) << "keep";
  write_shapes_dataset(mine.string(), 4, 1, 0.25);
  EXPECT_TRUE(fs::exists(mine / "notes.txt"));
}

// Every line of the dataset in `dir` describes the image it names, as scene `index` of `seed`
// draws it: the files of one writer, not a mix of two.
void expect_dataset_of_seed(const fs::path& dir, uint64_t seed, int n) {
  int index = 0;
  for (const char* split : {"train.jsonl", "heldout.jsonl"})
    for (const json& j : read_jsonl(dir / split)) {
      const ShapesScene scene = make_shapes_scene(seed, index++);
      const std::string image = j["messages"][0]["content"][0]["image"].get<std::string>();
      EXPECT_EQ(j["messages"][1]["content"].get<std::string>(), scene.caption) << image;
      EXPECT_EQ(load_image((dir / image).string()).pixels, scene.image.pixels) << image;
    }
  EXPECT_EQ(index, n);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "images"), fs::directory_iterator()), n);
}

TEST(TrainingShapes, ForceNeverWritesThroughALinkPlantedInTheOldDataset) {
  const fs::path dir = scratch_dir() / "planted", outside = scratch_dir() / "outside";
  fs::create_directories(outside);
  write_shapes_dataset(dir.string(), 4, 1, 0.25);
  const fs::path victim = outside / "photo.png", list_victim = outside / "list.txt";
  write_file_atomic(victim.string(), "precious");
  write_file_atomic(list_victim.string(), "mine");
  fs::remove(dir / "images" / "000002.png");
  fs::create_symlink(victim, dir / "images" / "000002.png");
  fs::remove(dir / "train.jsonl");
  fs::create_symlink(list_victim, dir / "train.jsonl");
  fs::create_symlink(outside, dir / "images" / "elsewhere");

  write_shapes_dataset(dir.string(), 4, 2, 0.25, 64, /*replace=*/true);
  EXPECT_EQ(read_text_file(victim.string()), "precious");
  EXPECT_EQ(read_text_file(list_victim.string()), "mine");
  EXPECT_FALSE(fs::is_symlink(dir / "images" / "000002.png"));
  EXPECT_FALSE(fs::is_symlink(dir / "train.jsonl"));
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir / "images" / "elsewhere")));
  EXPECT_EQ(std::distance(fs::directory_iterator(outside), fs::directory_iterator()), 2);
  expect_dataset_of_seed(dir, 2, 4);
  // Only the dataset and its lock are in the folder: no temporary is left.
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names,
            (std::set<std::string>{"heldout.jsonl", "images", "train.jsonl", kShapesLockFile}));
}

TEST(TrainingShapes, AWriterHoldingTheFolderExcludesAnother) {
  const fs::path dir = scratch_dir() / "held";
  fs::create_directories(dir);
  const DirectoryLock other(dir.string(), kShapesLockFile, "--out", "");
  const std::string msg = error_of([&] { write_shapes_dataset(dir.string(), 4, 1, 0.25); });
  EXPECT_NE(
      msg.find("--out " + dir.string() + " is in use by process " + std::to_string(::getpid())),
      std::string::npos)
      << msg;
  EXPECT_NE(msg.find("another iris data shapes"), std::string::npos) << msg;
  EXPECT_EQ(error_of([&] { write_shapes_dataset(dir.string(), 4, 1, 0.25, 64, true); }), msg);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, std::set<std::string>{kShapesLockFile});
}

TEST(TrainingShapes, ConcurrentWritersIntoOneNewFolderLeaveOneWinnersDataset) {
  constexpr int kWriters = 4, kScenes = 40;
  for (int round = 0; round < 3; ++round) {
    const fs::path dir = scratch_dir() / ("race" + std::to_string(round));
    int gate[2];
    ASSERT_EQ(::pipe(gate), 0);
    std::vector<pid_t> pids;
    for (int w = 0; w < kWriters; ++w) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        ::close(gate[1]);
        char c;
        if (::read(gate[0], &c, 1) < 0) ::_exit(3);  // returns 0 when the gate opens
        int code = 0;
        std::string msg;
        try {
          write_shapes_dataset(dir.string(), kScenes, 100 + w, 0.25);
        } catch (const Error& e) {
          msg = e.what();
          code = 1;
        }
        std::ofstream((scratch_dir() / ("writer" + std::to_string(w))).string()) << msg;
        ::_exit(code);
      }
      pids.push_back(pid);
    }
    ::close(gate[0]);
    ::close(gate[1]);  // all start at once
    std::vector<int> winners;
    for (int w = 0; w < kWriters; ++w) {
      int status = 0;
      ASSERT_EQ(::waitpid(pids[static_cast<size_t>(w)], &status, 0), pids[static_cast<size_t>(w)]);
      ASSERT_TRUE(WIFEXITED(status)) << "writer " << w << " was killed by a signal";
      const std::string msg =
          read_text_file((scratch_dir() / ("writer" + std::to_string(w))).string());
      if (WEXITSTATUS(status) == 0) {
        winners.push_back(w);
      } else {
        EXPECT_EQ(WEXITSTATUS(status), 1);
        EXPECT_TRUE(msg.find("is in use by process") != std::string::npos ||
                    msg.find("already holds a dataset") != std::string::npos)
            << msg;
      }
    }
    ASSERT_EQ(winners.size(), 1u) << "round " << round;
    expect_dataset_of_seed(dir, 100 + static_cast<uint64_t>(winners[0]), kScenes);
  }
}

}  // namespace
}  // namespace iris
