// The one place that names torch_ipc._C's Python functions and maps the C++
// exception types of errors.h onto the Python classes of torch_ipc/errors.py.
#include <torch/extension.h>

#include "cuda_driver.h"
#include "descriptor.h"
#include "errors.h"
#include "export.h"
#include "host_memory.h"
#include "import.h"
#include "process.h"
#include "refcount.h"

namespace py = pybind11;
using namespace torch_ipc;

namespace {

py::object error_class(const char* name) {
  static py::module_* errors = new py::module_(py::module_::import("torch_ipc.errors"));
  return errors->attr(name);
}

void raise(const char* cls, const std::string& what) {
  PyErr_SetString(error_class(cls).ptr(), what.c_str());
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const DescriptorError& e) {
    raise("DescriptorError", e.what());
  } catch (const CudaError& e) {
    py::object cls = error_class("CudaError");
    py::object exc = cls(e.what(), e.error_name);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (const CudaUnavailable& e) {
    raise("CudaUnavailableError", e.what());
  } catch (const ProducerGone& e) {
    raise("ProducerGoneError", e.what());
  } catch (const Released& e) {
    raise("ReleasedError", e.what());
  } catch (const DeviceNotFound& e) {
    raise("DeviceNotFoundError", e.what());
  }
}

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
    r["sizes"] = t.sizes;
    r["strides"] = t.strides;
    tensors.append(r);
  }
  out["tensors"] = tensors;
  py::list allocs;
  for (const auto& a : d.allocs) {
    py::dict r;
    r["kind"] = static_cast<int>(a.kind);
    r["size"] = a.size;
    r["lease"] = a.lease;
    allocs.append(r);
  }
  out["allocs"] = allocs;
  out["payload"] = py::bytes(d.payload);
  return out;
}

py::dict stats() {
  ExportStats e = export_stats();
  ImportStats i = import_stats();
  py::dict out;
  out["exports"] = e.exports;
  out["exported_bytes"] = e.exported_bytes;
  out["tokens_pending"] = e.tokens_pending;
  out["holders"] = e.holders;
  out["dead_holders"] = e.dead_holders;
  out["imports"] = i.holds;
  out["pending_releases"] = i.pending_releases;
  out["mappings_open"] = i.mappings_open;
  out["mappings_idle"] = i.mappings_idle;
  out["events_open"] = i.events_open;
  out["lease_segments"] = lease_segment_count();
  out["host_segments"] = host_segment_count();
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ipc's C++ core: descriptors, export/import, leases, CUDA driver";
  py::register_exception_translator(&translate);

  m.def(
      "export_tensors",
      [](const std::vector<at::Tensor>& tensors, const std::vector<bool>& is_parameter,
         const py::bytes& payload, uint32_t consumers) {
        std::string bytes = export_tensors(tensors, is_parameter, payload, consumers);
        return py::bytes(bytes);
      },
      py::arg("tensors"), py::arg("is_parameter"), py::arg("payload"), py::arg("consumers") = 1);
  m.def(
      "import_tensors",
      [](const py::bytes& data) {
        ImportResult r = import_tensors(data);
        return py::make_tuple(r.tensors, r.is_parameter, py::bytes(r.payload));
      },
      py::arg("data"));
  m.def("describe", &describe, py::arg("data"));
  m.def(
      "collect",
      [](bool close_idle) {
        int reclaimed = collect_exports();
        collect_imports(close_idle);
        return reclaimed;
      },
      py::arg("close_idle") = false);
  // Lease keys (segment, slot, generation) of this process's exports, for
  // connections that give back what their peer never loaded.
  m.def("own_lease", [](const py::bytes& data) -> py::object {
    std::string_view view = data;
    for (const auto& l : peek_leases(view.data(), view.size()))
      if (l.owner == self_process()) return py::make_tuple(l.segment, l.slot, l.generation);
    return py::none();
  });
  m.def("revoke_leases", [](const std::vector<std::tuple<uint32_t, uint32_t, uint64_t>>& keys) {
    std::vector<LeaseRecord> leases;
    for (auto& [segment, slot, generation] : keys)
      leases.push_back(LeaseRecord{self_process(), segment, slot, generation});
    if (!leases.empty()) revoke_exports(leases);
  });
  m.def("live_leases", [](const std::vector<std::tuple<uint32_t, uint32_t, uint64_t>>& keys) {
    std::vector<std::tuple<uint32_t, uint32_t, uint64_t>> out;
    for (auto& k : keys) {
      auto& [segment, slot, generation] = k;
      if (export_is_live(LeaseRecord{self_process(), segment, slot, generation})) out.push_back(k);
    }
    return out;
  });
  m.def("shutdown", [] {
    try {
      flush_imports();
    } catch (const CudaUnavailable&) {
    }
    collect_exports();
    lease_unlink_own_segments();
  });
  m.def("stats", &stats);
  m.def("cuda_available", [] {
    std::string why;
    bool ok = driver_available(&why);
    return py::make_tuple(ok, why);
  });
}
