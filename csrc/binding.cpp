// The torch side of hf_flash: defines the public ops hf_flash::fwd / bwd / fwd_kvcache (the one place their
// schemas are written), their CUDA implementations and the autograd kernel of fwd. An implementation checks its
// arguments, brings q/k/v to the layout the kernels read (zero-padded head dim, 16-byte aligned rows), fills
// hf_flash::FwdParams / BwdParams and launches; the kernels themselves stay torch-free. hf_flash/ops.py adds the
// fake (meta) implementations and calls the PyTorch reference instead where the kernels cannot run.
#include <Python.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "flash.h"

namespace hf_flash {
namespace {

// The instantiated head dim that runs head dim d: the smallest one >= d (columns past d are zero padding,
// which changes neither q.k nor the output's first d columns).
int64_t kernel_head_dim(int64_t d) {
  for (int64_t hd : kHeadDims) {
    if (hd >= d) return hd;
  }
  TORCH_CHECK_VALUE(false, "hf_flash: head_dim must be at most ", kMaxHeadDim, " for the CUDA kernels, got ", d);
}

// The kernels load and store rows with 16-byte cp.async: last dim contiguous, aligned base and strides.
bool kernel_layout(const at::Tensor& t, int64_t head_dim) {
  if (t.size(-1) != head_dim || t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return false;
  }
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;
  }
  return true;
}

// t as the kernels read it: head dim zero-padded to head_dim, copied only when its layout does not fit.
at::Tensor for_kernel(const at::Tensor& t, int64_t head_dim) {
  at::Tensor x = t.size(-1) == head_dim ? t : at::constant_pad_nd(t, {0, head_dim - t.size(-1)});
  return kernel_layout(x, head_dim) ? x : x.clone(at::MemoryFormat::Contiguous);
}

// An output shaped and strided like `like` (as the fake implementations in ops.py say), and the tensor the
// kernel writes: the output itself when its layout fits, else a padded twin copied back by finish().
struct Output {
  at::Tensor out, kernel;
  Output(const at::Tensor& like, int64_t head_dim) : out(at::empty_like(like)) {
    if (kernel_layout(out, head_dim)) {
      kernel = out;
    } else {
      auto shape = like.sizes().vec();
      shape.back() = head_dim;
      kernel = at::empty(shape, like.options());
    }
  }
  at::Tensor finish() {
    if (!kernel.is_same(out)) out.copy_(kernel.narrow(-1, 0, out.size(-1)));
    return out;
  }
};

// Checks shared by every op; layout and alignment are for_kernel's business.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool varlen) {
  TORCH_CHECK_VALUE(q.is_cuda() && k.device() == q.device() && v.device() == q.device(),
                    "hf_flash: q, k, v must be CUDA tensors on one device");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   "hf_flash: the CUDA kernels take float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "hf_flash: q, k, v must share a dtype");
  const int64_t dims = varlen ? 3 : 4;
  TORCH_CHECK_VALUE(q.dim() == dims && k.dim() == dims && v.dim() == dims, "hf_flash: q, k, v must be ", dims, "-D");
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(d >= 1 && d <= kMaxHeadDim, "hf_flash: head_dim must be in 1..", kMaxHeadDim, ", got ", d);
  TORCH_CHECK_VALUE(k.size(-1) == d && v.size(-1) == d, "hf_flash: q, k, v head dims differ");
  TORCH_CHECK_VALUE(k.size(-2) > 0 && q.size(-2) % k.size(-2) == 0,
                    "hf_flash: query heads must be a multiple of key/value heads");
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "hf_flash: k and v shapes differ");
  TORCH_CHECK_VALUE(varlen || k.size(0) == q.size(0), "hf_flash: q and k must have the same batch size");
  const auto* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(props->major >= 8, "hf_flash: the CUDA kernels need compute capability 8.0 or newer, got ",
              props->major, ".", props->minor);
}

// A launch's status as an exception; a kernel whose tiles need more shared memory than this GPU has
// (allow_smem in flash.h) gets a message naming the head dim (and the rel_bias radius, whose d rel_bias sums the
// backward keeps in shared memory) rather than a CUDA error code.
void check_launch(cudaError_t err, const at::Tensor& q, const FwdParams* p = nullptr) {
  if (err == cudaErrorLaunchOutOfResources) {
    const auto* props = at::cuda::getDeviceProperties(q.get_device());
    const bool rel = p && p->rel_bias;
    TORCH_CHECK_VALUE(false, "hf_flash: head_dim ", q.size(-1),
                      rel ? " with a rel_bias of radius " + std::to_string(p->rel_bias_radius) : std::string(),
                      " needs more shared memory per block than this GPU (", props->name, ") has (",
                      props->sharedMemPerBlockOptin / 1024, " KB); use a smaller ",
                      rel ? "rel_bias radius (T5's is its max_distance, 128)" : "head dim",
                      " or a GPU with more (Hopper: 227 KB)");
  }
  C10_CUDA_CHECK(err);
}

c10::optional<at::Tensor> contiguous(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : t;
}

at::Tensor lse_like(const at::Tensor& q, bool varlen) {
  auto opts = q.options().dtype(at::kFloat);
  return varlen ? at::empty({q.size(1), q.size(0)}, opts) : at::empty({q.size(0), q.size(2), q.size(1)}, opts);
}

// Learned sinks as the kernels read them: float32, contiguous, one logit per query head; undefined without.
at::Tensor sinks_for_kernel(const c10::optional<at::Tensor>& sinks, const at::Tensor& q) {
  if (!sinks.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(sinks->device() == q.device() && sinks->dim() == 1 && sinks->size(0) == q.size(-2),
                    "hf_flash: sinks must be a (heads,) tensor on q's device");
  TORCH_CHECK_TYPE(sinks->is_floating_point(), "hf_flash: sinks must be a floating-point tensor");
  return sinks->to(at::kFloat).contiguous();
}

// A relative position bias table as the kernels read it: float32, contiguous (heads, 2R + 1) with kRelBiasPad
// copies of each row's end entries on either side (flash.h: the kernels read near-diagonal blocks unclamped);
// undefined without. Allocated here, written by the call's first kernel from the caller's rows (RelBias::fill:
// launch_rel_bias_fill, or the backward's prologue). Columns no (row, key) pair can reach are cut off: distances
// lie within the longest sequence, so a radius past it changes nothing but the backward's shared memory. Sets
// p.rel_bias (head 0, column 0), its source and rel_bias_radius (after fill_common); the returned tensors must
// outlive the launch.
struct RelBiasTables {
  at::Tensor source, padded;  // the caller's rows in fp32, the kernels' padded table
  bool defined() const { return padded.defined(); }
};
RelBiasTables rel_bias_for_kernel(FwdParams& p, const c10::optional<at::Tensor>& rel_bias, const at::Tensor& q,
                                  double softcap) {
  if (!rel_bias.has_value()) return {};
  TORCH_CHECK_VALUE(rel_bias->device() == q.device() && rel_bias->dim() == 2 && rel_bias->size(0) == q.size(-2) &&
                        rel_bias->size(1) % 2 == 1,
                    "hf_flash: rel_bias must be a (heads, 2 * radius + 1) tensor on q's device");
  TORCH_CHECK_TYPE(rel_bias->is_floating_point(), "hf_flash: rel_bias must be a floating-point tensor");
  TORCH_CHECK_VALUE(softcap <= 0, "hf_flash: rel_bias cannot be combined with softcap > 0");
  const int64_t radius = rel_bias->size(1) / 2, reach = std::min<int64_t>(radius, std::max(p.seqlen_q, p.seqlen_k));
  const at::Tensor source = rel_bias->to(at::kFloat);  // any strides (RelBias::fill reads them)
  const at::Tensor padded = at::empty({source.size(0), rel_bias_stride(int(reach))}, source.options());
  p.rel_bias = padded.data_ptr<float>() + kRelBiasPad;
  p.rel_bias_src = source.data_ptr<float>() + (radius - reach) * source.stride(1);
  p.rel_bias_src_head_stride = source.stride(0);
  p.rel_bias_src_col_stride = source.stride(1);
  p.rel_bias_radius = int(reach);
  return {source, padded};
}

void fill_common(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& o, const at::Tensor& lse, const c10::optional<at::Tensor>& cu_seqlens_q,
                 const c10::optional<at::Tensor>& cu_seqlens_k, const c10::optional<at::Tensor>& seqused_k,
                 int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                 int64_t window_left, int64_t window_right, double softcap,
                 const c10::optional<at::Tensor>& alibi_slopes, double dropout_p,
                 const c10::optional<at::Tensor>& rng_state) {
  const bool varlen = cu_seqlens_q.has_value();
  TORCH_CHECK_VALUE(varlen == cu_seqlens_k.has_value(),
                    "hf_flash: pass both cu_seqlens_q and cu_seqlens_k or neither");
  std::memset(&p, 0, sizeof(p));
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  const int r = varlen ? 0 : 1;  // dim index of rows
  p.q_batch_stride = varlen ? 0 : q.stride(0); p.q_row_stride = q.stride(r); p.q_head_stride = q.stride(r + 1);
  p.k_batch_stride = varlen ? 0 : k.stride(0); p.k_row_stride = k.stride(r); p.k_head_stride = k.stride(r + 1);
  p.v_batch_stride = varlen ? 0 : v.stride(0); p.v_row_stride = v.stride(r); p.v_head_stride = v.stride(r + 1);
  p.o_batch_stride = varlen ? 0 : o.stride(0); p.o_row_stride = o.stride(r); p.o_head_stride = o.stride(r + 1);
  p.h = q.size(-2); p.h_k = k.size(-2); p.d = q.size(-1);
  if (varlen) {
    for (const auto* t : {&*cu_seqlens_q, &*cu_seqlens_k}) {
      TORCH_CHECK_TYPE(t->device() == q.device() && t->scalar_type() == at::kInt && t->dim() == 1,
                       "hf_flash: cu_seqlens_q and cu_seqlens_k must be 1-D int32 tensors on q's device");
    }
    TORCH_CHECK_VALUE(cu_seqlens_q->numel() == cu_seqlens_k->numel() && cu_seqlens_q->numel() >= 2,
                      "hf_flash: cu_seqlens_q and cu_seqlens_k must both have batch+1 entries");
    p.b = cu_seqlens_q->numel() - 1;
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
    // A sequence has at most the tensor's rows: bounds the grids whatever max_seqlen says (values unchecked).
    p.seqlen_q = int(std::clamp<int64_t>(max_seqlen_q, 0, q.size(0)));
    p.seqlen_k = int(std::clamp<int64_t>(max_seqlen_k, 0, k.size(0)));
    p.total_q = q.size(0);
    p.total_k = k.size(0);
    p.lse_batch_stride = 0; p.lse_head_stride = lse.stride(0);
  } else {
    p.b = q.size(0); p.seqlen_q = q.size(1); p.seqlen_k = k.size(1);
    p.total_q = p.b * p.seqlen_q;
    p.total_k = p.b * p.seqlen_k;
    p.lse_batch_stride = lse.stride(0); p.lse_head_stride = lse.stride(1);
  }
  if (seqused_k.has_value()) {
    TORCH_CHECK(seqused_k->is_cuda() && seqused_k->scalar_type() == at::kInt && seqused_k->numel() == p.b,
                "hf_flash: seqused_k must be an int32 CUDA vector of batch entries");
    p.seqused_k = seqused_k->data_ptr<int>();
  }
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.softmax_scale_log2 = softcap > 0 ? float(M_LOG2E) : float(softmax_scale * M_LOG2E);
  p.window_left = causal && window_left < 0 ? -1 : window_left;
  p.window_right = causal ? 0 : window_right;
  if (alibi_slopes.has_value()) {
    const bool shape_ok = alibi_slopes->dim() == 1 ? alibi_slopes->size(0) == p.h
                                                    : alibi_slopes->dim() == 2 && alibi_slopes->size(0) == p.b &&
                                                          alibi_slopes->size(1) == p.h;
    TORCH_CHECK_VALUE(alibi_slopes->device() == q.device() && alibi_slopes->scalar_type() == at::kFloat && shape_ok,
                      "hf_flash: alibi_slopes must be float32 of shape (heads,) or (batch, heads) on q's device");
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  p.dropout_p = dropout_p;
  if (dropout_p > 0) {
    TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->device() == q.device() &&
                          rng_state->scalar_type() == at::kLong && rng_state->numel() == 2,
                      "hf_flash: dropout needs rng_state, an int64 (2,) tensor on q's device");
    p.rng_state = rng_state->data_ptr<int64_t>();
    p.rp_dropout = 1.0f / (1.0f - float(dropout_p));
    p.dropout_threshold = uint32_t(std::min(dropout_p * 65536.0, 65535.0));  // 16-bit draws (tile::dropout_bits)
  }
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  const auto* props = at::cuda::getCurrentDeviceProperties();
  p.num_sms = props->multiProcessorCount;
  p.arch = props->major * 10 + props->minor;
}

// hf_flash::fwd: attention forward on dense (b, s, h, d) or varlen (total, h, d) q/k/v (varlen when cu_seqlens_q
// and cu_seqlens_k are given). Returns out (like q) and the float32 natural-log LSE, (b, h, s_q) dense or
// (h, total_q) varlen, +inf on rows with no visible key. `deterministic` only steers the backward.
std::tuple<at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& cu_seqlens_q,
    const c10::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes, double dropout_p, const c10::optional<at::Tensor>& rng_state,
    bool deterministic, const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& rel_bias) {
  const bool varlen = cu_seqlens_q.has_value();
  check_qkv(q, k, v, varlen);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t hd = kernel_head_dim(q.size(-1));
  Output o(q, hd);
  auto lse = lse_like(q, varlen);
  if (q.numel() == 0) return {o.out, lse};
  const auto qk = for_kernel(q, hd), kk = for_kernel(k, hd), vk = for_kernel(v, hd);
  // Locals: a copy must stay alive until the launch.
  const auto cu_q = contiguous(cu_seqlens_q), cu_k = contiguous(cu_seqlens_k), alibi = contiguous(alibi_slopes);
  FwdParams p;
  fill_common(p, qk, kk, vk, o.kernel, lse, cu_q, cu_k, c10::nullopt, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, alibi, dropout_p, rng_state);
  const at::Tensor sink = sinks_for_kernel(sinks, q);
  p.sinks = sink.defined() ? sink.data_ptr<float>() : nullptr;
  const RelBiasTables rel = rel_bias_for_kernel(p, rel_bias, q, softcap);
  if (p.seqlen_q == 0 || p.seqlen_k == 0) {  // no row sees a key: O = 0, LSE = the sink (+inf without one)
    if (!sink.defined()) return {o.out.zero_(), lse.fill_(INFINITY)};
    return {o.out.zero_(), lse.copy_(varlen ? sink.view({-1, 1}).expand_as(lse) : sink.view({1, -1, 1}).expand_as(lse))};
  }
#ifdef HF_FLASH_DISABLE_FORWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_FORWARD=1");
#else
  check_launch(run_fwd(p, at::cuda::getCurrentCUDAStream()), q, &p);
#endif
  return {o.finish(), lse};
}

// hf_flash::fwd_kvcache: inference forward against a KV cache (b, s_cache, h_k, d), strided views welcome:
// row b attends to cache rows [cache_leftpad[b], cache_seqlens[b]), masks aligned to that range. Returns out
// (like q) and the LSE (b, h, s_q). Up to kDecodeMaxSeqlenQ query rows run the split-KV decode kernel (any head
// dim that is a multiple of 8 read in place, so a d80 cache is not copied each step; num_splits: 0 = heuristic),
// longer queries the forward kernel.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const c10::optional<at::Tensor>& cache_leftpad, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes, int64_t num_splits,
    const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& rel_bias) {
  check_qkv(q, k_cache, v_cache, false);
  TORCH_CHECK_VALUE(num_splits >= 0, "hf_flash: num_splits must be >= 0");
  TORCH_CHECK_TYPE(cache_seqlens.is_cuda() && cache_seqlens.scalar_type() == at::kInt &&
                       cache_seqlens.numel() == q.size(0),
                   "hf_flash: cache_seqlens must be an int32 CUDA vector of batch entries");
  c10::cuda::CUDAGuard guard(q.device());
  const bool decode = q.size(1) <= kDecodeMaxSeqlenQ && q.size(-1) <= kDecodeMaxHeadDim;
  const int64_t d = q.size(-1), hd = decode ? (d + 7) / 8 * 8 : kernel_head_dim(d);
  Output o(q, hd);
  auto lse = lse_like(q, false);
  if (q.numel() == 0) return {o.out, lse};
  const auto qk = for_kernel(q, hd), kk = for_kernel(k_cache, hd), vk = for_kernel(v_cache, hd);
  const c10::optional<at::Tensor> seqlens = cache_seqlens.contiguous(), alibi = contiguous(alibi_slopes);
  FwdParams p;
  fill_common(p, qk, kk, vk, o.kernel, lse, c10::nullopt, c10::nullopt, seqlens, q.size(1), k_cache.size(1),
              softmax_scale, causal, window_left, window_right, softcap, alibi, 0.0, c10::nullopt);
  const at::Tensor sink = sinks_for_kernel(sinks, q);  // every row gets it, also one with no cached key
  p.sinks = sink.defined() ? sink.data_ptr<float>() : nullptr;
  const RelBiasTables rel = rel_bias_for_kernel(p, rel_bias, q, softcap);
  at::Tensor leftpad;  // keeps a contiguous copy alive until the launch
  if (cache_leftpad.has_value()) {
    TORCH_CHECK_TYPE(cache_leftpad->is_cuda() && cache_leftpad->scalar_type() == at::kInt &&
                         cache_leftpad->numel() == p.b,
                     "hf_flash: cache_leftpad must be an int32 CUDA vector of batch entries");
    leftpad = cache_leftpad->contiguous();
    p.leftpad_k = leftpad.data_ptr<int>();
  }
#ifdef HF_FLASH_DISABLE_FORWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_FORWARD=1");
#else
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (!decode) {
    check_launch(run_fwd(p, stream), q, &p);
    return {o.finish(), lse};
  }
  p.num_splits = num_splits > 0 ? int(std::min<int64_t>(num_splits, kDecodeMaxSplits)) : decode_num_splits(p);
  at::Tensor o_accum, lse_accum;  // fp32 partials, freed (stream-ordered) once the combine has read them
  if (p.num_splits > 1) {
    auto opts = q.options().dtype(at::kFloat);
    lse_accum = at::empty({p.num_splits, p.b, p.h, p.seqlen_q}, opts);
    o_accum = at::empty({p.num_splits, p.b, p.h, p.seqlen_q, p.d}, opts);
    p.o_accum = o_accum.data_ptr<float>();
    p.lse_accum = lse_accum.data_ptr<float>();
  }
  check_launch(run_decode(p, stream), q, &p);
#endif
  return {o.finish(), lse};
}

// hf_flash::bwd: attention backward from fwd's saved out and LSE (same arguments as fwd, led by dout):
// (dq, dk, dv) like (q, k, v), GQA head groups summed into dk / dv, d sinks (float32 (h,); (0,) without) and
// d rel_bias (float32 like rel_bias; (0, 0) without).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const c10::optional<at::Tensor>& rng_state, bool deterministic, const c10::optional<at::Tensor>& sinks,
    const c10::optional<at::Tensor>& rel_bias) {
  const bool varlen = cu_seqlens_q.has_value();
  check_qkv(q, k, v, varlen);
  TORCH_CHECK_VALUE(!rel_bias.has_value() || !deterministic,
                    "hf_flash: deterministic=True does not cover rel_bias's gradient on the CUDA kernels yet (its sums "
                    "use atomics); pass deterministic=False");
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "hf_flash: dout and out must have q's shape");
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                   "hf_flash: dout and out must have q's dtype");
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "hf_flash: lse must be float32");
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t hd = kernel_head_dim(q.size(-1));
  Output dq(q, hd), dk(k, hd), dv(v, hd);
  const at::Tensor sink = sinks_for_kernel(sinks, q);
  // Written by the backward's prologue; zero when no key is visible (then O = 0, so rowsum(dO * O) = 0).
  at::Tensor dsinks = at::empty({sink.defined() ? q.size(-2) : 0}, q.options().dtype(at::kFloat));
  // Zeroed by the backward's prologue, then accumulated by the main kernel.
  at::Tensor drel = rel_bias.has_value() ? at::empty(rel_bias->sizes(), q.options().dtype(at::kFloat))
                                         : at::empty({0, 0}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || k.numel() == 0) {
    return {dq.out.zero_(), dk.out.zero_(), dv.out.zero_(), dsinks.zero_(), drel.zero_()};
  }
  const auto qk = for_kernel(q, hd), kk = for_kernel(k, hd), vk = for_kernel(v, hd);
  const auto outk = for_kernel(out, hd), doutk = for_kernel(dout, hd), lsek = lse.contiguous();
  // Locals: a copy must stay alive until the launch.
  const auto cu_q = contiguous(cu_seqlens_q), cu_k = contiguous(cu_seqlens_k), alibi = contiguous(alibi_slopes);
  BwdParams p;
  fill_common(p, qk, kk, vk, outk, lsek, cu_q, cu_k, c10::nullopt, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, alibi, dropout_p, rng_state);
  const int r = varlen ? 0 : 1;
  p.dout = doutk.data_ptr(); p.dq = dq.kernel.data_ptr(); p.dk = dk.kernel.data_ptr(); p.dv = dv.kernel.data_ptr();
  const auto strides = [&](const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
    batch = varlen ? 0 : t.stride(0); row = t.stride(r); head = t.stride(r + 1);
  };
  strides(doutk, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  strides(dq.kernel, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  strides(dk.kernel, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  strides(dv.kernel, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  p.deterministic = deterministic;
  p.rel_bias_in_gmem = p.rel_bias_direct = false;  // the launchers decide (bwd::rel_bias_smem)
  p.sinks = sink.defined() ? sink.data_ptr<float>() : nullptr;
  p.dsinks = sink.defined() ? dsinks.data_ptr<float>() : nullptr;
  const RelBiasTables rel = rel_bias_for_kernel(p, rel_bias, q, softcap);
  // The kernels' d rel_bias covers the columns they read (rel_bias_for_kernel); the rest of drel is zero.
  const int64_t rel_width = rel.defined() ? 2 * int64_t(p.rel_bias_radius) + 1 : 0;  // without the padding
  const at::Tensor drel_kernel =
      !rel.defined() || rel_width == drel.size(1) ? drel : at::empty({drel.size(0), rel_width}, drel.options());
  p.drel_bias = rel.defined() ? drel_kernel.data_ptr<float>() : nullptr;
  if (p.seqlen_q == 0 || p.seqlen_k == 0) {
    return {dq.out.zero_(), dk.out.zero_(), dv.out.zero_(), dsinks.zero_(), drel.zero_()};
  }
#ifdef HF_FLASH_DISABLE_BACKWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_BACKWARD=1");
#else
  auto workspace = at::empty({int64_t(bwd_workspace_bytes(p))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  check_launch(run_bwd(p, at::cuda::getCurrentCUDAStream()), q, &p);
  if (!drel_kernel.is_same(drel)) {
    drel.zero_().narrow(1, (drel.size(1) - drel_kernel.size(1)) / 2, drel_kernel.size(1)).copy_(drel_kernel);
  }
#endif
  return {dq.finish(), dk.finish(), dv.finish(), dsinks, drel};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fwd under autograd: runs the op below the autograd key, saves what bwd needs, and calls the hf_flash::bwd op
// in the backward (so torch.compile traces both as ops). The LSE is an output without a gradient.
class FwdFunction : public torch::autograd::Function<FwdFunction> {
 public:
  static constexpr size_t kInputs = 18;  // forward's arguments: backward returns one gradient (or none) each
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const c10::optional<at::Tensor>& cu_seqlens_q,
                               const c10::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
                               int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
                               double dropout_p, const c10::optional<at::Tensor>& rng_state, bool deterministic,
                               const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& rel_bias) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hf_flash::fwd", "").typed<decltype(fwd_cuda)>();
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, lse] = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic,
                              sinks, rel_bias);
    const auto or_undefined = [](const c10::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward({q, k, v, out, lse, or_undefined(cu_seqlens_q), or_undefined(cu_seqlens_k),
                            or_undefined(alibi_slopes), or_undefined(rng_state), or_undefined(sinks),
                            or_undefined(rel_bias)});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    // The LSE never has a gradient and out's may be absent: without this, autograd would allocate and fill a
    // zero LSE gradient every backward (a launch a layer in a host-bound training step).
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hf_flash::bwd", "").typed<decltype(bwd_cuda)>();
    if (!grads[0].defined()) return variable_list(kInputs);  // out unused: every gradient is zero
    const auto s = ctx->get_saved_variables();
    const auto optional = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
    const auto& d = ctx->saved_data;
    // needs_input_grad counts only the tensors passed: q, k, v, then the defined optionals in order
    const size_t sinks_edge = 3 + s[5].defined() + s[6].defined() + s[7].defined() + s[8].defined();
    const bool dsinks_needed = s[9].defined() && ctx->needs_input_grad(sinks_edge);
    const bool drel_needed = s[10].defined() && ctx->needs_input_grad(sinks_edge + s[9].defined());
    // The table always reaches the op (the kernels add it to the logits); d rel_bias is computed either way.
    auto [dq, dk, dv, dsinks, drel] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], optional(s[5]), optional(s[6]),
                                              d.at("max_seqlen_q").toInt(), d.at("max_seqlen_k").toInt(),
                                              d.at("softmax_scale").toDouble(), d.at("causal").toBool(),
                                              d.at("window_left").toInt(), d.at("window_right").toInt(),
                                              d.at("softcap").toDouble(), optional(s[7]), d.at("dropout_p").toDouble(),
                                              optional(s[8]), d.at("deterministic").toBool(),
                                              dsinks_needed ? optional(s[9]) : c10::nullopt, optional(s[10]));
    // The LSE includes the sinks, so dq, dk, dv need nothing more; d sinks comes from the op when asked for.
    variable_list result(kInputs);  // q, k, v, the sinks and rel_bias get gradients
    result[0] = dq; result[1] = dk; result[2] = dv;
    if (dsinks_needed) result[16] = dsinks.to(s[9].scalar_type());
    if (drel_needed) result[17] = drel.to(s[10].scalar_type());
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& cu_seqlens_q,
    const c10::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes, double dropout_p, const c10::optional<at::Tensor>& rng_state,
    bool deterministic, const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& rel_bias) {
  auto r = FwdFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic,
                              sinks, rel_bias);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY(hf_flash, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
        "int max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "Tensor? alibi_slopes, float dropout_p, Tensor? rng_state, bool deterministic, Tensor? sinks=None, "
        "Tensor? rel_bias=None) -> (Tensor out, Tensor lse)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
        "Tensor? rng_state, bool deterministic, Tensor? sinks=None, Tensor? rel_bias=None) -> (Tensor dq, "
        "Tensor dk, Tensor dv, Tensor dsinks, Tensor drel_bias)");
  m.def("fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? cache_leftpad, "
        "float softmax_scale, bool causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
        "int num_splits, Tensor? sinks=None, Tensor? rel_bias=None) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(hf_flash, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("fwd_kvcache", &fwd_kvcache_cuda);
}

TORCH_LIBRARY_IMPL(hf_flash, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
}

}  // namespace hf_flash

// Importing hf_flash._C loads the library above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}
