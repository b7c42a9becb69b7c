// Consumer side: rebuild tensors from a descriptor on the producer's memory.
// Owns the per-process cache of opened allocations (each opened once), the
// holds on producers' leases, and the deferred release of those holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_ipc {

struct ImportResult {
  std::vector<at::Tensor> tensors;
  std::vector<bool> is_parameter;
  std::string payload;
};
ImportResult import_tensors(const std::string& data);

// Finish releases whose GPU work is done, close idle mappings (all of them when
// close_idle), and drop what belongs to producers that exited.
void collect_imports(bool close_idle);
// Wait for every deferred release and finish it (at exit).
void flush_imports();

struct ImportStats {
  int64_t holds, pending_releases, mappings_open, mappings_idle, events_open;
};
ImportStats import_stats();

}  // namespace torch_ipc
