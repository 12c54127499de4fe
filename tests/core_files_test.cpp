// Reading files that may come from a stranger: safetensors validated as strictly as the reference
// implementation (huggingface/safetensors), JSON with a nesting limit and bounded error text,
// typed field reads, regular-file checks (a FIFO is an error, not a hang), bounded lines, and
// writes that only ever touch the path asked for.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "core/safetensors.h"
#include "core/usable_cores.h"
#include "process_util.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::scratch_dir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A safetensors file from a header text, a header length (default: the text's) and data bytes.
std::string safetensors_blob(const std::string& header, const std::string& data,
                             int64_t header_len = -1) {
  const uint64_t n = header_len < 0 ? header.size() : static_cast<uint64_t>(header_len);
  std::string blob(8, '\0');
  std::memcpy(blob.data(), &n, 8);
  return blob + header + data;
}

std::string open_error(const std::string& name, const std::string& blob) {
  const std::string path = (scratch_dir() / name).string();
  write_bytes(path, blob);
  return error_of([&] { SafetensorsFile f(path); });
}

// Two f32 tensors of 2 elements each, back to back.
const std::string kTwoTensors = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";

// A container's CPU quota caps the threads: cgroup v2's cpu.max and v1's CFS quota, rounded up;
// "max", -1 and unreadable text set no cap.
TEST(UsableCores, CgroupQuotasAreReadAndRoundedUp) {
  EXPECT_EQ(cores_of_cpu_max("max 100000\n"), 0);
  EXPECT_EQ(cores_of_cpu_max("150000 100000\n"), 2);
  EXPECT_EQ(cores_of_cpu_max("200000 100000"), 2);
  EXPECT_EQ(cores_of_cpu_max("50000 100000"), 1);
  EXPECT_EQ(cores_of_cpu_max(""), 0);
  EXPECT_EQ(cores_of_cpu_max("lots 100000"), 0);
  EXPECT_EQ(cores_of_cfs_quota("-1\n", "100000\n"), 0);
  EXPECT_EQ(cores_of_cfs_quota("250000\n", "100000\n"), 3);
  EXPECT_EQ(cores_of_cfs_quota("", ""), 0);

  const std::string hybrid = "12:cpuset:/\n4:cpu,cpuacct:/docker/abc\n0::/system.slice/x.scope\n";
  EXPECT_EQ(cgroup_v2_path(hybrid), "/system.slice/x.scope");
  EXPECT_EQ(cgroup_v1_cpu_path(hybrid), "/docker/abc");
  EXPECT_EQ(cgroup_v1_cpu_path("3:cpuacct:/a\n"), "");
  EXPECT_EQ(cgroup_v2_path("1:cpu:/a\n"), "");

  // Never more than the affinity mask allows, never none.
  cpu_set_t mask;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
  const int cores = usable_cores();
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, CPU_COUNT(&mask));
}

TEST(Safetensors, AWellFormedFileLoads) {
  const std::string path = (scratch_dir() / "ok.safetensors").string();
  const float a[2] = {1.5f, -2.0f}, b[2] = {3.0f, 4.0f};
  write_safetensors(path, {{"a", DType::f32, {2}, a}, {"b", DType::f32, {2}, b}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.load("b").data<float>()[1], 4.0f);
  EXPECT_EQ(f.load("a").data<float>()[0], 1.5f);
}

// The finiteness check reads raw bits: every dtype, any byte alignment (a header's length is any
// number), the first bad element of several, and a tensor large enough to run on many threads.
TEST(Safetensors, FirstNonFiniteElementIsFoundInEveryDtypeAtAnyAlignment) {
  const int64_t n = (int64_t(1) << 20) + 37;
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    for (size_t misalign : {0u, 1u, 3u}) {
      for (int64_t bad_at : {int64_t(-1), int64_t(0), int64_t(4095), int64_t(4096), n - 1}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " misaligned by " + std::to_string(misalign) +
                     ", bad at " + std::to_string(bad_at));
        const size_t elem = dtype_size(dt);
        std::vector<unsigned char> bytes(misalign + static_cast<size_t>(n) * elem);
        std::vector<float> values(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) values[i] = 65000.0f * std::sin(0.001f * float(i));
        if (bad_at >= 0) {
          values[bad_at] = bad_at % 2 ? std::numeric_limits<float>::infinity()
                                      : std::numeric_limits<float>::quiet_NaN();
          if (bad_at + 9 < n) values[bad_at + 9] = -std::numeric_limits<float>::infinity();
        }
        for (int64_t i = 0; i < n; ++i) {
          unsigned char* at = bytes.data() + misalign + i * elem;
          if (dt == DType::f32) {
            std::memcpy(at, &values[i], 4);
          } else {
            const uint16_t h = dt == DType::bf16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
            std::memcpy(at, &h, 2);
          }
        }
        SafetensorsEntry e;
        e.name = "w";
        e.dtype = dt;
        e.shape = {n};
        e.data = bytes.data() + misalign;
        e.nbytes = static_cast<size_t>(n) * elem;
        EXPECT_EQ(first_non_finite(e), bad_at);
      }
    }
  }
}

TEST(Safetensors, AHeaderLengthOneByteShortIsRejected) {
  // The file write_safetensors made, with the header length one less: the header still parses
  // (it loses a padding space) but every tensor would start one byte early.
  const std::string path = (scratch_dir() / "short.safetensors").string();
  const float a[2] = {1.0f, 2.0f};
  write_safetensors(path, {{"a", DType::f32, {2}, a}});
  std::string blob = slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, blob.data(), 8);
  --n;
  std::memcpy(blob.data(), &n, 8);
  const std::string msg = open_error("short2.safetensors", blob);
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
}

TEST(Safetensors, TrailingBytesAreRejected) {
  const std::string msg =
      open_error("trailing.safetensors", safetensors_blob(kTwoTensors, std::string(16 + 3, '\0')));
  EXPECT_NE(msg.find("cover 16 bytes of a data section of 19"), std::string::npos) << msg;
}

TEST(Safetensors, AGapBetweenTensorsIsRejected) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})";
  const std::string msg =
      open_error("gap.safetensors", safetensors_blob(header, std::string(20, 0)));
  EXPECT_NE(msg.find("gap"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
}

TEST(Safetensors, DataThatDoesNotStartAtZeroIsRejected) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  const std::string msg =
      open_error("late.safetensors", safetensors_blob(header, std::string(12, 0)));
  EXPECT_NE(msg.find("gap"), std::string::npos) << msg;
}

TEST(Safetensors, OverlappingTensorsAreRejected) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  const std::string msg =
      open_error("overlap.safetensors", safetensors_blob(header, std::string(12, 0)));
  EXPECT_NE(msg.find("overlap"), std::string::npos) << msg;
}

TEST(Safetensors, ShapeProductOverflowIsRejected) {
  // 2^62 * 8 elements wraps to 0 in 64 bits, which would match empty data_offsets.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,0]}})";
  const std::string msg = open_error("overflow.safetensors", safetensors_blob(header, ""));
  EXPECT_NE(msg.find("overflows"), std::string::npos) << msg;
  // The element count fits but the byte count does not.
  const std::string bytes_header =
      R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})";
  EXPECT_NE(
      open_error("overflow2.safetensors", safetensors_blob(bytes_header, "")).find("overflows"),
      std::string::npos);
}

TEST(Safetensors, ByteCountMustMatchShapeAndDtype) {
  const std::string header = R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})";
  const std::string msg =
      open_error("size.safetensors", safetensors_blob(header, std::string(8, 0)));
  EXPECT_NE(msg.find("need 6"), std::string::npos) << msg;
}

TEST(Safetensors, HeaderMustBeAJsonObjectOfWellTypedEntries) {
  EXPECT_NE(open_error("array.safetensors", safetensors_blob("[1, 2]", "")).find("'{'"),
            std::string::npos);
  EXPECT_NE(
      open_error("huge.safetensors", safetensors_blob("{}", "", int64_t{200} << 20)).find("100 MB"),
      std::string::npos);
  const std::string typed =
      open_error("typed.safetensors",
                 safetensors_blob(R"({"w":{"dtype":7,"shape":[0],"data_offsets":[0,0]}})", ""));
  EXPECT_NE(typed.find("tensor 'w'.dtype must be a string"), std::string::npos) << typed;
  const std::string offsets = open_error(
      "offsets.safetensors",
      safetensors_blob(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.5]}})", "xxxx"));
  EXPECT_NE(offsets.find("data_offsets[1] must be an integer"), std::string::npos) << offsets;
  const std::string meta =
      open_error("meta.safetensors", safetensors_blob(R"({"__metadata__":{"format":1}})", ""));
  EXPECT_NE(meta.find("__metadata__.format must be a string"), std::string::npos) << meta;
}

TEST(Safetensors, DeeplyNestedHeaderIsRejectedWithoutRecursion) {
  const std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  const std::string msg = open_error("deep.safetensors", safetensors_blob(deep, ""));
  EXPECT_NE(msg.find("levels deep"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u) << msg;
}

TEST(Safetensors, Bf16AtAnOddOffsetIsReadCorrectly) {
  // A 9-byte header puts the data section at byte 17: every bf16 element is misaligned.
  const std::string header = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  std::string padded = header;
  while ((8 + padded.size()) % 2 == 0) padded += ' ';
  const uint16_t values[2] = {f32_to_bf16(1.0f), f32_to_bf16(-3.5f)};
  const std::string path = (scratch_dir() / "odd.safetensors").string();
  write_bytes(path,
              safetensors_blob(padded, std::string(reinterpret_cast<const char*>(values), 4)));
  SafetensorsFile f(path);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(f.at("a").data) % 2, 1u);
  const HostTensor t = f.load("a");
  EXPECT_EQ(t.data<float>()[0], 1.0f);
  EXPECT_EQ(t.data<float>()[1], -3.5f);
}

TEST(Safetensors, ShardIndexMustAgreeWithItsShards) {
  const fs::path dir = scratch_dir() / "sharded";
  fs::create_directories(dir);
  const float a[2] = {1, 2};
  write_safetensors((dir / "one.safetensors").string(), {{"a", DType::f32, {2}, a}});
  write_bytes((dir / "model.safetensors.index.json").string(),
              R"({"weight_map":{"a":"one.safetensors","b":"one.safetensors"}})");
  std::string msg = error_of([&] { SafetensorsCheckpoint c(dir.string()); });
  EXPECT_NE(msg.find("lists tensor 'b'"), std::string::npos) << msg;
  write_bytes((dir / "model.safetensors.index.json").string(),
              R"({"weight_map":{"a":"../one.safetensors"}})");
  msg = error_of([&] { SafetensorsCheckpoint c(dir.string()); });
  EXPECT_NE(msg.find("not a file name inside"), std::string::npos) << msg;
  write_bytes((dir / "model.safetensors.index.json").string(), R"({"weight_map":{"a":3}})");
  msg = error_of([&] { SafetensorsCheckpoint c(dir.string()); });
  EXPECT_NE(msg.find("weight_map.a must be a string"), std::string::npos) << msg;
}

TEST(Json, NestingBeyondTheLimitIsAnErrorThatQuotesNothing) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string msg = error_of([&] { parse_json(deep, "config.json"); });
  EXPECT_NE(msg.find("config.json nests"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 300u);
  // Brackets inside strings are text, not nesting.
  EXPECT_NO_THROW(parse_json("{\"a\": \"" + std::string(1000, '[') + "\\\"[\"}", "x"));
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": "]]]"}]})", 100), 3);
  EXPECT_NO_THROW(
      parse_json(std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']'), "x"));
}

TEST(Json, ValuesAreCountedExactlyWithoutParsing) {
  EXPECT_EQ(json_value_count(""), 0);
  EXPECT_EQ(json_value_count(" \n"), 0);
  EXPECT_EQ(json_value_count("7"), 1);
  EXPECT_EQ(json_value_count("[]"), 1);
  EXPECT_EQ(json_value_count("{ }"), 1);
  EXPECT_EQ(json_value_count("[1, 2, 3]"), 4);
  EXPECT_EQ(json_value_count("[[], [[ ]], {}]"), 5);
  // Keys are not values; commas, brackets and escaped quotes inside strings are text.
  EXPECT_EQ(json_value_count(R"({"a": [{}, []], "b,[": "x,\"{y"})"), 5);
  // root, a, {}, [], b, c and c's four members.
  EXPECT_EQ(json_value_count(R"({"a": [{}, []], "b": {"c": [1, null, true, "s"]}})"), 10);
  EXPECT_EQ(json_value_count("[[[[0]]]]"), 5);
}

TEST(Json, SizeAndValueCountAreBoundedBeforeParsing) {
  // The 114 MB config.json of 40M unused "{}" took 4.4 GB once parsed; the same shape just past
  // the config limit is refused from the text alone, naming the file and the limit.
  std::string many = R"({"model_type": "qwen3_vl", "unused": [{})";
  for (int64_t i = 0; i < kJsonConfigLimits.max_values; ++i) many += ",{}";
  many += "]}";
  ASSERT_LE(many.size(), kJsonConfigLimits.max_bytes);
  std::string msg = error_of([&] { parse_json(many, "config.json"); });
  // The root, model_type, the list and its max_values + 1 members.
  EXPECT_NE(msg.find("config.json holds " + std::to_string(kJsonConfigLimits.max_values + 4) +
                     " JSON values"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("more than the " + std::to_string(kJsonConfigLimits.max_values)),
            std::string::npos)
      << msg;
  // The same text is within what a tokenizer.json may hold.
  EXPECT_NO_THROW(parse_json(many, "tokenizer.json", kJsonTokenizerLimits));

  const std::string big = "[\"" + std::string(kJsonConfigLimits.max_bytes, 'x') + "\"]";
  msg = error_of([&] { parse_json(big, "generation_config.json"); });
  EXPECT_NE(msg.find("generation_config.json is " + std::to_string(big.size()) +
                     " bytes, more than the " + std::to_string(kJsonConfigLimits.max_bytes)),
            std::string::npos)
      << msg;
  EXPECT_LT(msg.size(), 300u);

  // A file is refused from its size, before it is read.
  const std::string path = (scratch_dir() / "big_tokenizer_config.json").string();
  write_bytes(path, big);
  msg = error_of([&] { read_json_file(path, "tokenizer config"); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(kJsonConfigLimits.max_bytes)), std::string::npos) << msg;
}

TEST(Json, ParseErrorsAreBounded) {
  // nlohmann quotes the token it stopped at, here a megabyte-long string.
  const std::string text = "{\"a\": \"" + std::string(1 << 20, 'x') + "\u0001\"}";
  const std::string msg = error_of([&] { parse_json(text, "tokenizer.json"); });
  EXPECT_NE(msg.find("tokenizer.json is not valid JSON"), std::string::npos);
  EXPECT_LT(msg.size(), 400u);
}

TEST(Json, ExcerptsAreShortWhateverTheValue) {
  nlohmann::json big = nlohmann::json::array();
  for (int i = 0; i < 100000; ++i) big.push_back({{"k", std::string(100, 'v')}});
  EXPECT_LE(json_excerpt(big).size(), 63u);
  EXPECT_EQ(json_excerpt(nlohmann::json::parse(R"({"a": [1, 2]})")), R"({"a": [1, 2]})");
}

TEST(Json, IntegersMustBeIntegersInRange) {
  using nlohmann::json;
  const std::string w = "config.json: text_config";
  EXPECT_EQ(json_integer(json(64), w, "hidden_size", 1, 1 << 20), 64);
  EXPECT_EQ(json_integer(json(64.0), w, "hidden_size", 1, 1 << 20), 64);
  auto msg = [&](const json& v) {
    return error_of([&] { json_integer(v, w, "hidden_size", 1, 1 << 20); });
  };
  EXPECT_NE(
      msg(json(64.9)).find("config.json: text_config.hidden_size must be an integer, got 64.9"),
      std::string::npos)
      << msg(json(64.9));
  EXPECT_NE(msg(json(true)).find("must be an integer, got true"), std::string::npos);
  EXPECT_NE(msg(json("64")).find("must be an integer"), std::string::npos);
  EXPECT_NE(msg(json((int64_t{1} << 32) + 64)).find("4294967360 is out of range"),
            std::string::npos);
  EXPECT_NE(msg(json(1e12)).find("out of range"), std::string::npos) << msg(json(1e12));
  EXPECT_NE(msg(json(0)).find("hidden_size = 0 is out of range"), std::string::npos);
  EXPECT_NE(msg(json(UINT64_MAX)).find("out of range"), std::string::npos);
  EXPECT_NE(error_of([&] {
              json_real(json(0.0), w, "rms_norm_eps", 0, 1, true);
            }).find("rms_norm_eps = 0.0 is out of range: it must be greater than 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              json_real(json(false), w, "rope_theta", 0, 1, true);
            }).find("must be a number, got false"),
            std::string::npos);
}

TEST(Files, AFifoIsRefusedInsteadOfBlocking) {
  const std::string fifo = (scratch_dir() / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string msg = error_of([&] { read_text_file(fifo, "model config"); });
  EXPECT_NE(msg.find("model config " + fifo + " is a FIFO"), std::string::npos) << msg;
  msg = error_of([&] { SafetensorsFile f(fifo); });
  EXPECT_NE(msg.find("FIFO"), std::string::npos) << msg;
  msg = error_of([&] { check_regular_file(fifo, "train file"); });
  EXPECT_NE(msg.find("FIFO"), std::string::npos) << msg;
  msg = error_of([&] { read_text_file(scratch_dir().string(), "model config"); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

TEST(Files, LinesAreBoundedAndSplitExactly) {
  // Lengths around the reader's 64 KiB chunk, a last line without a newline and an empty line.
  const std::string a(65535, 'a'), b(65536, 'b'), c(70000, 'c');
  std::istringstream in(a + "\n" + b + "\n\n" + c);
  std::string line;
  std::vector<size_t> sizes;
  int64_t n = 0;
  while (read_bounded_line(in, line, 100000, "f.jsonl", ++n)) sizes.push_back(line.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{65535, 65536, 0, 70000}));
  std::istringstream long_line(std::string(300000, 'x') + "\nok\n");
  const std::string msg =
      error_of([&] { read_bounded_line(long_line, line, 100000, "train.jsonl", 7); });
  EXPECT_NE(msg.find("train.jsonl:7: the line is longer than 100000 bytes"), std::string::npos)
      << msg;
}

TEST(Files, AtomicWritesLeaveOtherFilesAlone) {
  const fs::path dir = scratch_dir() / "atomic";
  fs::create_directories(dir);
  // A user's file that happens to have the name an older temporary scheme used.
  write_bytes((dir / "out.json.tmp").string(), "mine");
  write_file_atomic((dir / "out.json").string(), "new");
  EXPECT_EQ(slurp((dir / "out.json").string()), "new");
  EXPECT_EQ(slurp((dir / "out.json.tmp").string()), "mine");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);
  EXPECT_NE(error_of([] { write_file_atomic("", "x"); }).find("empty"), std::string::npos);
  const OwnedTempDir t1((dir / "export").string()), t2((dir / "export").string());
  EXPECT_NE(t1.path(), t2.path());
  EXPECT_EQ(fs::path(t1.path()).parent_path(), dir);
}

// The files a writer must leave alone: `victim` stands for a file outside the output folder that a
// link planted inside it points at.
struct Planted {
  fs::path dir, victim;
  explicit Planted(const std::string& name) : dir(scratch_dir() / name) {
    fs::create_directories(dir);
    victim = dir / "victim.txt";
    write_bytes(victim.string(), "precious");
  }
};

TEST(Files, NoWriterFollowsALinkOrReplacesWhatIsNotARegularFile) {
  const Planted p("links");
  const fs::path link = p.dir / "out.json";
  fs::create_symlink(p.victim, link);
  std::string msg = error_of([&] { write_file_atomic(link.string(), "new"); });
  EXPECT_NE(msg.find(link.string() + " is a symbolic link"), std::string::npos) << msg;
  msg = error_of([&] { write_new_file(link.string(), "new"); });
  EXPECT_NE(msg.find(link.string()), std::string::npos) << msg;
  msg = error_of([&] { open_append_file(link.string(), "the metrics file"); });
  EXPECT_NE(msg.find("the metrics file " + link.string() + " is a symbolic link"),
            std::string::npos)
      << msg;
  // A dangling link: following it would create a file wherever it points.
  const fs::path dangling = p.dir / "dangling.json", nowhere = p.dir / "created-through-link";
  fs::create_symlink(nowhere, dangling);
  EXPECT_NE(error_of([&] { write_file_atomic(dangling.string(), "x"); }).find("symbolic link"),
            std::string::npos);
  EXPECT_NE(error_of([&] { open_append_file(dangling.string(), "log"); }).find("symbolic link"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(nowhere));
  // A second hard link to a file elsewhere: appending would change that file too.
  const fs::path hard = p.dir / "hard.jsonl";
  ASSERT_EQ(::link(p.victim.c_str(), hard.c_str()), 0);
  msg = error_of([&] { open_append_file(hard.string(), "the metrics file"); });
  EXPECT_NE(msg.find("hard link"), std::string::npos) << msg;
  // A FIFO (or a device node such as /dev/full) is never replaced by a regular file.
  const fs::path fifo = p.dir / "plot.svg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  msg = error_of([&] { write_file_atomic(fifo.string(), "<svg/>"); });
  EXPECT_NE(msg.find("is a FIFO"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { open_append_file(fifo.string(), "log"); }).find("FIFO"),
            std::string::npos);
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(slurp(p.victim.string()), "precious");
  // Nothing was left behind by the refused writes.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(p.dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"dangling.json", "hard.jsonl", "out.json", "plot.svg",
                                             "victim.txt"}));
  // What they do write, they write.
  write_new_file((p.dir / "fresh.png").string(), "png");
  EXPECT_EQ(slurp((p.dir / "fresh.png").string()), "png");
  EXPECT_NE(
      error_of([&] { write_new_file((p.dir / "fresh.png").string(), "again"); }).find("fresh.png"),
      std::string::npos);
  const int fd = open_append_file((p.dir / "log.jsonl").string(), "log");
  write_all(fd, "a\n", 2, "log", "log.jsonl");
  ::close(fd);
  const int again = open_append_file((p.dir / "log.jsonl").string(), "log");
  write_all(again, "b\n", 2, "log", "log.jsonl");
  ::close(again);
  EXPECT_EQ(slurp((p.dir / "log.jsonl").string()), "a\nb\n");
}

TEST(Files, ALockFileThatIsALinkIsRefusedAndItsTargetKept) {
  const Planted p("lock");
  fs::create_symlink(p.victim, p.dir / "iris.lock");
  const std::string msg =
      error_of([&] { DirectoryLock lock(p.dir.string(), "iris.lock", "checkpoint.dir", "x"); });
  EXPECT_NE(msg.find((p.dir / "iris.lock").string() + " is a symbolic link"), std::string::npos)
      << msg;
  EXPECT_EQ(slurp(p.victim.string()), "precious");
  // A hard link to another file is refused too: the lock writes its pid into the file.
  const fs::path other = scratch_dir() / "lock2";
  fs::create_directories(other);
  ASSERT_EQ(::link(p.victim.c_str(), (other / "iris.lock").c_str()), 0);
  EXPECT_NE(error_of([&] {
              DirectoryLock lock(other.string(), "iris.lock", "checkpoint.dir", "x");
            }).find("hard links"),
            std::string::npos);
  EXPECT_EQ(slurp(p.victim.string()), "precious");
  // A real lock excludes a second one, even in the same process, naming the holder.
  const fs::path free = scratch_dir() / "lock3";
  fs::create_directories(free);
  const DirectoryLock held(free.string(), ".lock", "--out", "wait for it");
  EXPECT_NE(error_of([&] { DirectoryLock again(free.string(), ".lock", "--out", "wait for it"); })
                .find("--out " + free.string() + " is in use by process " +
                      std::to_string(::getpid()) + "; wait for it"),
            std::string::npos);
}

TEST(Files, OutputPathsStayInsideTheirDirectory) {
  const Planted p("inside");
  const std::string run = p.dir.string();
  const auto error = [&](const std::string& rel) {
    return error_of([&] { output_path_inside(run, rel, "logging.metrics_file", "the run dir"); });
  };
  std::string msg = error("../../notes.txt");
  EXPECT_NE(msg.find("logging.metrics_file '../../notes.txt' leaves the run dir"),
            std::string::npos)
      << msg;
  EXPECT_NE(error("sub/../../x").find("'..'"), std::string::npos);
  EXPECT_NE(error("sub/../x").find("'..'"), std::string::npos);
  msg = error("/tmp/metrics.jsonl");
  EXPECT_NE(msg.find("is an absolute path"), std::string::npos) << msg;
  EXPECT_NE(error("/dev/full").find("absolute"), std::string::npos);
  EXPECT_NE(error("").find("is empty"), std::string::npos);
  EXPECT_NE(error("sub/").find("names a directory"), std::string::npos);
  EXPECT_NE(error(".").find("names a directory"), std::string::npos);
  // A link on the way (a folder or the file itself) would carry the write out.
  fs::create_symlink(scratch_dir(), p.dir / "away");
  msg = error("away/metrics.jsonl");
  EXPECT_NE(msg.find((p.dir / "away").string() + " is a symbolic link"), std::string::npos) << msg;
  fs::create_symlink(p.victim, p.dir / "m.jsonl");
  EXPECT_NE(error("m.jsonl").find("symbolic link"), std::string::npos);
  EXPECT_EQ(output_path_inside(run, "./logs/m.jsonl", "k", "d"), run + "/logs/m.jsonl");
  EXPECT_EQ(output_path_inside(run, "metrics.jsonl", "k", "d"), run + "/metrics.jsonl");
  EXPECT_EQ(slurp(p.victim.string()), "precious");
}

TEST(Files, ATemporaryOfAKilledProcessIsRemovedByTheNextOneAndALiveOnesIsNot) {
  const fs::path parent = scratch_dir() / "abandoned";
  fs::create_directories(parent);
  // A process killed with SIGKILL while it fills its temporary, as an export can be.
  const std::string dead = test::temp_dir_of_killed_process((parent / "hf").string());
  ASSERT_TRUE(fs::is_regular_file(fs::path(dead) / "model.safetensors")) << dead;
  EXPECT_EQ(fs::path(dead).filename().string().rfind("hf.iris-tmp.", 0), 0u) << dead;

  // What must stay: a live owner's temporary, and the user's own look-alikes.
  OwnedTempDir live((parent / "other").string());
  write_bytes((fs::path(live.path()) / "config.json").string(), "{}");
  fs::create_directories(parent / "mine.iris-tmp.abcdef");
  fs::create_directories(parent / "notes.iris-tmp.qwerty");
  write_bytes((parent / "notes.iris-tmp.qwerty.lock").string(), "my own file");

  EXPECT_EQ(remove_abandoned_temp_dirs(parent.string()), std::vector<std::string>{dead});
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(dead + ".lock"));
  EXPECT_TRUE(fs::is_regular_file(fs::path(live.path()) / "config.json"));
  EXPECT_TRUE(fs::is_directory(parent / "mine.iris-tmp.abcdef"));
  EXPECT_TRUE(fs::is_directory(parent / "notes.iris-tmp.qwerty"));
  EXPECT_EQ(slurp((parent / "notes.iris-tmp.qwerty.lock").string()), "my own file");
  live.commit();
  EXPECT_TRUE(fs::is_regular_file(parent / "other" / "config.json"));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(parent)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"mine.iris-tmp.abcdef", "notes.iris-tmp.qwerty",
                                             "notes.iris-tmp.qwerty.lock", "other"}));
}

TEST(Files, ATemporaryDirectoryReplacesOnlyWhenAsked) {
  const Planted p("commit");
  const fs::path target = p.dir / "images";
  {
    OwnedTempDir tmp(target.string());
    write_bytes((fs::path(tmp.path()) / "000000.png").string(), "new");
    // Someone made the target meanwhile: it is theirs, even empty.
    fs::create_directories(target);
    EXPECT_NE(error_of([&] { tmp.commit(); }).find("appeared while it was being written"),
              std::string::npos);
  }
  EXPECT_TRUE(fs::is_empty(target));
  fs::remove(target);
  // Replacing an old folder whose entries include a link: the link goes, its target stays.
  fs::create_directories(target);
  write_bytes((target / "000000.png").string(), "old");
  fs::create_symlink(p.victim, target / "000001.png");
  {
    OwnedTempDir tmp(target.string());
    write_new_file((fs::path(tmp.path()) / "000000.png").string(), "new0");
    write_new_file((fs::path(tmp.path()) / "000001.png").string(), "new1");
    tmp.commit(/*replace=*/true);
  }
  EXPECT_EQ(slurp((target / "000000.png").string()), "new0");
  EXPECT_EQ(slurp((target / "000001.png").string()), "new1");
  EXPECT_FALSE(fs::is_symlink(target / "000001.png"));
  EXPECT_EQ(slurp(p.victim.string()), "precious");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(p.dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"images", "victim.txt"}));
}

TEST(Errors, BuildPathsOnlyUnderIrisDebug) {
  ::unsetenv("IRIS_DEBUG");
  std::string msg = error_of([] { IRIS_FAIL("bad value"); });
  EXPECT_EQ(msg, "bad value");
  ::setenv("IRIS_DEBUG", "1", 1);
  msg = error_of([] { IRIS_FAIL("bad value"); });
  EXPECT_NE(msg.find("core_files_test.cpp:"), std::string::npos) << msg;
  ::setenv("IRIS_DEBUG", "0", 1);
  EXPECT_EQ(error_of([] { IRIS_FAIL("bad value"); }), "bad value");
  ::unsetenv("IRIS_DEBUG");
}

}  // namespace
}  // namespace iris

namespace iris {
namespace {

// A run folder under a file, or on a filesystem that refuses it, is an error that names the key
// and the part of the path in the way, not the standard library's "filesystem error".
TEST(Files, DirectoriesThatCannotBeMadeNameTheKeyAndTheObstacle) {
  const std::filesystem::path root = test::scratch_dir() / "make_directories";
  std::filesystem::create_directories(root);
  const std::string file = (root / "a_file").string();
  std::ofstream(file) << "x";
  const std::string msg = test::error_of(
      [&] { make_directories(file + "/run/deeper", "the run directory (checkpoint.dir)"); });
  EXPECT_NE(msg.find("cannot create the run directory (checkpoint.dir)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'" + file + "' is a file, not a directory"), std::string::npos) << msg;
  make_directories((root / "fine" / "nested").string(), "x");
  EXPECT_TRUE(std::filesystem::is_directory(root / "fine" / "nested"));
}

}  // namespace
}  // namespace iris
