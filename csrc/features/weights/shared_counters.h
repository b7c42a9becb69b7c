// Sequentially consistent 64-bit atomics on the int64 slots of a CPU tensor,
// for counters that several processes map (a tensor in POSIX shared memory):
// the weights control block, one call per atomic (Note [two control blocks]
// in torch_ipc/weights/_control.py says why it is not the KV table's mutex).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>

namespace torch_ipc {

int64_t counter_load(const at::Tensor& counters, int64_t index);
void counter_store(const at::Tensor& counters, int64_t index, int64_t value);
// Store `desired` if the slot holds `expected`; return the value it held.
int64_t counter_compare_exchange(const at::Tensor& counters, int64_t index, int64_t expected, int64_t desired);

}  // namespace torch_ipc
