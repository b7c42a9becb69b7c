// The weights feature's C++ parts (features/weights); torch_ipc/weights is its Python face.
#include "features/weights/batched_copy.h"
#include "features/weights/shared_counters.h"
#include "python/bindings.h"

namespace torch_ipc::python {

void bind_weights(py::module_& m) {
  m.def("launch_batched", [](const at::Tensor& items, int kernel) {
    launch_batched(items, static_cast<BatchedKernel>(kernel));
  }, py::arg("items"), py::arg("kernel"));
  m.def("batched_copy_available", [](int device) {
    std::string why;
    bool ok = batched_copy_available(device, &why);
    return py::make_tuple(ok, why);
  }, py::arg("device"));
  m.attr("batched_item_bytes") = kBatchedItemBytes;
  m.def("counter_load", &counter_load, py::arg("counters"), py::arg("index"));
  m.def("counter_store", &counter_store, py::arg("counters"), py::arg("index"), py::arg("value"));
  m.def("counter_compare_exchange", &counter_compare_exchange, py::arg("counters"), py::arg("index"),
        py::arg("expected"), py::arg("desired"));
}

}  // namespace torch_ipc::python
