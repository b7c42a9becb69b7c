// Where a storage's bytes come from, for the export and the import side alike:
// this process's live exports (own storages, by lease) and the storages it
// imported (the allocation they map and the lease they hold at the owner).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <c10/core/Storage.h>

#include "wire/descriptor.h"

#include "os/process.h"

#include "memory/location.h"

namespace torch_ipc {

// ---- imported storages
struct Hold;  // the hold of one import on one lease (core/release.h)

// Build the DataPtr of an imported storage at `data`, `offset` bytes into the
// allocation `alloc` of a mapping that `hold` keeps (in hold->mappings: the
// storage refers to it, copying nothing), and find what such a storage came from.
c10::DataPtr imported_data_ptr(void* data, std::shared_ptr<Hold> hold, const Allocation* alloc, uint64_t offset,
                               c10::Device device);
struct ImportedOrigin {
  Location where;
  LeaseRecord lease;  // held at the owner
};
std::optional<ImportedOrigin> imported_origin(const c10::Storage& storage);

// ---- own exports
// One export of this process: the storages it keeps alive until every
// consumer released them, and where each lives. Keyed by its lease.
struct ExportRecord {
  LeaseRecord lease;
  bool open_ended = false;  // Note [open-ended exports] in export.cpp
  std::vector<c10::Storage> storages;
  std::vector<Location> locations;  // parallel to storages
  uint64_t bytes = 0;
  int64_t exported_at_ns = 0;  // steady clock, for stats' ages
};

void register_export(std::unique_ptr<ExportRecord> record);
bool export_is_live(const LeaseRecord& lease);
// An open-ended export that its producer revoked: kept only while held, as a
// counted one with no token left.
void end_open_ended(const LeaseRecord& lease);
// For a load in this very process: the storage of our live export `lease`
// at `where` with `nbytes` bytes. `next`: where to look first, the index after
// the storage found last (a message lists its storages in the export's
// order, so a load of n storages looks n times, not n * n / 2); updated.
std::optional<c10::Storage> find_exported_storage(const LeaseRecord& lease, const Location& where, uint64_t nbytes,
                                                  size_t& next);
// Drop the records `reclaim` returns true for (outside the lock, so storages
// die without it). Open-ended records whose storages something outside the
// registry still references are kept without asking. Returns how many were
// dropped.
int drop_exports(const std::function<bool(const ExportRecord&)>& reclaim);
// Visit every live record (under the lock: `visit` must not call back here).
void for_each_export(const std::function<void(const ExportRecord&)>& visit);

}  // namespace torch_ipc
