#include "features/weights/shared_counters.h"

#include <c10/util/Exception.h>

#include "base/errors.h"

namespace torch_ipc {
namespace {

// Note [counters across processes]
// The slots are plain int64 in memory that other processes map. The __atomic
// builtins on an aligned 8-byte slot are lock-free on every 64-bit target we
// build for, so they synchronise across processes as they do across threads;
// seq_cst everywhere because the weights protocol (torch_ipc/weights) is a
// store-then-load handshake between two sides, which weaker orders allow to
// reorder.
int64_t* slot(const at::Tensor& counters, int64_t index) {
  TORCH_IPC_CHECK_VALUE(counters.defined() && counters.device().is_cpu() && counters.scalar_type() == at::kLong &&
                            counters.is_contiguous(),
                        "torch_ipc: counters must be a contiguous int64 CPU tensor");
  TORCH_IPC_CHECK_INDEX(index >= 0 && index < counters.numel(), "torch_ipc: counter index ", index,
                        " out of range for ", counters.numel(), " counters");
  int64_t* p = counters.data_ptr<int64_t>() + index;
  TORCH_IPC_CHECK_VALUE(reinterpret_cast<uintptr_t>(p) % alignof(int64_t) == 0, "torch_ipc: counter slot not aligned");
  static_assert(__atomic_always_lock_free(sizeof(int64_t), 0), "64-bit atomics must be lock-free");
  return p;
}

}  // namespace

int64_t counter_load(const at::Tensor& counters, int64_t index) {
  return __atomic_load_n(slot(counters, index), __ATOMIC_SEQ_CST);
}

void counter_store(const at::Tensor& counters, int64_t index, int64_t value) {
  __atomic_store_n(slot(counters, index), value, __ATOMIC_SEQ_CST);
}

int64_t counter_compare_exchange(const at::Tensor& counters, int64_t index, int64_t expected, int64_t desired) {
  __atomic_compare_exchange_n(slot(counters, index), &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}

}  // namespace torch_ipc
