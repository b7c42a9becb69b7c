// The one place that names torch_ipc._C's Python functions and maps the C++
// exception types of errors.h onto the Python classes of torch_ipc/errors.py.
#include <torch/extension.h>

#include <mutex>

#include "batched_copy.h"
#include "block_allocator.h"
#include "cuda_driver.h"
#include "descriptor.h"
#include "errors.h"
#include "export.h"
#include "fd_passing.h"
#include "fork.h"
#include "host_memory.h"
#include "import.h"
#include "ipc_event.h"
#include "names.h"
#include "process.h"
#include "refcount.h"
#include "registry.h"
#include "shared_counters.h"
#include "sweep.h"
#include "vmm.h"

namespace py = pybind11;
using namespace torch_ipc;

namespace {

// Collections run one at a time (Note [collect without the GIL]).
struct CollectLock {
  std::mutex mu;
};
std::mutex& collect_lock() { return process_state<CollectLock>()->mu; }

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
    py::object exc = cls(e.what(), e.error_name, e.call);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (const CudaUnavailable& e) {
    raise("CudaUnavailableError", e.what());
  } catch (const ProducerGone& e) {
    raise("ProducerGoneError", e.what());
  } catch (const Released& e) {
    raise("ReleasedError", e.what());
  } catch (const DeviceNotFound& e) {
    raise("DeviceNotFoundError", e.what());
  } catch (const HolderLimit& e) {
    raise("HolderLimitError", e.what());
  } catch (const OsError& e) {
    py::object exc = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(PyExc_OSError, "is", e.error_number, e.what()));
    if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (const InvalidValue& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const InvalidIndex& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const InvalidUse& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const c10::OutOfMemoryError& e) {
    PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    // Note [c10 errors without backtrace]
    // TORCH_CHECK failures of this module (bad arguments) reach Python as the
    // builtin class torch would pick, with the message alone: what() would
    // symbolize a C++ backtrace through this library, slow and of no use to
    // the caller. Conditions met at run time throw the types of errors.h.
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
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
    r["handle"] = py::bytes(reinterpret_cast<const char*>(a.handle.data()), a.handle.size());
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
  out["held_bytes"] = e.held_bytes;
  out["held_cuda_ipc_bytes"] = e.held_cuda_ipc_bytes;
  py::list oldest;
  for (const PinnedExport& p : e.oldest) {
    py::dict r;
    r["age_s"] = p.age_s;
    r["bytes"] = p.bytes;
    r["tokens_pending"] = p.tokens_pending;
    r["holders"] = p.holders;
    r["dead_holders"] = p.dead_holders;
    oldest.append(r);
  }
  out["oldest_exports"] = oldest;
  out["imports"] = i.holds;
  out["pending_releases"] = i.pending_releases;
  out["mappings_open"] = i.mappings_open;
  out["mappings_idle"] = i.mappings_idle;
  out["events_open"] = i.events_open;
  out["lease_segments"] = lease_segment_count();
  out["host_segments"] = host_segment_count();
  out["swept_files"] = swept_file_count();
  VmmStats v = vmm_stats();
  out["vmm_export_groups"] = v.export_groups;
  out["vmm_exported_chunks"] = v.exported_chunks;
  out["vmm_exported_bytes"] = v.exported_bytes;
  out["vmm_pool_allocations"] = v.pool_allocations;
  out["vmm_pool_bytes"] = v.pool_bytes;
  out["vmm_mappings"] = v.mappings;
  out["vmm_mapped_bytes"] = v.mapped_bytes;
  FdStats f = fd_stats();
  out["fd_published"] = f.published;
  out["fd_served"] = f.served;
  out["fd_refused"] = f.refused;
  out["fd_via_socket"] = f.via_socket;
  out["fd_via_pidfd"] = f.via_pidfd;
  out["fd_pidfd_refused"] = f.pidfd_refused;
  out["fd_server_running"] = f.server_running;
  return out;
}

}  // namespace

void torch_ipc::collect_lock_forget_after_fork() { forget_after_fork<CollectLock>(); }

PYBIND11_MODULE(_C, m) {
  install_fork_handler();  // Note [fork] in process.h
  m.doc() = "torch_ipc's C++ core: descriptors, export/import, leases, CUDA driver";
  // Local: only the functions of this module, before pybind11's own translators.
  py::register_local_exception_translator(&translate);

  py::class_<Export, std::shared_ptr<Export>>(
      m, "Export",
      "One exported message: its descriptor (.data) and what it asked of leases. Dropping it "
      "changes nothing; revoke() says nobody will load it any more.")
      .def_property_readonly("data", [](const Export& e) { return py::bytes(e.data()); })
      .def_property_readonly("live", &Export::live)
      .def("revoke", &Export::revoke);
  m.def("export_tensors", &export_tensors, py::arg("tensors"), py::arg("is_parameter"),
        py::arg("payload"), py::arg("consumers") = 1);
  py::class_<PendingLoad, std::shared_ptr<PendingLoad>>(
      m, "PendingLoad",
      "What a load spends at its producers (a token, a forwarder's delivery) once it succeeded: "
      "commit() spends it; a load that failed drops it unspent.")
      .def("commit", &PendingLoad::commit);
  // Note [imports without the GIL]
  // A load may wait: for a VMM producer's fd server (up to 10 s), for /proc.
  // It touches no Python object, so it runs with the GIL released and the
  // other threads of the process keep running.
  auto import_released = [](const py::bytes& data) {
    std::string bytes = data;
    py::gil_scoped_release release;
    return import_tensors(bytes);
  };
  m.def(
      "import_tensors",
      [import_released](const py::bytes& data) {
        ImportResult r = import_released(data);
        r.pending->commit();
        return py::make_tuple(r.tensors, r.is_parameter, py::bytes(r.payload));
      },
      py::arg("data"));
  m.def(
      "import_pending",
      [import_released](const py::bytes& data) {
        ImportResult r = import_released(data);
        return py::make_tuple(r.tensors, r.is_parameter, py::bytes(r.payload), r.pending);
      },
      py::arg("data"),
      "import_tensors, with what the load spends left to PendingLoad.commit() (Note [a load "
      "spends last] in import.cpp).");
  m.def("describe", &describe, py::arg("data"));
  // Note [torch never sees our storages] in _reductions.py
  m.def(
      "is_torch_ipc_storage",
      [](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage()) return false;
        const c10::Storage& s = t.storage();
        return imported_origin(s).has_value() || is_host_shared(s) ||
               (t.is_cuda() && vmm_is_pool_storage(s));
      },
      py::arg("tensor"));
  m.def(
      "collect",
      [](bool close_idle) {
        // Note [collect without the GIL]
        // A collection looks at every live export and import: with thousands
        // held it takes milliseconds, and the GIL would stall every Python
        // thread for that long, every collect interval. It touches no Python
        // object; storages it drops take the GIL themselves if a Python object
        // still refers to them (torch's PyObject slot does). Collections run
        // one at a time (the GIL used to see to that): a collect() returns
        // after what another thread's collection dropped is freed and
        // unmapped, so stats() afterwards are settled. The GIL is released
        // before the lock is taken, never the other way round.
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(collect_lock());
        int reclaimed = collect_exports();
        collect_imports(close_idle);
        return reclaimed;
      },
      py::arg("close_idle") = false);
  m.def("shutdown", [] {
    try {
      flush_imports();
    } catch (const CudaUnavailable&) {
    }
    collect_exports();
    lease_unlink_own_segments();
    host_unlink_all();
  });
  // Note [sweep] in sweep.h; the collector calls it every TORCH_IPC_SWEEP_INTERVAL.
  m.def(
      "sweep",
      [] {
        int removed = sweep_stale_shm();
        forget_exited_processes();
        return removed;
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("stats", &stats);
  m.def("_forbid_cuda_after_fork", &forbid_cuda_after_fork);  // Note [CUDA after fork]
  m.def("cuda_available", [] {
    std::string why;
    bool ok = driver_available(&why);
    return py::make_tuple(ok, why);
  });

  // ---- IpcEvent (csrc/ipc_event.h); torch_ipc/ipc_event.py is its Python face ----
  auto stream_arg = [](const std::optional<uintptr_t>& s) -> std::optional<CUstream> {
    if (!s) return std::nullopt;
    return reinterpret_cast<CUstream>(*s);
  };
  py::class_<IpcEvent, std::shared_ptr<IpcEvent>>(m, "IpcEvent")
      .def(py::init<int>(), py::arg("device"))
      .def_static("from_state", [](const py::bytes& s) { return IpcEvent::from_state(s); })
      .def("state", [](const IpcEvent& e) { return py::bytes(e.state()); })
      .def_property_readonly("device", &IpcEvent::device)
      .def("record", [stream_arg](IpcEvent& e, std::optional<uintptr_t> s) { e.record(stream_arg(s)); },
           py::arg("stream") = py::none())
      .def("wait", [stream_arg](IpcEvent& e, std::optional<uintptr_t> s) { e.wait(stream_arg(s)); },
           py::arg("stream") = py::none())
      .def("query", &IpcEvent::query)
      .def("synchronize", &IpcEvent::synchronize, py::call_guard<py::gil_scoped_release>());

  // ---- begin VMM sharing and fd passing (csrc/vmm.h, csrc/fd_passing.h) ----
  m.def(
      "vmm_pool_empty",
      [](const std::vector<int64_t>& sizes, at::ScalarType dtype, int device, int handle_type) {
        return vmm_pool_empty(sizes, dtype, device, static_cast<CUmemAllocationHandleType>(handle_type));
      },
      py::arg("sizes"), py::arg("dtype"), py::arg("device"), py::arg("handle_type") = 1);
  m.def(
      "vmm_granularity",
      [](int device, int handle_type) {
        return vmm_granularity(device, static_cast<CUmemAllocationHandleType>(handle_type));
      },
      py::arg("device"), py::arg("handle_type") = 1);
  m.def("vmm_is_pool_tensor", [](const at::Tensor& t) {
    return t.defined() && t.is_cuda() && vmm_is_pool_storage(t.storage());
  });
  // ---- end VMM sharing ----

  // ---- begin KV pool block ownership (csrc/block_allocator.h) ----
  // Block ids cross as bytes of int64s (torch_ipc/kv.py packs them): no per-id
  // conversion. Every call that takes the pool's lock releases the GIL: the
  // lock may be held by another process (Note [block ownership under a robust
  // mutex]), and the collector thread calls reclaim_dead.
  using Allocator = BlockAllocator;
  using ReleaseGil = py::call_guard<py::gil_scoped_release>;
  auto ids_of = [](const py::bytes& packed) {
    std::string_view v = packed;
    TORCH_IPC_CHECK_VALUE(v.size() % sizeof(int64_t) == 0, "torch_ipc: packed block ids must be int64s");
    return std::make_pair(reinterpret_cast<const int64_t*>(v.data()), v.size() / sizeof(int64_t));
  };
  auto process = [](const ProcessId& p) { return py::make_tuple(p.pid, p.start_time); };
  py::class_<Allocator>(m, "BlockAllocator", "who holds each block of a KV pool, in shared memory")
      .def_static(
          "create",
          [](const std::vector<int64_t>& shape, at::ScalarType dtype, uint64_t max_blocks) {
            return Allocator::create(BlockLayout{shape, static_cast<int32_t>(dtype), 0}, max_blocks);
          },
          py::arg("shape"), py::arg("dtype"), py::arg("max_blocks"), ReleaseGil())
      .def_static(
          "attach",
          [](const std::string& name, uint32_t pid, uint64_t start_time) {
            return Allocator::attach(name, ProcessId{pid, start_time});
          },
          py::arg("name"), py::arg("pid"), py::arg("start_time"), ReleaseGil())
      .def_static("self_process", [=] { return process(self_process()); })
      .def_readonly_static("max_chunks", &Allocator::kMaxChunks)
      .def_property_readonly("name", &Allocator::name)
      .def_property_readonly("layout",
                             [](const Allocator& a) {
                               BlockLayout l = a.layout();
                               return py::make_tuple(l.shape, static_cast<at::ScalarType>(l.dtype), l.block_bytes);
                             })
      .def_property_readonly("num_blocks", &Allocator::num_blocks)
      .def_property_readonly("max_blocks", &Allocator::max_blocks)
      .def_property_readonly("free_blocks", &Allocator::free_blocks)
      .def_property_readonly("slot", &Allocator::slot)
      .def("allocate", &Allocator::allocate, py::arg("n"), ReleaseGil())
      .def("free",
           [=](Allocator& a, const py::bytes& ids) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.free(p, n);
           })
      .def("check_held",
           [=](const Allocator& a, const py::bytes& ids) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.check_held(p, n);
           })
      .def("take_over",
           [=](Allocator& a, const py::bytes& ids, uint32_t slot, uint32_t pid, uint64_t start_time) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.take_over(p, n, slot, ProcessId{pid, start_time});
           })
      .def("reclaim_dead", &Allocator::reclaim_dead, ReleaseGil())
      .def("holder_of",
           [=](const Allocator& a, int64_t id) {
             ProcessId p;
             {
               py::gil_scoped_release release;
               p = a.holder_of(id);
             }
             return process(p);
           })
      .def("holders",
           [=](const Allocator& a) {
             std::vector<PoolHolder> holders;
             {
               py::gil_scoped_release release;
               holders = a.holders();
             }
             py::list out;
             for (const auto& h : holders) out.append(py::make_tuple(process(h.process), h.blocks));
             return out;
           })
      .def("held_by_self", &Allocator::held_by_self, ReleaseGil())
      .def("add_chunk",
           [](Allocator& a, uint64_t count, const py::bytes& d) {
             std::string descriptor = d;
             py::gil_scoped_release release;
             a.add_chunk(count, descriptor);
           })
      .def("chunks",
           [](const Allocator& a, size_t from) {
             std::vector<PoolChunk> chunks;
             {
               py::gil_scoped_release release;
               chunks = a.chunks(from);
             }
             py::list out;
             for (const auto& c : chunks) out.append(py::make_tuple(c.first, c.count, py::bytes(c.descriptor)));
             return out;
           })
      .def("detach", &Allocator::detach, ReleaseGil())
      .def("unlink", &Allocator::unlink);
  // ---- end KV pool ----
  // ---- begin weights (csrc/batched_copy.h, csrc/shared_counters.h; torch_ipc/weights) ----
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
  // ---- end weights ----

  // ---- test-only: torch_ipc._C._testing, not part of the package's API ----
  py::module_ testing = m.def_submodule("_testing", "primitives torch_ipc's own tests drive directly");
  testing.def("vmm_mapping_view", &vmm_mapping_view, py::arg("tensor"));
  testing.def("kv_stall_mid_operation", [](BlockAllocator& a) {
    py::gil_scoped_release release;
    a.stall_mid_operation_for_tests();
  });
  // fd passing primitives: publish fds of this process, fetch another's.
  testing.def("fd_self", [] { return py::make_tuple(self_process().pid, self_process().start_time); });
  // The socket that serves export `id` of a process (Note [fd server name]).
  testing.def("fd_socket_name", [](uint32_t pid, uint64_t start_time, uint64_t id) {
    return fd_socket_name(ProcessId{pid, start_time}, static_cast<uint32_t>(id >> 32));
  });
  // The values the OS random source gives next in this process (Note [names]).
  testing.def("queue_random", &queue_random_for_testing, py::arg("values"));
  testing.def("fd_publish", [](const std::vector<int>& fds, const std::vector<uint64_t>& sizes) {
    TORCH_IPC_CHECK(fds.size() == sizes.size(), "torch_ipc: one size per fd");
    std::vector<PublishedItem> items;
    for (size_t i = 0; i < fds.size(); ++i) items.push_back(PublishedItem{sizes[i], fds[i], {}});
    return fd_publish(items);
  });
  testing.def("fd_unpublish", [](uint64_t id) { fd_unpublish(id); });
  testing.def(
      "fd_fetch",
      [](uint32_t pid, uint64_t start_time, uint64_t id, const std::vector<int>& remote_fds,
         const std::string& mode) {
        FdTransport t = mode.empty() ? fd_transport_from_env()
                        : mode == "socket" ? FdTransport::Socket
                        : mode == "pidfd"  ? FdTransport::Pidfd
                                           : FdTransport::Auto;
        std::vector<ReceivedItem> items;
        {
          py::gil_scoped_release release;
          items = fd_fetch(ProcessId{pid, start_time}, id, remote_fds, t);
        }
        py::list out;  // (fd, size) pairs; the caller owns and closes the fds
        for (auto& item : items) out.append(py::make_tuple(item.fd.release(), item.size));
        return out;
      },
      py::arg("pid"), py::arg("start_time"), py::arg("id"), py::arg("remote_fds"),
      py::arg("mode") = "");
  // The VMM handle field codec (csrc/vmm_handle.h), for its CPU tests.
  testing.def(
      "vmm_handle_encode",
      [](uint32_t type, uint32_t n_chunks, uint64_t id, uint64_t chunk_bytes, uint32_t pid,
         const std::vector<int32_t>& fds) {
        TORCH_IPC_CHECK_VALUE(type <= 0xFF, "torch_ipc: handle type must fit in a byte, not ", type);
        VmmHandleField f;
        f.type = static_cast<uint8_t>(type);
        f.n_chunks = n_chunks;
        f.id = id;
        f.chunk_bytes = chunk_bytes;
        f.pid = pid;
        f.fds = fds;
        Handle64 h = encode_vmm_handle(f);
        return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
      },
      py::kw_only(), py::arg("type"), py::arg("n_chunks"), py::arg("id"), py::arg("chunk_bytes"),
      py::arg("pid"), py::arg("fds") = std::vector<int32_t>{});
  testing.def(
      "vmm_handle_decode",
      [](const py::bytes& data, const py::object& alloc_size) {
        std::string_view view = data;
        TORCH_IPC_CHECK_VALUE(view.size() == sizeof(Handle64), "torch_ipc: a VMM handle field is 64 bytes, not ",
                          view.size());
        Handle64 h;
        std::memcpy(h.data(), view.data(), h.size());
        VmmHandleField f = alloc_size.is_none() ? decode_vmm_handle(h)
                                                 : decode_vmm_handle(h, alloc_size.cast<uint64_t>());
        py::dict out;
        out["version"] = kVmmHandleVersion;
        out["type"] = f.type;
        out["n_chunks"] = f.n_chunks;
        out["id"] = f.id;
        out["chunk_bytes"] = f.chunk_bytes;
        out["pid"] = f.pid;
        out["fds"] = f.fds;
        return out;
      },
      py::arg("data"), py::arg("alloc_size") = py::none());
}
