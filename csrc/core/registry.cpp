#include "core/registry.h"

#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "base/fork.h"

#include "core/release.h"

namespace torch_ipc {
namespace {

// The DataPtr context of every imported storage. `alloc` lives in a mapping
// that `hold` keeps.
struct ImportedStorage {
  std::shared_ptr<Hold> hold;
  const Allocation* alloc;
  uint64_t offset;
};

void delete_imported_storage(void* ctx) { delete static_cast<ImportedStorage*>(ctx); }

using LeaseKey = std::tuple<uint32_t, uint32_t, uint64_t>;  // own leases: segment, slot, generation
LeaseKey key_of(const LeaseRecord& l) { return {l.segment, l.slot, l.generation}; }

struct Exports {
  std::mutex mu;
  std::map<LeaseKey, std::unique_ptr<ExportRecord>> records;
};

// A forked child starts with no record, leaking the parent's: their storages
// are the parent's to free (Note [fork]).
Exports& exports() { return *process_state<Exports>(); }

}  // namespace

c10::DataPtr imported_data_ptr(void* data, std::shared_ptr<Hold> hold, const Allocation* alloc, uint64_t offset,
                               c10::Device device) {
  auto* ctx = new ImportedStorage{std::move(hold), alloc, offset};
  return c10::DataPtr(data, ctx, &delete_imported_storage, device);
}

std::optional<ImportedOrigin> imported_origin(const c10::Storage& storage) {
  if (storage.data_ptr().get_deleter() != &delete_imported_storage) return std::nullopt;
  const auto* ctx = static_cast<const ImportedStorage*>(storage.data_ptr().get_context());
  return ImportedOrigin{Location{*ctx->alloc, ctx->offset}, ctx->hold->lease};
}

void exports_forget_after_fork() { forget_after_fork<Exports>(); }
const AfterForkInChild reset_exports_after_fork(&exports_forget_after_fork);

void register_export(std::unique_ptr<ExportRecord> record) {
  Exports& e = exports();
  std::lock_guard<std::mutex> lock(e.mu);
  LeaseKey key = key_of(record->lease);
  e.records.emplace(key, std::move(record));
}

bool export_is_live(const LeaseRecord& lease) {
  Exports& e = exports();
  std::lock_guard<std::mutex> lock(e.mu);
  return e.records.count(key_of(lease)) > 0;
}

void end_open_ended(const LeaseRecord& lease) {
  Exports& e = exports();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.records.find(key_of(lease));
  if (it != e.records.end()) it->second->open_ended = false;
}

std::optional<c10::Storage> find_exported_storage(const LeaseRecord& lease, const Location& where, uint64_t nbytes,
                                                  size_t& next) {
  Exports& e = exports();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.records.find(key_of(lease));
  if (it == e.records.end()) return std::nullopt;
  const ExportRecord& r = *it->second;
  auto matches = [&](size_t i) {
    const Location& loc = r.locations[i];
    return loc.alloc.kind == where.alloc.kind && loc.alloc.handle == where.alloc.handle && loc.offset == where.offset &&
           r.storages[i].nbytes() == nbytes;
  };
  for (size_t k = 0; k < r.storages.size(); ++k) {
    const size_t i = (next + k) % r.storages.size();
    if (!matches(i)) continue;
    next = i + 1;
    return r.storages[i];
  }
  return std::nullopt;
}

namespace {

// Note [open-ended exports] in export.cpp: how many references the records
// hold on each storage that an open-ended record holds: the rest of a storage's references are the producer's own.
std::unordered_map<const c10::StorageImpl*, size_t> references_of_records(const Exports& e) {
  std::unordered_map<const c10::StorageImpl*, size_t> refs;
  for (auto& [key, r] : e.records)
    if (r->open_ended)
      for (const c10::Storage& s : r->storages) refs[s.unsafeGetStorageImpl()] = 0;
  if (refs.empty()) return refs;
  for (auto& [key, r] : e.records)
    for (const c10::Storage& s : r->storages) {
      auto it = refs.find(s.unsafeGetStorageImpl());
      if (it != refs.end()) ++it->second;
    }
  return refs;
}

bool held_outside(const ExportRecord& r, const std::unordered_map<const c10::StorageImpl*, size_t>& refs_of_records) {
  for (const c10::Storage& s : r.storages)
    if (s.use_count() > refs_of_records.at(s.unsafeGetStorageImpl())) return true;
  return false;
}

}  // namespace

int drop_exports(const std::function<bool(const ExportRecord&)>& reclaim) {
  Exports& e = exports();
  std::vector<std::unique_ptr<ExportRecord>> dropped;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    const auto refs_of_records = references_of_records(e);
    for (auto it = e.records.begin(); it != e.records.end();) {
      const ExportRecord& r = *it->second;
      if (!(r.open_ended && held_outside(r, refs_of_records)) && reclaim(r)) {
        dropped.push_back(std::move(it->second));
        it = e.records.erase(it);
      } else {
        ++it;
      }
    }
  }
  return static_cast<int>(dropped.size());  // storages die here, outside the lock
}

void for_each_export(const std::function<void(const ExportRecord&)>& visit) {
  Exports& e = exports();
  std::lock_guard<std::mutex> lock(e.mu);
  for (auto& [key, r] : e.records) visit(*r);
}

}  // namespace torch_ipc
