// Hopper (sm_90a) warpgroup MMA primitives: shared-memory matrix descriptors for 128-byte swizzled tiles,
// wgmma.mma_async with the A operand in shared memory (SS) or registers (RS), and the fences / commit / wait
// around it. Only compiled for sm_90a (wgmma does not exist elsewhere); callers guard with HF_SM90_ENABLED.
//
// Tile layout used with these descriptors ("panels"): a tile of R rows of 16-bit elements is stored as
// ceil(cols / 64) panels of R rows x 128 bytes, each panel 1024-byte aligned, and the 16-byte chunk c of row
// r at chunk c ^ (r % 8) (the hardware's 128-byte swizzle; it acts on address bits, hence the alignment).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HF_SM90_ENABLED 1
#endif

namespace hf_flash {
namespace sm90 {

// Host: whether this binary carries sm_90a code for `kernel` (not in an sm_80-only build, nor one for plain
// sm_90), so the dispatch can fall back to the mma.sync kernels.
template <class Kernel>
bool has_sm90a_code(Kernel kernel) {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion == 90;
}

constexpr int kPanelCols = 64;  // 16-bit elements per 128-byte swizzled row

// Byte offset of element (row, col) in a panel tile of `rows` rows (see above).
__device__ __forceinline__ uint32_t panel_offset(int rows, int row, int col) {
  return (col / kPanelCols) * rows * 128 + row * 128 + ((((col % kPanelCols) / 8) ^ (row % 8)) << 4) + (col % 8) * 2;
}

// Shared-memory matrix descriptor for a 128-byte swizzled operand starting at smem byte address `addr`.
// K-major (rows = M or N, contiguous along K): groups of 8 rows are `sbo` = 1024 bytes apart; lbo unused.
// MN-major (rows = K, contiguous along M or N): `lbo` = bytes between 64-element panels along M/N,
// `sbo` = 1024 bytes between groups of 8 K rows.
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo = 1024) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32 | uint64_t(1) << 62;
}

// Descriptor d moved `bytes` further in shared memory: the start address field (bits 0-13, bytes / 16) holds any
// shared address, so the add never carries out of it. With the descriptor warp-uniform this is one 64-bit uniform
// add per wgmma.
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }

// The descriptor of k16 step `kk` of a K-major tile of kRows rows: 32 bytes further within a panel, the
// next panel (kRows * 128 bytes) every 4 steps.
template <int kRows>
__device__ __forceinline__ uint64_t k_major_step(uint64_t d, int kk) {
  return desc_add(d, (kk / 4) * kRows * 128 + (kk % 4) * 32);
}

// This thread's warpgroup, broadcast from lane 0 so the compiler knows it is warp-uniform: the descriptors
// derived from it then live in uniform registers instead of being moved there before every wgmma.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0); }

#ifdef HF_SM90_ENABLED
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory"); }
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's async-proxy reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// wgmma reads and writes its register operands asynchronously, unknown to the compiler: this pins each
// register at this point (before the fence, after the wait) so no ordinary instruction moves across.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <class E, int N>
__device__ __forceinline__ void fence_operand(E (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(regs[i]);
}

#define HF_SM90_F4(x, i) "+f"(x[i]), "+f"(x[i + 1]), "+f"(x[i + 2]), "+f"(x[i + 3])
#define HF_SM90_F16(x, i) HF_SM90_F4(x, i), HF_SM90_F4(x, i + 4), HF_SM90_F4(x, i + 8), HF_SM90_F4(x, i + 12)
#define HF_SM90_OUT16(x) HF_SM90_F16(x, 0)
#define HF_SM90_OUT32(x) HF_SM90_F16(x, 0), HF_SM90_F16(x, 16)
#define HF_SM90_OUT64(x) HF_SM90_OUT32(x), HF_SM90_F16(x, 32), HF_SM90_F16(x, 48)
#define HF_SM90_OUT40(x) HF_SM90_OUT32(x), HF_SM90_F4(x, 32), HF_SM90_F4(x, 36)
#define HF_SM90_OUT128(x) HF_SM90_OUT64(x), HF_SM90_F16(x, 64), HF_SM90_F16(x, 80), HF_SM90_F16(x, 96), HF_SM90_F16(x, 112)
#define HF_SM90_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define HF_SM90_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define HF_SM90_D64                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define HF_SM90_D40                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "      \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define HF_SM90_D128                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "      \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "       \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "       \
  "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "       \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, "     \
  "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, "     \
  "%119, %120, %121, %122, %123, %124, %125, %126, %127}"

// d (m64 x kN, fp32, += when accumulate) = A (m64 x k16) * B (k16 x kN), both from shared memory; kTransA /
// kTransB = 1 when the operand is MN-major. Accumulator layout: d[j][r] is row 16 * (warp % 4) + lane / 4 +
// 8 * (r / 2), column 8 * j + 2 * (lane % 4) + r % 2 (mma.m16n8 C fragments stacked over the warpgroup).
#define HF_SM90_SS(TY, N, D, OUT, A, B, S, TA, TB)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " S ", 0;\nwgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY \
               "." TY " " D ", " A ", " B ", p, 1, 1, " TA ", " TB ";\n}\n"                                     \
               : OUT                                                                                            \
               : "l"(a), "l"(b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))
template <int kN, bool kIsBf16, int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[kN / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(kN == 32 || kN == 64 || kN == 80 || kN == 128, "instantiated widths");
  float* x = &d[0][0];
  if constexpr (kN == 32 && kIsBf16) HF_SM90_SS("bf16", "32", HF_SM90_D16, HF_SM90_OUT16(x), "%16", "%17", "%18", "%19", "%20");
  if constexpr (kN == 32 && !kIsBf16) HF_SM90_SS("f16", "32", HF_SM90_D16, HF_SM90_OUT16(x), "%16", "%17", "%18", "%19", "%20");
  if constexpr (kN == 80 && kIsBf16) HF_SM90_SS("bf16", "80", HF_SM90_D40, HF_SM90_OUT40(x), "%40", "%41", "%42", "%43", "%44");
  if constexpr (kN == 80 && !kIsBf16) HF_SM90_SS("f16", "80", HF_SM90_D40, HF_SM90_OUT40(x), "%40", "%41", "%42", "%43", "%44");
  if constexpr (kN == 64 && kIsBf16) HF_SM90_SS("bf16", "64", HF_SM90_D32, HF_SM90_OUT32(x), "%32", "%33", "%34", "%35", "%36");
  if constexpr (kN == 64 && !kIsBf16) HF_SM90_SS("f16", "64", HF_SM90_D32, HF_SM90_OUT32(x), "%32", "%33", "%34", "%35", "%36");
  if constexpr (kN == 128 && kIsBf16) HF_SM90_SS("bf16", "128", HF_SM90_D64, HF_SM90_OUT64(x), "%64", "%65", "%66", "%67", "%68");
  if constexpr (kN == 128 && !kIsBf16) HF_SM90_SS("f16", "128", HF_SM90_D64, HF_SM90_OUT64(x), "%64", "%65", "%66", "%67", "%68");
}
#undef HF_SM90_SS

// As mma_ss with A from registers: a[0..3] are the m16n8k16 A fragments of this warp's 16 rows (the packed
// accumulator layout above, so an fp32 result feeds the next MMA without shuffles).
#define HF_SM90_RS(TY, N, D, OUT, A, B, S, TB)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " S ", 0;\nwgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY \
               "." TY " " D ", " A ", " B ", p, 1, 1, " TB ";\n}\n"                                             \
               : OUT                                                                                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)), "n"(kTransB))
template <int kN, bool kIsBf16, int kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[kN / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(kN == 64 || kN == 128 || kN == 256, "instantiated widths");
  float* x = &d[0][0];
  if constexpr (kN == 256 && kIsBf16) HF_SM90_RS("bf16", "256", HF_SM90_D128, HF_SM90_OUT128(x), "{%128, %129, %130, %131}", "%132", "%133", "%134");
  if constexpr (kN == 256 && !kIsBf16) HF_SM90_RS("f16", "256", HF_SM90_D128, HF_SM90_OUT128(x), "{%128, %129, %130, %131}", "%132", "%133", "%134");
  if constexpr (kN == 64 && kIsBf16) HF_SM90_RS("bf16", "64", HF_SM90_D32, HF_SM90_OUT32(x), "{%32, %33, %34, %35}", "%36", "%37", "%38");
  if constexpr (kN == 64 && !kIsBf16) HF_SM90_RS("f16", "64", HF_SM90_D32, HF_SM90_OUT32(x), "{%32, %33, %34, %35}", "%36", "%37", "%38");
  if constexpr (kN == 128 && kIsBf16) HF_SM90_RS("bf16", "128", HF_SM90_D64, HF_SM90_OUT64(x), "{%64, %65, %66, %67}", "%68", "%69", "%70");
  if constexpr (kN == 128 && !kIsBf16) HF_SM90_RS("f16", "128", HF_SM90_D64, HF_SM90_OUT64(x), "{%64, %65, %66, %67}", "%68", "%69", "%70");
}
#undef HF_SM90_RS
#undef HF_SM90_D64
#undef HF_SM90_D128
#undef HF_SM90_D40
#undef HF_SM90_OUT128
#undef HF_SM90_OUT40
#undef HF_SM90_D32
#undef HF_SM90_D16
#undef HF_SM90_OUT16
#undef HF_SM90_OUT64
#undef HF_SM90_OUT32
#undef HF_SM90_F16
#undef HF_SM90_F4
#endif  // HF_SM90_ENABLED

}  // namespace sm90
}  // namespace hf_flash
