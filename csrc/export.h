// Producer side: turn tensors into a descriptor. Owns the base-allocation
// lookups and their caches, the interprocess event pool, and the export
// records that keep storages alive until every consumer released them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cuda.h>

#include <optional>
#include <string>
#include <vector>

#include "descriptor.h"

namespace torch_ipc {

// `is_parameter[i]`: rebuild tensor i as an nn.Parameter (Python knows, C++ does not).
std::string export_tensors(const std::vector<at::Tensor>& tensors,
                           const std::vector<bool>& is_parameter, const std::string& payload,
                           uint32_t consumers);

// For a load in this very process: the live storage of one of our exports.
std::optional<c10::Storage> find_own_storage(const LeaseRecord& lease, AllocKind kind,
                                             const Handle64& handle, uint64_t offset,
                                             uint64_t nbytes);
// One of our pool events, by its IPC handle (nullptr if not ours).
CUevent find_own_event(const Handle64& handle);

// Reclaim exports whose tokens are spent and whose holders released or died.
// Returns how many were reclaimed.
int collect_exports();
// Give back the tokens of exports that nobody has loaded yet (their channel
// closed). `leases` empty: all of this process's exports.
void revoke_exports(const std::vector<LeaseRecord>& leases);

bool export_is_live(const LeaseRecord& lease);

struct ExportStats {
  int64_t exports, exported_bytes, tokens_pending, holders, dead_holders;
};
ExportStats export_stats();

}  // namespace torch_ipc
