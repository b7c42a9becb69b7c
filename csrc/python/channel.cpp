// One end of a shared-memory channel (os/channel.h); torch_ipc/mp/_ring.py is
// its Python face. Every call that may wait releases the GIL.
#include "os/channel.h"

#include <cerrno>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/errors.h"

#include "os/fd_passing.h"
#include "os/ring.h"
#include "os/ring_segment.h"

#include "python/bindings.h"

namespace torch_ipc::python {

namespace {

// The bytes of a Python buffer, held while the view lives.
class BufferView {
 public:
  explicit BufferView(const py::object& data) {
    if (PyObject_GetBuffer(data.ptr(), &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  const void* data() const { return view_.buf; }
  size_t size() const { return size_t(view_.len); }

 private:
  Py_buffer view_;
};

// The InterruptCheck of every wait (Note [interruptible waits] in
// base/interrupt.h), called without the GIL: Python runs signal handlers in the
// main thread only, so other threads never take the GIL for it (a daemon
// thread that took it at interpreter exit would not come back).
bool python_signal_raised() {
  if (syscall(SYS_gettid) != getpid()) return false;
  py::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;  // its exception stays set: errors.cpp's translator raises it
}

// One message as bytes; None when the peer closed (before or during it).
py::object recv_message(Channel& channel, int64_t max_length) {
  uint64_t size = 0;
  bool got;
  {
    py::gil_scoped_release no_gil;
    got = channel.next_size(&size);
  }
  if (!got) return py::none();
  if (max_length >= 0 && size > uint64_t(max_length)) {
    {
      py::gil_scoped_release no_gil;
      got = channel.body(nullptr, size_t(size));
    }
    if (got) channel.finished();
    throw OsError(EMSGSIZE, str("torch_ipc: bad message length: ", size, " bytes, more than maxlength ", max_length));
  }
  py::object out = py::reinterpret_steal<py::object>(PyBytes_FromStringAndSize(nullptr, Py_ssize_t(size)));
  if (!out) throw py::error_already_set();
  char* dst = PyBytes_AS_STRING(out.ptr());
  if (!channel.try_body(dst, size_t(size))) {  // not all there yet: wait without the GIL
    py::gil_scoped_release no_gil;
    got = channel.body(dst, size_t(size));
  }
  if (!got) return py::none();
  channel.finished();
  return out;
}

void send_bytes(Channel& channel, const py::object& data) {
  BufferView view(data);
  py::gil_scoped_release no_gil;
  channel.send(view.data(), view.size());
}

// send_bytes that gives up after `timeout` seconds (Channel::send_within).
int64_t send_bytes_within(Channel& channel, const py::object& data, double timeout) {
  BufferView view(data);
  const int64_t ns = timeout <= 0 ? 0 : int64_t(timeout * 1e9);
  py::gil_scoped_release no_gil;
  return channel.send_within(view.data(), view.size(), ns);
}

int64_t timeout_ns(const py::object& seconds) {
  if (seconds.is_none()) return -1;
  double s = seconds.cast<double>();
  return s <= 0 ? 0 : int64_t(s * 1e9);
}

// A torch_ipc.Pipe end for a process its owner did not start (Note [fds for one fetch]).
void bind_channel_fds(py::module_& m) {
  m.def(
      "channel_publish_fds",
      [](const std::vector<int>& fds) {
        std::vector<UniqueFd> dups;
        for (int fd : fds) {
          dups.emplace_back(fcntl(fd, F_DUPFD_CLOEXEC, 0));
          if (dups.back().get() < 0) throw_os_error("fcntl(F_DUPFD_CLOEXEC)", "of a channel's fd");
        }
        return fd_publish_once(std::move(dups));
      },
      py::arg("fds"),
      "Duplicates of `fds`, published by the fd server for one fetch (Note [fds for one fetch]); returns its id.");
  m.def(
      "channel_fetch_fds",
      [](uint32_t pid, uint64_t start_time, uint32_t life, uint32_t pidns, uint64_t id) {
        std::vector<ReceivedItem> items;
        {
          py::gil_scoped_release release;
          items = fd_fetch(ProcessId{pid, start_time, life, pidns}, id, {});
        }
        std::vector<int> out;  // the caller's to close
        for (auto& item : items) out.push_back(item.fd.release());
        return out;
      },
      py::arg("pid"), py::arg("start_time"), py::arg("life"), py::arg("pidns"), py::arg("id"),
      "The fds that process published under `id` (channel_publish_fds there), through its fd server.");
}

}  // namespace

void bind_channel(py::module_& m) {
  using ReleaseGil = py::call_guard<py::gil_scoped_release>;
  py::class_<Channel, std::shared_ptr<Channel>>(m, "Channel", "one end of a shared-memory channel (os/channel.h)")
      .def(py::init([](int memory, int socket, int bell0, int bell1, int side, uint32_t ring_bytes) {
             return std::make_shared<Channel>(UniqueFd(memory), UniqueFd(socket), UniqueFd(bell0), UniqueFd(bell1),
                                              side, ring_bytes);
           }),
           py::arg("memory_fd"), py::arg("socket_fd"), py::arg("bell0_fd"), py::arg("bell1_fd"), py::arg("side"),
           py::arg("ring_bytes"), "takes the fds: they are closed with the channel, or now if a check fails")
      .def("send_bytes", &send_bytes, py::arg("data"))
      .def("send_bytes_within", &send_bytes_within, py::arg("data"), py::arg("timeout"))
      .def("recv_bytes", &recv_message, py::arg("max_length") = -1)
      .def(
          "poll",
          [](Channel& c, const py::object& timeout) {
            int64_t ns = timeout_ns(timeout);
            py::gil_scoped_release no_gil;
            return c.poll(ns);
          },
          py::arg("timeout"))
      .def("fileno", &Channel::wait_fd, ReleaseGil())
      .def("close", &Channel::close, ReleaseGil())
      .def_property_readonly("closed", &Channel::closed)
      .def_property_readonly("side", &Channel::side)
      .def_property_readonly("ring_bytes", &Channel::ring_bytes)
      .def(
          "fds",
          [](const Channel& c) {
            TORCH_IPC_CHECK(!c.closed(), "torch_ipc: the connection is closed");
            return py::make_tuple(c.memory_fd(), c.socket_fd(), c.bell_fd(0), c.bell_fd(1));
          },
          "(memory, socket, bell0, bell1): the channel's own fds, to duplicate for a child")
      .def("after_fork", &Channel::after_fork);
  m.def(
      "channel_segment",
      [](uint32_t ring_bytes) {
        ChannelFds fds = ChannelSegment::create(ring_bytes);
        return py::make_tuple(fds.memory.release(), fds.bell[0].release(), fds.bell[1].release());
      },
      py::arg("ring_bytes"), "a new channel segment: (memory fd, bell0 fd, bell1 fd), the caller's to close");
  bind_channel_fds(m);
  set_wait_interrupt_check(&python_signal_raised);
  m.def(
      "check_channel_memory",
      [](int fd, uint32_t ring_bytes, const py::object& between_reads) {
        if (between_reads.is_none()) return check_channel_memory(fd, ring_bytes);
        check_channel_memory(fd, ring_bytes, [&] { between_reads(); });
      },
      py::arg("fd"), py::arg("ring_bytes"), py::arg("between_reads") = py::none(),
      "the checks of a received segment's memory fd; `between_reads()` runs between the seal and size reads "
      "(for tests: a peer acting there)");
  m.def("channel_spin_ns", &ring_spin_ns);
  m.def("set_channel_spin_ns", &set_ring_spin_ns, py::arg("ns"));
  m.def(
      "channel_ring_offsets",
      [](int ring) {
        TORCH_IPC_CHECK_INDEX(ring == 0 || ring == 1, "torch_ipc: ring 0 or 1");
        return py::make_tuple(ring_head_offset(ring), ring_tail_offset(ring));
      },
      py::arg("ring"), "(head, tail): byte offsets in the segment, for tests that write over them");
}

}  // namespace torch_ipc::python
