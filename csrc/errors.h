// The C++ exception types of torch_ipc; bindings.cpp maps each to its Python class.
// Implementation files throw these (or TORCH_CHECK for bad arguments), never print.
#pragma once

#include <stdexcept>
#include <string>

namespace torch_ipc {

// A descriptor that is truncated, corrupted, of another format version, or from
// another host or boot. Python: torch_ipc.DescriptorError (a ValueError).
struct DescriptorError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A CUDA driver call failed. Python: torch_ipc.CudaError (a RuntimeError) with
// the driver's name for the error in `.error_name`.
struct CudaError : std::runtime_error {
  CudaError(const std::string& what, std::string name)
      : std::runtime_error(what), error_name(std::move(name)) {}
  std::string error_name;
};

// No usable CUDA driver in this process. Python: torch_ipc.CudaUnavailableError.
struct CudaUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The process that exported the memory has exited (or is in another PID
// namespace). Python: torch_ipc.ProducerGoneError.
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

}  // namespace torch_ipc
