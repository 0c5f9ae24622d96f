// The only file that sees torch: validates tensors, fills hf_flash::FwdParams /
// BwdParams and registers the CUDA implementations as torch.library ops
// (hf_flash::_cuda_fwd, _cuda_fwd_kvcache, _cuda_bwd). hf_flash/ops.py wraps them in the
// public ops with fake implementations and autograd.
#include <Python.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>

#include "flash.h"

namespace hf_flash {
namespace {

constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};

// The kernels load rows with 16-byte cp.async: last dim contiguous, aligned base and strides.
void check_rows(const at::Tensor& t) {
  TORCH_CHECK(t.stride(-1) == 1, "hf_flash: the last dimension of q, k, v, out, dout must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "hf_flash: tensors must be 16-byte aligned");
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    TORCH_CHECK(t.stride(i) % 8 == 0, "hf_flash: strides must be multiples of 8 elements");
  }
}

// exact_head_dim: the forward and backward kernels take exactly an instantiated head dim; the decode kernel any
// multiple of 8 up to 256 (it runs the next instantiated one, zero-filling and skipping the columns past d).
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool varlen, bool exact_head_dim) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "hf_flash: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "hf_flash: the CUDA kernels take float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "hf_flash: q, k, v must share a dtype");
  const int64_t dims = varlen ? 3 : 4;
  TORCH_CHECK(q.dim() == dims && k.dim() == dims && v.dim() == dims, "hf_flash: q, k, v must be ", dims, "-D");
  for (const auto* t : {&q, &k, &v}) check_rows(*t);
  const int64_t d = q.size(-1);
  if (exact_head_dim) {
    bool known = false;
    for (int hd : kHeadDims) known |= (d == hd);
    TORCH_CHECK(known, "hf_flash: kernel head dim must be one of 32/64/96/128/192/256, got ", d);
  } else {
    TORCH_CHECK(d % 8 == 0 && d >= 8 && d <= 256, "hf_flash: decode head dim must be a multiple of 8 up to 256, got ",
                d);
  }
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, "hf_flash: q, k, v head dims differ");
  TORCH_CHECK(q.size(-2) % k.size(-2) == 0, "hf_flash: query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.sizes() == v.sizes(), "hf_flash: k and v shapes differ");
}

void fill_common(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& o, const at::Tensor& lse, const c10::optional<at::Tensor>& cu_seqlens_q,
                 const c10::optional<at::Tensor>& cu_seqlens_k, const c10::optional<at::Tensor>& seqused_k,
                 int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                 int64_t window_left, int64_t window_right, double softcap,
                 const c10::optional<at::Tensor>& alibi_slopes, double dropout_p,
                 const c10::optional<at::Tensor>& rng_state) {
  const bool varlen = cu_seqlens_q.has_value();
  TORCH_CHECK(varlen == cu_seqlens_k.has_value(), "hf_flash: pass both cu_seqlens_q and cu_seqlens_k or neither");
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
      TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
                  "hf_flash: cu_seqlens must be contiguous int32 CUDA vectors");
    }
    TORCH_CHECK(cu_seqlens_q->numel() == cu_seqlens_k->numel() && cu_seqlens_q->numel() >= 2,
                "hf_flash: cu_seqlens_q and cu_seqlens_k must both have batch+1 entries");
    p.b = cu_seqlens_q->numel() - 1;
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
    p.seqlen_q = max_seqlen_q; p.seqlen_k = max_seqlen_k;
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
  p.is_causal = causal;
  p.window_left = causal && window_left < 0 ? -1 : window_left;
  p.window_right = causal ? 0 : window_right;
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->is_cuda() && alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->stride(-1) == 1,
                "hf_flash: alibi_slopes must be float32 CUDA, shape (h,) or (b, h)");
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  p.p_dropout = dropout_p;
  if (dropout_p > 0) {
    TORCH_CHECK(rng_state.has_value() && rng_state->is_cuda() && rng_state->scalar_type() == at::kLong &&
                    rng_state->numel() == 2, "hf_flash: dropout needs rng_state, an int64 CUDA (2,) tensor");
    p.rng_state = rng_state->data_ptr<int64_t>();
    p.rp_dropout = 1.0f / (1.0f - float(dropout_p));
    p.dropout_threshold = uint32_t(std::min(dropout_p * 4294967296.0, 4294967295.0));
  }
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  const auto* props = at::cuda::getCurrentDeviceProperties();
  p.num_sms = props->multiProcessorCount;
  p.arch = props->major * 10 + props->minor;
}

void check_arch() {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major >= 8, "hf_flash: the CUDA kernels need compute capability 8.0 or newer, got ",
              props->major, ".", props->minor);
}

std::tuple<at::Tensor, at::Tensor> cuda_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& cu_seqlens_q,
    const c10::optional<at::Tensor>& cu_seqlens_k, const c10::optional<at::Tensor>& seqused_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const c10::optional<at::Tensor>& rng_state) {
  const bool varlen = cu_seqlens_q.has_value();
  check_qkv(q, k, v, varlen, true);
  check_arch();
  c10::cuda::CUDAGuard guard(q.device());
  auto o = at::empty_like(q);
  auto opts = q.options().dtype(at::kFloat);
  auto lse = varlen ? at::empty({q.size(1), q.size(0)}, opts) : at::empty({q.size(0), q.size(2), q.size(1)}, opts);
  if (q.numel() == 0) return {o, lse};
  FwdParams p;
  fill_common(p, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state);
#ifdef HF_FLASH_DISABLE_FORWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_FORWARD=1");
#else
  C10_CUDA_CHECK(run_fwd(p, at::cuda::getCurrentCUDAStream()));
#endif
  return {o, lse};
}

// Inference against a KV cache (b, s_cache, h_k, d), any row/head/batch strides: the split-KV decode
// kernel for seqlen_q <= kDecodeMaxSeqlenQ, the forward kernel above that. num_splits: 0 = heuristic.
std::tuple<at::Tensor, at::Tensor> cuda_fwd_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const c10::optional<at::Tensor>& cache_leftpad, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  check_qkv(q, k_cache, v_cache, false, q.size(1) > kDecodeMaxSeqlenQ);
  check_arch();
  TORCH_CHECK(k_cache.size(0) == q.size(0), "hf_flash: k_cache and q batch sizes differ");
  TORCH_CHECK(cache_seqlens.is_contiguous(), "hf_flash: cache_seqlens must be contiguous");
  TORCH_CHECK(num_splits >= 0, "hf_flash: num_splits must be >= 0");
  c10::cuda::CUDAGuard guard(q.device());
  auto o = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {o, lse};
  FwdParams p;
  fill_common(p, q, k_cache, v_cache, o, lse, c10::nullopt, c10::nullopt, cache_seqlens, q.size(1), k_cache.size(1),
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, 0.0, c10::nullopt);
  if (cache_leftpad.has_value()) {
    TORCH_CHECK(cache_leftpad->is_cuda() && cache_leftpad->scalar_type() == at::kInt &&
                    cache_leftpad->numel() == p.b && cache_leftpad->is_contiguous(),
                "hf_flash: cache_leftpad must be a contiguous int32 CUDA vector of batch entries");
    p.leftpad_k = cache_leftpad->data_ptr<int>();
  }
#ifdef HF_FLASH_DISABLE_FORWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_FORWARD=1");
#else
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (p.seqlen_q > kDecodeMaxSeqlenQ) {
    C10_CUDA_CHECK(run_fwd(p, stream));
    return {o, lse};
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
  C10_CUDA_CHECK(run_decode(p, stream));
#endif
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const c10::optional<at::Tensor>& rng_state, bool deterministic) {
  const bool varlen = cu_seqlens_q.has_value();
  check_qkv(q, k, v, varlen, true);
  check_arch();
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "hf_flash: dout and out must have q's shape");
  check_rows(dout);
  check_rows(out);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "hf_flash: lse must be contiguous float32");
  c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  BwdParams p;
  fill_common(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, c10::nullopt, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state);
  const int r = varlen ? 0 : 1;
  p.dout = dout.data_ptr(); p.dq = dq.data_ptr(); p.dk = dk.data_ptr(); p.dv = dv.data_ptr();
  p.do_batch_stride = varlen ? 0 : dout.stride(0); p.do_row_stride = dout.stride(r); p.do_head_stride = dout.stride(r + 1);
  p.dq_batch_stride = varlen ? 0 : dq.stride(0); p.dq_row_stride = dq.stride(r); p.dq_head_stride = dq.stride(r + 1);
  p.dk_batch_stride = varlen ? 0 : dk.stride(0); p.dk_row_stride = dk.stride(r); p.dk_head_stride = dk.stride(r + 1);
  p.dv_batch_stride = varlen ? 0 : dv.stride(0); p.dv_row_stride = dv.stride(r); p.dv_head_stride = dv.stride(r + 1);
  p.deterministic = deterministic;
#ifdef HF_FLASH_DISABLE_BACKWARD
  TORCH_CHECK(false, "hf_flash: built with HF_FLASH_DISABLE_BACKWARD=1");
#else
  auto workspace = at::empty({int64_t(bwd_workspace_bytes(p))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  C10_CUDA_CHECK(run_bwd(p, at::cuda::getCurrentCUDAStream()));
#endif
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_flash, m) {
  m.def("_cuda_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_k, "
        "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, "
        "float softcap, Tensor? alibi_slopes, float dropout_p, Tensor? rng_state) -> (Tensor, Tensor)");
  m.def("_cuda_fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? cache_leftpad, "
        "float softmax_scale, bool causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
        "int num_splits) -> (Tensor, Tensor)");
  m.def("_cuda_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
        "Tensor? rng_state, bool deterministic) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_flash, CUDA, m) {
  m.impl("_cuda_fwd", &cuda_fwd);
  m.impl("_cuda_fwd_kvcache", &cuda_fwd_kvcache);
  m.impl("_cuda_bwd", &cuda_bwd);
}

}  // namespace hf_flash

// Importing hf_flash._C loads the library above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}
