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

// The items of a group of m rows (0 for an empty group).
MOEKIT_HD inline int block_gemm_items_of(int m, int n_tiles) {
  const int m_tiles = (m + kBlockTileM - 1) / kBlockTileM;
  if (m <= 0 || !block_gemm_is_half(m, m_tiles - 1)) return m_tiles * n_tiles;
  return (m_tiles - 1) * n_tiles + (n_tiles + 1) / 2;
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

// The rows of item `it` (of a group of m rows) whose D the unfused kernel stores by TMA where the
// launch allows it (`allowed`): 128 for a full tile, 64 (its first warpgroup's) for a tile of 65-127
// rows, none for a half item. A TMA box is written whole, so never a row past the group
// (block_gemm_sm90.cuh).
MOEKIT_HD inline int block_gemm_tma_rows(int m, const BlockGemmItem& it, bool allowed = true) {
  const int rows = m - it.mt * kBlockTileM;
  return !allowed || it.half ? 0 : rows >= kBlockTileM ? kBlockTileM : kBlockHalfTileRows;
}

}  // namespace moekit::cuda::detail
