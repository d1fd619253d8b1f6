// The pattern exchange shared by the in-process and MPI communicator tests: per-pair byte counts
// learnt through all_to_all_counts (some zero, rank 1 sends nothing), then one all_to_all_v whose
// every byte and every gap between receive regions is checked.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/communicator.h"

namespace moekit::testing {

inline constexpr std::uint8_t kPoison = 0xEE;
inline constexpr std::int64_t kGap = 5;  // unused bytes between regions, which must stay poisoned

// Bytes rank src sends rank dst in round `round`: varies per pair, is 0 for some pairs, and rank 1
// sends nothing at all (when there are at least 2 ranks).
inline std::int64_t pair_bytes(int src, int dst, int num_ranks, int round = 0) {
  if (num_ranks > 1 && src == 1) return 0;
  return ((src * 5 + dst * 3 + round) % 7) * 13 + (src == dst ? 1 : 0) * (round % 3);
}

inline std::uint8_t pattern(int src, int dst, std::int64_t idx, int round = 0) {
  return static_cast<std::uint8_t>(src * 37 + dst * 11 + idx * 3 + round * 17 + 1);
}

// One all_to_all_v with sizes learnt through all_to_all_counts; checks every byte and every gap.
// Returns the problems found (empty on success) so that callers on any thread can report them.
inline std::string exchange_and_check(Communicator& comm, int round) {
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<std::int64_t> send_bytes(un), send_offsets(un), recv_bytes(un), recv_offsets(un);
  std::int64_t send_total = 0;
  for (int dst = 0; dst < n; ++dst) {
    send_bytes[dst] = pair_bytes(me, dst, n, round);
    send_offsets[dst] = send_total;
    send_total += send_bytes[dst] + kGap;
  }
  std::vector<std::uint8_t> send(static_cast<std::size_t>(send_total), kPoison);
  for (int dst = 0; dst < n; ++dst)
    for (std::int64_t i = 0; i < send_bytes[dst]; ++i) send[send_offsets[dst] + i] = pattern(me, dst, i, round);

  comm.all_to_all_counts(send_bytes, recv_bytes);
  std::string problems;
  for (int src = 0; src < n; ++src)
    if (recv_bytes[src] != pair_bytes(src, me, n, round))
      problems += "count from " + std::to_string(src) + " is " + std::to_string(recv_bytes[src]) + "; ";

  // Receive regions in reverse rank order, so offsets are not monotonic in the peer index.
  std::int64_t recv_total = 0;
  for (int src = n - 1; src >= 0; --src) {
    recv_offsets[src] = recv_total;
    recv_total += recv_bytes[src] + kGap;
  }
  std::vector<std::uint8_t> recv(static_cast<std::size_t>(recv_total), kPoison);
  comm.all_to_all_v(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);

  for (int src = 0; src < n; ++src) {
    for (std::int64_t i = 0; i < recv_bytes[src]; ++i) {
      if (recv[recv_offsets[src] + i] != pattern(src, me, i, round)) {
        problems += "byte " + std::to_string(i) + " from " + std::to_string(src) + " is wrong; ";
        break;
      }
    }
    for (std::int64_t i = 0; i < kGap; ++i)
      if (recv[recv_offsets[src] + recv_bytes[src] + i] != kPoison)
        problems += "gap after " + std::to_string(src) + " was written; ";
  }
  if (!problems.empty())
    problems = "round " + std::to_string(round) + ", rank " + std::to_string(me) + " of " + std::to_string(n) + ": " +
               problems;
  return problems;
}

}  // namespace moekit::testing
