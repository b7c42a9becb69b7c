// torch_ipc._C._testing: primitives torch_ipc's own tests drive directly; not
// part of the package's API.
#include <cstring>

#include "base/env.h"
#include "base/errors.h"

#include "wire/descriptor.h"
#include "wire/vmm_handle.h"

#include "os/fd_passing.h"
#include "os/names.h"
#include "os/process.h"

#include "memory/shared_pool.h"

#include "core/mapping_cache.h"

#include "features/kv/block_allocator.h"

#include "python/bindings.h"

namespace torch_ipc::python {
namespace {

void bind_fd_testing(py::module_& testing) {
  // fd passing primitives: publish fds of this process, fetch another's.
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
      [](uint32_t pid, uint64_t start_time, uint64_t id, const std::vector<int>& remote_fds, const std::string& mode,
         uint32_t life, uint32_t pidns) {
        FdTransport t = mode.empty()       ? fd_transport_from_env()
                        : mode == "socket" ? FdTransport::Socket
                        : mode == "pidfd"  ? FdTransport::Pidfd
                                           : FdTransport::Auto;
        std::vector<ReceivedItem> items;
        {
          py::gil_scoped_release release;
          items = fd_fetch(ProcessId{pid, start_time, life, pidns}, id, remote_fds, t);
        }
        py::list out;  // (fd, size) pairs; the caller owns and closes the fds
        for (auto& item : items) out.append(py::make_tuple(item.fd.release(), item.size));
        return out;
      },
      py::arg("pid"), py::arg("start_time"), py::arg("id"), py::arg("remote_fds"), py::arg("mode") = "",
      py::arg("life") = 0, py::arg("pidns") = 0);
  // The fd server's socket at a path (Note [fd server at a path]), or "".
  testing.def("fd_server_path", &fd_server_path);
  // Seconds: what the environment set, or the defaults (Note [checked settings]).
  testing.def("fd_answer_seconds", &fd_answer_seconds);
  testing.def("kv_default_lock_timeout", &BlockAllocator::default_lock_timeout);
  // The parsers every numeric setting goes through, on a variable of the caller's choosing.
  testing.def("env_int", &env_int, py::arg("name"), py::arg("fallback"), py::arg("min"), py::arg("max"));
  testing.def("env_number", &env_number, py::arg("name"), py::arg("fallback"), py::arg("min"), py::arg("max"));
  // (idle nanoseconds, idle mappings): what the environment set (Note [checked settings]).
  testing.def("idle_policy", [] {
    const IdlePolicy p = idle_policy();
    return py::make_tuple(p.idle_ns, p.max_idle);
  });
}

}  // namespace

void bind_testing(py::module_& m) {
  py::module_ testing = m.def_submodule("_testing", "primitives torch_ipc's own tests drive directly");
  testing.def("vmm_mapping_view", &vmm_mapping_view, py::arg("tensor"));
  testing.def("kv_stall_mid_operation", [](BlockAllocator& a) {
    py::gil_scoped_release release;
    a.stall_mid_operation_for_tests();
  });
  bind_fd_testing(testing);
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
      py::kw_only(), py::arg("type"), py::arg("n_chunks"), py::arg("id"), py::arg("chunk_bytes"), py::arg("pid"),
      py::arg("fds") = std::vector<int32_t>{});
  testing.def(
      "vmm_handle_decode",
      [](const py::bytes& data, const py::object& alloc_size) {
        std::string_view view = data;
        TORCH_IPC_CHECK_VALUE(view.size() == sizeof(Handle64), "torch_ipc: a VMM handle field is 64 bytes, not ",
                              view.size());
        Handle64 h;
        std::memcpy(h.data(), view.data(), h.size());
        VmmHandleField f =
            alloc_size.is_none() ? decode_vmm_handle(h) : decode_vmm_handle(h, alloc_size.cast<uint64_t>());
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

}  // namespace torch_ipc::python
