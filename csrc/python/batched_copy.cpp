// The batched copy kernels (cuda/batched_copy.h) and the copy-engine copies
// (cuda/copy_engine.h); torch_ipc/_batched_copy.py is their Python face, used
// by the kv and weights features.
#include "cuda/batched_copy.h"

#include <algorithm>

#include "base/errors.h"

#include "cuda/copy_engine.h"

#include "python/bindings.h"

namespace torch_ipc::python {
namespace {

using SpanTuples = std::vector<std::tuple<int64_t, int64_t, int64_t>>;

// Block ids from Python: a contiguous buffer of int64 (array("q")), held while `info` lives.
struct BlockIds {
  py::buffer_info info;
  const int64_t* first() const { return static_cast<const int64_t*>(info.ptr); }
  size_t size() const { return static_cast<size_t>(info.shape[0]); }
};

BlockIds block_ids(const py::buffer& ids) {
  BlockIds out{ids.request()};
  const py::buffer_info& b = out.info;
  TORCH_IPC_CHECK_VALUE(b.itemsize == 8 && b.ndim == 1 && b.strides[0] == 8,
                        "torch_ipc: block ids must be a contiguous buffer of int64");
  return out;
}

// (first id, blocks, address) of each chunk.
std::vector<BlockSpan> block_spans(const SpanTuples& spans) {
  std::vector<BlockSpan> parts;
  for (const auto& [first, count, base] : spans) parts.push_back(BlockSpan{first, count, base});
  return parts;
}

void bind_block_items(py::module_& m) {
  m.def(
      "block_id_range",
      [](py::buffer ids) {
        BlockIds held = block_ids(ids);
        const size_t n = held.size();
        TORCH_IPC_CHECK_VALUE(n > 0, "torch_ipc: no block ids");
        const auto [low, high] = std::minmax_element(held.first(), held.first() + n);
        return py::make_tuple(*low, *high);
      },
      py::arg("ids"),
      "(smallest, largest) of block ids packed as int64 (array('q')): what min() and max() give, "
      "without making a Python int per id.");
  m.def(
      "fill_block_items",
      [](at::Tensor& table, py::buffer ids, const SpanTuples& spans, int64_t block_bytes, int64_t rows, bool into_rows,
         int64_t item_bytes) {
        BlockIds held = block_ids(ids);
        const size_t n = held.size();
        const int64_t per_block = item_bytes > 0 ? (block_bytes + item_bytes - 1) / item_bytes : 0;
        TORCH_IPC_CHECK_VALUE(
            table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 &&
                table.size(1) == 4 && table.size(0) == static_cast<int64_t>(n) * per_block,
            "torch_ipc: a block item table must be a contiguous CPU int64 tensor [", n * per_block, ", 4]");
        fill_block_items(table.data_ptr<int64_t>(), held.first(), n, block_spans(spans), block_bytes, rows, into_rows,
                         item_bytes);
      },
      py::arg("table"), py::arg("ids"), py::arg("spans"), py::arg("block_bytes"), py::arg("rows"), py::arg("into_rows"),
      py::arg("item_bytes"));
}

void bind_launch_block_items(py::module_& m) {
  m.def(
      "launch_block_items",
      [](py::buffer ids, const SpanTuples& spans, int64_t block_bytes, int64_t rows, bool into_rows, int64_t item_bytes,
         int device) {
        // Note [a gather's host time] in torch_ipc/kv/_copies.py. The tables live as long as
        // the launch needs them: torch's caching host allocator keeps the pinned block until
        // the copy has run; the device one is reused only by work queued after the launch.
        BlockIds held = block_ids(ids);
        TORCH_IPC_CHECK_VALUE(block_bytes > 0 && item_bytes > 0, "torch_ipc: block items of ", item_bytes,
                              " bytes for blocks of ", block_bytes);
        const int64_t per_block = (block_bytes + item_bytes - 1) / item_bytes;
        at::Tensor table = at::empty({static_cast<int64_t>(held.size()) * per_block, 4},
                                     at::TensorOptions().dtype(at::kLong).pinned_memory(true));
        fill_block_items(table.data_ptr<int64_t>(), held.first(), held.size(), block_spans(spans), block_bytes, rows,
                         into_rows, item_bytes);
        launch_batched(table.to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)), /*non_blocking=*/true),
                       BatchedKernel::Copy);
      },
      py::arg("ids"), py::arg("spans"), py::arg("block_bytes"), py::arg("rows"), py::arg("into_rows"),
      py::arg("item_bytes"), py::arg("device"),
      "Fill a pinned table of the items that copy blocks `ids` to or from `rows` (every id checked against "
      "`spans` first), copy it to CUDA `device` on its current "
      "stream without waiting, and launch the copy kernel over it: a KV gather's or scatter's host side in one "
      "call.");
}

void bind_copy_engine(py::module_& m) {
  m.def(
      "block_copy_ranges",
      [](py::buffer ids, const SpanTuples& spans, int64_t block_bytes, int64_t rows, bool into_rows) {
        BlockIds held = block_ids(ids);
        std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
        for (const CopyRange& r :
             block_ranges(held.first(), held.size(), block_spans(spans), block_bytes, rows, into_rows))
          out.emplace_back(r.src, r.dst, r.bytes);
        return out;
      },
      py::arg("ids"), py::arg("spans"), py::arg("block_bytes"), py::arg("rows"), py::arg("into_rows"));
  m.def(
      "copy_blocks_by_engine",
      [](py::buffer ids, const SpanTuples& spans, int64_t block_bytes, int64_t rows, bool into_rows, int device,
         bool batch, bool prefer_overlap) {
        BlockIds held = block_ids(ids);
        std::vector<CopyRange> ranges =
            block_ranges(held.first(), held.size(), block_spans(spans), block_bytes, rows, into_rows);
        EngineCall call =
            copy_ranges_by_engine(device, ranges, batch ? EngineCall::Batch : EngineCall::PerRange, prefer_overlap);
        return call == EngineCall::Batch;
      },
      py::arg("ids"), py::arg("spans"), py::arg("block_bytes"), py::arg("rows"), py::arg("into_rows"),
      py::arg("device"), py::arg("batch"), py::arg("prefer_overlap"));
  m.def(
      "copy_2d_by_engine",
      [](const at::Tensor& table, int device) {
        TORCH_IPC_CHECK_VALUE(table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() &&
                                  table.dim() == 2 && table.size(1) == 6,
                              "torch_ipc: a 2-D copy table must be a contiguous CPU int64 tensor [n, 6]");
        const int64_t* row = table.data_ptr<int64_t>();
        std::vector<Copy2D> copies;
        for (int64_t i = 0; i < table.size(0); ++i, row += 6)
          copies.push_back(Copy2D{row[0], row[1], row[2], row[3], row[4], row[5]});
        copy_2d_by_engine(device, copies);
      },
      py::arg("table"), py::arg("device"));
  m.def("memcpy_batch_available", []() {
    std::string why;
    bool ok = memcpy_batch_available(&why);
    return py::make_tuple(ok, why);
  });
}

}  // namespace

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
  bind_block_items(m);
  bind_launch_block_items(m);
  bind_copy_engine(m);
}

}  // namespace torch_ipc::python
