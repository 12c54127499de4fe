// CUDA graphs on the backend's own stream: capture, instantiate + upload, launch, destroy.
#include <cuda_runtime.h>

#include <cstdio>

#include "core/cuda/cuda_check.h"
#include "core/graph_capture.h"

namespace iris {
namespace {

cudaStream_t stream_of(Backend& backend) {
  IRIS_CHECK(backend.device() == Device::cuda, "CUDA graphs need a CUDA backend; ", backend.name(),
             " is not one (use the recording stand-in there)");
  void* stream = backend.native_stream();
  // The legacy default stream cannot be captured, so a null stream is an error, not a default.
  IRIS_CHECK(stream != nullptr, "backend ", backend.name(),
             " exposes no stream to capture (Backend::native_stream() returned null)");
  return static_cast<cudaStream_t>(stream);
}

// Runs a checked CUDA call where throwing is not allowed (destructors, abort paths).
template <typename F>
void report_instead_of_throwing(const char* what, F&& f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "iris: %s failed: %s\n", what, e.what());
  }
}

class CudaGraphApi final : public GraphApi {
 public:
  explicit CudaGraphApi(CaptureMode mode)
      : mode_(mode == CaptureMode::relaxed ? cudaStreamCaptureModeRelaxed
                                           : cudaStreamCaptureModeThreadLocal) {}

  std::string name() const override { return "cuda"; }
  bool capture_runs_work() const override { return false; }

  void begin_capture(Backend& backend, const std::string&) override {
    backend.finish_background_startup();
    IRIS_CUDA_CHECK(cudaStreamBeginCapture(stream_of(backend), mode_));
  }

  GraphHandle end_capture(Backend& backend, std::function<void()>) override {
    cudaGraph_t graph = nullptr;
    try {
      IRIS_CUDA_CHECK(cudaStreamEndCapture(stream_of(backend), &graph));
    } catch (...) {
      // An invalidated capture still ends here; whatever it recorded is unusable.
      if (graph != nullptr)
        report_instead_of_throwing("cudaGraphDestroy",
                                   [&] { IRIS_CUDA_CHECK(cudaGraphDestroy(graph)); });
      (void)cudaGetLastError();  // reported by this exception, not again by the next launch check
      throw;
    }
    return graph;
  }

  void abort_capture(Backend& backend) noexcept override {
    report_instead_of_throwing("leaving an aborted graph capture", [&] {
      const cudaStream_t stream = stream_of(backend);
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
      if (status == cudaStreamCaptureStatusNone) return;
      cudaGraph_t graph = nullptr;
      // A body that broke the capture makes this fail with cudaErrorStreamCaptureInvalidated;
      // the stream has left capture mode then as well, which is all that matters here.
      const cudaError_t err = cudaStreamEndCapture(stream, &graph);
      if (err != cudaErrorStreamCaptureInvalidated) IRIS_CUDA_CHECK(err);
      if (graph != nullptr) IRIS_CUDA_CHECK(cudaGraphDestroy(graph));
    });
    // The call that broke the capture has been reported by the exception in flight; left as the
    // last error, it would be reported again by the next kernel launch check.
    (void)cudaGetLastError();
  }

  GraphExecHandle instantiate(GraphHandle graph, Backend& backend) override {
    cudaGraphExec_t exec = nullptr;
    IRIS_CUDA_CHECK(cudaGraphInstantiate(&exec, static_cast<cudaGraph_t>(graph), 0));
    try {
      IRIS_CUDA_CHECK(cudaGraphUpload(exec, stream_of(backend)));
    } catch (...) {
      report_instead_of_throwing("cudaGraphExecDestroy",
                                 [&] { IRIS_CUDA_CHECK(cudaGraphExecDestroy(exec)); });
      throw;
    }
    return exec;
  }

  void launch(GraphExecHandle exec, Backend& backend) override {
    IRIS_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), stream_of(backend)));
  }

  // No synchronisation: an executable graph destroyed while in flight is freed by the driver
  // when it completes, so deleting never waits on the device (or on another stage).
  void destroy(GraphExecHandle exec, GraphHandle graph) noexcept override {
    if (exec != nullptr)
      report_instead_of_throwing("cudaGraphExecDestroy", [&] {
        IRIS_CUDA_CHECK(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)));
      });
    if (graph != nullptr)
      report_instead_of_throwing("cudaGraphDestroy", [&] {
        IRIS_CUDA_CHECK(cudaGraphDestroy(static_cast<cudaGraph_t>(graph)));
      });
  }

 private:
  cudaStreamCaptureMode mode_;
};

}  // namespace

std::unique_ptr<GraphApi> make_cuda_graph_api(CaptureMode mode) {
  return std::make_unique<CudaGraphApi>(mode);
}

}  // namespace iris
