#include "core/graph_capture.h"

#include <cstdio>
#include <utility>

#include "core/error.h"

namespace iris {

CapturedGraph::CapturedGraph(GraphApi& api, Backend& backend, std::string label,
                             std::function<void()> body)
    : api_(&api), backend_(&backend), label_(std::move(label)) {
  IRIS_CHECK(body != nullptr, "graph '", label_, "': nothing to capture (empty body)");
  api.begin_capture(backend, label_);
  try {
    body();
  } catch (...) {
    // The stream must leave capture mode, or every later op on it would fail as well.
    api.abort_capture(backend);
    throw;
  }
  graph_ = api.end_capture(backend, std::move(body));
  try {
    exec_ = api.instantiate(graph_, backend);
  } catch (...) {
    api.destroy(nullptr, graph_);
    graph_ = nullptr;
    throw;
  }
}

CapturedGraph::CapturedGraph(CapturedGraph&& other) noexcept
    : api_(std::exchange(other.api_, nullptr)),
      backend_(std::exchange(other.backend_, nullptr)),
      graph_(std::exchange(other.graph_, nullptr)),
      exec_(std::exchange(other.exec_, nullptr)),
      label_(std::move(other.label_)) {}

CapturedGraph& CapturedGraph::operator=(CapturedGraph&& other) noexcept {
  if (this != &other) {
    reset();
    api_ = std::exchange(other.api_, nullptr);
    backend_ = std::exchange(other.backend_, nullptr);
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
    label_ = std::move(other.label_);
  }
  return *this;
}

void CapturedGraph::launch() {
  IRIS_CHECK(valid(), "graph '", label_, "' was destroyed or never captured; it cannot launch");
  api_->launch(exec_, *backend_);
}

void CapturedGraph::reset() noexcept {
  if (api_ != nullptr && (exec_ != nullptr || graph_ != nullptr)) api_->destroy(exec_, graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}

CapturedGraph capture_and_run(GraphApi& api, Backend& backend, std::string label,
                              std::function<void()> body) {
  CapturedGraph g(api, backend, std::move(label), std::move(body));
  if (!api.capture_runs_work()) g.launch();
  return g;
}

// ---- recording stand-in ----

namespace {

void* to_handle(uint64_t id) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(id));
}
uint64_t to_id(const void* handle) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(handle));
}

}  // namespace

std::string_view to_string(RecordingGraphApi::Op op) {
  using Op = RecordingGraphApi::Op;
  switch (op) {
    case Op::begin_capture:
      return "begin_capture";
    case Op::end_capture:
      return "end_capture";
    case Op::abort_capture:
      return "abort_capture";
    case Op::instantiate:
      return "instantiate";
    case Op::upload:
      return "upload";
    case Op::launch:
      return "launch";
    case Op::destroy_exec:
      return "destroy_exec";
    case Op::destroy_graph:
      return "destroy_graph";
    case Op::note:
      return "note";
  }
  return "?";
}

void RecordingGraphApi::append(Op op, uint64_t graph, std::string label) {
  log_.push_back({op, graph, std::move(label)});
}

void RecordingGraphApi::begin_capture(Backend& backend, const std::string& label) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto open = open_.find(&backend);
  IRIS_CHECK(open == open_.end(), "graph '", label, "': a capture ('", open->second.label,
             "') is already open on backend ", backend.name(), "; captures do not nest");
  // The tape opens last: a refused capture leaves the backend untaped.
  const bool taped = backend.begin_op_tape();
  open_[&backend] = Open{label, taped};
  append(Op::begin_capture, 0, label);
}

GraphHandle RecordingGraphApi::end_capture(Backend& backend, std::function<void()> body) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto open = open_.find(&backend);
  IRIS_CHECK(open != open_.end(), "end_capture on backend ", backend.name(),
             " without a capture open");
  const uint64_t id = next_id_++;
  std::string label = std::move(open->second.label);
  const bool taped = open->second.taped;
  open_.erase(open);
  // A taped capture replays its record, as a CUDA graph does; a backend that cannot tape falls
  // back to running the body again, which re-reads host values a real graph would have frozen.
  if (taped) body = backend.end_op_tape();
  append(Op::end_capture, id, label);
  graphs_.emplace(id, Graph{std::move(label), std::move(body), 0});
  return to_handle(id);
}

void RecordingGraphApi::abort_capture(Backend& backend) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  const auto open = open_.find(&backend);
  if (open == open_.end()) return;
  std::string label = std::move(open->second.label);
  if (open->second.taped) {
    try {
      backend.end_op_tape();
    } catch (...) {  // the tape was open, so closing it cannot fail; nothing to report otherwise
    }
  }
  open_.erase(open);
  append(Op::abort_capture, 0, std::move(label));
}

GraphExecHandle RecordingGraphApi::instantiate(GraphHandle graph, Backend& backend) {
  std::lock_guard<std::mutex> lock(mu_);
  IRIS_CHECK(open_.find(&backend) == open_.end(), "instantiate while a capture is open on backend ",
             backend.name());
  const uint64_t id = to_id(graph);
  const auto g = graphs_.find(id);
  IRIS_CHECK(g != graphs_.end(), "instantiate of unknown or destroyed graph ", id);
  IRIS_CHECK(g->second.exec == 0, "graph ", id, " ('", g->second.label,
             "') is already instantiated");
  const uint64_t exec = next_id_++;
  g->second.exec = exec;
  execs_[exec] = id;
  append(Op::instantiate, id, g->second.label);
  append(Op::upload, id, g->second.label);
  return to_handle(exec);
}

void RecordingGraphApi::launch(GraphExecHandle exec, Backend& backend) {
  std::function<void()> body;
  {
    std::lock_guard<std::mutex> lock(mu_);
    IRIS_CHECK(open_.find(&backend) == open_.end(), "graph launch while a capture is open on ",
               backend.name(), " (a graph would record another graph's launch)");
    const auto e = execs_.find(to_id(exec));
    IRIS_CHECK(e != execs_.end(), "launch of unknown or destroyed executable graph ", to_id(exec));
    const Graph& g = graphs_.at(e->second);
    append(Op::launch, e->second, g.label);
    ++launches_;
    body = g.body;
  }
  // Outside the lock: the body issues backend ops, which may log notes of their own.
  body();
}

void RecordingGraphApi::destroy(GraphExecHandle exec, GraphHandle graph) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    if (exec != nullptr) {
      const auto e = execs_.find(to_id(exec));
      if (e == execs_.end()) {
        errors_.push_back(
            str_cat("destroy of unknown or already destroyed executable graph ", to_id(exec)));
      } else {
        append(Op::destroy_exec, e->second, graphs_.at(e->second).label);
        graphs_.at(e->second).exec = 0;
        execs_.erase(e);
      }
    }
    if (graph != nullptr) {
      const auto g = graphs_.find(to_id(graph));
      if (g == graphs_.end()) {
        errors_.push_back(str_cat("destroy of unknown or already destroyed graph ", to_id(graph)));
      } else {
        if (g->second.exec != 0) {
          errors_.push_back(str_cat("graph ", g->first, " ('", g->second.label,
                                    "') destroyed before its executable graph"));
          execs_.erase(g->second.exec);
        }
        append(Op::destroy_graph, g->first, g->second.label);
        graphs_.erase(g);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graph stand-in: destroy failed: %s\n", e.what());
  }
}

void RecordingGraphApi::note(std::string text) {
  std::lock_guard<std::mutex> lock(mu_);
  append(Op::note, 0, std::move(text));
}

bool RecordingGraphApi::capturing(const Backend* backend) const {
  std::lock_guard<std::mutex> lock(mu_);
  return backend == nullptr ? !open_.empty() : open_.count(backend) != 0;
}

std::vector<RecordingGraphApi::Call> RecordingGraphApi::log() const {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

std::vector<std::string> RecordingGraphApi::errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return errors_;
}

size_t RecordingGraphApi::live_graphs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return graphs_.size();
}

size_t RecordingGraphApi::launches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return launches_;
}

#ifndef IRIS_WITH_CUDA
std::unique_ptr<GraphApi> make_cuda_graph_api(CaptureMode) {
  IRIS_FAIL(
      "CUDA graphs need the CUDA backend, and this Iris build has none (nvcc was not found at "
      "configure time); rebuild with the CUDA toolkit or turn graphs off (cuda_graph_impl: none, "
      "vision_cuda_graph_impl: none)");
}
#endif

std::unique_ptr<GraphApi> make_graph_api(Backend& backend, CaptureMode mode) {
  if (backend.device() == Device::cuda) return make_cuda_graph_api(mode);
  return std::make_unique<RecordingGraphApi>();
}

}  // namespace iris
