// The weights feature's C++ parts (features/weights); torch_ipc/weights is its Python face.
#include "features/weights/shared_counters.h"

#include "python/bindings.h"

namespace torch_ipc::python {

void bind_weights(py::module_& m) {
  m.def("counter_load", &counter_load, py::arg("counters"), py::arg("index"));
  m.def("counter_store", &counter_store, py::arg("counters"), py::arg("index"), py::arg("value"));
  m.def("counter_compare_exchange", &counter_compare_exchange, py::arg("counters"), py::arg("index"),
        py::arg("expected"), py::arg("desired"));
}

}  // namespace torch_ipc::python
