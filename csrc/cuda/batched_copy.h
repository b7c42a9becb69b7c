// Batched device-to-device copies: one kernel launch copies a whole table of
// byte ranges (or converts fp32 ranges to bf16), PTX loaded through the driver.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace torch_ipc {

// What one launch does with each item {src, dst, count, unused} of its table.
enum class BatchedKernel : int {
  Copy = 0,       // count bytes
  F32ToBf16 = 1,  // count fp32 elements to bf16, rounded as tensor.to(torch.bfloat16)
};

// Bytes (Copy) or elements (F32ToBf16) one item should hold at most, so that
// a launch spreads evenly over the GPU's blocks.
constexpr int64_t kBatchedItemBytes = 256 << 10;

// Launch `kernel` over `items`, an int64 CUDA tensor of shape [n, 4] on the
// device of every address in it, on torch's current stream of that device.
// The addresses are not checked: the caller built them from live tensors and
// keeps those alive until the stream passes the launch.
void launch_batched(const at::Tensor& items, BatchedKernel kernel);

// Whether the kernels load on `device` (PTX ISA 7.0, sm_80 or newer); never
// throws. `why_not` says why they do not.
bool batched_copy_available(int device, std::string* why_not = nullptr);

}  // namespace torch_ipc
