// The block GEMM's work items (src/cuda/block_gemm_items.h), on the CPU: for every group size and
// weight-tile count, the items of a group deal each of its tiles exactly once; a two-tile item holds
// the half tiles of adjacent weight tiles; the half tiles of a group are half as many items, so
// every item costs about one full tile; D by TMA covers whole boxes inside the group only.
#include <gtest/gtest.h>

#include <map>
#include <utility>

#include "cuda/block_gemm_items.h"

namespace moekit::cuda::detail {
namespace {

void check_group(int m, int n_tiles) {
  const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  const int items = block_gemm_items_of(m, n_tiles);
  std::map<std::pair<int, int>, int> dealt;  // (mt, nt) -> times
  int lone_halves = 0;
  for (int local = 0; local < items; ++local) {
    const BlockGemmItem it = block_gemm_group_item(7, m, n_tiles, local);
    ASSERT_EQ(it.g, 7);
    ASSERT_TRUE(it.tiles == 1 || it.tiles == 2) << "m " << m << " n_tiles " << n_tiles << " item " << local;
    const bool half = block_gemm_is_half(m, it.mt);
    EXPECT_EQ(it.half, half) << "m " << m << " item " << local << ": the kernel runs it.half as 64 rows";
    if (it.tiles == 2 || half) {
      // Half tiles only in half items: the last token tile, holding 1-64 of the group's rows.
      EXPECT_TRUE(half) << "m " << m << " item " << local;
      EXPECT_EQ(it.mt, m_tiles - 1);
      if (it.tiles == 1) {
        ++lone_halves;
        EXPECT_EQ(it.nt, n_tiles - 1) << "a lone half tile only at the last odd weight tile (m " << m << ")";
      }
    }
    for (int i = 0; i < it.tiles; ++i) ++dealt[{it.mt, it.nt + i}];
    // D by TMA: whole boxes of 128 or 64 rows, never past the group's rows; none for half items.
    const int tma = block_gemm_tma_rows(m, it), rows = m - it.mt * kBlockTileM;
    EXPECT_TRUE(tma == 0 || tma == kBlockHalfTileRows || tma == kBlockTileM) << "m " << m << " item " << local;
    EXPECT_LE(tma, rows) << "m " << m << " item " << local << ": a TMA box past the group";
    EXPECT_EQ(tma == 0, it.half) << "m " << m << " item " << local;
    if (rows >= kBlockTileM) EXPECT_EQ(tma, kBlockTileM) << "m " << m << " item " << local;
  }
  EXPECT_EQ(static_cast<int>(dealt.size()), m_tiles * n_tiles) << "m " << m << " n_tiles " << n_tiles;
  for (const auto& [tile, times] : dealt) {
    EXPECT_EQ(times, 1) << "tile (" << tile.first << ", " << tile.second << ") of m " << m << " n_tiles " << n_tiles;
    EXPECT_LT(tile.first, m_tiles);
    EXPECT_LT(tile.second, n_tiles);
  }
  if (m > 0 && block_gemm_is_half(m, m_tiles - 1)) {
    EXPECT_EQ(items, (m_tiles - 1) * n_tiles + (n_tiles + 1) / 2);
    EXPECT_EQ(lone_halves, n_tiles % 2);
  } else {
    EXPECT_EQ(items, m_tiles * n_tiles);
  }
}

TEST(BlockGemmItems, EveryTileOnce) {
  for (int n_tiles = 1; n_tiles <= 9; ++n_tiles)
    for (int m = 0; m <= 700; ++m) {
      check_group(m, n_tiles);
      if (::testing::Test::HasFailure()) return;
    }
}

TEST(BlockGemmItems, HalfTileEdges) {
  // 64 rows: one half tile; 65: one full tile (a warpgroup's rows past the group); 128 + 64: a full
  // and a half; 128 + 65: two full; 300 (DeepSeek-V3 at T = 8192 holds 257-311): two full and a half.
  EXPECT_TRUE(block_gemm_is_half(64, 0));
  EXPECT_FALSE(block_gemm_is_half(65, 0));
  EXPECT_TRUE(block_gemm_is_half(192, 1));
  EXPECT_FALSE(block_gemm_is_half(193, 1));
  EXPECT_EQ(block_gemm_items_of(300, 16), 2 * 16 + 8);
  EXPECT_EQ(block_gemm_items_of(320, 16), 2 * 16 + 8);  // its last tile holds 64 rows: a half tile
  EXPECT_EQ(block_gemm_items_of(321, 16), 3 * 16);      // 65 rows: a full one
  // Weight tiles 0 and 1 of a 300-row group: full (0, 0), (1, 0); the pair (2, 0 + 1); full (0, 1), (1, 1).
  const BlockGemmItem pair = block_gemm_group_item(0, 300, 16, 2);
  EXPECT_EQ(pair.mt, 2);
  EXPECT_EQ(pair.nt, 0);
  EXPECT_EQ(pair.tiles, 2);
  EXPECT_EQ(block_gemm_group_item(0, 300, 16, 3).nt, 1);
}

// Clustered (block_gemm_cluster_item): the two CTAs of a cluster agree on every item's slots; a
// shared item is two full token tiles of one weight tile; every tile of the group is dealt once, the
// half tiles as the non-clustered table's half items; an item takes slots >= its tiles.
TEST(BlockGemmItems, ClusteredEveryTileOnceInLockStep) {
  for (int n_tiles = 1; n_tiles <= 9; ++n_tiles)
    for (int m = 0; m <= 700; ++m) {
      const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
      const int items = block_gemm_cluster_items_of(m, n_tiles);
      std::map<std::pair<int, int>, int> dealt;
      int shared_tiles = 0;
      for (int local = 0; local < items; ++local) {
        const BlockGemmClusterItem c0 = block_gemm_cluster_item(3, m, n_tiles, local, 0);
        const BlockGemmClusterItem c1 = block_gemm_cluster_item(3, m, n_tiles, local, 1);
        ASSERT_EQ(c0.slots, c1.slots) << "m " << m << " item " << local << ": the rings would part";
        ASSERT_EQ(c0.shared, c1.shared);
        ASSERT_TRUE(c0.slots == 1 || c0.slots == 2);
        ASSERT_TRUE(c0.it.tiles > 0 || c1.it.tiles > 0) << "m " << m << " item " << local << ": an empty item";
        if (c0.shared) {
          ASSERT_EQ(c0.it.nt, c1.it.nt) << "m " << m << " item " << local << ": a shared item's weight tiles differ";
          ASSERT_TRUE(c0.it.tiles == 1 && c1.it.tiles == 1 && !c0.it.half && !c1.it.half);
          EXPECT_FALSE(block_gemm_is_half(m, c0.it.mt) || block_gemm_is_half(m, c1.it.mt));
          shared_tiles += 2;
        }
        for (const BlockGemmClusterItem& c : {c0, c1}) {
          const BlockGemmItem& it = c.it;
          ASSERT_EQ(it.g, 3);
          ASSERT_LE(it.tiles, c.slots);
          EXPECT_EQ(it.half, it.tiles > 0 && block_gemm_is_half(m, it.mt)) << "m " << m << " item " << local;
          for (int i = 0; i < it.tiles; ++i) ++dealt[{it.mt, it.nt + i}];
          const int tma = block_gemm_tma_rows(m, it), rows = m - it.mt * kBlockTileM;
          if (it.tiles > 0) EXPECT_LE(tma, rows) << "m " << m << " item " << local << ": a TMA box past the group";
          EXPECT_EQ(tma == 0, it.tiles == 0 || it.half) << "m " << m << " item " << local;
        }
      }
      EXPECT_EQ(static_cast<int>(dealt.size()), m_tiles * n_tiles) << "m " << m << " n_tiles " << n_tiles;
      for (const auto& [tile, times] : dealt) {
        EXPECT_EQ(times, 1) << "m " << m << " tile (" << tile.first << ", " << tile.second << ")";
        EXPECT_LT(tile.first, m_tiles);
        EXPECT_LT(tile.second, n_tiles);
      }
      if (m > 0) EXPECT_EQ(shared_tiles, block_gemm_full_tiles(m) / 2 * 2 * n_tiles) << "m " << m;
      if (::testing::Test::HasFailure()) return;
    }
}

}  // namespace
}  // namespace moekit::cuda::detail
