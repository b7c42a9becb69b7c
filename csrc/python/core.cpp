// The core's Python face: export, load, describe, collect, shutdown, sweep, stats.
#include <algorithm>

#include <pybind11/stl.h>

#include "wire/descriptor.h"

#include "cuda/cuda_driver.h"

#include "core/export.h"
#include "core/import.h"
#include "core/maintenance.h"
#include "core/stats.h"

#include "python/bindings.h"

namespace torch_ipc::python {
namespace {

// A decoded descriptor as a dict, for tests and for looking at one by hand.
py::dict describe(const py::bytes& data) {
  std::string_view view = data;
  Descriptor d = decode(view.data(), view.size());
  py::dict out;
  out["version"] = kVersion;
  out["flags"] = d.flags;
  out["producer_pid"] = d.producer.pid;
  out["n_devices"] = d.devices.size();
  out["n_events"] = d.events.size();
  out["n_leases"] = d.leases.size();
  out["n_allocs"] = d.allocs.size();
  out["n_storages"] = d.storages.size();
  out["n_tensors"] = d.tensors.size();
  py::list tensors;
  for (const auto& t : d.tensors) {
    py::dict r;
    r["storage"] = t.storage;
    r["dtype"] = t.dtype;
    r["flags"] = t.flags;
    r["storage_offset"] = t.storage_offset;
    const auto sizes = tensor_sizes(d, t), strides = tensor_strides(d, t);
    r["sizes"] = std::vector<int64_t>(sizes.begin(), sizes.end());
    r["strides"] = std::vector<int64_t>(strides.begin(), strides.end());
    tensors.append(r);
  }
  out["tensors"] = tensors;
  py::list allocs;
  for (const auto& a : d.allocs) {
    py::dict r;
    r["kind"] = static_cast<int>(a.kind);
    r["size"] = a.size;
    r["lease"] = a.lease;
    r["handle"] = py::bytes(reinterpret_cast<const char*>(a.handle.data()), a.handle.size());
    allocs.append(r);
  }
  out["allocs"] = allocs;
  out["payload"] = py::bytes(d.payload);
  return out;
}

// Note [a load's Python objects]
// A load of many tensors crosses into Python once: the tensors are moved into
// their Python objects in one list (no reference count taken and dropped per
// tensor), and is_parameter is None when no tensor is a Parameter, so that
// _serialize._rebuild loops over nothing.
py::list tensor_list(std::vector<at::Tensor>&& tensors) {
  py::list out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* wrapped = THPVariable_Wrap(std::move(tensors[i]));
    if (wrapped == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), wrapped);
  }
  return out;
}

// The tensors of a list, by reference (Note [PyObject preservation for Tensor
// and Storages] in c10: a copy would take a reference to each one's Python object).
TensorRefs tensor_refs(const py::list& tensors) {
  TensorRefs out;
  out.reserve(tensors.size());
  for (py::handle t : tensors) {
    if (!THPVariable_Check(t.ptr()))
      throw py::type_error(std::string("torch_ipc exports a list of tensors, not one holding ") +
                           Py_TYPE(t.ptr())->tp_name);
    out.push_back(std::cref(THPVariable_Unpack(t.ptr())));
  }
  return out;
}

py::object parameter_flags(const std::vector<bool>& is_parameter) {
  if (std::none_of(is_parameter.begin(), is_parameter.end(), [](bool p) { return p; })) return py::none();
  return py::cast(is_parameter);
}

py::dict stats() {
  py::dict out;
  for (const StatField& f : process_stats()) {
    if (f.flag)
      out[f.name] = py::bool_(f.value != 0);
    else
      out[f.name] = f.value;
  }
  py::list oldest;
  for (const PinnedExport& p : export_stats().oldest) {
    py::dict r;
    const auto values = pinned_export_values(p);
    const auto& fields = pinned_export_fields();
    for (size_t i = 0; i < fields.size(); ++i) r[fields[i].name] = values[i];
    oldest.append(r);
  }
  out["oldest_exports"] = oldest;
  return out;
}

py::list stats_fields() {
  py::list out;
  for (const StatField& f : process_stats(/*with_values=*/false)) out.append(py::make_tuple(f.name, f.doc));
  py::list pinned;
  for (const PinnedField& f : pinned_export_fields()) pinned.append(py::make_tuple(f.name, f.doc));
  out.append(py::make_tuple("oldest_exports", pinned));
  return out;
}

}  // namespace

void bind_core(py::module_& m) {
  py::class_<Export, std::shared_ptr<Export>>(
      m, "Export",
      "One exported message: its descriptor (.data) and what it asked of leases. Dropping it "
      "changes nothing; revoke() says nobody will load it any more.")
      .def_property_readonly("data", [](const Export& e) { return py::bytes(e.data()); })
      .def_property_readonly("live", &Export::live)
      .def("revoke", &Export::revoke)
      .def("forbid_loads", &Export::forbid_loads,
           "revoke(), and refuse every load from now on (torch_ipc.Export.revoke)");
  m.def(
      "export_tensors",
      [](const py::list& tensors, const std::vector<bool>& is_parameter, const std::string& payload, uint32_t consumers,
         bool while_referenced) {
        return export_tensors(tensor_refs(tensors), is_parameter, payload, consumers, while_referenced);
      },
      py::arg("tensors"), py::arg("is_parameter"), py::arg("payload"), py::arg("consumers") = 1,
      py::arg("while_referenced") = false);
  // Note [one shareability rule] in core/export.cpp: one tensor, or all of a list.
  m.def("shared_natively", &shared_natively, py::arg("tensor"));
  m.def("torch_shared_memory_maker", &torch_shared_memory_maker, py::arg("tensor"));
  m.def(
      "all_shared_natively",
      [](const py::list& tensors) {  // read in place: no tensor copied into a vector
        return std::all_of(tensors.begin(), tensors.end(), [](py::handle t) {
          return THPVariable_Check(t.ptr()) && shared_natively(THPVariable_Unpack(t.ptr()));
        });
      },
      py::arg("tensors"));
  py::class_<PendingLoad, std::shared_ptr<PendingLoad>>(
      m, "PendingLoad",
      "What a load spends at its producers (a token, a forwarder's delivery) once it succeeded: "
      "commit() spends it; a load that failed drops it unspent.")
      .def("commit", &PendingLoad::commit);
  // Note [imports without the GIL]
  // A load may wait: for a VMM producer's fd server (up to 10 s), for /proc.
  // It touches no Python object, so it runs with the GIL released and the
  // other threads of the process keep running; it takes the GIL back only to
  // call `before_cuda`.
  m.def(
      "load",
      [](const py::bytes& data, const py::object& before_cuda) {
        // Bytes are immutable and `data` holds them: read in place, without the GIL.
        const std::string_view bytes = data;
        std::function<void()> hook;
        if (!before_cuda.is_none())
          hook = [&before_cuda] {
            py::gil_scoped_acquire gil;
            before_cuda();
          };
        ImportResult r;
        {
          py::gil_scoped_release release;
          r = import_tensors(bytes, hook);
        }
        return py::make_tuple(tensor_list(std::move(r.tensors)), parameter_flags(r.is_parameter), py::bytes(r.payload),
                              r.pending);
      },
      py::arg("data"), py::arg("before_cuda") = py::none(),
      "Decode and import a descriptor in one call: DescriptorError for malformed bytes first, then "
      "before_cuda() where it holds CUDA tensors, then the producer's memory. What the load spends "
      "is left to PendingLoad.commit() (Note [a load spends last] in core/import.cpp).");
  m.def("describe", &describe, py::arg("data"));
  // Note [torch never sees our storages] in torch_ipc/mp/_reductions.py
  m.def("is_torch_ipc_storage", &is_torch_ipc_storage, py::arg("tensor"));
  m.def("collect", &collect, py::arg("close_idle") = false, py::call_guard<py::gil_scoped_release>());
  m.def("shutdown", &shutdown);
  // Note [sweep] in os/sweep.h; the collector calls it every TORCH_IPC_SWEEP_INTERVAL.
  m.def("sweep", &sweep, py::call_guard<py::gil_scoped_release>());
  m.def("stats", &stats);
  m.def("stats_fields", &stats_fields, "(name, doc) of each stats() entry, for its docstring");
  m.def("_forbid_cuda_after_fork", &forbid_cuda_after_fork);  // Note [CUDA after fork]
  m.def("cuda_available", [] {
    std::string why;
    bool ok = driver_available(&why);
    return py::make_tuple(ok, why);
  });
}

}  // namespace torch_ipc::python
