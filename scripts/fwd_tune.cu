// Times forward tile configurations on the paper shape (bf16, B*S = 16k tokens,
// H*D = 2048), torch-free, to choose FwdTraitsFor in csrc/fwd/launch.cuh.
// Each config's output is compared with the first one of its head dim.
//   nvcc -std=c++17 -O3 --use_fast_math -Icsrc -gencode=arch=compute_90a,code=sm_90a scripts/fwd_tune.cu -o out/fwd_tune
#include <algorithm>
#include <cstdio>
#include <vector>

#include "fwd/launch.cuh"

using namespace hf_flash;

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__global__ void fill_random(__nv_bfloat16* x, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const tile::Philox4 r = tile::philox(salt, uint32_t(i), uint32_t(i >> 32), 0, 0);
    x[i] = __float2bfloat16((r.x >> 8) * (2.f / 16777216.f) - 1.f);
  }
}

__global__ void max_abs_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
  float m = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float d = fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i]));
    m = fmaxf(m, d != d ? INFINITY : d);
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));  // non-negative floats order like ints
}

struct Problem {
  int d, s;
  bool causal;
};

struct Config {
  const char* name;
  int d;
  cudaError_t (*launch)(const FwdParams&, cudaStream_t);
};

template <int D, int M, int N, int W>
Config config(const char* name) {
  return {name, D, &launch_fwd<FwdTraits<true, D, M, N, W>>};
}

int main() {
  const std::vector<Config> configs = {
      config<64, 128, 64, 4>("d64 128x64 4w"),   config<64, 128, 128, 4>("d64 128x128 4w"),
      config<64, 128, 128, 8>("d64 128x128 8w"), config<64, 64, 128, 4>("d64 64x128 4w"),
      config<64, 128, 64, 8>("d64 128x64 8w"),   config<128, 128, 64, 4>("d128 128x64 4w"),
      config<128, 128, 32, 4>("d128 128x32 4w"), config<128, 128, 64, 8>("d128 128x64 8w"),
      config<128, 64, 64, 4>("d128 64x64 4w"),   config<128, 128, 128, 8>("d128 128x128 8w"),
  };
  const std::vector<Problem> problems = {{64, 2048, false}, {64, 2048, true},  {64, 8192, false}, {64, 8192, true},
                                         {128, 2048, false}, {128, 2048, true}, {128, 8192, false}, {128, 8192, true}};
  const size_t tokens = 16384, hd = 2048, n = tokens * hd;
  __nv_bfloat16 *q, *k, *v, *o, *o_first;
  float *lse, *diff;
  CHECK(cudaMalloc(&q, n * 2));
  CHECK(cudaMalloc(&k, n * 2));
  CHECK(cudaMalloc(&v, n * 2));
  CHECK(cudaMalloc(&o, n * 2));
  CHECK(cudaMalloc(&o_first, n * 2));
  CHECK(cudaMalloc(&lse, tokens * 64 * 4));
  CHECK(cudaMalloc(&diff, 4));
  fill_random<<<1024, 256>>>(q, n, 1);
  fill_random<<<1024, 256>>>(k, n, 2);
  fill_random<<<1024, 256>>>(v, n, 3);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  std::printf("%-18s %6s %6s %8s %10s %9s %10s\n", "config", "S", "causal", "ms", "TFLOP/s", "vs first", "max|diff|");
  for (const Problem& pr : problems) {
    const int h = hd / pr.d, b = tokens / pr.s;
    FwdParams p{};
    p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = hd;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = pr.d;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(pr.s) * hd;
    p.lse_batch_stride = int64_t(h) * pr.s; p.lse_head_stride = pr.s;
    p.b = b; p.h = p.h_k = h; p.d = pr.d; p.seqlen_q = p.seqlen_k = pr.s; p.total_q = tokens;
    p.softmax_scale = 1.f / sqrtf(float(pr.d)); p.softmax_scale_log2 = p.softmax_scale * fwd::kLog2e;
    p.window_left = -1; p.window_right = pr.causal ? 0 : -1; p.is_causal = pr.causal;
    p.is_bf16 = true; p.num_sms = prop.multiProcessorCount;
    const double flops = 4.0 * b * double(pr.s) * pr.s * h * pr.d / (pr.causal ? 2 : 1);
    double first_ms = 0;
    bool first = true;
    for (const Config& c : configs) {
      if (c.d != pr.d) continue;
      for (int i = 0; i < 3; ++i) CHECK(c.launch(p, 0));
      std::vector<float> times;
      for (int i = 0; i < 30; ++i) {
        CHECK(cudaEventRecord(start));
        CHECK(c.launch(p, 0));
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      const double ms = times[times.size() / 2];
      float d = 0.f;
      if (first) {
        CHECK(cudaMemcpy(o_first, o, n * 2, cudaMemcpyDeviceToDevice));
        first_ms = ms;
      } else {
        CHECK(cudaMemset(diff, 0, 4));
        max_abs_diff<<<1024, 256>>>(o, o_first, n, diff);
        CHECK(cudaMemcpy(&d, diff, 4, cudaMemcpyDeviceToHost));
      }
      std::printf("%-18s %6d %6d %8.3f %10.1f %9.3f %10.2e\n", c.name, pr.s, int(pr.causal), ms, flops / ms * 1e-9,
                  first_ms / ms, d);
      first = false;
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
