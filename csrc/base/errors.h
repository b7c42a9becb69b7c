// The C++ exception types of torch_ipc; csrc/python/ maps each to its Python class.
// Implementation files throw these (bad arguments and usage limits through the
// TORCH_IPC_CHECK macros below), never a bare std::runtime_error or another
// std:: exception (std::invalid_argument, std::out_of_range), never print.
//
// Note [no c10 errors]
// A c10::Error (TORCH_CHECK) gathers a C++ backtrace when it is made, costly
// and of no use to a caller who passed a bad argument, and TORCH_CHECK formats
// its message through an ostringstream, which crashed this extension on the
// GPU machine (Note [messages without iostreams] in str.h). So torch_ipc's
// own checks throw these types, which gather nothing, with messages from
// torch_ipc::str.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "base/str.h"

namespace torch_ipc {

// A descriptor that is truncated, corrupted, of another format version, or from
// another host or boot. Python: torch_ipc.DescriptorError (a ValueError).
struct DescriptorError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A CUDA driver call failed. Python: torch_ipc.CudaError (a RuntimeError) with
// the driver's name for the error in `.error_name` and the call in `.call`.
// Built by throw_driver_error (cuda_driver.h) only.
struct CudaError : std::runtime_error {
  CudaError(const std::string& what, std::string name, std::string call_name)
      : std::runtime_error(what), error_name(std::move(name)), call(std::move(call_name)) {}
  std::string error_name;
  std::string call;
};

// No usable CUDA driver in this process. Python: torch_ipc.CudaUnavailableError.
struct CudaUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The process that exported the memory has exited (or is in another PID
// namespace). Python: torch_ipc.ProducerGoneError. Build it with producer_gone().
struct ProducerGone : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The export was already reclaimed by its producer: every consumer it was
// meant for has loaded and released it. Python: torch_ipc.ReleasedError.
struct Released : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The descriptor names a GPU (by UUID) that this process cannot see.
// Python: torch_ipc.DeviceNotFoundError.
struct DeviceNotFound : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A load would be one holder more than an export has room for (Note [holder
// limit] in refcount.h). Python: torch_ipc.HolderLimitError (a RuntimeError).
struct HolderLimit : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A KV pool's shared memory holds what no operation writes (Note [nothing
// trusted from the pool's segment] in features/kv/pool_segment.h). Python:
// torch_ipc.kv.PoolCorruptedError (a RuntimeError).
struct PoolCorrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A system call failed (sockets, shared memory, pidfd). Python: OSError with
// `errno` set, so the builtin subclass that fits (PermissionError,
// FileNotFoundError, ...) is what the caller catches.
struct OsError : std::runtime_error {
  OsError(int error_number, const std::string& what) : std::runtime_error(what), error_number(error_number) {}
  int error_number;
};

// "torch_ipc: <call> <subject> failed: <strerror(err)>[ <hint>]" as an OsError of
// err: for callers that captured errno before cleaning up (close, unlink).
OsError os_error(int err, const std::string& call, const std::string& subject = "", const std::string& hint = "");

// os_error(errno, call, subject): call it right after the failing call.
[[noreturn]] void throw_os_error(const std::string& call, const std::string& subject = "");

// The one wording of "the producer (pid N) has exited", and what is lost with it.
ProducerGone producer_gone(uint32_t pid, const std::string& consequence = "");

// A bad argument (Python ValueError), an index out of range (IndexError), a
// call this object cannot take now or a limit reached (RuntimeError).
struct InvalidValue : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidIndex : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidUse : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace torch_ipc

// TORCH_CHECK, TORCH_CHECK_VALUE, TORCH_CHECK_INDEX without a c10::Error
// (Note [no c10 errors]), their messages built by torch_ipc::str (Note
// [messages without iostreams]).
#define TORCH_IPC_CHECK_AS(type, cond, ...)                 \
  do {                                                      \
    if (!(cond)) throw type(::torch_ipc::str(__VA_ARGS__)); \
  } while (0)
#define TORCH_IPC_CHECK(cond, ...) TORCH_IPC_CHECK_AS(::torch_ipc::InvalidUse, cond, __VA_ARGS__)
#define TORCH_IPC_CHECK_VALUE(cond, ...) TORCH_IPC_CHECK_AS(::torch_ipc::InvalidValue, cond, __VA_ARGS__)
#define TORCH_IPC_CHECK_INDEX(cond, ...) TORCH_IPC_CHECK_AS(::torch_ipc::InvalidIndex, cond, __VA_ARGS__)
