#include "import.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

#include "cuda_context.h"
#include "cuda_driver.h"
#include "errors.h"
#include "export.h"
#include "host_memory.h"
#include "process.h"
#include "refcount.h"
#include "vmm.h"

namespace torch_ipc {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

struct OpenedEvent {
  CUevent event;
  int device;
  ProcessId producer;
};

// A hold whose tensors are gone, waiting for the GPU work queued on them.
struct PendingRelease {
  LeaseRecord lease;
  std::vector<std::pair<int, CUevent>> done;  // (device, event recorded at release)
  std::vector<std::shared_ptr<Mapping>> mappings;
};

// Note [idle mappings]
// A consumer that receives the same weights again and again (an inference
// engine fed by a trainer) would pay cuIpcOpenMemHandle (45-80 us) per base
// allocation per message if mappings closed with their last tensor. So a
// mapping with no tensor left stays open, idle, and is closed when its
// producer exits, when it has been idle TORCH_IPC_IDLE_SECONDS, when more than
// TORCH_IPC_IDLE_MAPPINGS are idle (oldest first), or on collect(close_idle=True).
// Only legacy IPC mappings stay idle; host and VMM ones close with their
// last tensor, since they would keep the producer's freed memory alive.
// The producer's lease is released already; the open handle may keep the
// segment's memory until it closes if the producer frees it (empty_cache).
struct Consumer {
  std::recursive_mutex mu;
  std::map<std::pair<uint8_t, Handle64>, std::shared_ptr<Mapping>> mappings;
  std::map<Handle64, OpenedEvent> events;
  std::vector<PendingRelease> pending;
  std::vector<std::pair<int, CUevent>> spare_events;
  std::atomic<int64_t> holds{0};
  const int64_t idle_ns = env_int("TORCH_IPC_IDLE_SECONDS", 60) * 1000000000ll;
  const int64_t max_idle = env_int("TORCH_IPC_IDLE_MAPPINGS", 1024);
};

Consumer& consumer() {
  static Consumer* c = new Consumer();  // used by deleters during interpreter exit
  return *c;
}

CUevent take_release_event(Consumer& c, int device) {
  for (auto it = c.spare_events.begin(); it != c.spare_events.end(); ++it) {
    if (it->first == device) {
      CUevent e = it->second;
      c.spare_events.erase(it);
      return e;
    }
  }
  CUevent e;
  TORCH_IPC_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
  return e;
}

void finish(Consumer& c, PendingRelease& p) {
  for (auto& de : p.done) c.spare_events.push_back(de);
  lease_unhold(p.lease);
  --c.holds;
}

// "/torch_ipc.<pid>.<start>.H<n>" and nothing else: a handle is never a path.
std::string host_name(const Handle64& h) {
  size_t n = 0;
  while (n < h.size() && h[n] != 0) ++n;
  std::string name(reinterpret_cast<const char*>(h.data()), n);
  unsigned pid = 0, segment = 0;
  unsigned long long start = 0;
  int used = 0;
  bool ok = std::sscanf(name.c_str(), "/torch_ipc.%u.%llu.H%u%n", &pid, &start, &segment, &used) == 3 &&
            used == static_cast<int>(n);
  for (char ch : name) ok = ok && (std::isdigit(static_cast<unsigned char>(ch)) || std::strchr("/torch_ipc.H", ch));
  if (!ok) throw DescriptorError("malformed torch_ipc descriptor: bad shared memory name");
  return name;
}

std::shared_ptr<Mapping> open_mapping(const AllocRecord& a, int device, const ProcessId& owner) {
  auto m = std::make_shared<Mapping>();
  m->kind = a.kind;
  m->device = device;
  m->size = a.size;
  m->handle = a.handle;
  m->producer = owner;
  if (a.kind == AllocKind::CpuShm) {
    std::string name = host_name(a.handle);
    std::shared_ptr<ShmMapping> shm;
    try {
      shm = open_host_segment(name, a.size);
    } catch (const std::runtime_error& e) {
      throw DescriptorError(std::string("torch_ipc descriptor names shared memory it cannot map: ") + e.what());
    }
    if (!shm) {
      if (!process_alive(owner))
        throw ProducerGone("torch_ipc: the producer (pid " + std::to_string(owner.pid) +
                           ") has exited and its shared memory is gone");
      throw Released("torch_ipc: the shared memory " + name + " was already released by its producer");
    }
    m->base = static_cast<char*>(shm->data());
    m->host = shm;
    return m;
  }
  if (a.kind == AllocKind::CudaVmm) {
    auto vmm = import_vmm(a.handle, a.size, device, owner);
    m->base = reinterpret_cast<char*>(vmm->base);
    m->vmm = std::move(vmm);
    return m;
  }
  if (a.kind != AllocKind::CudaIpc)
    throw DescriptorError("this build of torch_ipc cannot import allocation kind " +
                          std::to_string(static_cast<int>(a.kind)));
  ScopedContext scope(device);
  CUipcMemHandle h;
  std::memcpy(h.reserved, a.handle.data(), 64);
  CUdeviceptr ptr = 0;
  CUresult r = driver().cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    if (!process_alive(owner))
      throw ProducerGone("torch_ipc: the producer (pid " + std::to_string(owner.pid) + ") has exited");
    throw_driver_error("cuIpcOpenMemHandle", r);
  }
  m->base = reinterpret_cast<char*>(ptr);
  size_t range = 0;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_RANGE_SIZE;
  void* value = &range;
  CUresult q = driver().cuPointerGetAttributes(1, &attr, &value, ptr);
  if (q != CUDA_SUCCESS || range < a.size) {
    // m's destructor closes the handle.
    throw DescriptorError("malformed torch_ipc descriptor: the allocation is " +
                          std::to_string(range) + " bytes, the descriptor says " +
                          std::to_string(a.size));
  }
  return m;
}

std::shared_ptr<Mapping> get_mapping(Consumer& c, const AllocRecord& a, int device,
                                     const ProcessId& owner) {
  auto key = std::make_pair(static_cast<uint8_t>(a.kind), a.handle);
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  auto it = c.mappings.find(key);
  if (it != c.mappings.end() && it->second->size >= a.size && it->second->device == device) {
    it->second->idle_since_ns = 0;
    return it->second;
  }
  auto m = open_mapping(a, device, owner);
  c.mappings[key] = m;
  return m;
}

void wait_event(Consumer& c, const EventRecord& e, int device, const ProcessId& producer) {
  CUevent event = nullptr;
  if (producer == self_process()) {
    event = find_own_event(e.handle);
  } else {
    std::lock_guard<std::recursive_mutex> lock(c.mu);
    auto it = c.events.find(e.handle);
    if (it != c.events.end()) {
      event = it->second.event;
    } else {
      ScopedContext scope(device);
      CUipcEventHandle h;
      std::memcpy(h.reserved, e.handle.data(), 64);
      CUresult r = driver().cuIpcOpenEventHandle(&event, h);
      if (r != CUDA_SUCCESS) {
        if (!process_alive(producer))
          throw ProducerGone("torch_ipc: the producer (pid " + std::to_string(producer.pid) + ") has exited");
        throw_driver_error("cuIpcOpenEventHandle", r);
      }
      c.events.emplace(e.handle, OpenedEvent{event, device, producer});
    }
  }
  if (event == nullptr) throw DescriptorError("malformed torch_ipc descriptor: unknown event");
  ScopedContext scope(device);
  TORCH_IPC_CU(cuStreamWaitEvent, current_stream(device), event, 0);
}

c10::ScalarType checked_dtype(uint8_t code) {
  if (code >= static_cast<uint8_t>(c10::ScalarType::NumOptions) ||
      code == static_cast<uint8_t>(c10::ScalarType::Undefined))
    throw DescriptorError("malformed torch_ipc descriptor: unknown dtype code " + std::to_string(code));
  auto dtype = static_cast<c10::ScalarType>(code);
  if (c10::isQIntType(dtype))
    throw DescriptorError("torch_ipc cannot rebuild quantized dtype " + std::string(c10::toString(dtype)));
  return dtype;
}

void check_view_fits(const TensorRecord& t, size_t itemsize, uint64_t nbytes) {
  int64_t numel = 1;
  for (int64_t size : t.sizes)
    if (__builtin_mul_overflow(numel, size, &numel))
      throw DescriptorError("malformed torch_ipc descriptor: a tensor's element count overflows");
  unsigned __int128 last = static_cast<uint64_t>(t.storage_offset);
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    if (t.sizes[i] == 0) return;  // an empty view touches no memory
    last += static_cast<unsigned __int128>(t.sizes[i] - 1) * static_cast<uint64_t>(t.strides[i]);
  }
  if ((last + 1) * itemsize > nbytes)
    throw DescriptorError("malformed torch_ipc descriptor: a tensor view runs past its storage");
}

c10::Storage empty_storage(c10::Device device) {
  return c10::Storage(c10::Storage::use_byte_size_t(), 0,
                      c10::DataPtr(nullptr, device), nullptr, false);
}

}  // namespace

Mapping::~Mapping() {
  if (in_forked_child()) {  // CUDA is unusable here, and the mapping is the parent's
    new std::shared_ptr<void>(std::move(vmm));
    return;
  }
  if (kind == AllocKind::CudaIpc && base != nullptr) {
    try {
      ScopedContext scope(device);
      TORCH_IPC_CU_WARN(cuIpcCloseMemHandle, reinterpret_cast<CUdeviceptr>(base));
    } catch (const std::exception& e) {
      TORCH_WARN("torch_ipc: closing a mapping failed: ", e.what());
    }
  }
}

Hold::~Hold() {
  if (in_forked_child()) {  // the hold is the parent's to release
    new std::vector<std::shared_ptr<Mapping>>(std::move(mappings));
    return;
  }
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  PendingRelease p{lease, {}, std::move(mappings)};
  try {
    for (const auto& m : p.mappings) {
      if (m->kind == AllocKind::CpuShm) continue;
      bool seen = false;
      for (auto& de : p.done) seen = seen || de.first == m->device;
      if (seen) continue;
      ScopedContext scope(m->device);
      CUevent e = take_release_event(c, m->device);
      TORCH_IPC_CU(cuEventRecord, e, current_stream(m->device));
      p.done.emplace_back(m->device, e);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: could not order a release after GPU work (", e.what(),
               "); releasing after a device synchronize");
    for (auto& de : p.done) c.spare_events.push_back(de);
    p.done.clear();
  }
  if (p.done.empty()) {
    finish(c, p);
  } else {
    c.pending.push_back(std::move(p));
  }
}

void delete_imported_storage(void* ctx) { delete static_cast<ImportedStorage*>(ctx); }

ImportResult import_tensors(const std::string& data) {
  check_not_forked();
  Descriptor d = decode(data.data(), data.size());
  if (d.boot_id != boot_id())
    throw DescriptorError(
        "torch_ipc descriptor comes from another machine or from before this machine's last "
        "boot; handles are valid only on the machine and boot that made them");
  const bool same_process = d.producer == self_process();
  if (!same_process && !process_alive(d.producer))
    throw ProducerGone("torch_ipc: the producer (pid " + std::to_string(d.producer.pid) +
                       ") has exited; its CUDA memory is gone with it");
  Consumer& c = consumer();

  std::vector<int> local(d.devices.size());
  for (size_t i = 0; i < d.devices.size(); ++i) local[i] = device_for_uuid(d.devices[i]);

  // Leases first: from here on the producer cannot reclaim what we build on.
  std::vector<std::shared_ptr<Hold>> holds(d.leases.size());
  for (size_t i = 0; i < d.leases.size(); ++i) {
    const LeaseRecord& l = d.leases[i];
    const bool forwarded = l.owner != d.producer;  // Note [forwarding] in export.cpp
    if (l.owner == self_process()) {
      // Our own export: the storages themselves keep it; just check it lives.
      lease_take_token(l, /*take=*/!forwarded);
      if (forwarded) lease_remove_deliveries(l, d.producer.pid, 1);
      continue;
    }
    if (forwarded && !process_alive(l.owner))
      throw ProducerGone("torch_ipc: the process that owns this memory (pid " +
                         std::to_string(l.owner.pid) + ") has exited");
    lease_hold(l, /*take_token=*/!forwarded);
    if (forwarded) lease_remove_deliveries(l, d.producer.pid, 1);
    ++c.holds;
    holds[i] = std::make_shared<Hold>();
    holds[i]->lease = l;
  }

  for (const EventRecord& e : d.events) wait_event(c, e, local[e.device], d.producer);

  std::vector<std::shared_ptr<Mapping>> mapped(d.allocs.size());
  for (size_t i = 0; i < d.allocs.size(); ++i) {
    const AllocRecord& a = d.allocs[i];
    if (!holds[a.lease]) continue;  // ours: resolved by storage below
    int device = a.kind == AllocKind::CpuShm ? -1 : local[a.device];
    mapped[i] = get_mapping(c, a, device, d.leases[a.lease].owner);
    holds[a.lease]->mappings.push_back(mapped[i]);
  }

  std::vector<c10::Storage> storages;
  storages.reserve(d.storages.size());
  for (const StorageRecord& s : d.storages) {
    c10::Device device = s.kind == AllocKind::CpuShm
                             ? c10::Device(c10::DeviceType::CPU)
                             : c10::Device(c10::DeviceType::CUDA,
                                           static_cast<c10::DeviceIndex>(local[s.device]));
    if (s.alloc == kNoAlloc) {
      storages.push_back(empty_storage(device));
      continue;
    }
    const AllocRecord& a = d.allocs[s.alloc];
    if (!holds[a.lease]) {
      auto own = find_own_storage(d.leases[a.lease], a.kind, a.handle, s.offset, s.nbytes);
      if (!own)
        throw Released("torch_ipc: this export was already released by this process");
      storages.push_back(*own);
      continue;
    }
    Mapping* m = mapped[s.alloc].get();
    auto* ctx = new ImportedStorage{holds[a.lease], m, s.offset};
    c10::DataPtr ptr(m->base + s.offset, ctx, &delete_imported_storage, device);
    storages.emplace_back(c10::Storage::use_byte_size_t(), s.nbytes, std::move(ptr), nullptr, false);
  }
  holds.clear();  // now owned by the storages alone

  ImportResult out;
  out.payload = std::move(d.payload);
  out.tensors.reserve(d.tensors.size());
  out.is_parameter.reserve(d.tensors.size());
  for (const TensorRecord& t : d.tensors) {
    c10::ScalarType dtype = checked_dtype(t.dtype);
    const c10::Storage& storage = storages[t.storage];
    check_view_fits(t, c10::elementSize(dtype), storage.nbytes());
    c10::DispatchKeySet keys(storage.device_type() == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                                            : c10::DispatchKey::CPU);
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), keys,
                                                     c10::scalarTypeToTypeMeta(dtype));
    try {
      impl->set_sizes_and_strides(t.sizes, t.strides);
      impl->set_storage_offset(t.storage_offset);
    } catch (const c10::Error& e) {
      throw DescriptorError(std::string("malformed torch_ipc descriptor: ") + e.what_without_backtrace());
    }
    at::Tensor tensor(std::move(impl));
    if (t.flags & kRequiresGrad) {
      if (!c10::isFloatingType(dtype) && !c10::isComplexType(dtype))
        throw DescriptorError("malformed torch_ipc descriptor: requires_grad on an integer tensor");
      tensor.set_requires_grad(true);
    }
    out.tensors.push_back(std::move(tensor));
    out.is_parameter.push_back(t.flags & kParameter);
  }
  return out;
}

void collect_imports(bool close_idle) {
  if (in_forked_child()) return;
  Consumer& c = consumer();
  std::vector<std::shared_ptr<Mapping>> closing;  // closed after the lock
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (size_t i = 0; i < c.pending.size();) {
    bool ready = true;
    for (auto& [device, e] : c.pending[i].done) {
      CUresult r = driver().cuEventQuery(e);
      if (r == CUDA_ERROR_NOT_READY) ready = false;
    }
    if (ready) {
      finish(c, c.pending[i]);
      closing.insert(closing.end(), c.pending[i].mappings.begin(), c.pending[i].mappings.end());
      c.pending.erase(c.pending.begin() + i);
    } else {
      ++i;
    }
  }
  std::map<std::pair<uint32_t, uint64_t>, bool> alive;  // one /proc read per producer
  auto producer_alive = [&](const ProcessId& p) {
    auto key = std::make_pair(p.pid, p.start_time);
    auto it = alive.find(key);
    if (it == alive.end()) it = alive.emplace(key, process_alive(p)).first;
    return it->second;
  };
  int64_t now = now_ns();
  std::vector<std::pair<int64_t, std::map<std::pair<uint8_t, Handle64>, std::shared_ptr<Mapping>>::iterator>> idle;
  for (auto it = c.mappings.begin(); it != c.mappings.end();) {
    Mapping& m = *it->second;
    if (it->second.use_count() > 1) {
      m.idle_since_ns = 0;
      ++it;
    } else if (m.kind != AllocKind::CudaIpc) {
      // Host and VMM memory: an idle mapping would keep physical memory that its
      // producer freed (host mapping again costs microseconds). Closed at once,
      // and not counted against TORCH_IPC_IDLE_MAPPINGS, which bounds legacy ones.
      closing.push_back(std::move(it->second));
      it = c.mappings.erase(it);
    } else {
      if (m.idle_since_ns == 0) m.idle_since_ns = now;
      idle.emplace_back(m.idle_since_ns, it++);
    }
  }
  std::sort(idle.begin(), idle.end(), [](auto& a, auto& b) { return a.first < b.first; });
  int64_t over = static_cast<int64_t>(idle.size()) - c.max_idle;
  for (auto& [since, it] : idle) {
    bool close = close_idle || over-- > 0 || now - since > c.idle_ns ||
                 !producer_alive(it->second->producer);
    if (close) {
      closing.push_back(std::move(it->second));
      c.mappings.erase(it);
    }
  }
  lease_drop_dead_segments();
  for (auto it = c.events.begin(); it != c.events.end();) {
    if (!producer_alive(it->second.producer)) {
      TORCH_IPC_CU_WARN(cuEventDestroy, it->second.event);
      it = c.events.erase(it);
    } else {
      ++it;
    }
  }
}

void flush_imports() {
  if (in_forked_child()) return;
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (auto& p : c.pending) {
    for (auto& [device, e] : p.done) {
      CUresult r = driver().cuEventSynchronize(e);
      (void)r;  // released either way: at exit nothing else will
    }
    finish(c, p);
  }
  c.pending.clear();
}

ImportStats import_stats() {
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  ImportStats s{};
  s.holds = c.holds.load();
  s.pending_releases = static_cast<int64_t>(c.pending.size());
  s.mappings_open = static_cast<int64_t>(c.mappings.size());
  for (auto& [k, m] : c.mappings) s.mappings_idle += m.use_count() == 1;
  s.events_open = static_cast<int64_t>(c.events.size());
  return s;
}

}  // namespace torch_ipc
