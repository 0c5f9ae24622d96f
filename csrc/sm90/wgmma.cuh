// Hopper (sm_90a) PTX wrappers: warpgroup MMA (wgmma), its shared-memory descriptors and the
// fences around it. Generic: no attention-specific code here.
//
// Shared-memory operand tiles use the 128-byte swizzle (descriptor mode 1): a tile of `rows` x `cols`
// 16-bit elements is stored as cols / 64 panels of rows x 128 bytes, and 16-byte chunk c of row r of a
// panel sits at chunk c ^ (r % 8). Panels start 1024-byte aligned, so this XOR is the one wgmma applies
// to address bits [4, 7) from bits [7, 10).
#pragma once
#include <cstdint>

namespace hf_flash {
namespace sm90 {

// Byte offset of 16-byte chunk `chunk` (column chunk * 8) of row `row` in a kRows-row swizzled tile.
template <int kRows>
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// Descriptor of a swizzled tile at `addr`; adding (bytes >> 4) moves its start.
//   K-major (rows = M or N, K contiguous): 8-row groups 1024 bytes apart (SBO); LBO unused. A k16 step
//     inside a panel starts 32 bytes further, the next panel kRows * 128 bytes further.
//   MN-major (rows = K, M or N contiguous): 8-row groups 1024 bytes apart (SBO); the next 64 columns
//     one panel further (LBO = panel_bytes). A k16 step starts 16 * 128 bytes further.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32 | 1ull << 62;
}
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) { return make_desc(addr, 16, 1024); }
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t panel_bytes) {
  return make_desc(addr, panel_bytes, 1024);
}
// The descriptor of a k16 step of a K-major tile with kRows rows.
template <int kRows>
__device__ __forceinline__ uint64_t k_major_step(uint64_t desc, int kk) {
  return desc + (((kk / 4) * kRows * 128 + (kk % 4) * 32) >> 4);
}

// ---- ordering -------------------------------------------------------------------
// Before the first wgmma of a batch: registers written by ordinary instructions become visible to it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared-memory writes of this thread (st.shared, cp.async) become visible to wgmma reads, which go
// through the async proxy. Follow with a barrier before the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// wgmma reads and writes its register operands asynchronously, unknown to the compiler: this pins each
// register at this point (before the fence, after the wait) so no ordinary instruction moves across.
__device__ __forceinline__ void fence_operands(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operands(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <class E, int N>
__device__ __forceinline__ void fence_operands(E (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operands(regs[i]);
}

// ---- wgmma m64nNk16, fp32 accumulators ---------------------------------------------
// Accumulator layout (per warp w of the warpgroup, lane = 4g + t): d[n8][e] is row 16w + g + 8 (e / 2),
// column 8 n8 + 2t + e % 2, as the C fragment of mma.m16n8 repeated along N. A in registers uses the
// A fragment of mma.m16n8k16 for the warp's 16 rows. `accumulate` = false overwrites d.

#define HF_SM90_ACC_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define HF_SM90_ACC_REGS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define HF_SM90_ACC_OPS_64(d) "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define HF_SM90_ACC_OPS_128(d) HF_SM90_ACC_OPS_64(d), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])

// D(64 x 128) (+)= A(64 x 16) B(16 x 128), A and B in shared memory, both K-major.
template <bool kIsBf16>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[16][4], uint64_t a, uint64_t b, bool accumulate) {
  if constexpr (kIsBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " HF_SM90_ACC_REGS_128 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : HF_SM90_ACC_OPS_128(d) : "l"(a), "l"(b), "r"(int(accumulate)));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " HF_SM90_ACC_REGS_128 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : HF_SM90_ACC_OPS_128(d) : "l"(a), "l"(b), "r"(int(accumulate)));
  }
}

// D(64 x N) (+)= A(64 x 16) B(16 x N), A in registers, B in shared memory MN-major; N = 64 or 128.
template <bool kIsBf16, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 64 || N == 128, "instantiated shapes");
  if constexpr (N == 64 && kIsBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " HF_SM90_ACC_REGS_64 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : HF_SM90_ACC_OPS_64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
  } else if constexpr (N == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " HF_SM90_ACC_REGS_64 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : HF_SM90_ACC_OPS_64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
  } else if constexpr (kIsBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " HF_SM90_ACC_REGS_128 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : HF_SM90_ACC_OPS_128(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " HF_SM90_ACC_REGS_128 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : HF_SM90_ACC_OPS_128(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
  }
}

#undef HF_SM90_ACC_REGS_64
#undef HF_SM90_ACC_REGS_128
#undef HF_SM90_ACC_OPS_64
#undef HF_SM90_ACC_OPS_128

}  // namespace sm90
}  // namespace hf_flash
