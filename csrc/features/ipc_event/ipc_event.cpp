#include "features/ipc_event/ipc_event.h"

#include <cstring>
#include <map>
#include <mutex>

#include "base/errors.h"
#include "base/fork.h"

#include "os/process.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

namespace torch_ipc {
namespace {

// The pickled state: fixed size, every field checked before use.
// Version 2 names the maker as every descriptor does (ProcessId, base/ids.h):
// with its life key and PID namespace, so that a process of another PID
// namespace judges it by its life file and not by an unrelated process of
// the same pid (Note [life files] in os/life.h); version 1 named pid and start
// time only and is refused.
constexpr char kEventMagic[4] = {'T', 'I', 'E', 'V'};
constexpr uint32_t kStateVersion = 2;

struct State {
  char magic[4];
  uint32_t version;
  uint8_t handle[64];
  uint8_t device_uuid[16];
  uint8_t boot_id[16];
  uint32_t producer_pid;
  uint32_t reserved;  // zero
  uint64_t producer_start_time;
  uint32_t producer_life;   // its life key (0: it had none)
  uint32_t producer_pidns;  // the inode of its PID namespace (0: unknown)
};
static_assert(sizeof(State) == 128, "IpcEvent state layout");

// Events this process made and still has, for unpickling them here: a
// process cannot open its own IPC handle.
struct OwnEvents {
  std::mutex mu;
  std::map<Handle64, std::weak_ptr<OpenedEvent>> by_handle;
};

// A forked child starts with none (Note [fork]).
OwnEvents& own_events() { return *process_state<OwnEvents>(); }

[[noreturn]] void malformed(const std::string& what) {
  throw DescriptorError("malformed torch_ipc.IpcEvent state: " + what);
}

State parse_state(const std::string& bytes) {
  State s;
  // The version first: a state of another version has another size.
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kEventMagic, 4) == 0) {
    uint32_t version;
    std::memcpy(&version, bytes.data() + 4, 4);
    if (version != kStateVersion)
      malformed(str("format version ", version, " (this torch_ipc reads version ", kStateVersion,
                    "): it comes from another torch_ipc version; use one version in every process"));
  }
  if (bytes.size() != sizeof(State))
    malformed(std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof(State)));
  std::memcpy(&s, bytes.data(), sizeof(State));
  if (std::memcmp(s.magic, kEventMagic, 4) != 0) malformed("not an IpcEvent");
  if (s.reserved != 0) malformed("reserved field is not zero");
  if (s.producer_pid == 0) malformed("no producer");
  Uuid boot{};
  std::memcpy(boot.data(), s.boot_id, 16);
  if (boot != boot_id())
    throw DescriptorError(
        "torch_ipc.IpcEvent comes from another machine or an earlier boot: "
        "events are shared only between processes of one machine");
  return s;
}

}  // namespace

void ipc_events_forget_after_fork() { forget_after_fork<OwnEvents>(); }
const AfterForkInChild reset_ipc_events_after_fork(&ipc_events_forget_after_fork);

IpcEvent::IpcEvent(int device) {
  ScopedContext scope(device);
  auto event = std::make_shared<OpenedEvent>();
  event->device = device;
  event->producer = self_process();
  TORCH_IPC_CU(cuEventCreate, &event->event, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
  CUipcEventHandle h;
  TORCH_IPC_CU(cuIpcGetEventHandle, &h, event->event);
  std::memcpy(handle_.data(), h.reserved, 64);
  event_ = std::move(event);
  OwnEvents& own = own_events();
  std::lock_guard<std::mutex> lock(own.mu);
  own.by_handle[handle_] = event_;
}

std::shared_ptr<IpcEvent> IpcEvent::from_state(const std::string& bytes) {
  const State s = parse_state(bytes);
  Handle64 handle;
  std::memcpy(handle.data(), s.handle, 64);
  Uuid uuid;
  std::memcpy(uuid.data(), s.device_uuid, 16);
  const int device = device_for_uuid(uuid);
  const ProcessId producer{s.producer_pid, s.producer_start_time, s.producer_life, s.producer_pidns};
  if (producer == self_process()) {
    OwnEvents& own = own_events();
    std::lock_guard<std::mutex> lock(own.mu);
    auto it = own.by_handle.find(handle);
    auto event = it == own.by_handle.end() ? nullptr : it->second.lock();
    if (!event || event->device != device) malformed("an event this process made and no longer has");
    return std::shared_ptr<IpcEvent>(new IpcEvent(std::move(event), handle));
  }
  auto event = open_ipc_event(handle, device, producer, [](const ProcessId& p) { return process_alive(p); });
  return std::shared_ptr<IpcEvent>(new IpcEvent(std::move(event), handle));
}

std::string IpcEvent::state() const {
  State s{};
  std::memcpy(s.magic, kEventMagic, 4);
  s.version = kStateVersion;
  std::memcpy(s.handle, handle_.data(), 64);
  std::memcpy(s.device_uuid, device_uuid(event_->device).data(), 16);
  std::memcpy(s.boot_id, boot_id().data(), 16);
  s.producer_pid = event_->producer.pid;
  s.producer_start_time = event_->producer.start_time;
  s.producer_life = event_->producer.life;
  s.producer_pidns = event_->producer.pidns;
  return std::string(reinterpret_cast<const char*>(&s), sizeof(s));
}

CUstream IpcEvent::stream_or_current(std::optional<CUstream> stream) const {
  return stream ? *stream : current_stream(event_->device);
}

void IpcEvent::record(std::optional<CUstream> stream) {
  ScopedContext scope(event_->device);
  TORCH_IPC_CU(cuEventRecord, event_->event, stream_or_current(stream));
}

void IpcEvent::wait(std::optional<CUstream> stream) {
  ScopedContext scope(event_->device);
  order_stream_after(event_->event, stream_or_current(stream));
}

bool IpcEvent::query() {
  CUresult r = driver().cuEventQuery(event_->event);
  if (r == CUDA_SUCCESS) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;
  throw_driver_error("cuEventQuery", r);
}

void IpcEvent::synchronize() { TORCH_IPC_CU(cuEventSynchronize, event_->event); }

}  // namespace torch_ipc
