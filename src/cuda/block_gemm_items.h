// The work items of moekit's unswapped block GEMM (block_gemm_sm90.cuh), what its persistent grid
// deals out round-robin: plain C++ (MOEKIT_HD), so the CPU tests check that they deal every tile of
// every group once.
//
// A group (expert) of m rows has ceil(m / 128) token tiles of 128 rows by n_tiles weight tiles. Its
// last token tile is a half tile when it holds 1-64 of the group's rows. The half tiles of weight
// tiles nt and nt + 1 make one item (the kernel runs them pingpong, a warpgroup each), so
// every item costs about one full tile; a last odd weight tile's half tile is an item alone. Dealt one
// an item, half tiles made the round-robin lopsided: at 3 token tiles a group and 132 CTAs, a CTA got
// the same token tile of every weight tile, and the CTAs of full tiles set the time.
#pragma once

#include "numerics/host_device.h"

namespace moekit::cuda::detail {

inline constexpr int kBlockTileM = 128;  // token rows of a full tile
inline constexpr int kBlockHalfTileRows =
    64;  // a group's last token tile holding <= this many of its rows is a half tile

// Whether token tile mt of a group of m rows is a half tile.
MOEKIT_HD inline bool block_gemm_is_half(int m, int mt) {
  return m - mt * kBlockTileM <= kBlockHalfTileRows;
}

struct BlockGemmItem {
  int g, mt, nt, tiles;  // tiles 2: the half tiles (mt, nt) and (mt, nt + 1)
  bool half;             // run as a half tile (64 rows): a pair, or a lone half tile
};

// Weight tiles two at a time, a last odd one alone: the half items of a group whose last token tile
// is a half tile (a pair of half tiles an item), and clustered, the items of its odd last full token
// tile (one weight tile a CTA).
MOEKIT_HD inline int block_gemm_weight_tile_pairs(int n_tiles) {
  return (n_tiles + 1) / 2;
}

// The items of a group of m rows (0 for an empty group).
MOEKIT_HD inline int block_gemm_items_of(int m, int n_tiles) {
  const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  if (m <= 0 || !block_gemm_is_half(m, m_tiles - 1)) return m_tiles * n_tiles;
  return (m_tiles - 1) * n_tiles + block_gemm_weight_tile_pairs(n_tiles);
}

// Item `local` of group g (m rows, m > 0). Without a half tile: the token tiles of one weight tile
// adjacent (CTAs that read the same weights run together and share them through L2). With one, weight
// tiles 2b and 2b + 1 make a block: the full tiles of 2b, the half pair, the full tiles of 2b + 1 (a
// last odd weight tile's block ends at its half item).
MOEKIT_HD inline BlockGemmItem block_gemm_group_item(int g, int m, int n_tiles, int local) {
  const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  if (!block_gemm_is_half(m, m_tiles - 1)) return {g, local % m_tiles, local / m_tiles, 1, false};
  const int m_full = m_tiles - 1, b = local / (2 * m_full + 1), r = local % (2 * m_full + 1);
  if (r < m_full) return {g, r, 2 * b, 1, false};
  if (r > m_full) return {g, r - m_full - 1, 2 * b + 1, 1, false};
  return {g, m_full, 2 * b, n_tiles - 2 * b < 2 ? 1 : 2, true};
}

// Clustered launch (kBlockCluster = 2 CTAs a cluster): the cluster deals cluster items; a CTA's
// ring and its partner's carry the same k-blocks (every stage is handed back to both CTAs' producers),
// so a cluster item takes `slots` k-block loops on both, the longer of the two CTAs' items (a CTA
// with a shorter one, or none, waits out the rest: pad slots, first in its ring). Of a group:
//   shared: two full token tiles (not half tiles) of one weight tile, CTA `rank` the token tile
//     2 p + rank: each CTA loads half the weight tile, multicast into both (half the L2 reads of it);
//   then the group's leftovers, each CTA its own item of the non-clustered table, loading its own
//   weights: a last odd full token tile (weight tiles 2 j + rank), then the half items (half item
//   2 j + rank; a half pair takes 2 slots).
inline constexpr int kBlockCluster = 2;

struct BlockGemmClusterItem {
  BlockGemmItem it;  // this CTA's item (tiles 0: none: pad slots only)
  bool shared;       // its weight tile is the partner's: half loaded here, multicast
  int slots;         // k-block loops of the cluster item (1 or 2), the same on both CTAs
};

// A group's tiles by kind (m > 0): full token tiles (not half) f, then whether its last is a half.
MOEKIT_HD inline int block_gemm_full_tiles(int m) {
  const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  return block_gemm_is_half(m, m_tiles - 1) ? m_tiles - 1 : m_tiles;
}

MOEKIT_HD inline int block_gemm_cluster_items_of(int m, int n_tiles) {
  if (m <= 0) return 0;
  const int f = block_gemm_full_tiles(m), m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  const int halves = m_tiles > f ? block_gemm_weight_tile_pairs(n_tiles) : 0;
  return f / 2 * n_tiles + (f % 2) * block_gemm_weight_tile_pairs(n_tiles) + (halves + 1) / 2;
}

MOEKIT_HD inline BlockGemmClusterItem block_gemm_cluster_item(int g, int m, int n_tiles, int local, int rank) {
  const int f = block_gemm_full_tiles(m), m_tiles = (m + kBlockTileM - 1) / kBlockTileM, pairs = f / 2;
  if (local < pairs * n_tiles) return {{g, 2 * (local % pairs) + rank, local / pairs, 1, false}, true, 1};
  local -= pairs * n_tiles;
  if (f % 2 == 1) {
    if (local < block_gemm_weight_tile_pairs(n_tiles)) {
      const int nt = 2 * local + rank;
      return {{g, f - 1, nt, nt < n_tiles ? 1 : 0, false}, false, 1};
    }
    local -= block_gemm_weight_tile_pairs(n_tiles);
  }
  // Half item j pairs the half tiles of weight tiles 2 j and 2 j + 1 (one alone at an odd end).
  const int halves = block_gemm_weight_tile_pairs(n_tiles), j0 = 2 * local, j = j0 + rank;
  const auto tiles_of = [&](int h) { return h >= halves ? 0 : n_tiles - 2 * h < 2 ? 1 : 2; };
  const int t0 = tiles_of(j0), t1 = tiles_of(j0 + 1);
  return {{g, m_tiles - 1, 2 * j, tiles_of(j), tiles_of(j) > 0}, false, t0 > t1 ? t0 : t1};
}

// The rows of item `it` (of a group of m rows) whose D the unfused kernel stores by TMA where the
// launch allows it (`allowed`): 128 for a full tile, 64 (its first warpgroup's) for a tile of 65-127
// rows, none for a half item or a clustered CTA's empty one. A TMA box is written
// whole, so never a row past the group (block_gemm_sm90.cuh).
MOEKIT_HD inline int block_gemm_tma_rows(int m, const BlockGemmItem& it, bool allowed = true) {
  const int rows = m - it.mt * kBlockTileM;
  return !allowed || it.half || it.tiles == 0 ? 0 : rows >= kBlockTileM ? kBlockTileM : kBlockHalfTileRows;
}

}  // namespace moekit::cuda::detail
