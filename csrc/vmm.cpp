// VMM sharing: the producer's cache of exported physical allocations, the
// consumer's import + map sequence, and SharedPool's allocations.
#include "vmm.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

#include <unistd.h>

#include "cuda_context.h"
#include "cuda_driver.h"
#include "errors.h"
#include "fd_passing.h"
#include "process.h"

namespace torch_ipc {
namespace {

// Note [VMM handle field]
// A storage in VMM memory may span several physical allocations: torch's
// expandable segments map many cuMemCreate chunks (2 MiB in the small pool,
// 20 MiB in the large one) back to back in one reserved range. The
// descriptor's AllocRecord then stands for the run of chunks the storage
// touches (size = their total bytes, offset = where the storage starts in the
// first), and its 64-byte handle field says how to get them:
//   u8  version (1)          u8  handle type (CU_MEM_HANDLE_TYPE_*)
//   u16 fd numbers present   u32 chunks in the run
//   u64 export id            the producer's random id for the run (fd_publish)
//   u64 chunk bytes          when all chunks have one size, else 0
//   u32 producer pid         i32 x 9: the producer's fd numbers, for pidfd_getfd
// The consumer asks the producer (named by the lease owner) for the run by
// id, gets one shareable handle per chunk, reserves one range and maps each
// chunk in order: a consumer maps whole allocations, never part of one.
// Values are stored in host byte order; both sides are one machine.
constexpr uint8_t kFieldVersion = 1;
constexpr int kMaxFdNumbers = 9;
struct HandleField {
  uint8_t version;
  uint8_t type;
  uint16_t n_fds;
  uint32_t n_chunks;
  uint64_t id;
  uint64_t chunk_bytes;
  uint32_t pid;
  int32_t fds[kMaxFdNumbers];
};
static_assert(sizeof(HandleField) == 64, "the handle field is 64 bytes");

bool known_type(uint8_t t) {
  return t == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || t == CU_MEM_HANDLE_TYPE_FABRIC;
}

std::string not_shareable(const std::string& why) {
  return "torch_ipc: this CUDA tensor's memory cannot be shared: it is not a cudaMalloc segment "
         "(legacy CUDA IPC) and not a cuMemCreate allocation either (" + why +
         "). Memory from cudaMallocAsync pools (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) "
         "cannot be shared; copy the tensor into torch_ipc.SharedPool memory, or use "
         "torch_ipc.dumps(..., isolated=True)";
}

// ---------------------------------------------------------------- producer

// One physical allocation, retained and exported. Its fd stays open (and the
// retained handle keeps the memory) until no published run uses it.
struct Chunk {
  int device = -1;
  uint64_t size = 0;
  bool retained = false;
  CUmemGenericAllocationHandle handle = 0;
  CUmemAllocationHandleType type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  UniqueFd fd;
  Blob64 blob{};
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
// export record of export.cpp holds its storages, so a lease held by a
// consumer keeps the run, its fds and their numbers. A live storage also
// keeps torch from unmapping the chunks under it, so a chunk found at an
// address is the allocation the run names. Chunks are keyed by the driver's
// MEMORY_BLOCK_ID (unique in the process for each physical allocation; where
// the driver gives none, a chunk is exported afresh each time), runs by their
// chunks; dead storages are pruned by vmm_collect (called by the
// collector) and before every new export. Until then the retained handles keep
// physical memory that torch may have unmapped: at most one collect interval.
// A run located for a whole message (Note [VMM runs per message] in
// export.cpp) lives as long as its longest-lived storage, and with it the
// chunks of its other storages: like a cudaMalloc segment, which torch cannot
// free while one block in it is in use.
struct Exporter {
  std::mutex mu;
  std::unordered_map<unsigned long long, std::weak_ptr<Chunk>> chunks;
  std::map<std::vector<const Chunk*>, std::shared_ptr<Group>> groups;
};

Exporter& exporter() {
  static Exporter* e = new Exporter();  // outlives static destructors
  return *e;
}

// Called with e.mu held; what dies is moved to `dropped`, destroyed after the lock.
void sweep(Exporter& e, std::vector<std::shared_ptr<Group>>& dropped) {
  for (auto it = e.groups.begin(); it != e.groups.end();) {
    auto& users = it->second->users;
    users.erase(std::remove_if(users.begin(), users.end(), [](auto& w) { return w.expired(); }),
                users.end());
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
  if (r != CUDA_SUCCESS) throw std::runtime_error(not_shareable(driver_error_message("cuMemRetainAllocationHandle", r)));
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
    throw std::runtime_error(
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
  HandleField f{};
  f.version = kFieldVersion;
  f.type = static_cast<uint8_t>(g->chunks[0]->type);
  TORCH_CHECK(g->chunks.size() <= UINT32_MAX, "torch_ipc: too many allocations under one storage");
  f.n_chunks = static_cast<uint32_t>(g->chunks.size());
  f.chunk_bytes = g->chunks[0]->size;
  std::vector<PublishedItem> items;
  for (auto& c : g->chunks) {
    TORCH_CHECK(c->type == g->chunks[0]->type,
                "torch_ipc: a storage spans allocations with different shareable handle types");
    if (c->size != f.chunk_bytes) f.chunk_bytes = 0;
    g->size += c->size;
    items.push_back(PublishedItem{c->size, c->fd.get(), c->blob});
  }
  for (int& fd : f.fds) fd = -1;
  if (f.type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && f.chunk_bytes != 0 &&
      g->chunks.size() <= kMaxFdNumbers) {
    f.n_fds = static_cast<uint16_t>(g->chunks.size());
    for (size_t i = 0; i < g->chunks.size(); ++i) f.fds[i] = g->chunks[i]->fd.get();
  }
  f.pid = static_cast<uint32_t>(getpid());
  f.id = fd_publish(items);
  g->id = f.id;
  std::memcpy(g->field.data(), &f, 64);
  return g;
}

// ---------------------------------------------------------------- pool

std::atomic<int64_t> pool_count{0}, pool_bytes{0}, mapping_count{0}, mapped_bytes{0};

struct PoolAllocation {
  int device = -1;
  uint64_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
  bool created = false, reserved = false, mapped = false;
  ~PoolAllocation() {
    if (in_forked_child()) return;  // the parent's memory; CUDA is unusable here (Note [fork])
    try {
      ScopedContext scope(device);
      // Note [pool frees synchronize]: cuMemUnmap does not wait for kernels
      // still using the memory, and a storage deleter does not know which
      // streams used it; so wait for the device, as cudaFree would.
      if (mapped) {
        TORCH_IPC_CU_WARN(cuCtxSynchronize);
        TORCH_IPC_CU_WARN(cuMemUnmap, va, size);
      }
      if (created) TORCH_IPC_CU_WARN(cuMemRelease, handle);
      if (reserved) TORCH_IPC_CU_WARN(cuMemAddressFree, va, size);
    } catch (const std::exception& e) {
      TORCH_WARN("torch_ipc: freeing a SharedPool allocation failed: ", e.what());
    }
    if (created) {
      --pool_count;
      pool_bytes -= static_cast<int64_t>(size);
    }
  }
};

void delete_pool_allocation(void* ctx) { delete static_cast<PoolAllocation*>(ctx); }

CUmemAllocationProp pool_prop(int device, CUmemAllocationHandleType type) {
  TORCH_CHECK(known_type(type), "torch_ipc: handle type must be POSIX_FILE_DESCRIPTOR (1) or FABRIC (8), not ",
              static_cast<int>(type));
  CUdevice dev;
  TORCH_IPC_CU(cuDeviceGet, &dev, device);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = type;
  return prop;
}

// The cuMemMap mapping that holds address p: its start, its size, and the
// driver's id of the physical allocation behind it (0 when the driver has none).
struct MappedChunk {
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long block = 0;
};

MappedChunk chunk_at(CUdeviceptr p) {
  MappedChunk c;
  // The driver's MAPPING_* attributes (CUDA >= 11.7) name the mapping and its
  // physical allocation; where they are not answered, cuMemGetAddressRange
  // returns the mapped region (not the reservation) for VMM memory.
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                 CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
                                 CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID};
  void* values[] = {&c.base, &c.size, &c.block};
  bool ok = driver().cuPointerGetAttributes(3, attrs, values, p) == CUDA_SUCCESS && c.size != 0 &&
            c.base <= p && p < c.base + c.size;
  if (!ok) {
    c = MappedChunk{};
    CUresult r = driver().cuMemGetAddressRange(&c.base, &c.size, p);
    if (r != CUDA_SUCCESS || c.size == 0 || c.base > p || c.base + c.size <= p)
      throw std::runtime_error(not_shareable(
          r != CUDA_SUCCESS ? driver_error_message("cuMemGetAddressRange", r)
                            : "the driver reports no mapping at this address"));
  }
  return c;
}

c10::DispatchKeySet cuda_keys() { return c10::DispatchKeySet(c10::DispatchKey::CUDA); }

void delete_storage_ref(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

}  // namespace

// ---------------------------------------------------------------- producer API

std::vector<VmmLocation> locate_vmm(const std::vector<c10::Storage>& storages, int device) {
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

  std::vector<VmmLocation> out(storages.size());
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
        g.users.emplace_back(
            c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(const_cast<c10::StorageImpl*>(impl)));
      out[order[k]] = VmmLocation{g.field, g.size, spans[order[k]].data - run.front().base};
    }
    i = j;
  }
  return out;
}

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

// ---------------------------------------------------------------- consumer API

VmmMapping::~VmmMapping() {
  if (device < 0) return;
  try {
    ScopedContext scope(device);
    for (auto it = mapped.rbegin(); it != mapped.rend(); ++it)
      TORCH_IPC_CU_WARN(cuMemUnmap, it->first, it->second);
    for (auto h : handles) TORCH_IPC_CU_WARN(cuMemRelease, h);
    if (base != 0) TORCH_IPC_CU_WARN(cuMemAddressFree, base, size);
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: unmapping shared VMM memory failed: ", e.what());
  }
  if (base != 0) {
    --mapping_count;
    mapped_bytes -= static_cast<int64_t>(size);
  }
}

std::shared_ptr<VmmMapping> import_vmm(const Handle64& handle, uint64_t size, int device,
                                       const ProcessId& owner) {
  HandleField f;
  std::memcpy(&f, handle.data(), sizeof(f));
  auto bad = [](const std::string& what) {
    return DescriptorError("malformed torch_ipc descriptor: VMM handle field: " + what);
  };
  if (f.version != kFieldVersion) throw bad("unknown version " + std::to_string(f.version));
  if (!known_type(f.type)) throw bad("unknown handle type " + std::to_string(f.type));
  if (f.n_chunks == 0 || f.id == 0) throw bad("no allocations");
  if (f.n_fds != 0 && (f.n_fds != f.n_chunks || f.n_fds > kMaxFdNumbers || f.chunk_bytes == 0))
    throw bad("inconsistent fd numbers");
  if (f.pid != owner.pid)
    throw bad("it names pid " + std::to_string(f.pid) + " but its lease belongs to pid " +
              std::to_string(owner.pid));
  if (f.chunk_bytes != 0 && (size / f.chunk_bytes != f.n_chunks || size % f.chunk_bytes != 0))
    throw bad("allocation size " + std::to_string(size) + " is not " + std::to_string(f.n_chunks) +
              " chunks of " + std::to_string(f.chunk_bytes) + " bytes");
  const auto type = static_cast<CUmemAllocationHandleType>(f.type);

  std::vector<int> remote;
  if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) remote.assign(f.fds, f.fds + f.n_fds);
  std::vector<ReceivedItem> items = fd_fetch(owner, f.id, remote);
  if (items.size() != f.n_chunks)
    throw bad("the producer holds " + std::to_string(items.size()) + " allocations, the descriptor says " +
              std::to_string(f.n_chunks));
  uint64_t total = 0;
  for (auto& item : items) {
    if (item.size == 0) item.size = f.chunk_bytes;
    if (f.chunk_bytes != 0 && item.size != f.chunk_bytes) throw bad("the producer reports other chunk sizes");
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && item.fd.get() < 0)
      throw bad("the producer sent no file descriptor");
    total += item.size;
  }
  if (total != size)
    throw bad("the allocations hold " + std::to_string(total) + " bytes, the descriptor says " +
              std::to_string(size));

  ScopedContext scope(device);
  auto m = std::make_shared<VmmMapping>();
  m->device = device;
  size_t alignment = 0;
  CUmemAllocationProp last_prop{};
  size_t granularity = 0;
  for (auto& item : items) {
    CUmemGenericAllocationHandle h;
    void* os_handle = type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                          ? reinterpret_cast<void*>(static_cast<uintptr_t>(item.fd.get()))
                          : static_cast<void*>(item.blob.data());
    CUresult r = driver().cuMemImportFromShareableHandle(&h, os_handle, type);
    item.fd.reset();  // the imported handle holds the memory now
    if (r != CUDA_SUCCESS)
      throw_driver_error("cuMemImportFromShareableHandle", r,
                         "torch_ipc: what the producer (pid " + std::to_string(owner.pid) +
                             ") sent is not a CUDA allocation this process can import" +
                             (type == CU_MEM_HANDLE_TYPE_FABRIC ? " (fabric handles need an IMEX channel)" : ""));
    m->handles.push_back(h);
    CUmemAllocationProp prop{};
    TORCH_IPC_CU(cuMemGetAllocationPropertiesFromHandle, &prop, h);
    if (granularity == 0 || std::memcmp(&prop, &last_prop, sizeof(prop)) != 0) {
      granularity = 0;
      TORCH_IPC_CU(cuMemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      last_prop = prop;
    }
    if (granularity == 0 || item.size % granularity != 0)
      throw bad("a chunk of " + std::to_string(item.size) + " bytes is not a multiple of the granularity " +
                std::to_string(granularity));
    alignment = std::max(alignment, granularity);
  }
  TORCH_IPC_CU(cuMemAddressReserve, &m->base, size, alignment, 0, 0);
  m->size = size;
  ++mapping_count;
  mapped_bytes += static_cast<int64_t>(size);
  CUdeviceptr at = m->base;
  for (size_t i = 0; i < items.size(); ++i) {
    CUresult r = driver().cuMemMap(at, items[i].size, 0, m->handles[i], 0);
    if (r != CUDA_SUCCESS)
      throw_driver_error("cuMemMap", r,
                         "torch_ipc: mapping " + std::to_string(items[i].size) + " bytes of allocation " +
                             std::to_string(i) + " from pid " + std::to_string(owner.pid) +
                             " (is the allocation smaller than the descriptor says?)");
    m->mapped.emplace_back(at, items[i].size);
    at += items[i].size;
  }
  CUdevice dev;
  TORCH_IPC_CU(cuDeviceGet, &dev, device);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // One call for the whole range: the chunks are mapped back to back, and
  // the driver's cost is per call as well as per page.
  TORCH_IPC_CU(cuMemSetAccess, m->base, m->size, &access, 1);
  return m;
}

// ---------------------------------------------------------------- pool API

uint64_t vmm_granularity(int device, CUmemAllocationHandleType handle_type) {
  ScopedContext scope(device);
  CUmemAllocationProp prop = pool_prop(device, handle_type);
  size_t g = 0;
  TORCH_IPC_CU(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  return g;
}

at::Tensor vmm_pool_empty(const std::vector<int64_t>& sizes, c10::ScalarType dtype, int device,
                          CUmemAllocationHandleType handle_type) {
  uint64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "torch_ipc: negative dimension ", s);
    TORCH_CHECK(s == 0 || numel <= UINT64_MAX / static_cast<uint64_t>(s), "torch_ipc: tensor too large");
    numel *= static_cast<uint64_t>(s);
  }
  const uint64_t item = c10::elementSize(dtype);
  TORCH_CHECK(numel <= UINT64_MAX / item, "torch_ipc: tensor too large");
  const uint64_t nbytes = numel * item;

  ScopedContext scope(device);
  CUmemAllocationProp prop = pool_prop(device, handle_type);
  size_t granularity = 0;
  TORCH_IPC_CU(cuMemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  auto a = std::make_unique<PoolAllocation>();
  a->device = device;
  a->size = (std::max<uint64_t>(nbytes, 1) + granularity - 1) / granularity * granularity;
  CUresult r = driver().cuMemCreate(&a->handle, a->size, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    TORCH_CHECK_WITH(OutOfMemoryError, false, "torch_ipc.SharedPool: out of memory allocating ",
                     a->size, " bytes on CUDA device ", device);
  if (r != CUDA_SUCCESS && handle_type == CU_MEM_HANDLE_TYPE_FABRIC)
    throw_driver_error("cuMemCreate", r,
                       "torch_ipc.SharedPool: cannot create memory with fabric handles here; they "
                       "need an IMEX channel (/dev/nvidia-caps-imex-channels) on a system with a "
                       "multi-node NVLink fabric; use handle_type='posix_fd'");
  if (r != CUDA_SUCCESS) throw_driver_error("cuMemCreate", r);
  a->created = true;
  ++pool_count;
  pool_bytes += static_cast<int64_t>(a->size);
  TORCH_IPC_CU(cuMemAddressReserve, &a->va, a->size, granularity, 0, 0);
  a->reserved = true;
  TORCH_IPC_CU(cuMemMap, a->va, a->size, 0, a->handle, 0);
  a->mapped = true;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TORCH_IPC_CU(cuMemSetAccess, a->va, a->size, &access, 1);
  // Note [pool tail]: a consumer maps the whole allocation; what lies past the
  // tensor must not be stale bytes of memory this process freed before.
  if (a->size > nbytes)
    TORCH_IPC_CU(cuMemsetD8Async, a->va + nbytes, 0, a->size - nbytes, current_stream(device));

  void* ptr = reinterpret_cast<void*>(a->va);
  c10::DataPtr data(ptr, a.release(), &delete_pool_allocation,
                    c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), cuda_keys(),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

bool vmm_is_pool_storage(const c10::Storage& storage) {
  return storage.data_ptr().get_deleter() == &delete_pool_allocation;
}

at::Tensor vmm_mapping_view(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda() && t.storage().nbytes() > 0, "torch_ipc: need a non-empty CUDA tensor");
  int device = t.device().index();
  ScopedContext scope(device);
  auto [base, size, block] = chunk_at(reinterpret_cast<CUdeviceptr>(t.storage().data()));
  (void)block;
  c10::DataPtr data(reinterpret_cast<void*>(base), new c10::Storage(t.storage()), &delete_storage_ref,
                    t.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), cuda_keys(),
                                                   c10::scalarTypeToTypeMeta(c10::ScalarType::Byte));
  impl->set_sizes_contiguous({static_cast<int64_t>(size)});
  return at::Tensor(std::move(impl));
}

VmmStats vmm_stats() {
  Exporter& e = exporter();
  VmmStats s{};
  {
    std::lock_guard<std::mutex> lock(e.mu);
    s.export_groups = static_cast<int64_t>(e.groups.size());
    for (auto& [block, weak] : e.chunks) {
      if (auto c = weak.lock()) {
        ++s.exported_chunks;
        s.exported_bytes += static_cast<int64_t>(c->size);
      }
    }
  }
  s.pool_allocations = pool_count.load();
  s.pool_bytes = pool_bytes.load();
  s.mappings = mapping_count.load();
  s.mapped_bytes = mapped_bytes.load();
  return s;
}

}  // namespace torch_ipc
