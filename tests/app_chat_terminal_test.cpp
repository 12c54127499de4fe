// iris generate's chat on a terminal, driven through a pseudo-terminal as a person at a keyboard
// drives it: Ctrl-C (the terminal turns it into SIGINT) stops the reply in flight and the chat
// goes on at its prompt, the next turn giving the tokens of a one-shot run over the whole
// conversation with the reply as far as it got; Ctrl-C at an empty prompt ends the chat; and,
// where the binary has libedit, lines are edited and recalled. stdout goes to a pipe so that the
// replies can be read apart from the prompt and the notes.
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bridge/generator.h"
#include "bridge/model_config.h"
#include "core/backend.h"
#include "language/tokenizer.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

// iris started on a pseudo-terminal (stdin and stderr) with stdout on a pipe.
class TerminalChat {
 public:
  explicit TerminalChat(const std::vector<std::string>& args) {
    int out[2];
    if (::pipe(out) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      return;
    }
    const std::string home = (test::scratch_dir() / "home").string();
    fs::create_directories(home);
    pid_ = ::forkpty(&terminal_fd_, nullptr, nullptr, nullptr);
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::close(out[0]);
      ::close(out[1]);
      // A terminal libedit knows, and no ~/.editrc of the user running the tests.
      ::setenv("TERM", "xterm", 1);
      ::setenv("HOME", home.c_str(), 1);
      ::unsetenv("EDITRC");
      std::vector<std::string> all{IRIS_BINARY};
      all.insert(all.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (std::string& a : all) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    out_fd_ = out[0];
    if (pid_ < 0) ADD_FAILURE() << "forkpty: " << std::strerror(errno);
  }

  ~TerminalChat() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    if (terminal_fd_ >= 0) ::close(terminal_fd_);
    if (out_fd_ >= 0) ::close(out_fd_);
  }

  // Keys as a terminal sends them (Enter is "\r", Ctrl-C "\x03").
  void type(const std::string& keys) {
    ASSERT_EQ(::write(terminal_fd_, keys.data(), keys.size()), static_cast<ssize_t>(keys.size()));
  }

  // Reads what the chat writes until `done` holds; false if it never does: the chat ended first,
  // or a minute and a half went by (a hang guard, not a timing check).
  bool wait_until(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd fds[2] = {{terminal_fd_, POLLIN, 0}, {out_fd_, POLLIN, 0}};
      const int n = ::poll(fds, 2, 100);
      if (n < 0 && errno != EINTR) return false;
      bool open = false;
      for (int i = 0; i < 2; ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
          open = true;
          continue;
        }
        char buf[4096];
        const ssize_t got = ::read(fds[i].fd, buf, sizeof(buf));
        if (got > 0) {
          (i == 0 ? terminal : out).append(buf, static_cast<size_t>(got));
          open = true;
        }
      }
      if (!open && reap()) return done();
    }
    return true;
  }

  // Whether the terminal is in raw mode, as libedit sets it while it reads a line: keys typed
  // before then are the terminal's to echo and edit (and a Ctrl-C discards them).
  bool raw() const {
    const int slave = ::open(::ptsname(terminal_fd_), O_RDWR | O_NOCTTY);
    if (slave < 0) return false;
    termios t{};
    const bool ok = ::tcgetattr(slave, &t) == 0;
    ::close(slave);
    return ok && (t.c_lflag & ICANON) == 0;
  }

  // The exit status once the chat has ended (reading what it writes meanwhile), or -1.
  int exit_code() {
    wait_until([&] { return reap(); });
    return exited_ && WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }

  std::string terminal;  // the prompt, the echo of what was typed, the notes: stderr
  std::string out;       // the replies: stdout

 private:
  bool reap() {
    if (!exited_ && pid_ > 0 && ::waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
    return exited_;
  }

  pid_t pid_ = -1;
  int terminal_fd_ = -1, out_fd_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

// The number in "(reply stopped by Ctrl-C after N tokens" from `from` on, or -1.
int stopped_after(const std::string& terminal, size_t from) {
  const std::string note = "(reply stopped by Ctrl-C after ";
  const size_t at = terminal.find(note, from);
  if (at == std::string::npos) return -1;
  return std::atoi(terminal.c_str() + at + note.size());
}

bool has_after(const std::string& text, const std::string& what, size_t from) {
  return text.size() > from && text.find(what, from) != std::string::npos;
}

const std::string kSystem = "You are terse.";
const std::string kTurn1 = "Write one sentence about CUDA graphs.";
const std::string kTurn2 = "Describe a cat.";

// The greedy tokens of a one-shot `iris generate -p` run of `prompt`, `n` of them.
std::vector<int32_t> one_shot_tokens(const std::string& prompt, int n) {
  const std::string out = (test::scratch_dir() / "one_shot.json").string();
  const std::string cmd = std::string(IRIS_BINARY) + " generate -m '" + test::fixture_dir() +
                          "' -sys '" + kSystem + "' -p '" + prompt +
                          "' --temp 0 --ignore-eos --json --device cpu -c 4096 -n " +
                          std::to_string(n) + " </dev/null >" + out + " 2>/dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), {});
  return nlohmann::json::parse(text).at("tokens").get<std::vector<int32_t>>();
}

TEST(AppChatTerminal, CtrlCStopsTheReplyAndTheNextTurnEqualsAOneShotRun) {
  // Replies that run on (no end-of-sequence, -n -1: until the 4096-token context is full) are
  // still going when Ctrl-C comes.
  TerminalChat chat({"generate", "-m", test::fixture_dir(), "-sys", kSystem, "--temp", "0",
                     "--ignore-eos", "-n", "-1", "-c", "4096", "--device", "cpu"});
  ASSERT_TRUE(chat.wait_until([&] { return has_after(chat.terminal, "> ", 0); })) << chat.terminal;
  EXPECT_NE(chat.terminal.find("Ctrl-C stops a reply"), std::string::npos) << chat.terminal;

  // Turn 1: Ctrl-C once the reply has begun.
  size_t mark = chat.terminal.size();
  chat.type(kTurn1 + "\r");
  ASSERT_TRUE(chat.wait_until([&] { return !chat.out.empty(); })) << chat.terminal;
  chat.type("\x03");
  ASSERT_TRUE(chat.wait_until([&] {
    const size_t note = chat.terminal.find("(reply stopped by Ctrl-C", mark);
    return note != std::string::npos && has_after(chat.terminal, "> ", note);
  })) << chat.terminal;
  const int k1 = stopped_after(chat.terminal, mark);
  ASSERT_GT(k1, 0) << chat.terminal;
  EXPECT_LT(k1, 3000) << "the reply ran to the end of the context: Ctrl-C did not stop it";
  const std::string reply1 = chat.out;
  ASSERT_EQ(reply1.find('\n'), reply1.size() - 1) << reply1;  // one line, ended

  // Turn 2, stopped the same way.
  mark = chat.terminal.size();
  chat.type(kTurn2 + "\r");
  ASSERT_TRUE(chat.wait_until([&] { return chat.out.size() > reply1.size(); })) << chat.terminal;
  chat.type("\x03");
  ASSERT_TRUE(chat.wait_until([&] {
    const size_t note = chat.terminal.find("(reply stopped by Ctrl-C", mark);
    return note != std::string::npos && has_after(chat.terminal, "> ", note);
  })) << chat.terminal;
  const int k2 = stopped_after(chat.terminal, mark);
  ASSERT_GT(k2, 0) << chat.terminal;
  const std::string reply2 = chat.out.substr(reply1.size());
  ASSERT_EQ(reply2.find('\n'), reply2.size() - 1) << reply2;

  // Ctrl-C at the empty prompt ends the chat, after the timings, as SIGINT would.
  chat.type("\x03");
  EXPECT_EQ(chat.exit_code(), 130) << chat.terminal;
  EXPECT_NE(chat.terminal.find("decode"), std::string::npos) << chat.terminal;
  EXPECT_EQ(chat.terminal.find("error"), std::string::npos) << chat.terminal;

  // Turn 1 is the first k1 tokens of the one-shot reply to message 1.
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  const std::vector<int32_t> t1 = one_shot_tokens(kTurn1, k1);
  ASSERT_EQ(t1.size(), static_cast<size_t>(k1));
  EXPECT_EQ(tok.decode(t1) + "\n", reply1);
  // Turn 2 is a one-shot run over the whole conversation, built here: the system prompt, message
  // 1, reply 1 as the ids generated and closed as the template closes it, message 2.
  const std::string dir = test::fixture_dir();
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  GenerationRequest req;
  req.prompt_ids = tok.encode("<|im_start|>system\n" + kSystem + "<|im_end|>\n<|im_start|>user\n" +
                              kTurn1 + "<|im_end|>\n<|im_start|>assistant\n");
  req.prompt_ids.insert(req.prompt_ids.end(), t1.begin(), t1.end());
  for (int32_t id : tok.encode("<|im_end|>\n<|im_start|>user\n" + kTurn2 +
                               "<|im_end|>\n<|im_start|>assistant\n"))
    req.prompt_ids.push_back(id);
  req.max_new_tokens = k2;
  req.sampling.temperature = 0;
  req.sampleable = sampleable_ids(tok, cfg.text.vocab_size);
  auto be = make_cpu_backend();
  ModelLimits limits;
  limits.max_context = 4096;
  limits.max_step_tokens = 256;
  Qwen3VLModel model(*be, dir, limits);
  const GenerationResult want = generate(model, req);
  ASSERT_EQ(want.tokens.size(), static_cast<size_t>(k2));
  EXPECT_EQ(tok.decode(want.tokens) + "\n", reply2);
}

// Ctrl-C while a line is typed drops the line and gives a fresh prompt; with libedit the line is
// edited (the left arrow, by UTF-8 characters, and an insertion) and recalled (the up arrow);
// Ctrl-D ends the chat. The turns are those of a piped chat sending the same two lines.
TEST(AppChatTerminal, LinesAreEditedAndRecalledWithLibedit) {
#ifndef IRIS_BINARY_HAS_LIBEDIT
  GTEST_SKIP() << "the iris binary was built without libedit (-DIRIS_LINE_EDITING)";
#endif
  const std::vector<std::string> flags = {"--temp", "0", "-n", "4", "--json", "--device", "cpu"};
  std::vector<std::string> args = {"generate", "-m", test::fixture_dir()};
  args.insert(args.end(), flags.begin(), flags.end());
  TerminalChat chat(args);
  // Each key goes to libedit: typed once it reads (it shows the prompt before it takes the
  // terminal).
  const auto editing = [&](size_t from) {
    return chat.wait_until([&] { return has_after(chat.terminal, "> ", from) && chat.raw(); });
  };
  ASSERT_TRUE(editing(0)) << chat.terminal;
  size_t mark = chat.terminal.size();
  chat.type("never sent");
  ASSERT_TRUE(chat.wait_until([&] { return has_after(chat.terminal, "never sent", mark); }))
      << chat.terminal;
  mark = chat.terminal.size();
  chat.type("\x03");
  ASSERT_TRUE(editing(mark)) << chat.terminal;
  EXPECT_EQ(chat.out, "");  // no turn
  const auto lines = [&] { return std::count(chat.out.begin(), chat.out.end(), '\n'); };
  // "hélo", three characters left (é is one, of two bytes), "x": "hxélo".
  chat.type("h\xc3\xa9lo\x1b[D\x1b[D\x1b[Dx\r");
  ASSERT_TRUE(chat.wait_until([&] { return lines() == 1 && chat.raw(); })) << chat.terminal;
  chat.type("\x1b[A\r");  // the last line again
  ASSERT_TRUE(chat.wait_until([&] { return lines() == 2 && chat.raw(); })) << chat.terminal;
  chat.type("\x04");
  EXPECT_EQ(chat.exit_code(), 0) << chat.terminal;

  const std::string piped_out = (test::scratch_dir() / "piped.json").string();
  std::string cmd = std::string(IRIS_BINARY) + " generate -m '" + test::fixture_dir() + "'";
  for (const std::string& f : flags) cmd += " " + f;
  cmd += " >" + piped_out + " 2>/dev/null <<'EOF'\nhx\xc3\xa9lo\nhx\xc3\xa9lo\nEOF";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(piped_out);
  const std::string piped((std::istreambuf_iterator<char>(f)), {});
  ASSERT_FALSE(piped.empty());
  std::vector<nlohmann::json> want, got;
  for (const auto& [text, into] : {std::pair{piped, &want}, std::pair{chat.out, &got}}) {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) into->push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(got.size(), 2u);
  ASSERT_EQ(want.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i]["tokens"], want[i]["tokens"]) << i;
    EXPECT_EQ(got[i]["prompt_tokens"], want[i]["prompt_tokens"]) << i;
    EXPECT_EQ(got[i]["interrupted"], false);
  }
}

}  // namespace
}  // namespace iris
