#include "memory/host_memory.h"

#include <cstring>
#include <mutex>
#include <set>

#include <c10/core/CPUAllocator.h>

#include "base/errors.h"
#include "base/fork.h"

#include "os/names.h"
#include "os/process.h"
#include "os/refcount.h"

namespace torch_ipc {
namespace {

// The DataPtr context of a storage moved into shared memory by this process.
struct OwnedHostSegment;
struct LiveSegments {
  std::mutex mu;
  std::set<OwnedHostSegment*> segments;
};
LiveSegments& live() { return *process_state<LiveSegments>(); }

struct OwnedHostSegment {
  std::unique_ptr<ShmMapping> shm;
  MadeHere made;
  OwnedHostSegment(std::unique_ptr<ShmMapping> m) : shm(std::move(m)) {
    std::lock_guard<std::mutex> lock(live().mu);
    live().segments.insert(this);
  }
  ~OwnedHostSegment() {
    if (made.inherited()) {  // the parent's name, in a forked child (Note [fork])
      shm->disown();
      return;
    }
    std::lock_guard<std::mutex> lock(live().mu);
    live().segments.erase(this);
  }
};

void delete_owned_host_segment(void* ctx) { delete static_cast<OwnedHostSegment*>(ctx); }

}  // namespace

bool is_host_shared(const c10::Storage& storage) {
  return storage.data_ptr().get_deleter() == &delete_owned_host_segment;
}

HostSegment ensure_host_shared(const c10::Storage& storage) {
  const c10::DataPtr& current = storage.data_ptr();
  if (current.get_deleter() == &delete_owned_host_segment) {
    auto* seg = static_cast<OwnedHostSegment*>(current.get_context());
    return {seg->shm->name(), seg->shm->size()};
  }
  size_t nbytes = storage.nbytes();
  const uint32_t anchor = lease_anchor_segment();  // made first: Note [sweep]
  auto shm = create_under_random_name("a host segment", [&](uint64_t r) {
    return ShmMapping::create(host_segment_name(self_process(), anchor, r), nbytes, self_process());
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
  // The name says whose it is (Note [names]); the file must be that process's
  // (Note [segment identity] in os/shm.h).
  auto parsed = name.size() > 1 && name[0] == '/' ? parse_shared_file_name(name.substr(1)) : std::nullopt;
  if (!parsed || parsed->lease)
    throw DescriptorError("malformed torch_ipc descriptor: " + name + " is not a host segment's name");
  auto m = ShmMapping::open(name, min_size, ProcessId{parsed->pid, parsed->start_time});
  return std::shared_ptr<ShmMapping>(m.release());
}

int host_segment_count() {
  std::lock_guard<std::mutex> lock(live().mu);
  return static_cast<int>(live().segments.size());
}

void host_unlink_all() {
  std::lock_guard<std::mutex> lock(live().mu);
  for (OwnedHostSegment* seg : live().segments) seg->shm->unlink();
}

// The parent's segments are not the child's to unlink at its exit.
void host_forget_after_fork() { forget_after_fork<LiveSegments>(); }
const AfterForkInChild reset_host_after_fork(&host_forget_after_fork);

}  // namespace torch_ipc
