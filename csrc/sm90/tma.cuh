// Hopper (sm_90a) asynchronous copies: mbarriers, TMA tile loads and reductions, and warpgroup register reallocation.
// Generic: no attention-specific code here.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hf_flash {
namespace sm90 {

// ---- mbarrier (shared memory, CTA scope) -----------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes mbar_init visible to the other threads (and to TMA); follow with a barrier.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` of TMA data before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n"
               ::"r"(bar), "r"(bytes) : "memory");
}
// Adds `bytes` of expected TMA data to the current phase without an arrival (the issuing thread arrives later).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival on `bar` once all of this thread's earlier cp.async copies have landed (counted in mbar_init's count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Blocks until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int phase) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(phase) : "memory");
}

// ---- thread-block clusters ------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: the mbarriers initialised before it are visible to the whole cluster
// (remote arrivals and st.async) after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address of the same shared-memory offset in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}
// One arrival on the mbarrier at cluster address `remote_bar` (cluster_map); default semantics (a .release.cluster
// arrive compiles to MEMBAR.ALL.GPU first).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
// 16 bytes into another CTA's shared memory (cluster addresses), completing 16 bytes of its mbarrier's transaction
// count: the receiver waits on that mbarrier (armed with mbar_arrive_expect_tx) and then reads the data.
__device__ __forceinline__ void st_async_v4(uint32_t remote_dst, const float (&v)[4], uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(remote_dst), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(remote_bar) : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (a multiple of 32) of the CTA, e.g. the
// consumer warpgroups of a warp-specialised kernel without its producer.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at named barrier `id` without waiting (a producer's half of a hand-off to threads that sync on it).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA ------------------------------------------------------------------------------
// Loads the box at coordinates (c0..c3) of a 4-D tensor map into shared memory, completing `bytes`
// of the transaction count of mbarrier `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

// Adds the box at smem to the one at coordinates (c0..c3) of a 4-D tensor map, asynchronously (bulk group; rows
// past the map's dims are dropped). The smem tile is in the map's swizzled layout.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}

// ---- bulk groups -----------------------------------------------------------------------------
// Adds `bytes` (a multiple of 16) of fp32 from shared memory into global memory element by element, as one bulk
// copy in this thread's bulk group (bulk_commit / bulk_wait*).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, uint32_t smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(smem), "r"(bytes)
               : "memory");
}
// Copies `bytes` (a multiple of 16) from shared to global memory, as one bulk copy in this thread's bulk group.
__device__ __forceinline__ void bulk_store(void* gmem, uint32_t smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most kPending of this thread's bulk groups still read shared memory (the source may be reused).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory"); }
// At most kPending of this thread's bulk groups are incomplete (their global writes included).
template <int kPending>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory"); }

// ---- ordering bulk global writes across CTAs (a counter in global memory) --------------------
// Spins until *counter == value (kAtLeast: >= value; acquire at GPU scope), then orders this thread's later bulk
// (async-proxy) global operations after what the releasing threads wrote before their release.
template <bool kAtLeast = false>
__device__ __forceinline__ void counter_wait(const int* counter, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
  } while (kAtLeast ? seen < value : seen != value);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Claims a block (counter 0 -> 1) and returns what the counter held, with acquire semantics: a 2 seen here orders
// this thread's later adds after the claimer's store, as counter_wait does (one round trip instead of two).
__device__ __forceinline__ int counter_claim(int* counter) {
  int old;
  asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;\n" : "=r"(old) : "l"(counter) : "memory");
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  return old;
}
// Once this thread's bulk groups have completed (bulk_wait<0>): makes their global writes visible to the next
// counter_wait and adds 1 (release at GPU scope).
__device__ __forceinline__ void counter_release_inc(int* counter) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// ---- register reallocation between warpgroups ----------------------------------------------
template <int kRegs>
__device__ __forceinline__ void regs_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void regs_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }

// ---- host: tensor maps ---------------------------------------------------------------------
// Element types of the maps: 16-bit operands, or fp32 (accumulators).
enum class TmaElem { kBf16, kF16, kF32 };
inline TmaElem tma_elem(bool is_bf16) { return is_bf16 ? TmaElem::kBf16 : TmaElem::kF16; }

// A 4-D map, dims innermost first (the innermost contiguous), strides in elements of dims 1..3, boxes of one
// 128-byte row (64 16-bit / 32 fp32 elements) x 1 x box_rows x 1 with the 128-byte swizzle: one box fills one
// panel of the swizzled wgmma layout (wgmma.cuh). Out-of-range rows read as zero (loads) or are dropped (reductions).
inline cudaError_t make_tensor_map_4d(CUtensorMap* map, const void* ptr, TmaElem elem, const uint64_t (&dims)[4],
                                      const int64_t (&strides)[3], uint32_t box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess || found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t global_dims[4] = {dims[0], dims[1], dims[2], dims[3]};
  const uint32_t bytes = elem == TmaElem::kF32 ? 4 : 2;
  const cuuint64_t global_strides[3] = {cuuint64_t(strides[0]) * bytes, cuuint64_t(strides[1]) * bytes,
                                        cuuint64_t(strides[2]) * bytes};
  const cuuint32_t box[4] = {128 / bytes, 1, box_rows, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = elem == TmaElem::kF32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : elem == TmaElem::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, type, 4,
                            const_cast<void*>(ptr), global_dims, global_strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

// The map of a (batch, rows, heads, d) tensor with element strides (batch, row, head) as dims (d, heads, rows,
// batch), boxes of one 128-byte panel row x one head x box_rows rows; with batches == 1 (e.g. varlen tensors: one
// batch of all their rows) batch_stride is unused.
inline cudaError_t make_rows_map(CUtensorMap* map, const void* ptr, TmaElem elem, int d, int heads, int rows,
                                 int batches, int64_t head_stride, int64_t row_stride, int64_t batch_stride,
                                 uint32_t box_rows) {
  const uint64_t dims[4] = {uint64_t(d), uint64_t(heads), uint64_t(rows), uint64_t(batches)};
  const int64_t strides[3] = {head_stride, row_stride, batches == 1 ? row_stride * rows : batch_stride};
  return make_tensor_map_4d(map, ptr, elem, dims, strides, box_rows);
}

}  // namespace sm90
}  // namespace hf_flash
