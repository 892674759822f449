// Per-row fp8 (e4m3) quantization for hidden-state storage: one thread block per row, two passes
// over the row (absmax, then scale and convert). scale = absmax / 448 (e4m3's largest finite
// value), q = saturate(x / scale). An all-zero row gets scale 1 (q = 0). The PyTorch reference
// (same contract) is quantize_ref in fp8_rows.py.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/extension.h>

namespace {

constexpr int kThreads = 256;
constexpr float kFp8Max = 448.f;

// c10's types convert in device code under torch's build flags (cuda_fp8.h's do not there).
template <typename T>
__device__ __forceinline__ float to_float(const T* p) { return static_cast<float>(*p); }

template <typename T>
__global__ void quantize_rows(const T* __restrict__ x, c10::Float8_e4m3fn* __restrict__ q,
                              float* __restrict__ scale, int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  c10::Float8_e4m3fn* qr = q + row * cols;
  float m = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(to_float(xr + c)));
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
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    qr[c] = c10::Float8_e4m3fn(fminf(fmaxf(to_float(xr + c) * inv, -kFp8Max), kFp8Max));
}

}  // namespace

std::vector<torch::Tensor> quantize(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x: contiguous (N, C) CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  auto q = torch::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = torch::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {q, scale};
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto* qp = q.data_ptr<c10::Float8_e4m3fn>();
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows<<<x.size(0), kThreads, 0, stream>>>(x.data_ptr<at::BFloat16>(), qp,
                                                      scale.data_ptr<float>(), x.size(1));
  } else if (x.scalar_type() == at::kHalf) {
    quantize_rows<<<x.size(0), kThreads, 0, stream>>>(x.data_ptr<at::Half>(), qp,
                                                      scale.data_ptr<float>(), x.size(1));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x: bf16, fp16 or fp32");
    quantize_rows<<<x.size(0), kThreads, 0, stream>>>(x.data_ptr<float>(), qp,
                                                      scale.data_ptr<float>(), x.size(1));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quantize", &quantize); }
