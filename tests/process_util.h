// Child processes for the command-line tests: the iris binary, mpirun or a script, with stdout and
// stderr in a log file that the test reads back.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/fs.h"

namespace iris::test {

struct ProcessExit {
  int code = -1;  // exit status, or -1 when killed by a signal
  int signal = 0;
  std::string output;  // the log
  double seconds = 0;  // wall time, for run_process
};

// Starts args (args[0] looked up in PATH) with `env` ("NAME=value") added to its environment and
// stdout and stderr in `log`: appended to it, or replacing what it held.
inline pid_t spawn_process(const std::vector<std::string>& args, const std::string& log,
                           const std::vector<std::string>& env = {}, bool append = false) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    std::vector<std::string> copy = args, vars = env;
    for (std::string& e : vars) ::putenv(e.data());
    std::vector<char*> argv;
    for (std::string& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

inline ProcessExit wait_process(pid_t pid, const std::string& log) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  ProcessExit e;
  if (WIFEXITED(status)) e.code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) e.signal = WTERMSIG(status);
  e.output = std::filesystem::exists(log) ? read_text_file(log) : "";
  return e;
}

inline ProcessExit run_process(const std::vector<std::string>& args, const std::string& log,
                               const std::vector<std::string>& env = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  ProcessExit e = wait_process(spawn_process(args, log, env), log);
  e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

// What a process killed with SIGKILL mid-export leaves: an OwnedTempDir beside `target` holding
// a partial file, whose owner is gone. Returns the temporary's path.
inline std::string temp_dir_of_killed_process(const std::string& target) {
  int ready[2];
  if (::pipe(ready) != 0) return {};
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(ready[0]);
    const OwnedTempDir tmp(target);
    write_new_file(tmp.path() + "/model.safetensors", "half a model");
    const std::string& path = tmp.path();
    if (::write(ready[1], path.data(), path.size()) < 0) ::_exit(2);
    ::close(ready[1]);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char buf[4096] = {};
  const ssize_t n = child > 0 ? ::read(ready[0], buf, sizeof(buf) - 1) : -1;
  ::close(ready[0]);
  if (child > 0) {
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
  }
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace iris::test
