// A small fixed thread pool owned by a context (no process-wide state): parallel_for splits
// [0, n) into contiguous chunks, runs them on the pool's threads and the caller, and rethrows the
// first exception after all chunks finished.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moekit::cpu {

class ThreadPool {
 public:
  // num_threads: total threads including the caller, 1 to limits::kMaxThreads. Raises moekit::Error
  // (naming how many threads the OS granted) when it cannot start them all.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  // fn(begin, end) over disjoint chunks covering [0, n); at most num_threads chunks unless grain
  // asks for smaller ones.
  void parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn, std::int64_t grain = 1);

 private:
  void worker_loop(int index);
  void stop_workers() noexcept;
  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(std::int64_t, std::int64_t)>* job_ = nullptr;
  std::int64_t job_n_ = 0, job_chunk_ = 0, next_chunk_ = 0, num_chunks_ = 0, chunks_done_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace moekit::cpu
