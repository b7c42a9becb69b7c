// The batched copy kernels (cuda/batched_copy.h); torch_ipc/_batched_copy.py is
// their Python face, used by the kv and weights features.
#include "cuda/batched_copy.h"

#include "base/errors.h"

#include "python/bindings.h"

namespace torch_ipc::python {

void bind_batched_copy(py::module_& m) {
  m.def(
      "launch_batched",
      [](const at::Tensor& items, int kernel) { launch_batched(items, static_cast<BatchedKernel>(kernel)); },
      py::arg("items"), py::arg("kernel"));
  m.def(
      "batched_copy_available",
      [](int device) {
        std::string why;
        bool ok = batched_copy_available(device, &why);
        return py::make_tuple(ok, why);
      },
      py::arg("device"));
  m.attr("batched_item_bytes") = kBatchedItemBytes;
  m.def(
      "fill_block_items",
      [](at::Tensor& table, py::buffer ids, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& spans,
         int64_t block_bytes, int64_t rows, bool into_rows, int64_t item_bytes) {
        py::buffer_info b = ids.request();
        TORCH_IPC_CHECK_VALUE(b.itemsize == 8 && b.ndim == 1 && b.strides[0] == 8,
                              "torch_ipc: block ids must be a contiguous buffer of int64");
        const size_t n = static_cast<size_t>(b.shape[0]);
        const int64_t per_block = item_bytes > 0 ? (block_bytes + item_bytes - 1) / item_bytes : 0;
        TORCH_IPC_CHECK_VALUE(
            table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 &&
                table.size(1) == 4 && table.size(0) == static_cast<int64_t>(n) * per_block,
            "torch_ipc: a block item table must be a contiguous CPU int64 tensor [", n * per_block, ", 4]");
        std::vector<BlockSpan> parts;
        for (const auto& [first, count, base] : spans) parts.push_back(BlockSpan{first, count, base});
        fill_block_items(table.data_ptr<int64_t>(), static_cast<const int64_t*>(b.ptr), n, parts, block_bytes, rows,
                         into_rows, item_bytes);
      },
      py::arg("table"), py::arg("ids"), py::arg("spans"), py::arg("block_bytes"), py::arg("rows"), py::arg("into_rows"),
      py::arg("item_bytes"));
}

}  // namespace torch_ipc::python
