// IpcEvent (features/ipc_event); torch_ipc/ipc_event.py is its Python face.
#include "features/ipc_event/ipc_event.h"

#include <optional>

#include "python/bindings.h"

namespace torch_ipc::python {

void bind_ipc_event(py::module_& m) {
  auto stream_arg = [](const std::optional<uintptr_t>& s) -> std::optional<CUstream> {
    if (!s) return std::nullopt;
    return reinterpret_cast<CUstream>(*s);
  };
  py::class_<IpcEvent, std::shared_ptr<IpcEvent>>(m, "IpcEvent")
      .def(py::init<int>(), py::arg("device"))
      .def_static("from_state", [](const py::bytes& s) { return IpcEvent::from_state(s); })
      .def("state", [](const IpcEvent& e) { return py::bytes(e.state()); })
      .def_property_readonly("device", &IpcEvent::device)
      .def(
          "record", [stream_arg](IpcEvent& e, std::optional<uintptr_t> s) { e.record(stream_arg(s)); },
          py::arg("stream") = py::none())
      .def(
          "wait", [stream_arg](IpcEvent& e, std::optional<uintptr_t> s) { e.wait(stream_arg(s)); },
          py::arg("stream") = py::none())
      .def("query", &IpcEvent::query)
      .def("synchronize", &IpcEvent::synchronize, py::call_guard<py::gil_scoped_release>());
}

}  // namespace torch_ipc::python
