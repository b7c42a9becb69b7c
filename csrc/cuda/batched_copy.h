// Batched device-to-device copies: one kernel launch copies a whole table of
// byte ranges (or converts fp32 ranges to bf16), PTX loaded through the driver.
#pragma once

#include <ATen/core/Tensor.h>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

// Where blocks first .. first + count - 1 of a pool live: at base + (id - first) * block bytes.
struct BlockSpan {
  int64_t first;
  int64_t count;
  int64_t base;
};

// The index in `spans` (sorted by first id, adjacent) of the span holding
// block `id`; an id outside every span is an InvalidIndex.
size_t block_span(const std::vector<BlockSpan>& spans, int64_t id);

// Fill `table` (n * k rows of 4 int64, k = ceil(block_bytes / item_bytes))
// with the items that copy block ids[i] (found in `spans`) to the i-th
// block-sized row of the buffer at `rows` (into_rows) or back. An id outside
// every span is an InvalidIndex before anything is written: the kernel trusts
// these addresses (Note [block items] in torch_ipc/_batched_copy.py).
void fill_block_items(int64_t* table, const int64_t* ids, size_t n, const std::vector<BlockSpan>& spans,
                      int64_t block_bytes, int64_t rows, bool into_rows, int64_t item_bytes);

// Whether the kernels load on `device` (PTX ISA 7.0, sm_80 or newer); never
// throws. `why_not` says why they do not.
bool batched_copy_available(int device, std::string* why_not = nullptr);

}  // namespace torch_ipc
