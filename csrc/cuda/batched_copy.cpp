#include "cuda/batched_copy.h"

#include <algorithm>
#include <mutex>

#include <c10/util/Exception.h>

#include "base/errors.h"

#include "cuda/batched_copy_ptx.h"
#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"
#include "cuda/per_device.h"

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

PerDevice<Module>& modules() {
  static auto* m = new PerDevice<Module>();
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
  PerDevice<Module>& all = modules();
  std::lock_guard<std::mutex> lock(all.mu);
  return all.at(device, [device] { return load_module(device); });
}

}  // namespace

size_t block_span(const std::vector<BlockSpan>& spans, int64_t id) {
  auto after =
      std::upper_bound(spans.begin(), spans.end(), id, [](int64_t v, const BlockSpan& s) { return v < s.first; });
  TORCH_IPC_CHECK_INDEX(after != spans.begin() && id - (after - 1)->first < (after - 1)->count, "torch_ipc: block id ",
                        id, " is out of range of the KV pool's mapped blocks");
  return static_cast<size_t>(after - 1 - spans.begin());
}

namespace {

// The address of block `id`; spans are sorted by first id and adjacent.
int64_t block_address(const std::vector<BlockSpan>& spans, int64_t id, int64_t block_bytes) {
  const BlockSpan& span = spans[block_span(spans, id)];
  return span.base + (id - span.first) * block_bytes;
}

}  // namespace

void fill_block_items(int64_t* table, const int64_t* ids, size_t n, const std::vector<BlockSpan>& spans,
                      int64_t block_bytes, int64_t rows, bool into_rows, int64_t item_bytes) {
  TORCH_IPC_CHECK_VALUE(block_bytes > 0 && item_bytes > 0, "torch_ipc: block items of ", item_bytes,
                        " bytes for blocks of ", block_bytes);
  std::vector<int64_t> blocks(n);
  for (size_t i = 0; i < n; ++i) blocks[i] = block_address(spans, ids[i], block_bytes);
  int64_t* item = table;
  for (size_t i = 0; i < n; ++i) {
    const int64_t row = rows + static_cast<int64_t>(i) * block_bytes;
    for (int64_t at = 0; at < block_bytes; at += item_bytes, item += 4) {
      item[0] = (into_rows ? blocks[i] : row) + at;
      item[1] = (into_rows ? row : blocks[i]) + at;
      item[2] = std::min(item_bytes, block_bytes - at);
      item[3] = 0;
    }
  }
}

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
  TORCH_IPC_CHECK_VALUE(items.defined() && items.is_cuda() && items.scalar_type() == at::kLong && items.dim() == 2 &&
                            items.size(1) == 4 && items.is_contiguous(),
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
