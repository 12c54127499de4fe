// Graph capture and replay behind one interface, so that the code that decides when to capture,
// what to replay and when to free runs unchanged on every machine:
//  - the CUDA implementation records the ops a body enqueues on the backend's stream
//    (cudaStreamBeginCapture ... cudaStreamEndCapture), instantiates and uploads the graph, and
//    replays it with cudaGraphLaunch;
//  - the recording stand-in (any backend, used on the CPU) runs the body while the backend tapes
//    each op with its arguments (Backend::begin_op_tape), replays that tape on every launch, and
//    logs every call, so tests can check ownership and ordering (each graph destroyed exactly
//    once, before the memory it reads) without a GPU, and see a host value frozen at capture as a
//    GPU would. On a backend that cannot tape, a launch runs the body again.
//
// Nothing here synchronises the device or talks to other processes: capture and deletion are
// local to the calling stage, so stages that own different parts of a model never wait on each
// other (the vision-graph deadlock of Megatron-Core's barrier-in-capture cannot happen).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/backend.h"

namespace iris {

// How strictly the CUDA runtime polices the capturing thread. thread_local_mode rejects calls
// that could implicitly synchronise or allocate (cudaMalloc, a host sync) made by this thread
// while it captures, so a body that is not capturable fails loudly at capture instead of
// replaying wrong work; other threads stay unaffected. relaxed allows them (for libraries that
// allocate lazily on first use).
enum class CaptureMode { thread_local_mode, relaxed };

// Opaque handles: a cudaGraph_t / cudaGraphExec_t, or the stand-in's ids.
using GraphHandle = void*;
using GraphExecHandle = void*;

class GraphApi {
 public:
  virtual ~GraphApi() = default;
  virtual std::string name() const = 0;
  // True when a body's work has already run once by the end of its capture (the stand-in: its
  // backend executes ops as they are issued); false when capture only records (CUDA).
  virtual bool capture_runs_work() const = 0;

  // Starts recording the ops issued on backend's stream.
  virtual void begin_capture(Backend& backend, const std::string& label) = 0;
  // Ends the capture and returns the graph. `body` is what ran since begin_capture(); a device
  // implementation ignores it (the graph holds the recorded work), the stand-in keeps it to run
  // on launch, so it must stay valid until the graph is destroyed.
  virtual GraphHandle end_capture(Backend& backend, std::function<void()> body) = 0;
  // Leaves capture after the body failed, discarding whatever was recorded.
  virtual void abort_capture(Backend& backend) noexcept = 0;
  // Instantiates the graph and uploads it to the device, so that the first launch costs no
  // more than later ones.
  virtual GraphExecHandle instantiate(GraphHandle graph, Backend& backend) = 0;
  virtual void launch(GraphExecHandle exec, Backend& backend) = 0;
  // Destroys the executable graph, then the graph (either may be null). Errors are reported on
  // stderr, never thrown: this runs from destructors.
  virtual void destroy(GraphExecHandle exec, GraphHandle graph) noexcept = 0;
};

// An instantiated graph and its source graph, destroyed exactly once (move-only).
class CapturedGraph {
 public:
  CapturedGraph() = default;
  // Captures the ops `body` issues on backend's stream. The body must not allocate, copy from or
  // to the host, or synchronise; it must outlive the graph (the stand-in re-runs it). The api
  // and the backend must outlive the graph too.
  CapturedGraph(GraphApi& api, Backend& backend, std::string label, std::function<void()> body);
  ~CapturedGraph() { reset(); }
  CapturedGraph(CapturedGraph&& other) noexcept;
  CapturedGraph& operator=(CapturedGraph&& other) noexcept;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  // Replays the graph on the backend's stream (asynchronous on a device).
  void launch();
  // Destroys the graph now; a second call, or a call on an empty graph, does nothing.
  void reset() noexcept;
  bool valid() const { return exec_ != nullptr; }
  const std::string& label() const { return label_; }

 private:
  GraphApi* api_ = nullptr;
  Backend* backend_ = nullptr;
  GraphHandle graph_ = nullptr;
  GraphExecHandle exec_ = nullptr;
  std::string label_;
};

// Captures `body` and makes sure its work has run exactly once when this returns: the stand-in
// ran it during capture, a device graph is launched once. For capturing in the middle of real
// work (lazy capture after warmup), where the step being captured must also produce its result.
CapturedGraph capture_and_run(GraphApi& api, Backend& backend, std::string label,
                              std::function<void()> body);

// The stand-in. Every call is appended to log(); misuse that CUDA would reject (nested capture on
// one backend, launch or instantiate while capturing, unknown handles) throws, except in
// destroy(), which cannot throw and records it in errors() instead.
class RecordingGraphApi final : public GraphApi {
 public:
  enum class Op {
    begin_capture,
    end_capture,
    abort_capture,
    instantiate,
    upload,
    launch,
    destroy_exec,
    destroy_graph,
    note,
  };
  struct Call {
    Op op;
    uint64_t graph = 0;  // the graph's id (0 for notes and aborts)
    std::string label;   // the graph's label, or a note's text
  };

  std::string name() const override { return "recording stand-in"; }
  bool capture_runs_work() const override { return true; }
  void begin_capture(Backend& backend, const std::string& label) override;
  GraphHandle end_capture(Backend& backend, std::function<void()> body) override;
  void abort_capture(Backend& backend) noexcept override;
  GraphExecHandle instantiate(GraphHandle graph, Backend& backend) override;
  void launch(GraphExecHandle exec, Backend& backend) override;
  void destroy(GraphExecHandle exec, GraphHandle graph) noexcept override;

  // Appends an outside event (e.g. a buffer being freed) to the log, so that its order relative
  // to the graph calls can be checked.
  void note(std::string text);
  // True while a capture is open on `backend` (any backend when null).
  bool capturing(const Backend* backend = nullptr) const;
  std::vector<Call> log() const;
  std::vector<std::string> errors() const;
  // Graphs ended and not yet destroyed.
  size_t live_graphs() const;
  size_t launches() const;

 private:
  struct Graph {
    std::string label;
    std::function<void()> body;
    uint64_t exec = 0;  // 0 = not instantiated
  };
  void append(Op op, uint64_t graph, std::string label);

  mutable std::mutex mu_;
  std::vector<Call> log_;
  std::vector<std::string> errors_;
  std::unordered_map<uint64_t, Graph> graphs_;    // live graphs by id
  std::unordered_map<uint64_t, uint64_t> execs_;  // live exec id -> graph id
  struct Open {
    std::string label;
    bool taped = false;  // the backend records the ops (Backend::begin_op_tape)
  };
  std::unordered_map<const Backend*, Open> open_;  // backend -> capture in progress
  uint64_t next_id_ = 1;
  size_t launches_ = 0;
};

std::string_view to_string(RecordingGraphApi::Op op);

// The real CUDA graph API. Throws iris::Error when Iris was built without CUDA.
std::unique_ptr<GraphApi> make_cuda_graph_api(CaptureMode mode = CaptureMode::thread_local_mode);
// The API that fits `backend`: CUDA graphs on a CUDA backend, the recording stand-in elsewhere.
std::unique_ptr<GraphApi> make_graph_api(Backend& backend,
                                         CaptureMode mode = CaptureMode::thread_local_mode);

}  // namespace iris
