// hf_flash tile primitives: thin PTX wrappers (sm80+) that the attention
// kernels are written in. Register fragments follow the PTX ISA layouts of
// mma.m16n8k16 so that an fp32 accumulator tile packs into an A operand with
// no shuffles (P stays in registers for P @ V).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace hf_flash {
namespace tile {

// ---- element types ---------------------------------------------------------
template <bool kIsBf16> struct Elem;
template <> struct Elem<false> { using T = half; using T2 = half2; };
template <> struct Elem<true> { using T = __nv_bfloat16; using T2 = __nv_bfloat162; };

// Pack two fp32 values into one 32-bit register of 16-bit elements (lo = a).
template <bool kIsBf16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (kIsBf16) {
    __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    half2 r = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

// ---- shared memory addressing ------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// XOR swizzle of 16-byte chunks within a row of kRowBytes (a multiple of 128):
// chunk c of row r lives at chunk c ^ (r % 8), so the 8 rows an ldmatrix phase
// reads hit 8 different bank groups.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzle(int row, int byte_in_row) {
  const int chunk = (byte_in_row >> 4) ^ (row & 7);
  return row * kRowBytes + (chunk << 4) + (byte_in_row & 15);
}

// ---- async copies (global -> shared) ----------------------------------------
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem, bool pred = true) {
  const int bytes = pred ? 16 : 0;  // 0 source bytes = zero-fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// ---- ldmatrix ------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// stmatrix: lanes 8q..8q+7 give the row addresses of 8 x 8 matrix q; register q of each thread holds the pair of
// matrix q that an mma accumulator (or A fragment) holds (sm_90).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// A 16-byte global store; `ptr` must be 16-byte aligned (the compiler splits a uint4 store through a pointer it
// cannot prove aligned into four).
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// ---- tensor-core mma: D(16x8, fp32) += A(16x16) * B(16x8) ----------------------
// A: 4 regs (rows g / g+8, k 2t..2t+1 / +8), B: 2 regs, C/D: 4 floats
// (rows g, g+8; cols 2t, 2t+1), with g = lane / 4, t = lane % 4.
template <bool kIsBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// ---- math ---------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Reductions across the 4 lanes (t = lane % 4) that share an accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// ---- dropout RNG: Philox4x32-10 (see FwdParams for the counter layout) -----------
struct Philox4 { uint32_t x, y, z, w; };
__device__ __forceinline__ Philox4 philox(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return {c0, c1, c2, c3};
}
// The dropout rule (hf_flash/reference.py dropout_keep states the same; FwdParams the seed and offset):
// element (i, j) of (batch, head) draws 16 bits, half (j >> 3) & 1 of word (i >> 3) & 3 of the Philox block at
// counter ((j >> 4) * 8 + (j & 7), (i >> 5) * 8 + (i & 7), batch * h + head, offset) (dropout_block), and is
// dropped iff they are < dropout_threshold. One block covers rows a, a + 8, a + 16, a + 24 (a = i & 7, a 32-row
// group) x keys b, b + 8 (b = j & 7, a 16-key group): the eight elements one thread holds of the forward's S
// fragments (its rows g + {0, 8} of two m16 tiles x columns 2t + e of two n8 tiles) and of the backward's Sᵀ
// fragments (keys g + {0, 8} x rows 2t + e of four n8 tiles).
// The 16 bits of word w, upper or lower half (the kernels pass compile-time indices where their fragment layout
// fixes row % 32 / 8 and key % 16 / 8), and of element (row, key) of the block drawn for it.
__device__ __forceinline__ uint32_t dropout_bits_at(const Philox4& r, int w, int upper) {
  const uint32_t word = w & 2 ? (w & 1 ? r.w : r.z) : (w & 1 ? r.y : r.x);
  return upper ? word >> 16 : word & 0xFFFFu;
}
__device__ __forceinline__ uint32_t dropout_bits(const Philox4& r, int row, int key) {
  return dropout_bits_at(r, (row >> 3) & 3, (key >> 3) & 1);
}
__device__ __forceinline__ Philox4 dropout_block(uint64_t seed, int row, int key, uint32_t batch_head,
                                                 uint32_t offset) {
  return philox(seed, uint32_t(key >> 4) * 8 + (key & 7), uint32_t(row >> 5) * 8 + (row & 7), batch_head, offset);
}

// Programmatic dependent launch (sm_90+; no-ops on older GPUs and when the kernel was launched without it,
// launch_kernel in flash.h): a dependent kernel's CTAs may start while the kernel before it in the stream
// finishes, and wait here before reading what that kernel wrote; a kernel lets its dependent start early by
// calling grid_launch_dependents (once every CTA has called it or exited).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace tile
}  // namespace hf_flash
