// The layer over 4 MPI processes (ctest runs it under `mpirun -np 4`): each process is one rank of
// dp = ep = 4; the outputs, gathered on every process, must be bit-identical to the same global
// tokens over 4 in-process ranks (the same owner-first combine order), and within fp32 association of
// one rank holding every expert. Exit code is nonzero if any rank failed.
#include <gtest/gtest.h>

#include <cstring>

#include "layer_test_util.h"

namespace moekit {
namespace {

std::unique_ptr<Communicator> g_comm;

std::vector<std::uint16_t> gather_all(Communicator& comm, const std::vector<std::uint16_t>& mine,
                                      std::int64_t per_rank) {
  const auto P = static_cast<std::size_t>(comm.size());
  const std::int64_t bytes = per_rank * 2;
  std::vector<std::uint16_t> send(static_cast<std::size_t>(per_rank) * P), all(send.size());
  std::vector<std::int64_t> counts(P, bytes), offs(P);
  for (std::size_t r = 0; r < P; ++r) {
    std::memcpy(send.data() + r * static_cast<std::size_t>(per_rank), mine.data(), static_cast<std::size_t>(bytes));
    offs[r] = static_cast<std::int64_t>(r) * bytes;
  }
  comm.all_to_all_v(send.data(), counts, offs, all.data(), counts, offs);
  return all;
}

TEST(MpiLayer, FourProcessesBitIdenticalToFourInProcessRanks) {
  Communicator& comm = *g_comm;
  ASSERT_EQ(comm.size(), 4);
  for (bool grouped : {false, true}) {
    for (QuantScheme q : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128}) {
      const ModelConfig m = testing::tiny_model(grouped);
      const std::int64_t T = 6;
      const std::uint64_t seed = 5;
      const auto g = synthetic::make_tokens(m.hidden_size, m.num_experts, 0, 4 * T, 21);
      LayerOptions opt;
      opt.quant = q;
      opt.checked = true;
      // Chunked: max_tokens_per_rank 4 < 6 tokens per rank.
      const ParallelConfig par{4, 4, 4, 0};
      const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, q);
      cpu::ThreadPool pool(1);
      const auto w = synthetic::make_expert_weights(p, first_local_expert(par, p, comm.rank()), seed, pool);
      const std::vector<float> bias =
          grouped ? synthetic::make_routing_bias(m.num_experts, seed) : std::vector<float>{};
      const auto shared = synthetic::make_shared_experts(m, p, seed, pool);
      LayerWeights lw{w.view(), grouped ? bias.data() : nullptr};
      shared.set(lw);
      MoeLayer layer(m, par, opt, lw, comm);
      const std::int64_t r = comm.rank();
      std::vector<std::uint16_t> out(static_cast<std::size_t>(T * m.hidden_size));
      layer.forward(g.hidden.data() + r * T * m.hidden_size, g.logits.data() + r * T * m.num_experts, T, out.data());
      const auto all = gather_all(comm, out, T * m.hidden_size);
      LayerOptions ref_opt = opt;
      ref_opt.checked = false;
      const auto four = testing::run_layout(m, g, {T, T, T, T}, 4, 4, ref_opt, seed);
      EXPECT_EQ(all, four.output) << m.name << " " << quant_name(q) << " rank " << r;
      const auto one = testing::run_layout(m, g, {4 * T}, 1, 4 * T, ref_opt, seed);
      EXPECT_LT(testing::relative_difference(all, one.output), testing::kRanksVsOneRank)
          << m.name << " " << quant_name(q) << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace moekit

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  moekit::g_comm = moekit::make_mpi_communicator();
  const int rc = RUN_ALL_TESTS();
  // Every rank must agree on failure.
  const std::int64_t failed = moekit::g_comm->all_reduce_max(static_cast<std::int64_t>(rc != 0));
  moekit::g_comm.reset();
  return failed != 0 ? 1 : 0;
}
