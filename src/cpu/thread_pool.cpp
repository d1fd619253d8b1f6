// ThreadPool: workers sleep on a condition variable; parallel_for publishes one job, every thread
// (the caller too) takes chunks until none is left, and the caller waits for the last one.
#include "cpu/thread_pool.h"

#include <algorithm>
#include <system_error>

#include "moekit/check.h"
#include "moekit/limits.h"

namespace moekit::cpu {

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads) {
  MOEKIT_CHECK(num_threads >= 1 && num_threads <= limits::kMaxThreads,
               "a thread pool takes 1 to {} threads (moekit/limits.h), got {}", limits::kMaxThreads, num_threads);
  workers_.reserve(static_cast<std::size_t>(num_threads - 1));
  try {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {
    // The OS refused a thread (EAGAIN: a process or user thread limit, or no memory for its stack):
    // stop and join the ones started, then say how many it granted.
    const auto started = workers_.size() + 1;
    stop_workers();
    MOEKIT_FAIL("could start only {} of the {} threads asked for ({}): ask for {} or fewer (--threads)", started,
                num_threads, e.what(), started);
  }
}

ThreadPool::~ThreadPool() {
  stop_workers();
}

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn,
                              std::int64_t grain) {
  if (n <= 0) return;
  grain = std::max<std::int64_t>(grain, 1);
  const std::int64_t chunk = std::max(grain, (n + num_threads_ - 1) / num_threads_);
  const std::int64_t num_chunks = (n + chunk - 1) / chunk;
  if (num_threads_ == 1 || num_chunks == 1) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = chunk;
  num_chunks_ = num_chunks;
  next_chunk_ = 0;
  chunks_done_ = 0;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  // The caller works too.
  while (next_chunk_ < num_chunks_) {
    const std::int64_t c = next_chunk_++;
    lock.unlock();
    try {
      fn(c * chunk, std::min(n, (c + 1) * chunk));
    } catch (...) {
      std::lock_guard<std::mutex> g(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    ++chunks_done_;
  }
  done_.wait(lock, [&] { return chunks_done_ == num_chunks_; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop(int /*index*/) {
  std::uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || (generation_ != seen && job_ != nullptr && next_chunk_ < num_chunks_); });
    if (stop_) return;
    seen = generation_;
    while (job_ != nullptr && next_chunk_ < num_chunks_) {
      const std::int64_t c = next_chunk_++;
      const auto* fn = job_;
      const std::int64_t n = job_n_, chunk = job_chunk_;
      lock.unlock();
      try {
        (*fn)(c * chunk, std::min(n, (c + 1) * chunk));
      } catch (...) {
        std::lock_guard<std::mutex> g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      lock.lock();
      if (++chunks_done_ == num_chunks_) done_.notify_all();
    }
  }
}

}  // namespace moekit::cpu
