// State of the cuda layer kept per device for the life of the process.
#pragma once

#include <map>
#include <mutex>

namespace torch_ipc {

// One T per device, made on first use. Callers allocate it with new and never
// free it: it outlives static destructors, as the driver objects it holds do.
template <class T>
struct PerDevice {
  std::mutex mu;
  std::map<int, T> by_device;

  // The entry of `device`, made by make() the first time; call with `mu` held.
  // The reference stays valid: entries are never removed.
  template <class Make>
  T& at(int device, Make make) {
    auto it = by_device.find(device);
    if (it == by_device.end()) it = by_device.emplace(device, make()).first;
    return it->second;
  }
};

}  // namespace torch_ipc
