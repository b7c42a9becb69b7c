// Process identity and liveness (os/process.h) for the Python side: the one
// "is that process still running" of torch_ipc, pid AND start time, so a pid
// that was recycled never passes for the process that had it.
#include "os/process.h"

#include "os/socket_dir.h"

#include "python/bindings.h"

namespace torch_ipc::python {

void bind_process(py::module_& m) {
  m.def(
      "self_process", [] { return py::make_tuple(self_process().pid, self_process().start_time); },
      "(pid, start time) of this process; a forked child has its own.");
  m.def(
      "self_identity",
      [] {
        const ProcessId& p = self_process();
        return py::make_tuple(p.pid, p.start_time, p.life, p.pidns);
      },
      "(pid, start time, life key, PID namespace) of this process: what a peer in another PID "
      "namespace needs to judge it (Note [life files] in os/life.h); the key is 0 while it has no "
      "life file.");
  m.def(
      "process_alive",
      [](uint32_t pid, uint64_t start_time, uint32_t life, uint32_t pidns) {
        return process_alive(ProcessId{pid, start_time, life, pidns});
      },
      py::arg("pid"), py::arg("start_time"), py::arg("life") = 0, py::arg("pidns") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Whether the process of self_process() or self_identity() still runs: by /proc in this PID "
      "namespace, by its life file in another.");
  m.def("pid_namespace", &own_pid_namespace,
        "The inode of this process's PID namespace, 0 when /proc is not mounted for it.");
  m.def(
      "socket_dir",
      [] {
        std::string why;
        const std::string dir = usable_socket_dir(/*create=*/false, &why);
        return py::make_tuple(socket_dir(), dir.empty() ? why : std::string());
      },
      "(the socket folder, why it cannot be used or ''): Note [socket folder] in os/socket_dir.h.");
  m.def("life_key_alive", &life_key_alive, py::arg("key"), py::call_guard<py::gil_scoped_release>(),
        "Whether the process whose life file has `key` lives: False only when its lock is free or the file "
        "is gone (Note [life files] in os/life.h); key 0 names nobody and is not proven dead.");
  m.def("life_file_error", &life_file_error, "The errno of the last failed attempt to make the life file, else 0.");
}

}  // namespace torch_ipc::python
