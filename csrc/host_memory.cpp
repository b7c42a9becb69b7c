#include "host_memory.h"

#include <cstring>
#include <mutex>
#include <set>

#include <c10/core/CPUAllocator.h>

#include "names.h"
#include "process.h"
#include "refcount.h"

namespace torch_ipc {
namespace {

// The DataPtr context of a storage moved into shared memory by this process.
struct OwnedHostSegment;
std::mutex live_mutex;
std::set<OwnedHostSegment*>* live = new std::set<OwnedHostSegment*>();

struct OwnedHostSegment {
  std::unique_ptr<ShmMapping> shm;
  OwnedHostSegment(std::unique_ptr<ShmMapping> m) : shm(std::move(m)) {
    std::lock_guard<std::mutex> lock(live_mutex);
    live->insert(this);
  }
  ~OwnedHostSegment() {
    if (in_forked_child()) shm->disown();  // the parent's name, Note [fork]
    std::lock_guard<std::mutex> lock(live_mutex);
    live->erase(this);
  }
};

void delete_owned_host_segment(void* ctx) { delete static_cast<OwnedHostSegment*>(ctx); }

}  // namespace

HostSegment ensure_host_shared(const c10::Storage& storage) {
  const c10::DataPtr& current = storage.data_ptr();
  if (current.get_deleter() == &delete_owned_host_segment) {
    auto* seg = static_cast<OwnedHostSegment*>(current.get_context());
    return {seg->shm->name(), seg->shm->size()};
  }
  size_t nbytes = storage.nbytes();
  const uint32_t anchor = lease_anchor_segment();  // made first: Note [sweep]
  auto shm = create_under_random_name("a host segment", [&](uint64_t r) {
    return ShmMapping::create(host_segment_name(self_process(), anchor, r), nbytes);
  });
  std::memcpy(shm->data(), current.get(), nbytes);
  HostSegment out{shm->name(), nbytes};
  void* data = shm->data();
  auto* ctx = new OwnedHostSegment(std::move(shm));
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(data, ctx, &delete_owned_host_segment, c10::Device(c10::DeviceType::CPU)));
  return out;
}

std::shared_ptr<ShmMapping> open_host_segment(const std::string& name, size_t min_size) {
  auto m = ShmMapping::open(name, min_size);
  return std::shared_ptr<ShmMapping>(m.release());
}

int host_segment_count() {
  std::lock_guard<std::mutex> lock(live_mutex);
  return static_cast<int>(live->size());
}

void host_unlink_all() {
  std::lock_guard<std::mutex> lock(live_mutex);
  for (OwnedHostSegment* seg : *live) seg->shm->unlink();
}

}  // namespace torch_ipc
