// Tests of the MPI communicator (src/comm/mpi_communicator.cpp) under `mpirun -np 4`: exact byte
// patterns through all_to_all_v, the count and max collectives, 50 rounds, and a size mismatch that
// must raise an Error on every rank. Every rank runs every collective even after a failed check.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "exchange_check.h"
#include "moekit/communicator.h"
#include "moekit/error.h"

namespace moekit {
namespace {

Communicator* g_comm = nullptr;

// On ranks other than 0, replaces GoogleTest's printer: only failures, each tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

using testing::exchange_and_check;

TEST(Mpi, WorldOfFour) {
  EXPECT_EQ(g_comm->size(), 4);
  EXPECT_EQ(g_comm->name(), "mpi");
  EXPECT_TRUE(mpi_available());
}

TEST(Mpi, AllToAllVCarriesExactPattern) {
  EXPECT_EQ(exchange_and_check(*g_comm, 0), "");
}

TEST(Mpi, AllToAllCounts) {
  const int n = g_comm->size(), me = g_comm->rank();
  std::vector<std::int64_t> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n), -1);
  // Values beyond 32 bits, to catch an int-sized transfer.
  for (int r = 0; r < n; ++r) send[r] = 1000 * me + r + (std::int64_t{r} << 40);
  g_comm->all_to_all_counts(send, recv);
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(recv[r], 1000 * r + me + (std::int64_t{me} << 40)) << "rank " << me << ", from " << r;
}

TEST(Mpi, BroadcastFromEveryRoot) {
  for (int root = 0; root < g_comm->size(); ++root) {
    std::vector<std::uint8_t> data(128);
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(g_comm->rank() * 31 + i);
    g_comm->broadcast(data.data(), static_cast<std::int64_t>(data.size()), root);
    for (std::size_t i = 0; i < data.size(); ++i)
      ASSERT_EQ(data[i], static_cast<std::uint8_t>(root * 31 + i)) << "rank " << g_comm->rank() << " root " << root;
  }
}

TEST(Mpi, AllReduceMax) {
  const int me = g_comm->rank();
  const std::int64_t mine = me == 2 ? (std::int64_t{1} << 40) : -me - 1;
  EXPECT_EQ(g_comm->all_reduce_max(mine), std::int64_t{1} << 40) << "rank " << me;
  EXPECT_EQ(g_comm->all_reduce_max(std::int64_t{-7} - me), -7) << "rank " << me;
  EXPECT_EQ(g_comm->all_reduce_max(me == 1 ? 2.5 : -1.0 * me), 2.5) << "rank " << me;
  g_comm->barrier();
}

TEST(Mpi, FiftyRoundsOfMixedCollectives) {
  Communicator& comm = *g_comm;
  std::string problems;
  for (int round = 0; round < 50; ++round) {
    const std::string found = exchange_and_check(comm, round);
    if (problems.empty()) problems = found;
    const std::int64_t base = -1000 * std::int64_t{round};
    const std::int64_t mine = comm.rank() == round % comm.size() ? base + 500 : base - comm.rank();
    if (comm.all_reduce_max(mine) != base + 500 && problems.empty())
      problems = "all_reduce_max of round " + std::to_string(round);
    if (round % 10 == 0) comm.barrier();
  }
  EXPECT_EQ(problems, "") << "rank " << comm.rank();
}

TEST(Mpi, MismatchedRecvBytesIsAnErrorOnEveryRank) {
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  std::vector<std::uint8_t> send(2 * un, 1), recv(8 * un, 0);
  std::vector<std::int64_t> send_bytes(un, 2), send_offsets(un), recv_bytes(un, 2), recv_offsets(un);
  for (int r = 0; r < n; ++r) {
    send_offsets[r] = 2 * r;
    recv_offsets[r] = 8 * r;
  }
  if (comm.rank() == 3) recv_bytes[0] = 5;  // rank 0 sends it 2
  try {
    comm.all_to_all_v(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);
    ADD_FAILURE() << "rank " << comm.rank() << ": no error";
  } catch (const Error& e) {
    // The two ranks of the bad pair name it; the others name the rank that found it.
    const std::string what = e.what();
    const bool in_pair = comm.rank() == 0 || comm.rank() == 3;
    EXPECT_NE(what.find(in_pair ? "rank 3 expects 5 B from rank 0, which sends it 2 B" : "rejected the exchange"),
              std::string::npos)
        << "rank " << comm.rank() << ": " << what;
  }
  // The communicator is still usable afterwards.
  EXPECT_EQ(exchange_and_check(comm, 7), "");
}

}  // namespace
}  // namespace moekit

int main(int argc, char** argv) {
  std::unique_ptr<moekit::Communicator> comm = moekit::make_mpi_communicator();
  moekit::g_comm = comm.get();
  ::testing::InitGoogleTest(&argc, argv);
  // Only rank 0 prints the usual progress; the others print just their failures.
  if (comm->rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moekit::FailurePrinter(comm->rank()));
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  // One failing rank fails the job, whichever rank mpirun reports first.
  const std::int64_t any_failed = comm->all_reduce_max(std::int64_t{failed});
  if (comm->rank() == 0 && any_failed != 0)
    std::fprintf(stderr, "mpi_test_communicator: a rank failed; see its [rank N] lines\n");
  comm.reset();
  return any_failed != 0 ? 1 : 0;
}
