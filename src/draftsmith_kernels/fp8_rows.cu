// Per-row fp8 (e4m3) quantization for hidden-state storage: one thread block per row, two passes
// over the row (absmax, then scale and convert). scale = absmax / 448 (e4m3's largest finite
// value), q = saturate(x / scale). An all-zero row gets scale 1 (q = 0). The PyTorch reference
// (same contract) is quantize_ref in fp8_rows.py, which also checks the argument and allocates
// the outputs: CUDA's headers only, one C function called through ctypes (_build.py).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr float kFp8Max = 448.f;

template <typename T>
__global__ void quantize_rows(const T* __restrict__ x, __nv_fp8_e4m3* __restrict__ q,
                              float* __restrict__ scale, int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  __nv_fp8_e4m3* qr = q + row * cols;
  float m = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    m = fmaxf(m, fabsf(static_cast<float>(xr[c])));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (threadIdx.x == 0) warp_max[0] = m;
  }
  __syncthreads();
  const float s = warp_max[0] > 0.f ? warp_max[0] / kFp8Max : 1.f;
  if (threadIdx.x == 0) scale[row] = s;
  const float inv = 1.f / s;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)  // round to nearest even, as torch
    qr[c] = __nv_fp8_e4m3(fminf(fmaxf(static_cast<float>(xr[c]) * inv, -kFp8Max), kFp8Max));
}

template <typename T>
cudaError_t launch(const void* x, void* q, float* scale, int64_t rows, int64_t cols,
                   cudaStream_t stream) {
  quantize_rows<<<rows, kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                static_cast<__nv_fp8_e4m3*>(q), scale, cols);
  return cudaGetLastError();
}

}  // namespace

// x: contiguous (rows, cols) of dtype 0 fp32, 1 fp16, 2 bf16 (fp8_rows.py's _DTYPES), checked
// by the caller; q: (rows, cols) bytes; scale: (rows,) fp32. Returns a cudaError_t.
extern "C" int draftsmith_fp8_rows(const void* x, int dtype, void* q, float* scale, int64_t rows,
                                   int64_t cols, void* stream) {
  if (rows == 0) return cudaSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch<float>(x, q, scale, rows, cols, s);
    case 1: return launch<__half>(x, q, scale, rows, cols, s);
    case 2: return launch<__nv_bfloat16>(x, q, scale, rows, cols, s);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" const char* draftsmith_fp8_rows_error(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
