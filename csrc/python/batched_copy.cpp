// The batched copy kernels (cuda/batched_copy.h); torch_ipc/_batched_copy.py is
// their Python face, used by the kv and weights features.
#include "cuda/batched_copy.h"
#include "python/bindings.h"

namespace torch_ipc::python {

void bind_batched_copy(py::module_& m) {
  m.def("launch_batched", [](const at::Tensor& items, int kernel) {
    launch_batched(items, static_cast<BatchedKernel>(kernel));
  }, py::arg("items"), py::arg("kernel"));
  m.def("batched_copy_available", [](int device) {
    std::string why;
    bool ok = batched_copy_available(device, &why);
    return py::make_tuple(ok, why);
  }, py::arg("device"));
  m.attr("batched_item_bytes") = kBatchedItemBytes;
}

}  // namespace torch_ipc::python
