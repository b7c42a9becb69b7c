#include "fork.h"

#include <pthread.h>

#include <mutex>

#include "process.h"

namespace torch_ipc {
namespace {

void after_fork_in_child() {
  reset_identity_after_fork();
  leases_forget_after_fork();
  exports_forget_after_fork();
  imports_forget_after_fork();
  host_forget_after_fork();
  events_forget_after_fork();
  ipc_events_forget_after_fork();
  locations_forget_after_fork();
  vmm_forget_after_fork();
  fd_server_forget_after_fork();
  collect_lock_forget_after_fork();
  cuda_forbid_after_fork();
}

}  // namespace

void install_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &after_fork_in_child); });
}

}  // namespace torch_ipc
