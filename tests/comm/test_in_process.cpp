// Tests of the in-process communicator (src/comm/in_process.cpp): exact byte patterns through
// all_to_all_v for 1..7 ranks, the count and max collectives, 100 back-to-back rounds, and failures
// (a throwing rank, mismatched sizes, an early return) that must end in an Error, never a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "exchange_check.h"
#include "moekit/communicator.h"
#include "moekit/error.h"

namespace moekit {
namespace {

using testing::exchange_and_check;

// A hang is a failure, not a stuck CI job: abort the binary if a case runs past its deadline.
class Watchdog {
 public:
  explicit Watchdog(const char* what, std::chrono::seconds limit = std::chrono::seconds(60))
      : thread_([this, what, limit] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "test_in_process: '%s' still running after %llds: a collective hangs\n", what,
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

class InProcessSizes : public ::testing::TestWithParam<int> {};

TEST_P(InProcessSizes, AllToAllVCarriesExactPattern) {
  Watchdog watchdog("AllToAllVCarriesExactPattern");
  const int n = GetParam();
  run_in_process(n, [&](Communicator& comm) {
    EXPECT_EQ(comm.size(), n);
    EXPECT_EQ(comm.name(), "in-process");
    EXPECT_EQ(exchange_and_check(comm, 0), "");
  });
}

TEST_P(InProcessSizes, AllToAllCounts) {
  Watchdog watchdog("AllToAllCounts");
  const int n = GetParam();
  run_in_process(n, [&](Communicator& comm) {
    const auto un = static_cast<std::size_t>(n);
    std::vector<std::int64_t> send(un), recv(un, -1);
    for (int r = 0; r < n; ++r) send[r] = 1000 * comm.rank() + r - (r == 0 ? 5'000'000'000LL : 0);
    comm.all_to_all_counts(send, recv);
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(recv[r], 1000 * r + comm.rank() - (comm.rank() == 0 ? 5'000'000'000LL : 0))
          << "rank " << comm.rank() << " of " << n << ", from " << r;
  });
}

TEST_P(InProcessSizes, AllReduceMax) {
  Watchdog watchdog("AllReduceMax");
  const int n = GetParam();
  run_in_process(n, [&](Communicator& comm) {
    const int me = comm.rank();
    // The maximum sits on the middle rank, so neither the first nor the last rank's value wins by order.
    const int peak = n / 2;
    const std::int64_t mine = me == peak ? (std::int64_t{1} << 40) : -me - 1;
    EXPECT_EQ(comm.all_reduce_max(mine), std::int64_t{1} << 40) << "rank " << me << " of " << n;
    EXPECT_EQ(comm.all_reduce_max(std::int64_t{-7} - me), std::int64_t{-7}) << "rank " << me << " of " << n;
    EXPECT_EQ(comm.all_reduce_max(me == peak ? 2.5 : -1.0 * me), 2.5) << "rank " << me << " of " << n;
    // A NaN on one rank reaches every rank (rather than each rank keeping its own answer).
    const double nan = std::numeric_limits<double>::quiet_NaN();
    EXPECT_TRUE(std::isnan(comm.all_reduce_max(me == n - 1 ? nan : 1.0 * me))) << "rank " << me << " of " << n;
    comm.barrier();
  });
}

TEST_P(InProcessSizes, BroadcastFromEveryRoot) {
  Watchdog watchdog("BroadcastFromEveryRoot");
  const int n = GetParam();
  run_in_process(n, [&](Communicator& comm) {
    for (int root = 0; root < n; ++root) {
      std::vector<std::uint8_t> data(128);
      for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(comm.rank() * 31 + i);
      comm.broadcast(data.data(), static_cast<std::int64_t>(data.size()), root);
      for (std::size_t i = 0; i < data.size(); ++i)
        ASSERT_EQ(data[i], static_cast<std::uint8_t>(root * 31 + i)) << "rank " << comm.rank() << " root " << root;
    }
  });
}

TEST_P(InProcessSizes, HundredRoundsOfMixedCollectives) {
  Watchdog watchdog("HundredRoundsOfMixedCollectives");
  const int n = GetParam();
  run_in_process(n, [&](Communicator& comm) {
    std::string problems;
    for (int round = 0; round < 100 && problems.empty(); ++round) {
      problems = exchange_and_check(comm, round);
      // Each round's maximum comes from a different rank, and values fall round by round: a value
      // left over from the previous round would win the max and show.
      const std::int64_t base = -1000 * std::int64_t{round};
      const std::int64_t mine = comm.rank() == round % n ? base + 500 : base - comm.rank();
      if (comm.all_reduce_max(mine) != base + 500 && problems.empty())
        problems = "all_reduce_max of round " + std::to_string(round);
      if (round % 10 == 0) comm.barrier();
      // Keep all ranks in lockstep even when one found a problem: agree on whether to stop.
      if (comm.all_reduce_max(problems.empty() ? 0.0 : 1.0) != 0.0 && problems.empty()) problems = "a peer failed";
    }
    EXPECT_EQ(problems, "") << "rank " << comm.rank() << " of " << n;
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, InProcessSizes, ::testing::Values(1, 2, 3, 4, 7),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "n" + std::to_string(param_info.param);
                         });

TEST(InProcess, RejectsZeroRanks) {
  EXPECT_THROW(run_in_process(0, [](Communicator&) {}), Error);
  EXPECT_THROW(run_in_process(-3, [](Communicator&) {}), Error);
}

TEST(InProcess, ThrowingRankEndsTheGroupWithItsException) {
  Watchdog watchdog("ThrowingRankEndsTheGroupWithItsException");
  constexpr int kRanks = 4;
  std::mutex mu;
  std::vector<std::string> seen(kRanks);
  try {
    run_in_process(kRanks, [&](Communicator& comm) {
      try {
        comm.barrier();
        if (comm.rank() == 2) throw std::runtime_error("rank 2 ran out of experts");
        for (int i = 0; i < 1000; ++i) exchange_and_check(comm, i);
      } catch (const Error& e) {
        std::lock_guard lock(mu);
        seen[comm.rank()] = e.what();
        throw;
      }
    });
    ADD_FAILURE() << "run_in_process returned normally";
  } catch (const Error& e) {
    ADD_FAILURE() << "rethrew a secondary error, not rank 2's: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 2 ran out of experts");
  }
  for (int r = 0; r < kRanks; ++r) {
    if (r == 2) continue;
    EXPECT_NE(seen[r].find("in-process group aborted: rank 2 failed: rank 2 ran out of experts"), std::string::npos)
        << "rank " << r << " saw: " << seen[r];
  }
}

TEST(InProcess, MismatchedRecvBytesIsAnErrorOnEveryRank) {
  Watchdog watchdog("MismatchedRecvBytesIsAnErrorOnEveryRank");
  constexpr int kRanks = 3;
  std::mutex mu;
  int num_errors = 0;
  try {
    run_in_process(kRanks, [&](Communicator& comm) {
      std::vector<std::uint8_t> send(8, 1), recv(64, 0);
      std::vector<std::int64_t> send_bytes(kRanks, 2), send_offsets{0, 2, 4}, recv_bytes(kRanks, 2),
          recv_offsets{0, 8, 16};
      if (comm.rank() == 1) recv_bytes[0] = 3;  // rank 0 sends it 2
      try {
        comm.all_to_all_v(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);
      } catch (const Error& e) {
        std::lock_guard lock(mu);
        ++num_errors;
        EXPECT_NE(std::string(e.what()).find("rank 1 expects 3 B from rank 0, which sends it 2 B"), std::string::npos)
            << e.what();
        throw;
      }
    });
    ADD_FAILURE() << "run_in_process returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_to_all_counts"), std::string::npos) << e.what();
  }
  EXPECT_EQ(num_errors, kRanks);
}

TEST(InProcess, BadSpanSizeOnOneRankIsAnError) {
  Watchdog watchdog("BadSpanSizeOnOneRankIsAnError");
  EXPECT_THROW(run_in_process(3,
                              [](Communicator& comm) {
                                std::vector<std::int64_t> send(comm.rank() == 2 ? 2 : 3, 0), recv(3, 0);
                                comm.all_to_all_counts(send, recv);
                              }),
               Error);
}

TEST(InProcess, RankReturningEarlyIsAnErrorNotAHang) {
  Watchdog watchdog("RankReturningEarlyIsAnErrorNotAHang");
  try {
    run_in_process(3, [](Communicator& comm) {
      comm.barrier();
      if (comm.rank() == 0) return;
      comm.barrier();
    });
    ADD_FAILURE() << "run_in_process returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("after rank 0 returned"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moekit
