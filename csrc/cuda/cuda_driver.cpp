#include "cuda/cuda_driver.h"

#include <atomic>
#include <cstddef>
#include <dlfcn.h>
#include <mutex>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/fork.h"

namespace torch_ipc {
namespace {

constexpr int kDriverAbi = 12000;       // entry points as of CUDA 12.0
constexpr int kMemcpyBatchAbi = 12080;  // cuMemcpyBatchAsync with failIdx (Note [optional driver entry points])

#if CUDA_VERSION >= 12080
static_assert(sizeof(MemcpyAttributes) == sizeof(CUmemcpyAttributes) &&
                  offsetof(MemcpyAttributes, src_location_type) == offsetof(CUmemcpyAttributes, srcLocHint) &&
                  offsetof(MemcpyAttributes, dst_location_type) == offsetof(CUmemcpyAttributes, dstLocHint) &&
                  sizeof(CUmemLocation) == 2 * sizeof(int) &&
                  offsetof(MemcpyAttributes, flags) == offsetof(CUmemcpyAttributes, flags),
              "MemcpyAttributes must match cuda.h's CUmemcpyAttributes");
static_assert(kMemcpySrcAccessOrderStream == CU_MEMCPY_SRC_ACCESS_ORDER_STREAM &&
                  kMemcpyPreferOverlapWithCompute == CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
              "cuMemcpyBatchAsync's constants must match cuda.h's");
#endif

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// An entry point at ABI `version`, or null with `why` saying what the driver answered.
void* optional_entry(GetProcAddress get_proc, const char* name, int version, std::string* why) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult r = get_proc(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && fn != nullptr) return fn;
  *why = std::string("the CUDA driver lacks ") + name + " (CUDA " + std::to_string(version / 1000) + "." +
         std::to_string(version % 1000 / 10) + " or newer; cuGetProcAddress: CUresult " + std::to_string(r) +
         ", status " + std::to_string(status) + ")";
  return nullptr;
}

struct Loaded {
  DriverApi api;
  std::string error;  // empty when loaded
};

Loaded load() {
  Loaded out;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("no CUDA driver: dlopen(libcuda.so.1) failed: ") + (why ? why : "unknown error");
    return out;
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    out.error = "the CUDA driver is too old: cuGetProcAddress_v2 is missing (need a driver for CUDA 12 or newer)";
    return out;
  }
#define TORCH_IPC_RESOLVE(name)                                                                                      \
  {                                                                                                                  \
    void* fn = nullptr;                                                                                              \
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;                                    \
    CUresult r = get_proc(#name, &fn, kDriverAbi, CU_GET_PROC_ADDRESS_DEFAULT, &status);                             \
    if (r != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || fn == nullptr) {                               \
      out.error = "the CUDA driver lacks " #name " (cuGetProcAddress: CUresult " + std::to_string(r) + ", status " + \
                  std::to_string(status) + ")";                                                                      \
      return out;                                                                                                    \
    }                                                                                                                \
    out.api.name = reinterpret_cast<decltype(out.api.name)>(fn);                                                     \
  }
  TORCH_IPC_DRIVER_FUNCTIONS(TORCH_IPC_RESOLVE)
#undef TORCH_IPC_RESOLVE
  out.api.cuMemcpyBatchAsync = reinterpret_cast<MemcpyBatchAsync>(
      optional_entry(get_proc, "cuMemcpyBatchAsync", kMemcpyBatchAbi, &out.api.cuMemcpyBatchAsync_missing));
  CUresult init = out.api.cuInit(0);
  if (init != CUDA_SUCCESS) {
    const char* name = nullptr;
    if (out.api.cuGetErrorName(init, &name) != CUDA_SUCCESS) name = nullptr;
    out.error = std::string("cuInit failed: ") + (name ? name : "CUDA_ERROR_" + std::to_string(init));
  }
  return out;
}

// The driver's name for `result` ("CUDA_ERROR_INVALID_VALUE"); one it does
// not know is "CUDA_ERROR_<number>".
std::string error_name(const Loaded& l, CUresult result) {
  const char* name = nullptr;
  if (l.error.empty() && l.api.cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return "CUDA_ERROR_" + std::to_string(result);
}

// Note [CUDA after fork]
// A child forked from a process that initialised CUDA cannot use it, as torch
// says. Initialised means: this module's driver called cuInit there, or torch
// did (the Python half of the fork handler asks torch, _runtime.py). Only
// loaded is not enough: torch's CUDA libraries load libcuda at import, and
// a fork server that imported torch forks children that use CUDA well.
std::atomic<bool> driver_initialised{false};
std::atomic<bool> cuda_forbidden{false};

const Loaded& loaded() {
  static const Loaded instance = (driver_initialised.store(true), load());
  return instance;
}

}  // namespace

void cuda_forbid_after_fork() { cuda_forbidden.store(driver_initialised.load()); }
const AfterForkInChild reset_cuda_after_fork(&cuda_forbid_after_fork);
void forbid_cuda_after_fork() { cuda_forbidden.store(true); }

const DriverApi& driver() {
  TORCH_IPC_CHECK(!cuda_forbidden.load(),
                  "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                  "you must use the 'spawn' start method");
  const Loaded& l = loaded();
  if (!l.error.empty()) throw CudaUnavailable("torch_ipc: CUDA is not usable here: " + l.error);
  return l.api;
}

bool driver_available(std::string* why_not) {
  const Loaded& l = loaded();
  if (why_not) *why_not = l.error;
  return l.error.empty();
}

std::string driver_error_message(const char* call, CUresult result) {
  const Loaded& l = loaded();
  const char* text = nullptr;
  if (!l.error.empty() || l.api.cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  return std::string(call) + " failed: " + error_name(l, result) + " (" + (text ? text : "unknown error") + ")";
}

void throw_driver_error(const char* call, CUresult result, const std::string& context) {
  std::string message = driver_error_message(call, result);
  if (!context.empty()) message = context + ": " + message;
  throw CudaError(message, error_name(loaded(), result), call);
}

}  // namespace torch_ipc
