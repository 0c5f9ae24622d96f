// The tensor cores' sustained ceiling on this GPU: every SM runs warpgroups that issue nothing but bf16 wgmmas on
// random operands resident in shared memory (no loads, no softmax), for long enough that the clock settles where
// the power limit holds it. Attention's TFLOP/s counts only its GEMMs (forward 4·S²·D, backward 2.5× that), so no
// attention kernel can run above this rate on the same GPU; a speed target above it is out of reach.
//   nvcc -std=c++17 -O3 -arch=sm_90a -Icsrc tools/tensor_peak.cu -o build/tensor_peak && build/tensor_peak [ms]
// Prints CSV: shape, warpgroups a CTA, TFLOP/s (median / min / max of the timed launches).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "sm90/wgmma.cuh"

namespace sm90 = hf_flash::sm90;

constexpr int kSteps = 4;  // k16 steps a group: one 64-column panel of A and B

// One CTA an SM (the dynamic shared memory sees to it); each warpgroup accumulates m64 x kN over `iters` groups
// of kSteps wgmmas, two groups in flight, as the attention kernels keep their GEMMs. m64n256 (128 accumulators a
// thread) runs two warpgroups a CTA, the narrower shapes up to three.
template <int kN, bool kRs>
__global__ void __launch_bounds__(kN == 256 ? 256 : 384, 1) peak_kernel(long iters, float* sink) {
#ifdef HF_SM90_ENABLED
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023) & ~1023u;
  unsigned char* tile = smem + (base - static_cast<uint32_t>(__cvta_generic_to_shared(smem)));
  const int a_bytes = 64 * 128, b_bytes = kN * 128;
  // Random bf16 of magnitude [0.5, 1) and random sign: zeros would draw less power and flatter the clock.
  auto bits = [](uint32_t i) {
    i = i * 2654435761u + 0x9E3779B9u;
    i ^= i >> 15;
    i *= 0x2C1B3C6Du;
    return 0x3F00u | (i & 0x807Fu);
  };
  for (int i = threadIdx.x; i < (a_bytes + b_bytes) / 2; i += blockDim.x)
    reinterpret_cast<uint16_t*>(tile)[i] = static_cast<uint16_t>(bits(i + 7919u * blockIdx.x));
  sm90::fence_proxy_async();
  __syncthreads();

  const uint64_t a_desc = sm90::desc(base, 0), b_desc = sm90::desc(base + a_bytes, 0);
  uint32_t a_frag[kSteps][4];
  for (int s = 0; s < kSteps; ++s)
    for (int r = 0; r < 4; ++r) a_frag[s][r] = bits(threadIdx.x * 32 + s * 8 + r) | bits(threadIdx.x * 32 + s * 8 + r + 4) << 16;
  float acc[kN / 8][4];
  for (int j = 0; j < kN / 8; ++j)
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;
  for (long it = 0; it < iters; ++it) {
    sm90::fence_operand(acc);
    sm90::fence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if constexpr (kRs)
        sm90::mma_rs<kN, true, 0>(acc, a_frag[s], sm90::k_major_step<kN>(b_desc, s), true);
      else
        sm90::mma_ss<kN, true, 0, 0>(acc, sm90::k_major_step<64>(a_desc, s), sm90::k_major_step<kN>(b_desc, s), true);
    }
    sm90::commit();
    sm90::wait<1>();
  }
  sm90::wait<0>();
  sm90::fence_operand(acc);
  float total = 0.f;
  for (int j = 0; j < kN / 8; ++j)
    for (int r = 0; r < 4; ++r) total += acc[j][r];
  if (total == 1234.5f) sink[threadIdx.x] = total;  // keeps the work observable without storing it
#endif
}

template <int kN, bool kRs>
void run(const char* name, int warpgroups, int sms, float seconds, float* sink) {
  const int smem = 200 * 1024;  // one CTA an SM
  auto kernel = peak_kernel<kN, kRs>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (!sm90::has_sm90a_code(kernel)) {
    std::fprintf(stderr, "tensor_peak: no sm_90a code (build with -arch=sm_90a, run on a Hopper GPU)\n");
    std::exit(1);
  }
  const double flop_per_iter = 2.0 * 64 * kN * 16 * kSteps * warpgroups * sms;
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  // Size a launch to ~40 ms from a short probe, then warm up for `seconds` before timing 15 launches.
  long iters = 2000;
  float ms = 0.f;
  cudaEventRecord(t0);
  kernel<<<sms, 128 * warpgroups, smem>>>(iters, sink);
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  cudaEventElapsedTime(&ms, t0, t1);
  iters = std::max(1000L, long(iters * 40.0 / std::max(ms, 1e-3f)));
  for (float warm = 0.f; warm < seconds * 1000.f; warm += ms) {
    cudaEventRecord(t0);
    kernel<<<sms, 128 * warpgroups, smem>>>(iters, sink);
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    cudaEventElapsedTime(&ms, t0, t1);
  }
  std::vector<double> tflops;
  for (int i = 0; i < 15; ++i) {
    cudaEventRecord(t0);
    kernel<<<sms, 128 * warpgroups, smem>>>(iters, sink);
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    cudaEventElapsedTime(&ms, t0, t1);
    tflops.push_back(flop_per_iter * iters / (ms * 1e-3) / 1e12);
  }
  if (cudaGetLastError() != cudaSuccess) {
    std::fprintf(stderr, "tensor_peak: %s failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  std::sort(tflops.begin(), tflops.end());
  std::printf("%s,%d,%.1f,%.1f,%.1f\n", name, warpgroups, tflops[tflops.size() / 2], tflops.front(), tflops.back());
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  const float seconds = argc > 1 ? std::atof(argv[1]) / 1000.f : 3.f;  // warm-up per shape
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, 384 * sizeof(float));
  std::printf("# %s, %d SMs\nshape,warpgroups,tflops_median,tflops_min,tflops_max\n", prop.name, prop.multiProcessorCount);
  const int sms = prop.multiProcessorCount;
  run<128, false>("ss_m64n128k16", 2, sms, seconds, sink);  // attention's S = Q K^T at d128
  run<128, true>("rs_m64n128k16", 2, sms, seconds, sink);   // its O += P V (P from registers)
  run<128, false>("ss_m64n128k16", 3, sms, seconds, sink);
  run<256, true>("rs_m64n256k16", 2, sms, seconds, sink);  // the widest wgmma: least issue overhead
  return 0;
}
