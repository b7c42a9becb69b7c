// Source of the PTX in csrc/cuda/batched_copy_ptx.h (regenerate: scripts/gen-batched-copy-ptx).
// Not compiled by setup.py: the extension loads the PTX through the driver at run time.
//
// Each block copies one item of a table {src, dst, count, unused} (int64 each):
// count bytes for torch_ipc_batched_copy, count fp32 -> bf16 elements for
// torch_ipc_batched_f32_to_bf16. The host splits tensors into items of at most a
// few hundred KiB, so one launch covers a whole model with even work per block.
#include <cuda_bf16.h>
#include <stdint.h>

struct Item {
  const char* src;
  char* dst;
  long long count;
  long long unused;
};

extern "C" __global__ void __launch_bounds__(512) torch_ipc_batched_copy(const Item* __restrict__ items) {
  const Item it = items[blockIdx.x];
  const char* __restrict__ src = it.src;
  char* __restrict__ dst = it.dst;
  const long long n = it.count;
  const long long step = blockDim.x;
  long long done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ d = reinterpret_cast<uint4*>(dst);
    const long long nv = n >> 4;
    long long i = threadIdx.x;
    for (; i + 3 * step < nv; i += 4 * step) {  // four 16-byte loads in flight per thread
      uint4 a = __ldg(s + i), b = __ldg(s + i + step), c = __ldg(s + i + 2 * step), e = __ldg(s + i + 3 * step);
      d[i] = a;
      d[i + step] = b;
      d[i + 2 * step] = c;
      d[i + 3 * step] = e;
    }
    for (; i < nv; i += step) d[i] = __ldg(s + i);
    done = nv << 4;
  }
  for (long long i = done + threadIdx.x; i < n; i += step) dst[i] = src[i];
}

// Rounding: __float2bfloat16_rn is cvt.rn.bf16.f32, the instruction torch's own
// CUDA conversion (c10::BFloat16(float) on sm_80+) compiles to, so results are
// bitwise equal to tensor.to(torch.bfloat16), NaN and subnormals included.
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(lo)) | (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}

__device__ __forceinline__ uint2 bf16_quad(float4 a) { return make_uint2(bf16_pair(a.x, a.y), bf16_pair(a.z, a.w)); }

extern "C" __global__ void __launch_bounds__(512) torch_ipc_batched_f32_to_bf16(const Item* __restrict__ items) {
  const Item it = items[blockIdx.x];
  const float* __restrict__ src = reinterpret_cast<const float*>(it.src);
  __nv_bfloat16* __restrict__ dst = reinterpret_cast<__nv_bfloat16*>(it.dst);
  const long long n = it.count;
  const long long step = blockDim.x;
  long long done = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    const float4* __restrict__ s = reinterpret_cast<const float4*>(src);
    uint2* __restrict__ d = reinterpret_cast<uint2*>(dst);
    const long long nv = n >> 2;
    long long i = threadIdx.x;
    for (; i + step < nv; i += 2 * step) {  // two 16-byte loads in flight per thread
      float4 a = __ldg(s + i), b = __ldg(s + i + step);
      d[i] = bf16_quad(a);
      d[i + step] = bf16_quad(b);
    }
    for (; i < nv; i += step) d[i] = bf16_quad(__ldg(s + i));
    done = nv << 2;
  }
  for (long long i = done + threadIdx.x; i < n; i += step) dst[i] = __float2bfloat16_rn(src[i]);
}
