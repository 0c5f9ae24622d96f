// hf_flash: the one parameter struct every kernel reads. Torch-free on purpose:
// kernels compile with bare nvcc; csrc/binding.cpp fills these from tensors.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace hf_flash {

// Tensor layout (all strides in elements, last dim contiguous):
//   dense : q (b, seqlen_q, h, d), k/v (b, seqlen_k, h_k, d), o like q
//   varlen: q (total_q, h, d), k/v (total_k, h_k, d); batch b spans rows
//           [cu_seqlens_q[b], cu_seqlens_q[b+1]) (batch_stride unused)
// d is one of the compiled head dims kHeadDims; binding.cpp zero-pads other sizes,
// so kernels never predicate along d.
// The head dims the mma.sync families are instantiated for (csrc/generate_kernels.py reads this line).
constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256, 512};
constexpr int kMaxHeadDim = kHeadDims[sizeof(kHeadDims) / sizeof(kHeadDims[0]) - 1];
// The head dims of the Hopper (wgmma) forward and backward (the generator reads these lines too).
constexpr int kFwdSm90HeadDims[] = {64, 128, 256, 512};
constexpr int kBwdSm90HeadDims[] = {64, 128, 256, 512};
// From d256 the Hopper backward splits d between its two warpgroups, which then share every key of the CTA: T5's
// bias sums would count each key twice, so those head dims run the bias on the mma.sync kernels. d512 also splits
// d between the two CTAs of a cluster (bwd_sm90/kernel.cuh): plain scores only, not deterministic.
constexpr bool bwd_sm90_splits_d(int d) { return d >= 256; }
// What a Hopper kernel instance does to the scores before the mask, a compile-time variant picked by the params'
// rel_bias and softcap (no model combines them): nothing, T5's relative bias, softcap; kPlainOrRelBias is a
// forward instance holding the first two, chosen at run time (fwd_sm90/launch.cuh says where).
enum class Scores { kPlain, kRelBias, kSoftcap, kPlainOrRelBias };
template <int N>
constexpr bool is_one_of(int d, const int (&dims)[N]) {
  for (int x : dims) {
    if (x == d) return true;
  }
  return false;
}

// Entries copied past each end of a head's relative bias row (the tables the kernels read; binding.cpp pads them),
// so the kernels read a block near the diagonal without clamping each element's column (RelBias::table_at).
constexpr int kRelBiasPad = 256;
constexpr int64_t rel_bias_stride(int radius) { return 2 * radius + 1 + 2 * kRelBiasPad; }

struct FwdParams {
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  void* __restrict__ o;
  float* __restrict__ lse;  // natural-log LSE; +inf for fully masked rows

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // dense: lse[b*lse_batch_stride + h*lse_head_stride + i]
  // varlen: lse[h*lse_head_stride + cu_seqlens_q[b] + i]   (FA2 layout (h, total_q))
  int64_t lse_batch_stride, lse_head_stride;

  int b, h, h_k;
  int d;                   // head dim; the decode kernel runs the next instantiated one (columns past d: zero)
  int seqlen_q, seqlen_k;  // dense lengths; varlen: max_seqlen_q / max_seqlen_k
  int total_q;             // rows of q (b*seqlen_q when dense)
  int total_k;             // rows of k / v (b*seqlen_k when dense)

  const int* __restrict__ cu_seqlens_q;  // (b+1) int32 or nullptr (dense)
  const int* __restrict__ cu_seqlens_k;  // (b+1) int32 or nullptr (dense)
  const int* __restrict__ seqused_k;     // (b) valid keys per row of a KV cache, or nullptr
  // KV cache with left padding: row b's keys are rows [leftpad_k[b], seqused_k[b]) (dense only; nullptr = 0).
  // Both are clamped to [0, seqlen_k] on the device, and cu_seqlens to [0, total] (seq_rows below), so bad
  // lengths or offsets cannot read or write out of bounds.
  const int* __restrict__ leftpad_k;

  float softmax_scale;       // applied to q.k before softcap
  float softmax_scale_log2;  // softmax_scale * log2(e), or log2(e) when softcap > 0
  float softcap;             // 0 = off; else s = softcap * tanh(s * softmax_scale / softcap)

  // Key j is visible to query i (both within their sequence) iff
  //   j >= i + seqlen_k - seqlen_q - window_left   (when window_left  >= 0)
  //   j <= i + seqlen_k - seqlen_q + window_right  (when window_right >= 0)
  // causal == (window_right == 0) with bottom-right alignment; -1 = unbounded.
  int window_left, window_right;

  // ALiBi: s += -slope[h] * |i + seqlen_k - seqlen_q - j|; slopes fp32 (h) or (b, h).
  const float* __restrict__ alibi_slopes;
  int64_t alibi_batch_stride;  // 0 for (h,) slopes
  const float* __restrict__ sinks;  // (h,) learned sink logits (natural log), in every row's denominator; or nullptr
  // Relative position bias (T5): fp32 (h, 2 * rel_bias_radius + 1), added to the scaled logit of row i, key j at the
  // column RelBias (below) picks; nullptr = none. Each head's row is padded with kRelBiasPad copies of its end
  // entries on both sides (row stride rel_bias_stride(radius)); rel_bias points at head 0's column 0. The call's
  // first kernel writes it (RelBias::fill) from the caller's table: rel_bias_src, fp32 with strides
  // (rel_bias_src_head_stride, rel_bias_src_col_stride) in floats, at the column of distance -rel_bias_radius (a view
  // as T5's compute_bias returns it is read in place).
  float* __restrict__ rel_bias;
  const float* __restrict__ rel_bias_src;
  int64_t rel_bias_src_head_stride, rel_bias_src_col_stride;
  int rel_bias_radius;

  // Dropout on P (after softmax), kept values scaled by 1/(1-p). The mask for element (batch, head, i, j) comes
  // from Philox4x32-10 keyed by (seed_lo, seed_hi), seed = rng_state[0], counter (.., .., batch*h + head,
  // offset_lo), offset = rng_state[1]: 16 bits an element, 8 elements a block (tile::dropout_bits states the rule);
  // the element is dropped iff its bits < dropout_threshold.
  float dropout_p;                 // probability of dropping; 0 = off
  float rp_dropout;                // 1 / (1 - dropout_p)
  uint32_t dropout_threshold;      // dropout_p * 2^16, saturated at 2^16 - 1
  const int64_t* __restrict__ rng_state;  // device (2,) int64, nullptr when dropout_p == 0

  bool is_bf16;       // else fp16
  int num_sms;        // of the current device, for split / persistent heuristics
  int arch;           // its compute capability, major * 10 + minor (picks Hopper kernels on 90)

  // Split-KV decode: each row's visible keys are cut into num_splits ranges; with num_splits > 1 every
  // range writes fp32 partials, o_accum (num_splits, b, h, seqlen_q, d) normalised by its own sum and
  // lse_accum (num_splits, b, h, seqlen_q) (-inf when the range saw no key), and a combine kernel
  // writes o and lse.
  int num_splits;
  float* __restrict__ o_accum;
  float* __restrict__ lse_accum;
};

// The Scores instance a call's params pick (FwdParams or BwdParams): run(std::integral_constant<Scores, S>{}).
template <class Params, class Run>
cudaError_t run_for_scores(const Params& p, Run run) {
  if (p.rel_bias) return run(std::integral_constant<Scores, Scores::kRelBias>{});
  if (p.softcap > 0.f) return run(std::integral_constant<Scores, Scores::kSoftcap>{});
  return run(std::integral_constant<Scores, Scores::kPlain>{});
}

struct BwdParams : FwdParams {
  const void* __restrict__ dout;  // like o
  void* __restrict__ dq;          // like q
  void* __restrict__ dk;          // like k but with h heads' sums folded into h_k (GQA)
  void* __restrict__ dv;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // (h,) float32 d loss / d sinks, written when `sinks` is set (the forward's learned sinks).
  float* __restrict__ dsinks;
  // Like rel_bias, float32: d loss / d rel_bias, zeroed by the caller and accumulated with atomics (set with rel_bias).
  float* __restrict__ drel_bias;
  // The kernels add d rel_bias straight into drel_bias instead of per-CTA shared-memory sums (the launchers set it
  // where those sums do not fit next to the tiles: bwd::rel_bias_smem).
  bool rel_bias_in_gmem;
  // Each warp adds its d logits into the sums one (key, row) pair of diagonals at a time, without staging them by
  // diagonal in shared memory first (set where the staging rows do not fit: bwd::rel_bias_smem).
  bool rel_bias_direct;

  // Workspace owned by the caller (sizes from bwd_workspace_bytes()).
  void* workspace;
  bool deterministic;  // bitwise-reproducible dq/dk/dv
};

// The Hopper kernel when `sm90` (allowed and supported), unless it declines before launching anything (no sm_90a
// code in this build: cudaErrorNoKernelImageForDevice; tensors TMA cannot describe: cudaErrorNotSupported);
// then the mma.sync kernel. One rule for run_fwd and run_bwd.
template <class Params>
cudaError_t run_sm90_or_sm80(bool sm90, cudaError_t (*run_sm90)(const Params&, cudaStream_t),
                             cudaError_t (*run_sm80)(const Params&, cudaStream_t), const Params& p, cudaStream_t s) {
  if (sm90) {
    const cudaError_t err = run_sm90(p, s);
    if (err != cudaErrorNoKernelImageForDevice && err != cudaErrorNotSupported) return err;
  }
  return run_sm80(p, s);
}

// Packed (varlen) batches counted in blocks of M rows: sequence b, whose rows start at `start` (seq_rows),
// owns blocks packed_block0(start, b, M) .. + ceil(length / M) - 1, before the next sequence's first (at most one
// block between them unused). Grids and workspaces over packed_blocks() blocks cover every sequence without
// giving each the longest one's count.
__host__ __device__ inline int64_t packed_block0(int start, int b, int block_m) {
  return (int64_t(start) + int64_t(b) * block_m) / block_m;
}
__host__ __device__ inline int64_t packed_blocks(int total, int batch, int block_m) {
  return packed_block0(total, batch, block_m);
}
#ifdef __CUDACC__
// Rows of sequence `batch` as (first row, count): [cu[batch], cu[batch + 1]) clamped to the tensor's `total`
// rows (empty when the offsets decrease), or (0, dense_len) when dense. Branch-free min/max: a bad offset
// gives a wrong (caught by HF_FLASH_CHECK=1) but in-bounds range.
__device__ __forceinline__ int2 seq_rows(const int* cu, int batch, int total, int dense_len) {
  if (!cu) return make_int2(0, dense_len);
  const int start = min(max(cu[batch], 0), total);
  return make_int2(start, min(max(cu[batch + 1], start), total) - start);
}

// The sequence that owns packed block `block` (the last whose first block is at most `block`): a binary search
// over the offsets. The caller checks the block against that sequence's rows (a gap or past its end: no rows).
__device__ __forceinline__ int packed_block_seq(const int* cu, int batch, int total, int64_t block, int block_m) {
  int b = 0;
  for (int hi = batch - 1; b < hi;) {
    const int mid = (b + hi + 1) / 2;
    if (packed_block0(seq_rows(cu, mid, total, 0).x, mid, block_m) <= block) b = mid;
    else hi = mid - 1;
  }
  return b;
}

// The visibility rule (causal, sliding window, seqlen_q != seqlen_k; rows and keys counted within their
// sequence, masks aligned bottom-right): query i sees key j iff i < seqlen_q and lo(i) <= j <= hi(i). Causal is
// window_right = 0; an unbounded side reaches past both sequences, so one formula covers every mask. Every
// kernel masks through this struct; hf_flash/reference.py states the same rule (_visible).
struct KeyWindow {
  int seqlen_q, seqlen_k, diag, lo_off, hi_off;  // row i sees keys i + lo_off .. i + hi_off (and < seqlen_k)
  __device__ __forceinline__ KeyWindow(const FwdParams& p, int seqlen_q_, int seqlen_k_)
      : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), diag(seqlen_k_ - seqlen_q_) {
    const int reach = seqlen_q_ + seqlen_k_;
    lo_off = diag - (p.window_left >= 0 ? min(p.window_left, reach) : reach);
    hi_off = diag + (p.window_right >= 0 ? min(p.window_right, reach) : reach);
  }
  // Keys row i sees: [lo(i), hi(i)] (lo may be negative).
  __device__ __forceinline__ int lo(int i) const { return i + lo_off; }
  __device__ __forceinline__ int hi(int i) const { return min(seqlen_k - 1, i + hi_off); }
  // Rows that see key j: [row_lo(j), row_hi(j)] (unclamped: callers bound them by [0, seqlen_q)).
  __device__ __forceinline__ int row_lo(int j) const { return j - hi_off; }
  __device__ __forceinline__ int row_hi(int j) const { return j - lo_off; }
  __device__ __forceinline__ bool visible(int i, int j) const {
    return i < seqlen_q && j < seqlen_k && j - i >= lo_off && j - i <= hi_off;
  }
  // The blocks of block_n keys that rows [m0, m_last] see: [x, y) (x == y: none).
  __device__ __forceinline__ int2 key_blocks(int m0, int m_last, int block_n) const {
    const int begin = max(0, lo(m0)), end = hi(m_last) + 1;
    return make_int2(begin / block_n, end > begin ? (end + block_n - 1) / block_n : begin / block_n);
  }
  // Every (row, key) of rows [m0, m_last] x keys [n0, n_last] is visible: the block needs no mask.
  __device__ __forceinline__ bool covers(int m0, int m_last, int n0, int n_last) const {
    return m_last < seqlen_q && n_last < seqlen_k && n0 - m_last >= lo_off && n_last - m0 <= hi_off;
  }
};

// The relative position bias rule: row i and key j (within their sequence, aligned bottom-right like KeyWindow)
// read column clamp(j - i - (seqlen_k - seqlen_q), -R, R) + R of their head's 2R + 1 entries; every distance past
// R reads the last entry on its side (T5's buckets saturate at max_distance). hf_flash/reference.py states the same
// rule (relative_positions).
struct RelBias {
  const float* table;  // this head's entries (column 0; kRelBiasPad padded entries before and after)
  int width, shift;    // 2R + 1; column = clamp(j - i + shift, 0, 2R)
  __device__ __forceinline__ RelBias(const FwdParams& p, int head, int seqlen_q, int seqlen_k)
      : table(head_table(p, head)), width(2 * p.rel_bias_radius + 1),
        shift(p.rel_bias_radius - (seqlen_k - seqlen_q)) {}
  // Entries of the padded rows (heads x rel_bias_stride(radius)), which fill() writes one at a time.
  static __host__ __device__ __forceinline__ int64_t padded_entries(const FwdParams& p) {
    return int64_t(p.h) * rel_bias_stride(p.rel_bias_radius);
  }
  // Entry i of the padded rows, in order, from the caller's table.
  static __device__ __forceinline__ void fill(const FwdParams& p, int64_t i) {
    const int64_t row = rel_bias_stride(p.rel_bias_radius), head = i / row;
    const int c = int(i - head * row) - kRelBiasPad;
    p.rel_bias[head * row + c] = p.rel_bias_src[head * p.rel_bias_src_head_stride +
                                                min(max(c, 0), 2 * p.rel_bias_radius) * p.rel_bias_src_col_stride];
  }
  // Head `head`'s row of p.rel_bias (its column 0), or nullptr without a bias.
  static __device__ __forceinline__ const float* head_table(const FwdParams& p, int head) {
    return p.rel_bias ? p.rel_bias + int64_t(head) * rel_bias_stride(p.rel_bias_radius) : nullptr;
  }
  // Column of (row i, key j) given d = j - i.
  __device__ __forceinline__ int column(int d) const { return min(max(d + shift, 0), width - 1); }
  // The entry of d = j - i without the clamp: the padding holds the end entries, so this reads the same value for
  // every d whose column is off the table by at most kRelBiasPad. Blocks that block_column() does not saturate
  // are that close: rows [m0, m_last] x keys [n0, n_last] with (m_last - m0) + (n_last - n0) <= kRelBiasPad.
  // table_at(d0) + c with a compile-time c is one load with an immediate offset (no clamp, no address math).
  __device__ __forceinline__ const float* table_at(int d) const { return table + d + shift; }
  __device__ __forceinline__ float at(int i, int j) const { return __ldg(table + column(j - i)); }
  // The one column every (row, key) of rows [m0, m_last] x keys [n0, n_last] reads, or -1 (saturated blocks
  // far from the diagonal: one value for the whole block).
  __device__ __forceinline__ int block_column(int m0, int m_last, int n0, int n_last) const {
    return n0 - m_last + shift >= width - 1 ? width - 1 : n_last - m0 + shift <= 0 ? 0 : -1;
  }
};
#endif

// Lets `kernel` take `bytes` of dynamic shared memory (above 48 KB a kernel must opt in). A device with less
// (d512 on an A100, d256's backward on an sm_86/89 GPU) gets cudaErrorLaunchOutOfResources before any CUDA call
// could leave a sticky last error; the binding turns it into a message naming the head dim.
// The current device's shared memory a block may opt in to (0 if it cannot be read).
inline int smem_optin_bytes() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    return 0;
  }
  return optin;
}

template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  if (bytes > smem_optin_bytes()) return cudaErrorLaunchOutOfResources;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// How launch_kernel launches: `dependent` (Hopper) as a programmatic dependent of the kernel before it in the
// stream: its CTAs may start while that one finishes (their prologue under its tail, no launch gap), and the kernel
// calls tile::grid_dependency_wait before reading that kernel's results. `cluster_x` > 1: thread-block clusters of
// that many consecutive CTAs (Hopper; the grid a multiple of it).
struct LaunchAttrs {
  bool dependent;
  int cluster_x;
  LaunchAttrs(bool dependent_ = false, int cluster_x_ = 1) : dependent(dependent_), cluster_x(cluster_x_) {}
};
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                          LaunchAttrs how, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (how.dependent) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (how.cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {unsigned(how.cluster_x), 1, 1};
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Entry points. They validate nothing (the binding did) and return the CUDA launch status. run_fwd / run_bwd
// choose the kernel family once (csrc/fwd.cu, csrc/bwd.cu); each family's run_<family> dispatches on
// (dtype, d) to its instantiations, generated at build time (csrc/generate_kernels.py).
// run_fwd picks the Hopper wgmma kernel (run_fwd_sm90) on CC 9.0 for the cases fwd_sm90_supports
// accepts, the mma.sync kernel (run_fwd_sm80) otherwise (csrc/fwd.cu).
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);
// With a relative bias, the forward's and decode's first kernel: the padded table (RelBias::fill). The Hopper
// forward runs as its programmatic dependent (the table is written under the forward's prologue); the backward's
// prologue writes its own (bwd_common.cuh).
cudaError_t launch_rel_bias_fill(const FwdParams& params, cudaStream_t stream);
// Hopper kernels are allowed: a CC 9.0 device, and HF_FLASH_DISABLE_SM90 is not 1 (A/B runs, tests). Defined in
// the always-compiled csrc/fwd.cu: the backward asks it too.
bool use_sm90(const FwdParams& params);
bool fwd_sm90_supports(const FwdParams& params);
cudaError_t run_fwd_sm80(const FwdParams& params, cudaStream_t stream);
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream);

// Decode against a KV cache (dense, seqused_k set): seqlen_q <= kDecodeMaxSeqlenQ query rows per
// sequence, the h / h_k query heads of one KV head packed into one tile's rows.
// Head dims above kDecodeMaxHeadDim (d512) run the forward kernel instead (the generator reads this line).
constexpr int kDecodeMaxSeqlenQ = 16;
constexpr int kDecodeMaxHeadDim = 256;
constexpr int kDecodeMaxSplits = 128;
constexpr int kDecodeBlockM = 16;       // packed (query, head-in-group) rows per CTA
constexpr int kDecodeSplitBlock = 256;  // decode_num_splits: at least this many keys per split (4 steps per warp)
int decode_num_splits(const FwdParams& params);  // enough CTAs to saturate HBM (csrc/decode.cu)
cudaError_t run_decode(const FwdParams& params, cudaStream_t stream);

// run_bwd picks the Hopper kernel (run_bwd_sm90) on CC 9.0 for the cases bwd_sm90_supports accepts, the
// mma.sync kernels (run_bwd_sm80) otherwise (csrc/bwd.cu).
size_t bwd_workspace_bytes(const BwdParams& params);
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);
bool bwd_sm90_supports(const BwdParams& params);
cudaError_t run_bwd_sm80(const BwdParams& params, cudaStream_t stream);
cudaError_t run_bwd_sm90(const BwdParams& params, cudaStream_t stream);

}  // namespace hf_flash
