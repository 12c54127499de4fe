#include "apps/chat_input.h"

#include <langinfo.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <clocale>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <cwchar>

#include "core/error.h"

#ifdef IRIS_WITH_LIBEDIT
#include <histedit.h>
#endif

namespace iris {
namespace {

volatile std::sig_atomic_t g_sigint = 0;
struct sigaction g_previous_sigint;

extern "C" void on_sigint(int) {
  g_sigint = 1;
}

// Waits for a byte of stdin and reads it: 1, 0 at the end of input, -1 with errno EINTR for a
// Ctrl-C, -1 for a failed read. The wait is cut into short polls that look at the flag between
// them, because the SIGINT may have come just before the wait began, or to another thread (an
// OpenMP worker), and then interrupts no system call of this one.
int read_byte(char& c) {
  for (;;) {
    if (g_sigint != 0) {
      errno = EINTR;
      return -1;
    }
    pollfd in{STDIN_FILENO, POLLIN, 0};
    const int ready = ::poll(&in, 1, /*timeout_ms=*/100);
    if (ready < 0 && errno != EINTR) return -1;
    if (ready <= 0) continue;
    const ssize_t n = ::read(STDIN_FILENO, &c, 1);
    if (n >= 0) return static_cast<int>(n);
    if (errno != EINTR) return -1;
  }
}

}  // namespace

ChatInterrupts::ChatInterrupts() {
  if (sigaction(SIGINT, nullptr, &g_previous_sigint) != 0)
    IRIS_FAIL("cannot set up Ctrl-C for the chat: sigaction: ", std::strerror(errno));
  g_sigint = 0;
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  if (sigemptyset(&sa.sa_mask) != 0)
    IRIS_FAIL("cannot set up Ctrl-C for the chat: sigemptyset: ", std::strerror(errno));
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGINT, &sa, nullptr) != 0)
    IRIS_FAIL("cannot set up Ctrl-C for the chat: sigaction: ", std::strerror(errno));
}

ChatInterrupts::~ChatInterrupts() {
  if (sigaction(SIGINT, &g_previous_sigint, nullptr) != 0)
    std::fprintf(stderr, "warning: could not restore the Ctrl-C handler: %s\n",
                 std::strerror(errno));
}

bool ChatInterrupts::pending() const {
  return g_sigint != 0;
}

void ChatInterrupts::clear() {
  g_sigint = 0;
}

#ifdef IRIS_WITH_LIBEDIT
struct TerminalLineReader::Editor {
  EditLine* el = nullptr;
  History* history = nullptr;
  std::string previous_ctype;  // restored at the end
  ~Editor() {
    if (el != nullptr) el_end(el);  // gives the terminal back its settings
    if (history != nullptr) history_end(history);
    if (!previous_ctype.empty()) std::setlocale(LC_CTYPE, previous_ctype.c_str());
  }
};

namespace {

const char* chat_prompt(EditLine*) {
  return "> ";
}

// libedit's character reader (EL_GETCFN), on read_byte: one character of the locale's multibyte
// encoding (UTF-8) a call; bytes that are no character are dropped, as libedit's own reader does.
int read_wide_char(EditLine*, wchar_t* wc) {
  char bytes[MB_LEN_MAX];
  size_t n = 0;
  for (;;) {
    const int got = read_byte(bytes[n]);
    if (got <= 0) return got;
    ++n;
    std::mbstate_t state{};
    const size_t used = std::mbrtowc(wc, bytes, n, &state);
    if (used == static_cast<size_t>(-2) && n < sizeof(bytes)) continue;  // more bytes to come
    if (used == static_cast<size_t>(-1) || used == static_cast<size_t>(-2)) {
      n = 0;
      continue;
    }
    return 1;
  }
}

// libedit reads and shows characters through the C library's multibyte conversion, which under
// the C locale knows ASCII only; Qwen chats are UTF-8, so the character type comes from the
// environment when it is UTF-8, else from C.UTF-8. Only LC_CTYPE changes (numbers print as
// before).
std::string use_utf8_ctype() {
  const char* now = std::setlocale(LC_CTYPE, nullptr);
  std::string previous = now != nullptr ? now : "C";
  if (std::setlocale(LC_CTYPE, "") == nullptr || std::strcmp(nl_langinfo(CODESET), "UTF-8") != 0)
    std::setlocale(LC_CTYPE, "C.UTF-8");
  return previous;
}

}  // namespace
#else
struct TerminalLineReader::Editor {};
#endif

TerminalLineReader::TerminalLineReader(ChatInterrupts& interrupts) : interrupts_(interrupts) {
#ifdef IRIS_WITH_LIBEDIT
  // libedit draws the line on stderr, beside the prompt and the notes; when stderr is not the
  // terminal (2>log) the terminal's own line editing is all there is.
  if (::isatty(STDERR_FILENO) == 0) return;
  auto editor = std::make_unique<Editor>();
  editor->previous_ctype = use_utf8_ctype();
  editor->el = el_init("iris", stdin, stderr, stderr);
  editor->history = history_init();
  if (editor->el == nullptr || editor->history == nullptr) {
    std::fprintf(stderr, "note: line editing is off: libedit could not start on this terminal\n");
    return;
  }
  HistEvent ev;
  const bool set = history(editor->history, &ev, H_SETSIZE, 1000) >= 0 &&
                   history(editor->history, &ev, H_SETUNIQUE, 1) >= 0 &&
                   el_set(editor->el, EL_EDITOR, "emacs") == 0 &&
                   el_set(editor->el, EL_PROMPT, chat_prompt) == 0 &&
                   el_set(editor->el, EL_GETCFN, read_wide_char) == 0 &&
                   el_set(editor->el, EL_HIST, history, editor->history) == 0;
  if (!set) {
    std::fprintf(stderr, "note: line editing is off: libedit refused its settings\n");
    return;
  }
  // The user's ~/.editrc (key bindings, vi mode), as other libedit programs read it; none is fine.
  el_source(editor->el, nullptr);
  editor_ = std::move(editor);
#endif
}

TerminalLineReader::~TerminalLineReader() = default;

void TerminalLineReader::remember(const std::string& line) {
#ifdef IRIS_WITH_LIBEDIT
  if (editor_ == nullptr) return;
  HistEvent ev;
  history(editor_->history, &ev, H_ENTER, line.c_str());
#else
  (void)line;
#endif
}

TerminalLineReader::Status TerminalLineReader::read(std::string& line) {
  line.clear();
  had_text_ = false;
  // A Ctrl-C that came while something else ran (a reply that ended anyway, a /video being
  // decoded) has been spent on it; this prompt waits for one of its own.
  interrupts_.clear();
  Status status = Status::end;
  int read_errno = 0;
#ifdef IRIS_WITH_LIBEDIT
  if (editor_ != nullptr) {
    int count = 0;
    const char* got = el_gets(editor_->el, &count);
    if (got != nullptr && count > 0) {
      line.assign(got, static_cast<size_t>(count));
      status = Status::line;
    } else if (interrupts_.pending()) {
      const LineInfo* typed = el_line(editor_->el);
      had_text_ = typed != nullptr && typed->lastchar != typed->buffer;
      status = Status::interrupted;
    } else if (count < 0) {
      read_errno = errno;
    }
  }
#endif
  if (editor_ == nullptr) {
    // The terminal edits the line (canonical mode) and hands it over whole; a Ctrl-C discards
    // what was typed before this process sees any of it.
    std::fputs("> ", stderr);
    std::fflush(stderr);
    for (;;) {
      char c = 0;
      const int got = read_byte(c);
      if (got == 1 && c != '\n') {
        line += c;
        continue;
      }
      if (got == 1 || (got == 0 && !line.empty())) {
        status = Status::line;
      } else if (got < 0 && interrupts_.pending()) {
        line.clear();
        status = Status::interrupted;
      } else if (got < 0) {
        read_errno = errno;
      }
      break;
    }
  }
  if (read_errno != 0)
    IRIS_FAIL("the chat could not read the terminal: ", std::strerror(read_errno));
  if (status == Status::line) {
    // A Ctrl-C between the line's end and here belongs to no reply yet.
    interrupts_.clear();
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  }
  return status;
}

}  // namespace iris
