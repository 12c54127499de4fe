// The interactive chat's input on a terminal, as llama-mtmd-cli's: Ctrl-C stops the reply in
// flight and comes back to the prompt, where a Ctrl-C on an empty line ends the chat; lines are
// edited, and earlier ones recalled, through libedit when the build has it. A chat whose stdin is
// not a terminal reads with std::getline and takes no signal (apps/generate_command.cpp).
#pragma once

#include <memory>
#include <string>

namespace iris {

// SIGINT while the chat runs: the handler only sets a flag, which the reply polls between tokens
// and the prompt between waits for a key. System calls restart after it, so that a reply's writes
// and a file being read carry on. The previous disposition is restored at the end.
class ChatInterrupts {
 public:
  ChatInterrupts();
  ~ChatInterrupts();
  ChatInterrupts(const ChatInterrupts&) = delete;
  ChatInterrupts& operator=(const ChatInterrupts&) = delete;

  // True once a SIGINT came since the last clear().
  bool pending() const;
  void clear();
};

// Lines typed at the "> " prompt (on stderr, so that stdout holds only the replies).
class TerminalLineReader {
 public:
  enum class Status { line, interrupted, end };

  explicit TerminalLineReader(ChatInterrupts& interrupts);
  ~TerminalLineReader();
  TerminalLineReader(const TerminalLineReader&) = delete;
  TerminalLineReader& operator=(const TerminalLineReader&) = delete;

  // The next line (without its newline), a Ctrl-C at the prompt, or the end of input (Ctrl-D).
  // After `interrupted`, had_text() says whether a line was being typed.
  Status read(std::string& line);
  bool had_text() const { return had_text_; }
  // Recalls `line` with the up arrow from then on (libedit only).
  void remember(const std::string& line);

 private:
  struct Editor;
  ChatInterrupts& interrupts_;
  std::unique_ptr<Editor> editor_;  // null: lines as the terminal edits them
  bool had_text_ = false;
};

}  // namespace iris
