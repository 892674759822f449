// Fused soft cross-entropy of draft logits against the target's distribution over the same vocab,
// with its gradient: one thread block per row, two passes over the row, nothing (N, V) in fp32.
//   pass 1: online max / sum-exp of both rows, the p-weighted sums, both argmaxes; block reduce
//   pass 2: grad = row_scale * (softmax(logits) - softmax(target)), in the logits dtype
// The PyTorch reference (same contract) is soft_ce_ref in soft_ce.py, which also checks the
// arguments and allocates the outputs: this file includes no torch header (nvcc alone builds it
// in seconds, where torch/extension.h made it a minute) and exports one C function, called
// through ctypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kMaxThreads = 512;
constexpr int kWarp = 32;

// Running state of pass 1 over some of a row's columns, with e = exp(t - mt):
//   st = sum e,  wl = sum e * (l - ml),  wt = sum e * (t - mt)
// so that ce = log(sl) - wl / st and target_neg_entropy = wt / st - log(st). Keeping the sums
// relative to the maxima avoids cancelling two numbers of the logits' magnitude at the end.
// Maxima start at -FLT_MAX rather than -inf so that rescaling an empty state (all sums 0) gives
// 0 * finite, never (-inf) - (-inf).
struct State {
  float ml, sl;  // logits: max, sum exp(l - ml)
  int il;        // argmax of logits
  float mt, st, wl, wt;
  int it;        // argmax of target
};

__device__ __forceinline__ State empty_state() {
  return {-FLT_MAX, 0.f, INT_MAX, -FLT_MAX, 0.f, 0.f, 0.f, INT_MAX};
}

// Columns arrive in increasing order per thread, so a strict > keeps the first index on ties.
__device__ __forceinline__ void add(State& s, float l, float t, int i) {
  if (l > s.ml) {
    s.sl = s.sl * __expf(s.ml - l) + 1.f;
    s.wl += s.st * (s.ml - l);  // re-anchor at the new max before this column's term
    s.ml = l;
    s.il = i;
  } else {
    s.sl += __expf(l - s.ml);
  }
  if (t > s.mt) {
    const float c = __expf(s.mt - t);
    s.wt = (s.wt + s.st * (s.mt - t)) * c;
    s.wl = s.wl * c + (l - s.ml);
    s.st = s.st * c + 1.f;
    s.mt = t;
    s.it = i;
  } else {
    const float e = __expf(t - s.mt);
    s.st += e;
    s.wl += e * (l - s.ml);
    s.wt += e * (t - s.mt);
  }
}

__device__ __forceinline__ int first_argmax(float ma, int ia, float mb, int ib) {
  return ma > mb ? ia : mb > ma ? ib : min(ia, ib);
}

__device__ __forceinline__ State merge(const State& a, const State& b) {
  State r;
  r.ml = fmaxf(a.ml, b.ml);
  r.sl = a.sl * __expf(a.ml - r.ml) + b.sl * __expf(b.ml - r.ml);
  r.il = first_argmax(a.ml, a.il, b.ml, b.il);
  r.mt = fmaxf(a.mt, b.mt);
  const float ca = __expf(a.mt - r.mt), cb = __expf(b.mt - r.mt);
  r.st = a.st * ca + b.st * cb;
  r.wl = (a.wl + a.st * (a.ml - r.ml)) * ca + (b.wl + b.st * (b.ml - r.ml)) * cb;
  r.wt = (a.wt + a.st * (a.mt - r.mt)) * ca + (b.wt + b.st * (b.mt - r.mt)) * cb;
  r.it = first_argmax(a.mt, a.it, b.mt, b.it);
  return r;
}

__device__ __forceinline__ State shfl_xor(const State& s, int mask) {
  constexpr unsigned kAll = 0xffffffffu;
  return {__shfl_xor_sync(kAll, s.ml, mask), __shfl_xor_sync(kAll, s.sl, mask),
          __shfl_xor_sync(kAll, s.il, mask), __shfl_xor_sync(kAll, s.mt, mask),
          __shfl_xor_sync(kAll, s.st, mask), __shfl_xor_sync(kAll, s.wl, mask),
          __shfl_xor_sync(kAll, s.wt, mask), __shfl_xor_sync(kAll, s.it, mask)};
}

__device__ __forceinline__ State warp_reduce(State s) {
#pragma unroll
  for (int mask = kWarp / 2; mask > 0; mask /= 2) s = merge(s, shfl_xor(s, mask));
  return s;
}

// Every thread gets the whole block's state. blockDim.x is a multiple of 32.
__device__ State block_reduce(State s) {
  __shared__ State warps[kMaxThreads / kWarp];
  __shared__ State total;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  s = warp_reduce(s);
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = warp_reduce(lane < static_cast<int>(blockDim.x) / kWarp ? warps[lane] : empty_state());
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// VEC consecutive elements moved as whole 16-byte words (8-byte ones for a bf16 target beside
// fp32 logits); VEC == 1 is the scalar path for rows that are not 16-byte aligned.
template <typename T, int VEC>
struct Pack {
  using Word = std::conditional_t<VEC * sizeof(T) % 16 == 0, uint4, uint2>;
  static constexpr int kWords = VEC * sizeof(T) / sizeof(Word);
  union {
    Word words[kWords];
    T v[VEC];
  };
};

template <int VEC, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[VEC]) {
  if constexpr (VEC == 1) {
    out[0] = static_cast<float>(*p);
  } else {
    using P = Pack<T, VEC>;
    P pack;
#pragma unroll
    for (int w = 0; w < P::kWords; ++w)
      pack.words[w] = reinterpret_cast<const typename P::Word*>(p)[w];
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = static_cast<float>(pack.v[k]);
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[VEC]) {
  if constexpr (VEC == 1) {
    *p = static_cast<T>(in[0]);
  } else {
    using P = Pack<T, VEC>;
    P pack;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.v[k] = static_cast<T>(in[k]);
#pragma unroll
    for (int w = 0; w < P::kWords; ++w) reinterpret_cast<typename P::Word*>(p)[w] = pack.words[w];
  }
}

// logits and grad may be the same memory (inplace): each element is read by the thread that
// later overwrites it, and no block touches another's row, so they are not __restrict__.
template <typename L, typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
soft_ce_kernel(const L* logits, const T* __restrict__ target, const float* __restrict__ row_scale,
               L* grad, float* __restrict__ ce, float* __restrict__ neg_entropy,
               int64_t* __restrict__ pred, int64_t* __restrict__ target_pred, int V) {
  const int64_t row = blockIdx.x;
  const L* lrow = logits + row * V;
  const T* trow = target + row * V;
  const int stride = blockDim.x * VEC;

  State s = empty_state();
  for (int i = threadIdx.x * VEC; i < V; i += stride) {
    float l[VEC], t[VEC];
    load<VEC>(lrow + i, l);
    load<VEC>(trow + i, t);
#pragma unroll
    for (int k = 0; k < VEC; ++k) add(s, l[k], t[k], i + k);
  }
  s = block_reduce(s);

  const float log_sl = logf(s.sl), log_st = logf(s.st);
  if (threadIdx.x == 0) {
    ce[row] = log_sl - s.wl / s.st;
    neg_entropy[row] = s.wt / s.st - log_st;
    pred[row] = s.il;
    target_pred[row] = s.it;
  }

  const float scale = row_scale[row];
  L* grow = grad + row * V;
  for (int i = threadIdx.x * VEC; i < V; i += stride) {
    float l[VEC], t[VEC], g[VEC];
    load<VEC>(lrow + i, l);
    load<VEC>(trow + i, t);
#pragma unroll
    for (int k = 0; k < VEC; ++k)  // (x - max) - log(sum), not x - lse: exact at large logits
      g[k] = scale * (__expf(l[k] - s.ml - log_sl) - __expf(t[k] - s.mt - log_st));
    store<VEC>(grow + i, g);
  }
}

// Element types as soft_ce.py numbers them (DTYPES there).
enum Dtype : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct Args {
  const void* logits;
  const void* target;
  const float* row_scale;
  void* grad;
  float* ce;
  float* neg_entropy;
  int64_t* pred;
  int64_t* target_pred;
  int n, V;
  cudaStream_t stream;
};

template <typename L, typename T>
cudaError_t launch(const Args& a) {
  constexpr int kVec = 16 / sizeof(L);
  // Every row starts 16-byte aligned when the bases are and V is a multiple of the vector.
  const bool vec = a.V % kVec == 0 && aligned16(a.logits) && aligned16(a.grad) &&
                   aligned16(a.target);
  const int per_thread = vec ? kVec : 1;
  const int warps = (a.V + per_thread * kWarp - 1) / (per_thread * kWarp);
  const int threads = std::min(kMaxThreads, warps * kWarp);
  const auto kernel = vec ? soft_ce_kernel<L, T, kVec> : soft_ce_kernel<L, T, 1>;
  kernel<<<a.n, threads, 0, a.stream>>>(
      static_cast<const L*>(a.logits), static_cast<const T*>(a.target), a.row_scale,
      static_cast<L*>(a.grad), a.ce, a.neg_entropy, a.pred, a.target_pred, a.V);
  return cudaGetLastError();
}

template <typename L>
cudaError_t dispatch_target(const Args& a, int target_dtype) {
  return target_dtype == kF32 ? launch<L, float>(a) : launch<L, __nv_bfloat16>(a);
}

}  // namespace

// The whole contract (shapes, dtypes, contiguity, one device, N < 2^31, V <= 2^30) is checked
// by the caller, soft_ce.py; grad may be logits itself (inplace). Returns a cudaError_t.
extern "C" int draftsmith_soft_ce(const void* logits, int logits_dtype, const void* target,
                                  int target_dtype, const float* row_scale, void* grad, float* ce,
                                  float* neg_entropy, int64_t* pred, int64_t* target_pred,
                                  int64_t n, int64_t V, void* stream) {
  if (n == 0) return cudaSuccess;
  const Args a{logits, target, row_scale, grad, ce, neg_entropy, pred, target_pred,
               static_cast<int>(n), static_cast<int>(V), static_cast<cudaStream_t>(stream)};
  switch (logits_dtype) {
    case kF32: return dispatch_target<float>(a, target_dtype);
    case kF16: return dispatch_target<__half>(a, target_dtype);
    case kBF16: return dispatch_target<__nv_bfloat16>(a, target_dtype);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" const char* draftsmith_soft_ce_error(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
