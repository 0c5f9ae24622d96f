// Pieces shared by the backward kernels: sequence offsets, the D = rowsum(dO*O)
// preprocess, the dQ conversion, tile loads and paired mma.
#pragma once
#include <cmath>

#include "attn/bwd_config.h"
#include "flash.h"
#include "tile.cuh"

namespace hf_flash {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;


// One sequence of the batch: its lengths, its first row in the tensors (added
// to batch_stride * b, so 0 when dense), and its first row in the workspace's
// packed row space (dense: b * seqlen_q).
struct Seq {
  int q0, k0, sq, sk, ws0;
  __device__ Seq(const BwdParams& p, int b) {
    const int2 rows_q = seq_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    const int2 rows_k = seq_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);  // clamped: in bounds whatever the offsets
    q0 = rows_q.x; sq = rows_q.y;
    k0 = rows_k.x; sk = rows_k.y;
    ws0 = p.cu_seqlens_q ? q0 : b * p.seqlen_q;
  }
};

// Element offset of (packed row, head) for a tensor with (batch, row, head)
// strides; dense rows split into (batch, row), varlen rows are already global.
__device__ __forceinline__ int64_t row_offset(const BwdParams& p, int row, int seqlen, int head, int64_t bs,
                                              int64_t rs, int64_t hs) {
  const int b = p.cu_seqlens_q ? 0 : row / seqlen, i = p.cu_seqlens_q ? row : row % seqlen;
  return b * bs + int64_t(i) * rs + head * hs;
}

// 4-byte cp.async, zero-filled when !pred.
__device__ __forceinline__ void cp_async4(uint32_t smem_addr, const void* gmem, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(pred ? 4 : 0));
}

// D[head][row] = sum_c dO[row, head, c] * O[row, head, c]; kHeadDim / 8 lanes per (row, head), 16 bytes
// of O and dO each (one warp per (row, head) would leave most lanes idle).
// Lanes per (row, head): the largest power of two (at most 32) dividing the row's 16-byte chunks.
__host__ __device__ constexpr int dot_lanes(int d) {
  int l = 1;
  while (l < 32 && (d / 8) % (2 * l) == 0) l *= 2;
  return l;
}

// The D kernel also zeroes `n_zero` 16-byte chunks at `zero` (the dQ accumulators: bwd_prologue) and, with a bias,
// writes its padded table and zeroes its d sums, in grid-stride loops.
template <bool kIsBf16, int kHeadDim>
__global__ void __launch_bounds__(kThreads) dot_do_o_kernel(const BwdParams p, float* __restrict__ dsum,
                                                            uint4* __restrict__ zero, int64_t n_zero) {
  using T = typename tile::Elem<kIsBf16>::T;
  constexpr int kLanes = dot_lanes(kHeadDim), kChunks = kHeadDim / 8 / kLanes;  // 16-byte chunks per lane
  static_assert(kLanes >= 4 && 32 % kLanes == 0 && kChunks * kLanes * 8 == kHeadDim, "lane groups");
  tile::grid_launch_dependents();  // the Hopper backward may start: it waits for D before reading it
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x, step = int64_t(gridDim.x) * kThreads;
  for (int64_t i = first; i < n_zero; i += step) zero[i] = make_uint4(0, 0, 0, 0);
  if (p.rel_bias) {  // the padded bias table (RelBias::fill) and the zeroed d rel_bias sums
    const int64_t n = RelBias::padded_entries(p), sums = int64_t(p.h) * (2 * p.rel_bias_radius + 1);
    for (int64_t i = first; i < n; i += step) RelBias::fill(p, i);
    for (int64_t i = first; i < sums; i += step) p.drel_bias[i] = 0.f;
  }
  const int64_t item = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  const int lane = threadIdx.x % kLanes;
  const bool ok = item < int64_t(p.total_q) * p.h;
  const int row = ok ? int(item / p.h) : 0, head = ok ? int(item % p.h) : 0;
  float acc = 0.f;
  if (ok) {
    const T* o = static_cast<const T*>(p.o) +
                 row_offset(p, row, p.seqlen_q, head, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    const T* d = static_cast<const T*>(p.dout) +
                 row_offset(p, row, p.seqlen_q, head, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 ov = reinterpret_cast<const uint4*>(o)[lane + c * kLanes];
      const uint4 dv = reinterpret_cast<const uint4*>(d)[lane + c * kLanes];
      const T* o8 = reinterpret_cast<const T*>(&ov);
      const T* d8 = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += float(o8[i]) * float(d8[i]);
    }
  }
#pragma unroll
  for (int s = kLanes / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
  if (ok && lane == 0) dsum[int64_t(head) * p.total_q + row] = acc;
}

// d sink_h = -sum over the rows of head h of exp(sink_h - LSE) * D: a sink is one more term of each row's
// denominator (the LSE includes it), so its gradient is -P(sink) * rowsum(dO * O). One block per head walks the
// rows of every sequence (not the rows outside them) in a fixed order: deterministic, and D is already here.
constexpr int kSinkThreads = 256;
static __global__ void __launch_bounds__(kSinkThreads) sink_grad_kernel(const BwdParams p, const float* __restrict__ dsum) {
  const int head = blockIdx.x;
  const float sink = p.sinks[head];
  float acc = 0.f;
  for (int b = 0; b < p.b; ++b) {
    const int2 rows = seq_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    const int ws0 = p.cu_seqlens_q ? rows.x : b * p.seqlen_q;
    const float* lse = p.lse + int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride +
                       (p.cu_seqlens_q ? rows.x : 0);
    const float* d = dsum + int64_t(head) * p.total_q + ws0;
    for (int i = threadIdx.x; i < rows.y; i += kSinkThreads) acc += __expf(sink - lse[i]) * d[i];
  }
  __shared__ float warp_sums[kSinkThreads / 32];
#pragma unroll
  for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kSinkThreads / 32; ++w) total += warp_sums[w];
    p.dsinks[head] = -total;
  }
}

// d rel_bias of one CTA's key block: every d logit (= P (dP - D)) of a query block summed into its table column in
// shared memory, then added to p.drel_bias once per query head (flush). A warp's tile is 16 keys x 8 kJ queries:
// element (j, r) of a thread's accumulator x[kJ][4] is key key0 + g + 8 (r / 2), query row0 + 8 j + 2 t + r % 2.
// Adding each element into its column with shared-memory atomics is slow (a float atomicAdd on shared memory is a
// compare-and-swap loop on sm_90, and 8 lanes of a warp hit each diagonal), so a warp first sorts its tile by
// diagonal, without atomics or bank conflicts:
//   registers  elements (j - 1, r / 2 = 0) and (j, r / 2 = 1) share a diagonal: summed into bin j (0..kJ), one
//              per parity r % 2;
//   staging    each diagonal's bins come from 8 lanes, one per (t, parity): bin b of lane (g, t), parity p, goes to
//              row 2t + p of the warp's 8 staging rows (a row stride of 5 mod 16 floats puts a store's 32 lanes on
//              32 banks), at its diagonal's slot; then lane l sums the 8 rows of diagonals l, l + 32, ... and adds
//              each into its column (the saturated columns 0 and 2R summed over the warp first).
// Where the staging rows do not fit next to a kernel's tiles (p.rel_bias_direct: GPUs smaller than sm_90's, where
// every kernel has room by its traits' static_assert), every bin goes straight into the sums instead; where the
// sums do not fit either, and always in the Hopper kernels (p.rel_bias_in_gmem, bwd::rel_bias_smem), they are
// p.drel_bias itself. kGlobalSums: the caller's launcher always puts the sums there (the Hopper kernels'
// kRelSumsInGmem), so each add is one reduction instruction (a generic float atomic also carries the shared-memory
// compare-and-swap path, a space check and a branch per add).
template <int kJ, bool kGlobalSums = false>
struct RelBiasGrad {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr bool kMayBeDirect = false;
#else
  static constexpr bool kMayBeDirect = true;
#endif
  static constexpr int kDiags = rel_scratch_diagonals(kJ), kRow = rel_scratch_stride(kJ);
  static __device__ __forceinline__ bool in_gmem(const BwdParams& p) { return kGlobalSums || p.rel_bias_in_gmem; }
  // Bin b, parity p of lane (g, t) lands on bank (t (2 kRow - 2) + g + const) % 32: distinct for the 32 lanes when
  // 2 kRow - 2 is an odd multiple of 8.
  static_assert(kRow >= kDiags && (2 * kRow - 2) % 16 == 8, "staging rows: every diagonal, conflict-free stores");
  RelBias rb;
  float* sums;     // shared, rb.width floats, zero between flushes; or (in_gmem(p)) this head's drel_bias
  float scale;     // d logit = x * scale (the main kernel's dS carries softmax_scale)
  float add_scale;  // scale applied per add: `scale` straight into global memory, else 1 (flush applies it)
  // Shared address of this lane's slot of bin 0, parity 0 (row 2t of its warp's staging rows): bin b, parity p at
  // slot - 32 b + 4 p (kRow - 1), for the diagonal key - row = base - 8 (b - 1) - p. 0 with p.rel_bias_direct.
  uint32_t slot = 0;
  int base = 0;    // key - row of this thread's bin 1, parity 0: key0 + g - row0 - 2t (column() adds the shift)
  float carry[2] = {0.f, 0.f};  // r / 2 = 0 of the previous j

  __device__ __forceinline__ RelBiasGrad(float* smem_sums, const BwdParams& p, int head, const Seq& seq, float scale_)
      : rb(p, head, seq.sq, seq.sk),
        sums(in_gmem(p) && p.drel_bias ? p.drel_bias + int64_t(head) * rb.width : smem_sums),
        scale(scale_), add_scale(in_gmem(p) ? scale_ : 1.f) {}
  // Whether this launch stages (else p.rel_bias_direct: one add per bin).
  static __device__ __forceinline__ bool staged(const BwdParams& p) { return !(kMayBeDirect && p.rel_bias_direct); }
  // The staging rows follow the shared sums (or take their place when the sums live in global memory).
  static __device__ __forceinline__ float* staging(const BwdParams& p, float* smem_sums) {
    return smem_sums + (in_gmem(p) ? 0 : rel_sums_floats(p.rel_bias_radius));
  }
  // Sums and staging rows start at zero (a barrier orders this before the first add): a slot no lane writes (the
  // rows' ragged ends) reads as 0 in every tile.
  static __device__ __forceinline__ void zero(const BwdParams& p, float* smem_sums, int tid, int threads) {
    if (!p.rel_bias) return;
    const int n = (in_gmem(p) ? 0 : rel_sums_floats(p.rel_bias_radius)) +
                  (staged(p) ? rel_scratch_floats(kJ) : 0);
    for (int c = tid; c < n; c += threads) smem_sums[c] = 0.f;
  }
  // A tile of this warp (of 8), its first key and row; lane (g, t).
  __device__ __forceinline__ void begin(const BwdParams& p, float* smem_sums, int warp, int key0, int row0, int g,
                                        int t) {
    base = key0 + g - row0 - 2 * t;
    if (staged(p)) {
      slot = tile::smem_u32(staging(p, smem_sums) + warp * 8 * kRow) + lane_slot();
    }
  }
  // The bias of bin b, parity p's diagonal (after begin()), read unclamped (RelBias::table_at): for a tile of a
  // block that RelBias::block_column does not saturate, whose rows and keys span at most kRelBiasPad.
  __device__ __forceinline__ float bin_bias(int b, int par) const {
    return __ldg(rb.table_at(base) - 8 * (b - 1) - par);
  }
  // step(j, x_j) in order j = 0, 1, ..., kJ - 1, finish() after the last; then commit() (every lane of the warp),
  // which may wait (under the next GEMM, when the tile's registers are free) until before the next tile's steps.
  __device__ __forceinline__ void step(int j, const float (&x)[4]) {
    put(j, (j > 0 ? carry[0] : 0.f) + x[2], (j > 0 ? carry[1] : 0.f) + x[3]);
    carry[0] = x[0];
    carry[1] = x[1];
  }
  __device__ __forceinline__ void finish() { put(kJ, carry[0], carry[1]); }
  // The staged diagonals into their columns.
  __device__ __forceinline__ void commit() {
    if (direct()) return;
    __syncwarp();  // the staging stores are visible
    const int lane = threadIdx.x % 32;
    const int first = base - lane / 4 + 2 * (lane % 4) - (8 * kJ - 1);  // key - row of the warp's slot 0
    const uint32_t rows = slot - lane_slot();
    float lo = 0.f, hi = 0.f;  // saturated columns 0 and 2R: one add per warp
#pragma unroll
    for (int i = 0; i < (kDiags + 31) / 32; ++i) {
      const int dl = lane + 32 * i;
      if (dl < kDiags) {
        float v[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v[r]) : "r"(rows + 4 * (r * kRow + dl)));
        }
        const float sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        const int c = rb.column(first + dl);
        if (c == 0) {
          lo += sum;
        } else if (c == rb.width - 1) {
          hi += sum;
        } else {
          add(sums + c, sum * add_scale);  // one lane per column in this warp
        }
      }
    }
    __syncwarp();  // every lane has read the rows before the next tile's stores
    if (__any_sync(0xffffffffu, lo != 0.f || hi != 0.f)) {
#pragma unroll
      for (int s = 16; s > 0; s /= 2) {
        lo += __shfl_xor_sync(0xffffffffu, lo, s);
        hi += __shfl_xor_sync(0xffffffffu, hi, s);
      }
      if (lane == 0) {
        add(sums, lo * add_scale);
        if (rb.width > 1) add(sums + rb.width - 1, hi * add_scale);
      }
    }
  }
  // A block whose every element reads one column: this thread's sum x_sum, summed over the warp first.
  __device__ __forceinline__ void add_block(int column, float x_sum) {
#pragma unroll
    for (int s = 16; s > 0; s /= 2) x_sum += __shfl_xor_sync(0xffffffff, x_sum, s);
    if (threadIdx.x % 32 == 0) add(sums + column, x_sum * add_scale);
  }
  // After a barrier that follows every add of a query head: its sums into p.drel_bias, and zeroed (the caller's
  // next barrier orders the zeros before the next adds). Thread `tid` of `threads`.
  __device__ __forceinline__ void flush(const BwdParams& p, int head, int tid = threadIdx.x,
                                        int threads = kThreads) const {
    if (in_gmem(p)) return;  // added there already
    for (int c = tid; c < rb.width; c += threads) {
      const float v = sums[c];
      if (v != 0.f) atomicAdd(p.drel_bias + int64_t(head) * rb.width + c, v * scale);
      sums[c] = 0.f;
    }
  }

 private:
  __device__ __forceinline__ bool direct() const { return kMayBeDirect && !slot; }
  static __device__ __forceinline__ void add(float* at, float v) {
    if constexpr (kGlobalSums) {
      asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(at), "f"(v) : "memory");
    } else {
      atomicAdd(at, v);
    }
  }
  // Lane (g, t)'s bin 0, parity 0 in its warp's rows: row 2t, the diagonal's offset from the warp's first one
  // (key0 - row0 - 8 kJ + 1), in bytes.
  static __device__ __forceinline__ uint32_t lane_slot() {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    return 4 * (2 * t * kRow + g - 2 * t + 8 * kJ + 7);
  }
  // Bin b's parity 0 and 1 sums (diagonals base - 8 (b - 1) and one less).
  __device__ __forceinline__ void put(int b, float v0, float v1) {
    if (direct()) {
      add(sums + rb.column(base - 8 * (b - 1)), v0 * add_scale);
      add(sums + rb.column(base - 8 * (b - 1) - 1), v1 * add_scale);
      return;
    }
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(slot - 32 * b), "f"(v0));
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(slot - 32 * b + 4 * (kRow - 1)), "f"(v1));
  }
};

// dq = sum over copies of the fp32 accumulator, 8 elements per thread.
template <bool kIsBf16, int kHeadDim>
__global__ void __launch_bounds__(kThreads) convert_dq_kernel(const BwdParams p, const float* __restrict__ acc,
                                                              size_t copy_floats, int copies) {
  tile::grid_dependency_wait();  // launched as the Hopper backward's dependent: its additions are done
  const int64_t chunk = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (chunk >= int64_t(p.total_q) * p.h * (kHeadDim / 8)) return;
  const int c = int(chunk % (kHeadDim / 8)) * 8, head = int(chunk / (kHeadDim / 8) % p.h);
  const int row = int(chunk / (kHeadDim / 8) / p.h);
  float sum[8] = {};
  for (int copy = 0; copy < copies; ++copy) {
    const float4* src = reinterpret_cast<const float4*>(acc + copy * copy_floats + chunk * 8);
    const float4 a = src[0], b = src[1];
    sum[0] += a.x; sum[1] += a.y; sum[2] += a.z; sum[3] += a.w;
    sum[4] += b.x; sum[5] += b.y; sum[6] += b.z; sum[7] += b.w;
  }
  uint4 out;
  out.x = tile::pack2<kIsBf16>(sum[0], sum[1]); out.y = tile::pack2<kIsBf16>(sum[2], sum[3]);
  out.z = tile::pack2<kIsBf16>(sum[4], sum[5]); out.w = tile::pack2<kIsBf16>(sum[6], sum[7]);
  auto* dq = static_cast<typename tile::Elem<kIsBf16>::T*>(p.dq) +
             row_offset(p, row, p.seqlen_q, head, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) + c;
  *reinterpret_cast<uint4*>(dq) = out;
}

// dq from the Hopper kernel's blocks of block_m rows (bwd_config.h). A block holds two 64 x 64 pieces (d128:
// column halves; d64: row halves), each 128 threads' 16-byte chunks, chunk j of thread i at 128 j + i; thread
// i = 32 w + 4 g + t held rows 16 w + g (+ 8) and columns 8 j + 2 t (+ 1) of its piece (the wgmma accumulator's
// layout, sm90/wgmma.cuh). So threads 32 w + 4 g .. + 3's chunks j are 64 contiguous bytes holding columns
// 8 j .. 8 j + 7 of two rows: one thread here reads them and writes both rows.
// `touched` (or nullptr: all of them): a block's counter, 0 where no key block added into it (its accumulator was
// not zeroed, BwdWorkspace::zero_counters_only), whose rows get zeros.
template <bool kIsBf16>
__global__ void __launch_bounds__(kThreads) convert_dq_blocks_kernel(const BwdParams p, const float* __restrict__ acc,
                                                                     int block_m, int64_t blocks,
                                                                     const int* __restrict__ touched) {
  tile::grid_dependency_wait();  // launched as the Hopper backward's dependent: its additions are done
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // (block, head, piece, w, j, g), g fastest
  if (idx >= blocks * p.h * 512) return;
  const int g = int(idx % 8), j = int(idx / 8 % 8), w = int(idx / 64 % 4), piece = int(idx / 256 % 2);
  const int head = int(idx / 512 % p.h);
  const int64_t block = idx / 512 / p.h;
  const int b = p.cu_seqlens_q ? packed_block_seq(p.cu_seqlens_q, p.b, p.total_q, block, block_m)
                               : int(block / ((p.seqlen_q + block_m - 1) / block_m));
  const int2 rows = seq_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
  const int r = int(block - dq_block0(p, b, rows.x, block_m)) * block_m + (block_m == 64 ? 0 : 64 * piece) + 16 * w + g;
  const int c = (block_m == 64 ? 64 * piece : 0) + 8 * j;
  const float4* src =
      reinterpret_cast<const float4*>(acc + (block * p.h + head) * kDqBlockFloats + 4096 * piece) + 128 * j + 32 * w + 4 * g;
  float4 v[4];
  const bool added = !touched || touched[block * p.h + head] != 0;
#pragma unroll
  for (int t = 0; t < 4; ++t) v[t] = added ? src[t] : make_float4(0.f, 0.f, 0.f, 0.f);
  auto* dq = static_cast<typename tile::Elem<kIsBf16>::T*>(p.dq) + c + int64_t(head) * p.dq_head_stride +
             (p.cu_seqlens_q ? int64_t(rows.x) * p.dq_row_stride : int64_t(b) * p.dq_batch_stride);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (r < 0 || r + 8 * half >= rows.y) return;  // r < 0: a block before the first sequence's (cu_seqlens[0] > 0)
    uint4 out;
    out.x = tile::pack2<kIsBf16>(half ? v[0].z : v[0].x, half ? v[0].w : v[0].y);
    out.y = tile::pack2<kIsBf16>(half ? v[1].z : v[1].x, half ? v[1].w : v[1].y);
    out.z = tile::pack2<kIsBf16>(half ? v[2].z : v[2].x, half ? v[2].w : v[2].y);
    out.w = tile::pack2<kIsBf16>(half ? v[3].z : v[3].x, half ? v[3].w : v[3].y);
    *reinterpret_cast<uint4*>(dq + int64_t(r + 8 * half) * p.dq_row_stride) = out;
  }
}

// The backward around either main kernel, one stream and no host synchronisation:
//   bwd_prologue  zeroes the fp32 dQ accumulators (or only the counters: zero_counters_only) and d rel_bias,
//                 writes the padded bias table (RelBias::fill), D = rowsum(dO * O) into the workspace and d sinks;
//   bwd_epilogue  sums the accumulators into dq.
struct BwdWorkspace {
  float* dsum;
  float* dq_acc;
  size_t dq_copy_floats;
  int copies;
  int* counters;  // the Hopper backward's dQ counters (WorkspaceLayout), or nullptr
  size_t n_counters;
  // What bwd_prologue zeroes (16-byte chunks from `zero`): the accumulators and the counters after them, to the
  // workspace's end (the layout's pieces are 256-byte aligned); only the counters where the first add into each
  // accumulator block stores it (zero_counters_only).
  void* zero;
  int64_t zero_chunks;
  bool first_add_stores = false;
  explicit BwdWorkspace(const BwdParams& p) {
    const WorkspaceLayout ws(p);
    auto* base = static_cast<unsigned char*>(p.workspace);
    dsum = reinterpret_cast<float*>(base + ws.dsum_offset);
    dq_acc = reinterpret_cast<float*>(base + ws.dq_offset);
    dq_copy_floats = ws.dq_copy_floats;
    copies = dq_copies(p);
    n_counters = ws.counters;
    counters = n_counters ? reinterpret_cast<int*>(base + ws.counters_offset) : nullptr;
    zero = dq_acc;
    zero_chunks = int64_t(ws.bytes - ws.dq_offset) / 16;
  }
  void zero_counters_only() {
    first_add_stores = true;
    zero = counters;
    zero_chunks = counters ? int64_t(WorkspaceLayout::align(sizeof(int) * n_counters)) / 16 : 0;
  }
};

template <bool kIsBf16, int kHeadDim>
cudaError_t bwd_prologue(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  // ws.zero_chunks are zeroed by dot_do_o_kernel beside D, not by a memset in front of it (a launch and a pass of
  // its own: 15 µs of t5-base's 230 µs backward).
  const int64_t row_warps = int64_t(p.total_q) * p.h;
  constexpr int kDotLanes = dot_lanes(kHeadDim);
  dot_do_o_kernel<kIsBf16, kHeadDim><<<(row_warps * kDotLanes + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      p, ws.dsum, static_cast<uint4*>(ws.zero), ws.zero_chunks);
  if (p.sinks) sink_grad_kernel<<<p.h, kSinkThreads, 0, stream>>>(p, ws.dsum);
  return cudaSuccess;
}

// dependent: launched as the main kernel's programmatic dependent (the Hopper backward).
template <bool kIsBf16, int kHeadDim>
// dq_block_m: the accumulator is the Hopper kernel's blocks of that many rows (bwd_config.h), else rows.
cudaError_t bwd_epilogue(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream, bool dependent = false,
                         int dq_block_m = 0) {
  if constexpr (sm90_dq_blocked(kHeadDim)) {
    if (dq_block_m) {
      const int64_t blocks = dq_blocks(p, dq_block_m), threads = blocks * p.h * 512;
      return launch_kernel(&convert_dq_blocks_kernel<kIsBf16>, int((threads + kThreads - 1) / kThreads), kThreads,
                           0, stream, dependent, p, ws.dq_acc, dq_block_m, blocks,
                           ws.first_add_stores ? ws.counters : nullptr);
    }
  }
  const int64_t chunks = int64_t(p.total_q) * p.h * (kHeadDim / 8);
  return launch_kernel(&convert_dq_kernel<kIsBf16, kHeadDim>, int((chunks + kThreads - 1) / kThreads), kThreads, 0,
                       stream, dependent, p, ws.dq_acc, ws.dq_copy_floats, ws.copies);
}

// Copy kRows x kD elements (rows >= limit zero-filled) into padded smem rows. Compile-time trip count,
// and each thread's rows are r0, r0 + kRowStep, ... so the source advances by one 64-bit add per copy
// (a runtime-bound loop with per-chunk index math cost ~100 instructions per tile per step).
template <class Tr, int kRows>
__device__ __forceinline__ void load_tile(uint32_t smem, const typename Tr::T* gmem, int64_t row_stride, int limit) {
  constexpr int kChunks = Tr::kD / 8;  // 16-byte chunks per row
  if constexpr (kThreads % kChunks == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "whole passes");
    const int r0 = threadIdx.x / kChunks, col = threadIdx.x % kChunks * 8;
    const typename Tr::T* src = gmem + r0 * row_stride + col;
    smem += (r0 * Tr::kStrideD + col) * 2;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const bool ok = r0 + i * kRowStep < limit;
      tile::cp_async16(smem + i * kRowStep * Tr::kStrideD * 2, ok ? src : gmem, ok);
      src += kRowStep * row_stride;
    }
  } else {  // d96, d192: rows of 12 / 24 chunks
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
      const int c = threadIdx.x + i * kThreads, r = c / kChunks, col = c % kChunks * 8;
      if (kTotal % kThreads == 0 || c < kTotal) {
        const bool ok = r < limit;
        tile::cp_async16(smem + (r * Tr::kStrideD + col) * 2, ok ? gmem + r * row_stride + col : gmem, ok);
      }
    }
  }
}

// Key block n0 and the query blocks of kBlockM rows [m_begin, m_begin + m_count) that see at least one key.
struct KeyBlock {
  int n0, m_begin, m_count;
};
template <int kBlockN, int kBlockM>
__device__ __forceinline__ KeyBlock query_blocks(const BwdParams& p, const Seq& seq, int n0) {
  const KeyWindow w(p, seq.sq, seq.sk);
  const int m_lo = max(0, w.row_lo(n0)), m_hi = min(seq.sq, w.row_hi(n0 + kBlockN - 1) + 1);
  const int m_begin = m_lo / kBlockM;
  return {n0, m_begin, m_hi > m_lo ? (m_hi + kBlockM - 1) / kBlockM - m_begin : 0};
}
// Query blocks from a key block's first (m_begin) to the one holding its first key's diagonal row, within
// [0, m_count): 0 where the mask starts the key block there (causal), up to m_count - 1 with full attention.
template <int kBlockM>
__device__ __forceinline__ int diagonal_offset(const BwdParams& p, const Seq& seq, const KeyBlock& kb) {
  const int diag_row = kb.n0 - (seq.sk - seq.sq);
  const int off = (diag_row > 0 ? diag_row / kBlockM : 0) - kb.m_begin;
  return max(0, min(off, kb.m_count - 1));
}
// Deterministic dQ on Hopper (bwd_sm90/kernel.cuh): the key blocks that add into query block m are the contiguous
// run first_key_block(m) .. last_key_block(m) (query_blocks starts and ends later for later key blocks); key block
// n is the (n - first)-th to add in ascending order, the (last - n)-th in descending order.
template <int kBlockN, int kBlockM>
__device__ __forceinline__ int first_key_block(const BwdParams& p, const Seq& seq, int m) {
  const KeyWindow w(p, seq.sq, seq.sk);
  // Key block n reaches m iff m kBlockM < row_hi(n kBlockN + kBlockN - 1) + 1, i.e. n kBlockN > m kBlockM - kBlockN
  // + lo_off.
  const int x = m * kBlockM + w.lo_off + 1 - kBlockN;
  return x > 0 ? (x + kBlockN - 1) / kBlockN : 0;
}
template <int kBlockN, int kBlockM>
__device__ __forceinline__ int last_key_block(const BwdParams& p, const Seq& seq, int m) {
  const KeyWindow w(p, seq.sq, seq.sk);
  // Key block n reaches m iff row_lo(n kBlockN) < (m + 1) kBlockM, i.e. n kBlockN < (m + 1) kBlockM + hi_off.
  const int x = (m + 1) * kBlockM + w.hi_off;
  const int last = x > 0 ? (x + kBlockN - 1) / kBlockN - 1 : -1;
  return min(last, (seq.sk + kBlockN - 1) / kBlockN - 1);
}

// The start of a key block, shared by the sm80 main kernels: K and V into smem (one cp.async group) and its
// query blocks.
template <class Tr>
__device__ __forceinline__ KeyBlock begin_key_block(const BwdParams& p, const Seq& seq, int b, int hk, int n_block,
                                                    uint32_t sK, uint32_t sV) {
  using T = typename Tr::T;
  const int n0 = n_block * Tr::kBlockN;
  const T* k = static_cast<const T*>(p.k) + p.k_batch_stride * b + int64_t(seq.k0 + n0) * p.k_row_stride +
               hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + p.v_batch_stride * b + int64_t(seq.k0 + n0) * p.v_row_stride +
               hk * p.v_head_stride;
  load_tile<Tr, Tr::kBlockN>(sK, k, p.k_row_stride, seq.sk - n0);
  load_tile<Tr, Tr::kBlockN>(sV, v, p.v_row_stride, seq.sk - n0);
  tile::cp_async_commit();
  return query_blocks<Tr::kBlockN, Tr::kBlockM>(p, seq, n0);
}

// Row `key` of dK (is_dv false) or dV from this thread's accumulator rows (g or g + 8 by h2), columns
// col0 + 8j + 2t, as 16-bit pairs; GQA: the group's query heads are already summed in the accumulator.
template <bool kIsBf16, int kCols>
__device__ __forceinline__ void store_grad_row(const BwdParams& p, const Seq& seq, int b, int hk, int key, int col0,
                                               int h2, bool is_dv, const float (&acc)[kCols / 8][4]) {
  using T = typename tile::Elem<kIsBf16>::T;
  if (key >= seq.sk) return;
  T* dst = static_cast<T*>(is_dv ? p.dv : p.dk) + (is_dv ? p.dv_batch_stride : p.dk_batch_stride) * b +
           int64_t(seq.k0 + key) * (is_dv ? p.dv_row_stride : p.dk_row_stride) +
           hk * (is_dv ? p.dv_head_stride : p.dk_head_stride) + col0;
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j)
    *reinterpret_cast<uint32_t*>(dst + 8 * j) = tile::pack2<kIsBf16>(acc[j][2 * h2], acc[j][2 * h2 + 1]);
}

// Two n8 tiles sharing one A fragment; b holds both B fragments (ldmatrix_x4).
template <bool kIsBf16>
__device__ __forceinline__ void mma_pair(float (&acc0)[4], float (&acc1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  tile::mma_16816<kIsBf16>(acc0, a, b0);
  tile::mma_16816<kIsBf16>(acc1, a, b1);
}

}  // namespace bwd
}  // namespace hf_flash
