// VMM producer side: the export cache of physical allocations (chunks), the runs
// of them published for consumers (fd_publish), and their collection once dead.
#include "memory/vmm_export.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <unistd.h>
#include <unordered_map>

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include "base/errors.h"
#include "base/fork.h"

#include "wire/vmm_handle.h"

#include "os/fd_passing.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

#include "memory/shared_pool.h"
#include "memory/vmm_mapping.h"

namespace torch_ipc {
namespace {

// One physical allocation, retained and exported. Its fd stays open (and the
// retained handle keeps the memory) until no published run uses it.
struct Chunk {
  int device = -1;
  uint64_t size = 0;
  bool retained = false;
  CUmemGenericAllocationHandle handle = 0;
  CUmemAllocationHandleType type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  UniqueFd fd;
  Handle64 blob{};  // the fabric handle
  ~Chunk() {
    fd.reset();
    if (!retained) return;
    try {
      ScopedContext scope(device);
      TORCH_IPC_CU_WARN(cuMemRelease, handle);
    } catch (const std::exception& e) {
      TORCH_WARN("torch_ipc: releasing an exported allocation failed: ", e.what());
    }
  }
};

// A published run of chunks and the storages that use it (weakly).
struct Group {
  uint64_t id = 0;
  uint64_t size = 0;
  Handle64 field{};
  std::vector<std::shared_ptr<Chunk>> chunks;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> users;
  ~Group() {
    if (id != 0) fd_unpublish(id);  // before the chunks (and their fds) go
  }
};

// Note [VMM export lifetime]
// A run stays published while any storage that lies in it lives: the
// export record (registry.h) holds its storages, so a lease held by a
// consumer keeps the run, its fds and their numbers. A live storage also
// keeps torch from unmapping the chunks under it, so a chunk found at an
// address is the allocation the run names. Chunks are keyed by the driver's
// MEMORY_BLOCK_ID (unique in the process for each physical allocation; where
// the driver gives none, a chunk is exported afresh each time), runs by their
// chunks; dead storages are pruned by vmm_collect (called by the
// collector) and before every new export. Until then the retained handles keep
// physical memory that torch may have unmapped: at most one collect interval.
// A run located for a whole message (Note [VMM runs per message] in
// locate.cpp) lives as long as its longest-lived storage, and with it the
// chunks of its other storages: like a cudaMalloc segment, which torch cannot
// free while one block in it is in use.
struct Exporter {
  std::mutex mu;
  std::unordered_map<unsigned long long, std::weak_ptr<Chunk>> chunks;
  std::map<std::vector<const Chunk*>, std::shared_ptr<Group>> groups;
};

Exporter& exporter() { return *process_state<Exporter>(); }

// Called with e.mu held; what dies is moved to `dropped`, destroyed after the lock.
void sweep(Exporter& e, std::vector<std::shared_ptr<Group>>& dropped) {
  for (auto it = e.groups.begin(); it != e.groups.end();) {
    auto& users = it->second->users;
    users.erase(std::remove_if(users.begin(), users.end(), [](auto& w) { return w.expired(); }), users.end());
    if (users.empty()) {
      dropped.push_back(std::move(it->second));
      it = e.groups.erase(it);
    } else {
      ++it;
    }
  }
  // Chunks of the runs dropped now expire after the lock; their slots go next time.
  for (auto it = e.chunks.begin(); it != e.chunks.end();) {
    if (it->second.expired())
      it = e.chunks.erase(it);
    else
      ++it;
  }
}

std::shared_ptr<Chunk> export_chunk(CUdeviceptr va, uint64_t size, int device) {
  auto c = std::make_shared<Chunk>();
  c->device = device;
  c->size = size;
  CUresult r = driver().cuMemRetainAllocationHandle(&c->handle, reinterpret_cast<void*>(va));
  TORCH_IPC_CHECK(r == CUDA_SUCCESS, vmm_not_shareable(driver_error_message("cuMemRetainAllocationHandle", r)));
  c->retained = true;
  CUmemAllocationProp prop{};
  TORCH_IPC_CU(cuMemGetAllocationPropertiesFromHandle, &prop, c->handle);
  // POSIX fds when the allocation allows them (one machine needs nothing
  // more); fabric handles otherwise (they need an IMEX channel, see pool.py).
  if (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    c->type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    int fd = -1;
    TORCH_IPC_CU(cuMemExportToShareableHandle, &fd, c->handle, c->type, 0);
    c->fd.reset(fd);
  } else if (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) {
    c->type = CU_MEM_HANDLE_TYPE_FABRIC;
    CUmemFabricHandle fabric;
    TORCH_IPC_CU(cuMemExportToShareableHandle, &fabric, c->handle, c->type, 0);
    static_assert(sizeof(fabric) == 64, "a fabric handle is 64 bytes");
    std::memcpy(c->blob.data(), &fabric, 64);
  } else {
    TORCH_IPC_CHECK(false,
                    "torch_ipc: this CUDA tensor lives in a cuMemCreate allocation made without a shareable "
                    "handle type (requestedHandleTypes has neither POSIX_FILE_DESCRIPTOR nor FABRIC), so no "
                    "other process can map it. Allocate it from torch_ipc.SharedPool, or use "
                    "torch_ipc.dumps(..., isolated=True), which copies it there");
  }
  return c;
}

std::shared_ptr<Group> publish_group(std::vector<std::shared_ptr<Chunk>> chunks) {
  auto g = std::make_shared<Group>();
  g->chunks = std::move(chunks);
  VmmHandleField f;
  f.type = static_cast<uint8_t>(g->chunks[0]->type);
  TORCH_IPC_CHECK(g->chunks.size() <= UINT32_MAX, "torch_ipc: too many allocations under one storage");
  f.n_chunks = static_cast<uint32_t>(g->chunks.size());
  f.chunk_bytes = g->chunks[0]->size;
  std::vector<PublishedItem> items;
  for (auto& c : g->chunks) {
    TORCH_IPC_CHECK(c->type == g->chunks[0]->type,
                    "torch_ipc: a storage spans allocations with different shareable handle types");
    if (c->size != f.chunk_bytes) f.chunk_bytes = 0;
    g->size += c->size;
    items.push_back(PublishedItem{c->size, c->fd.get(), c->blob});
  }
  if (f.type == kVmmPosixFd && f.chunk_bytes != 0 && g->chunks.size() <= kVmmMaxFdNumbers)
    for (auto& c : g->chunks) f.fds.push_back(c->fd.get());
  f.pid = static_cast<uint32_t>(getpid());
  f.id = fd_publish(items);
  g->id = f.id;  // unpublished by ~Group from here on
  g->field = encode_vmm_handle(f);
  return g;
}

}  // namespace

std::vector<Location> locate_vmm(const std::vector<c10::Storage>& storages, int device) {
  Exporter& e = exporter();
  std::vector<std::shared_ptr<Group>> dropped;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(e.mu);
  sweep(e, dropped);

  // The chunks under each storage, and the storages in address order.
  struct Span {
    CUdeviceptr data;
    std::vector<MappedChunk> chunks;
    bool alone;  // SharedPool: never shares a run (isolation)
  };
  std::vector<Span> spans;
  spans.reserve(storages.size());
  for (const c10::Storage& s : storages) {
    Span span{reinterpret_cast<CUdeviceptr>(s.data()), {}, vmm_is_pool_storage(s)};
    const CUdeviceptr end = span.data + std::max<uint64_t>(s.nbytes(), 1);
    for (CUdeviceptr p = span.data; p < end;) {
      span.chunks.push_back(chunk_at(p));
      p = span.chunks.back().base + span.chunks.back().size;
    }
    spans.push_back(std::move(span));
  }
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a].data < spans[b].data; });

  std::vector<Location> out(storages.size());
  for (size_t i = 0; i < order.size();) {
    // A run: the chunks of storage order[i], extended by each next storage
    // whose first chunk is in the run or starts where the run ends.
    std::vector<MappedChunk> run = spans[order[i]].chunks;
    size_t j = i + 1;
    for (; j < order.size() && !spans[order[i]].alone; ++j) {
      const Span& next = spans[order[j]];
      const CUdeviceptr run_end = run.back().base + run.back().size;
      if (next.alone || next.chunks.front().base > run_end) break;
      for (const MappedChunk& c : next.chunks)
        if (c.base >= run_end) run.push_back(c);
    }
    std::vector<std::shared_ptr<Chunk>> chunks;
    chunks.reserve(run.size());
    for (const MappedChunk& m : run) {
      std::shared_ptr<Chunk> c;
      if (m.block != 0) {
        std::weak_ptr<Chunk>& slot = e.chunks[m.block];
        c = slot.lock();
        if (!c || c->size != m.size) slot = c = export_chunk(m.base, m.size, device);
      } else {
        c = export_chunk(m.base, m.size, device);  // no id to share it by
      }
      chunks.push_back(std::move(c));
    }
    std::vector<const Chunk*> key;
    for (auto& c : chunks) key.push_back(c.get());
    auto it = e.groups.find(key);
    if (it == e.groups.end()) it = e.groups.emplace(key, publish_group(std::move(chunks))).first;
    Group& g = *it->second;
    for (size_t k = i; k < j; ++k) {
      const c10::StorageImpl* impl = storages[order[k]].unsafeGetStorageImpl();
      bool known = false;
      for (auto& w : g.users) known = known || w._unsafe_get_target() == impl;
      if (!known)
        g.users.emplace_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(const_cast<c10::StorageImpl*>(impl)));
      out[order[k]] =
          Location{Allocation{AllocKind::CudaVmm, device, g.field, g.size}, spans[order[k]].data - run.front().base};
    }
    i = j;
  }
  return out;
}

// The child closes its copies of the parent's fds (they would keep the
// memory after the parent freed it) and leaks the rest: CUDA is unusable here.
void vmm_forget_after_fork() {
  {
    Exporter& e = exporter();
    std::unique_lock<std::mutex> lock(e.mu, std::try_to_lock);  // Note [reading the parent's state after fork]
    if (lock.owns_lock())
      for (auto& [id, weak] : e.chunks)
        if (auto chunk = weak.lock()) chunk->fd.reset();
  }
  forget_after_fork<Exporter>();
}
const AfterForkInChild reset_vmm_after_fork(&vmm_forget_after_fork);

int vmm_collect() {
  Exporter& e = exporter();
  std::vector<std::shared_ptr<Group>> dropped;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.groups.empty() && e.chunks.empty()) return 0;
    sweep(e, dropped);
  }
  return static_cast<int>(dropped.size());
}

VmmExportStats vmm_export_stats() {
  Exporter& e = exporter();
  VmmExportStats s;
  std::lock_guard<std::mutex> lock(e.mu);
  s.groups = static_cast<int64_t>(e.groups.size());
  for (auto& [block, weak] : e.chunks) {
    if (auto c = weak.lock()) {
      ++s.chunks;
      s.bytes += static_cast<int64_t>(c->size);
    }
  }
  return s;
}

}  // namespace torch_ipc
