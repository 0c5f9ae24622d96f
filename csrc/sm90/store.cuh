// Hopper (sm_90) epilogue store: a warp's 16 rows of an fp32 accumulator written to global memory as 16-bit
// values through shared memory. Generic: no attention-specific code here.
//
// Stores straight from the accumulator layout write 8 rows x 16 bytes an instruction: twice the L2 sectors and
// four times the instructions of whole 16-byte chunks of whole rows, at the end of every CTA, where nothing
// hides them (docs/design/forward-sm90.md).
#pragma once
#include <cstdint>

#include "sm90/wgmma.cuh"
#include "tile.cuh"

namespace hf_flash {
namespace sm90 {

// Writes rows warp_row .. warp_row + 15 of a panel tile of kTileRows rows (sm90/wgmma.cuh: 128-byte swizzled
// panels) from the accumulator `acc` (the wgmma / mma.m16n8 C layout: n8 tiles, lane g = lane / 4 holding rows
// g and g + 8, columns 2 (lane % 4) and + 1), row g scaled by scale[0] and row g + 8 by scale[1], then copies
// them to dst (row 0 = tile row warp_row; 16-byte aligned rows row_stride elements apart), rows < valid_rows.
// The tile rows are this warp's alone: no barrier beyond the warp's own.
template <bool kIsBf16, int kCols, int kTileRows>
__device__ __forceinline__ void store_rows(const float (&acc)[kCols / 8][4], const float (&scale)[2], uint32_t tile,
                                           int warp_row, void* dst, int64_t row_stride, int valid_rows) {
  static_assert(kCols % 64 == 0, "whole panels");
  const int lane = threadIdx.x % 32;
  // 16-byte chunk `chunk` of tile row `row`: panel_offset(kTileRows, row, 8 * chunk) spelled per chunk (through
  // panel_offset ptxas emits 24 more instructions in the d128 forward).
  auto chunk_addr = [&](int row, int chunk) {
    return tile + (chunk / 8) * kTileRows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
  };
  __syncwarp();  // the warp's earlier reads of these rows (a previous call) are done
  {
    // stmatrix x4 per pair of n8 tiles: matrices (rows 0-7, 8-15) x (tiles 2j, 2j + 1); lane 8q + r addresses row
    // r + 8 (q % 2) of chunk 2j + q / 2.
    const int row = warp_row + lane / 8 % 2 * 8 + lane % 8;
#pragma unroll
    for (int j = 0; j < kCols / 16; ++j) {
      const float(&lo)[4] = acc[2 * j];
      const float(&hi)[4] = acc[2 * j + 1];
      const uint32_t r[4] = {tile::pack2<kIsBf16>(lo[0] * scale[0], lo[1] * scale[0]),
                             tile::pack2<kIsBf16>(lo[2] * scale[1], lo[3] * scale[1]),
                             tile::pack2<kIsBf16>(hi[0] * scale[0], hi[1] * scale[0]),
                             tile::pack2<kIsBf16>(hi[2] * scale[1], hi[3] * scale[1])};
      tile::stmatrix_x4(chunk_addr(row, 2 * j + lane / 16), r);
    }
  }
  __syncwarp();
  constexpr int kChunks = kCols / 8;  // 16-byte chunks a row
  char* out = static_cast<char*>(dst);
#pragma unroll
  for (int pass = 0; pass < 16 * kChunks / 32; ++pass) {
    const int r = (pass * 32 + lane) / kChunks, chunk = lane % kChunks;
    const uint4 v = tile::ld_shared_v4(chunk_addr(warp_row + r, chunk));
    if (r < valid_rows) tile::st_global_v4(out + (int64_t(r) * row_stride + chunk * 8) * 2, v);
  }
}

}  // namespace sm90
}  // namespace hf_flash
