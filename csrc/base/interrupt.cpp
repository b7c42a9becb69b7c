#include "base/interrupt.h"

#include <atomic>

namespace torch_ipc {
namespace {
std::atomic<InterruptCheck> g_interrupt_check{nullptr};
}  // namespace

void set_wait_interrupt_check(InterruptCheck check) { g_interrupt_check.store(check, std::memory_order_relaxed); }

bool wait_interrupted() {
  InterruptCheck check = g_interrupt_check.load(std::memory_order_relaxed);
  return check != nullptr && check();
}

}  // namespace torch_ipc
