#include "cuda/cuda_context.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "base/errors.h"

#include "cuda/cuda_driver.h"

namespace torch_ipc {
namespace {

struct DeviceTable {
  std::vector<Uuid> uuids;
  std::vector<CUcontext> contexts;
};

DeviceTable& table() {
  static DeviceTable* t = [] {
    auto out = std::make_unique<DeviceTable>();  // a failed call below retries on the next use
    int count = 0;
    TORCH_IPC_CU(cuDeviceGetCount, &count);
    out->uuids.resize(count);
    out->contexts.assign(count, nullptr);
    for (int i = 0; i < count; ++i) {
      CUdevice dev;
      TORCH_IPC_CU(cuDeviceGet, &dev, i);
      CUuuid u;
      TORCH_IPC_CU(cuDeviceGetUuid, &u, dev);
      std::copy(u.bytes, u.bytes + 16, reinterpret_cast<char*>(out->uuids[i].data()));
    }
    return out.release();  // kept for the process
  }();
  return *t;
}

std::string format_uuid(const Uuid& u) {
  char text[48];
  std::snprintf(text, sizeof(text), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return text;
}

std::mutex context_mutex;

CUcontext primary_context(int device) {
  DeviceTable& t = table();
  TORCH_IPC_CHECK(device >= 0 && device < static_cast<int>(t.contexts.size()), "torch_ipc: no CUDA device ", device);
  std::lock_guard<std::mutex> lock(context_mutex);
  if (t.contexts[device] == nullptr) {
    CUdevice dev;
    TORCH_IPC_CU(cuDeviceGet, &dev, device);
    CUcontext ctx = nullptr;
    TORCH_IPC_CU(cuDevicePrimaryCtxRetain, &ctx, dev);  // kept for the process
    t.contexts[device] = ctx;
  }
  return t.contexts[device];
}

}  // namespace

const Uuid& device_uuid(int index) {
  DeviceTable& t = table();
  TORCH_IPC_CHECK(index >= 0 && index < static_cast<int>(t.uuids.size()), "torch_ipc: no CUDA device ", index);
  return t.uuids[index];
}

int device_for_uuid(const Uuid& uuid) {
  const DeviceTable& t = table();
  for (size_t i = 0; i < t.uuids.size(); ++i)
    if (t.uuids[i] == uuid) return static_cast<int>(i);
  throw DeviceNotFound("torch_ipc: the tensor lives on " + format_uuid(uuid) +
                       ", which this process cannot see (check CUDA_VISIBLE_DEVICES; this "
                       "process sees " +
                       std::to_string(t.uuids.size()) + " GPU(s))");
}

ScopedContext::ScopedContext(int device) {
  CUcontext wanted = primary_context(device);
  CUcontext current = nullptr;
  TORCH_IPC_CU(cuCtxGetCurrent, &current);
  if (current == wanted) return;
  TORCH_IPC_CU(cuCtxPushCurrent, wanted);
  pushed_ = true;
}

ScopedContext::~ScopedContext() {
  if (!pushed_) return;
  CUcontext popped;
  TORCH_IPC_CU_WARN(cuCtxPopCurrent, &popped);
}

CUstream current_stream(int device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream s = impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return static_cast<CUstream>(s.native_handle());
}

bool stream_idle(CUstream stream) {
  CUresult r = driver().cuStreamQuery(stream);
  if (r == CUDA_SUCCESS) return true;
  if (r != CUDA_ERROR_NOT_READY) throw_driver_error("cuStreamQuery", r);
  return false;
}

}  // namespace torch_ipc
