#include "cuda/batched_copy.h"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>

#include "cuda/batched_copy_ptx.h"
#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"
#include "base/errors.h"

namespace torch_ipc {
namespace {

// Note [batched copy kernels]
// torch._foreach_copy_ launches per tensor group and reaches ~70% of a
// contiguous copy's bandwidth on a 384-tensor model; a copy per tensor less;
// torch.index_select over a KV pool's blocks ~78%. One launch over a table of
// fixed-size items (csrc/cuda/kernels/batched_copy.cu) keeps every SM busy
// with 16-byte loads whatever the sizes. The PTX is generated once
// (scripts/gen-batched-copy-ptx) and JIT-compiled by the driver on first use
// per device, so the build needs no nvcc and the extension still links no CUDA
// library; a driver or GPU that cannot load it makes the caller fall back to
// torch's own ops (weights: torch._foreach_copy_; kv: index_select). It lives
// in this layer because both features use it (torch_ipc/_batched_copy.py).
constexpr unsigned kThreads = 512;

struct Module {
  CUmodule module = nullptr;
  CUfunction functions[2] = {nullptr, nullptr};
  std::string error;  // non-empty: loading failed, do not retry
};

struct Modules {
  std::mutex mu;
  std::map<int, Module> by_device;
};

Modules& modules() {
  static Modules* m = new Modules();  // outlives static destructors, as the driver's modules do
  return *m;
}

Module load_module(int device) {
  Module m;
  ScopedContext scope(device);
  const DriverApi& d = driver();
  CUresult r = d.cuModuleLoadData(&m.module, kBatchedCopyPtx);
  if (r != CUDA_SUCCESS) {
    m.error = driver_error_message("cuModuleLoadData", r);
    return m;
  }
  const char* names[2] = {"torch_ipc_batched_copy", "torch_ipc_batched_f32_to_bf16"};
  for (int i = 0; i < 2; ++i) {
    r = d.cuModuleGetFunction(&m.functions[i], m.module, names[i]);
    if (r != CUDA_SUCCESS) {
      m.error = driver_error_message("cuModuleGetFunction", r);
      return m;
    }
  }
  return m;
}

const Module& module_for(int device) {
  Modules& all = modules();
  std::lock_guard<std::mutex> lock(all.mu);
  auto it = all.by_device.find(device);
  if (it == all.by_device.end()) it = all.by_device.emplace(device, load_module(device)).first;
  return it->second;
}

}  // namespace

bool batched_copy_available(int device, std::string* why_not) {
  std::string why;
  try {
    const Module& m = module_for(device);
    why = m.error;
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why_not) *why_not = why;
  return why.empty();
}

void launch_batched(const at::Tensor& items, BatchedKernel kernel) {
  TORCH_IPC_CHECK_VALUE(items.defined() && items.is_cuda() && items.scalar_type() == at::kLong &&
                        items.dim() == 2 && items.size(1) == 4 && items.is_contiguous(),
                    "torch_ipc: batched copy items must be a contiguous int64 CUDA tensor of shape [n, 4]");
  const int k = static_cast<int>(kernel);
  TORCH_IPC_CHECK_VALUE(k == 0 || k == 1, "torch_ipc: unknown batched kernel ", k);
  const int64_t n = items.size(0);
  TORCH_IPC_CHECK_VALUE(n <= 0x7fffffff, "torch_ipc: a batched copy holds at most 2^31-1 items, not ", n);
  if (n == 0) return;
  const int device = items.get_device();
  const Module& m = module_for(device);
  if (!m.error.empty()) throw CudaUnavailable("torch_ipc: batched copy kernels unavailable: " + m.error);
  ScopedContext scope(device);
  CUdeviceptr table = reinterpret_cast<CUdeviceptr>(items.data_ptr());
  void* params[] = {&table};
  TORCH_IPC_CU(cuLaunchKernel, m.functions[k], static_cast<unsigned>(n), 1, 1, kThreads, 1, 1, 0,
               current_stream(device), params, nullptr);
}

}  // namespace torch_ipc
