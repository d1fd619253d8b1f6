// ThreadPool::parallel_for: every index of [0, n) is visited exactly once for any n, grain and
// thread count; the first exception reaches the caller after all chunks ran; the pool stays usable;
// a pool the OS cannot give its threads raises moekit::Error (no abort, no hang).
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/thread_pool.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

TEST(ThreadPool, CoversRangeExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (std::int64_t n : {1, 2, 3, 7, 64, 1000}) {
      for (std::int64_t grain : {1, 3, 16, 5000}) {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        std::atomic<int> chunks{0};
        pool.parallel_for(
            n,
            [&](std::int64_t b, std::int64_t e) {
              ASSERT_LT(b, e);
              ++chunks;
              for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
            },
            grain);
        for (std::int64_t i = 0; i < n; ++i)
          ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1)
              << "threads=" << threads << " n=" << n << " grain=" << grain << " i=" << i;
        // At most num_threads chunks unless grain asks for smaller ones (grain >= 1 here is a
        // lower bound on chunk size, so chunks never exceed num_threads).
        EXPECT_LE(chunks.load(), threads) << "threads=" << threads << " n=" << n << " grain=" << grain;
      }
    }
  }
}

TEST(ThreadPool, ZeroAndNegativeNAreNoOps) {
  ThreadPool pool(3);
  int calls = 0;
  pool.parallel_for(0, [&](std::int64_t, std::int64_t) { ++calls; });
  pool.parallel_for(-4, [&](std::int64_t, std::int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPool, ExceptionPropagatesAndPoolIsReusable) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    std::atomic<std::int64_t> visited{0};
    EXPECT_THROW(pool.parallel_for(100,
                                   [&](std::int64_t b, std::int64_t e) {
                                     visited += e - b;
                                     if (b == 0) throw std::runtime_error("chunk 0 failed");
                                   }),
                 std::runtime_error)
        << "threads=" << threads;
    // All chunks still ran before the rethrow (no chunk is abandoned mid-flight).
    EXPECT_EQ(visited.load(), 100) << "threads=" << threads;
    for (int round = 0; round < 3; ++round) {
      std::atomic<std::int64_t> sum{0};
      pool.parallel_for(1000, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) sum += i;
      });
      EXPECT_EQ(sum.load(), 999 * 1000 / 2) << "threads=" << threads << " round=" << round;
    }
  }
}

TEST(ThreadPool, ManySmallJobs) {
  // Back-to-back jobs exercise the generation handshake between caller and workers.
  ThreadPool pool(3);
  std::int64_t total = 0;
  for (int job = 0; job < 2000; ++job) {
    std::atomic<std::int64_t> sum{0};
    pool.parallel_for(job % 7 + 1, [&](std::int64_t b, std::int64_t e) { sum += e - b; });
    total += sum.load();
    ASSERT_EQ(sum.load(), job % 7 + 1) << "job=" << job;
  }
  EXPECT_GT(total, 0);
}

TEST(ThreadPool, RejectsZeroThreads) {
  EXPECT_THROW(ThreadPool(0), moekit::Error);
}

// The OS refuses threads: every new thread's default stack made larger than any machine's memory
// (glibc's pthread_setattr_default_np), so pthread_create fails with EAGAIN as it does past a thread
// limit. The pool raises, naming how many it started, and leaves no thread behind.
TEST(ThreadPool, RaisesWhenTheOsGrantsFewerThreads) {
  pthread_attr_t saved, huge;
  ASSERT_EQ(pthread_getattr_default_np(&saved), 0);
  ASSERT_EQ(pthread_attr_init(&huge), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&huge, std::size_t{1} << 46), 0);  // 64 TiB
  ASSERT_EQ(pthread_setattr_default_np(&huge), 0);
  std::string what;
  try {
    ThreadPool pool(8);
  } catch (const Error& e) {
    what = e.what();
  }
  ASSERT_EQ(pthread_setattr_default_np(&saved), 0);
  pthread_attr_destroy(&huge);
  pthread_attr_destroy(&saved);
  EXPECT_NE(what.find("could start only 1 of the 8 threads"), std::string::npos) << what;
  EXPECT_NE(what.find("--threads"), std::string::npos) << what;
  ThreadPool after(3);  // the default restored, a pool starts again
  EXPECT_EQ(after.num_threads(), 3);
  // Past the limit of moekit/limits.h, or below 1: refused before any thread starts.
  EXPECT_THROW(ThreadPool(0), Error);
  EXPECT_THROW(ThreadPool(1025), Error);
}

}  // namespace
}  // namespace moekit::cpu
