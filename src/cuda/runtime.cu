// Streams, events and graphs behind plain C++ (cuda/launch.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/launch.h"

namespace moekit::cuda {
namespace {}  // namespace

double median_ms(int reps, const std::function<void()>& fn, void* stream) {
  Event a, b;
  for (int i = 0; i < 3; ++i) fn();  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    a.record(stream);
    fn();
    b.record(stream);
    ms.push_back(b.ms_since(a));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void* create_stream() {
  cudaStream_t s = nullptr;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void destroy_stream(void* stream) {
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

Graph::Graph(const std::function<void(void*)>& enqueue, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue(stream);
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  graph_ = graph;
  exec_ = exec;
}

Graph::~Graph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_ != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void Graph::replay(void* stream) {
  MOEKIT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream)));
}

Event::Event() {
  cudaEvent_t e = nullptr;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  event_ = e;
}

Event::~Event() {
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void Event::record(void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
  // NOTES: inside a capture a plain record only orders streams; cudaEventRecordExternal makes it a
  // node of the graph that records the event at every replay (stage times from one graph).
  MOEKIT_CUDA_CHECK(cudaEventRecordWithFlags(
      static_cast<cudaEvent_t>(event_), s,
      capturing == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault));
}

float Event::ms_since(const Event& start) const {
  MOEKIT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
  float ms = 0;
  MOEKIT_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(event_)));
  return ms;
}

}  // namespace moekit::cuda
