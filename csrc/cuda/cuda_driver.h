// The CUDA driver API, resolved at run time (dlopen libcuda.so.1 + cuGetProcAddress).
// Owns the function table and the one macro that turns a driver error into an exception.
#pragma once

#include <cuda.h>
#include <string>

namespace torch_ipc {

// Note [driver API at run time]
// The extension links no CUDA library: it must import under a CPU-only torch
// and build without nvcc. Every driver entry point is looked up once, on first
// use, through cuGetProcAddress with the ABI version we were written against
// (kDriverAbi), so a newer cuda.h cannot silently change a signature under us.
#define TORCH_IPC_DRIVER_FUNCTIONS(X)       \
  X(cuInit)                                 \
  X(cuDriverGetVersion)                     \
  X(cuGetErrorName)                         \
  X(cuGetErrorString)                       \
  X(cuDeviceGet)                            \
  X(cuDeviceGetCount)                       \
  X(cuDeviceGetUuid)                        \
  X(cuDevicePrimaryCtxRetain)               \
  X(cuCtxGetCurrent)                        \
  X(cuCtxPushCurrent)                       \
  X(cuCtxPopCurrent)                        \
  X(cuPointerGetAttributes)                 \
  X(cuIpcGetMemHandle)                      \
  X(cuIpcOpenMemHandle)                     \
  X(cuIpcCloseMemHandle)                    \
  X(cuIpcGetEventHandle)                    \
  X(cuIpcOpenEventHandle)                   \
  X(cuEventCreate)                          \
  X(cuEventRecord)                          \
  X(cuEventQuery)                           \
  X(cuEventSynchronize)                     \
  X(cuEventDestroy)                         \
  X(cuStreamWaitEvent)                      \
  X(cuStreamQuery)                          \
  X(cuStreamCreate)                         \
  X(cuMemcpyAsync)                          \
  X(cuMemcpy2DAsync)                        \
  X(cuMemCreate)                            \
  X(cuMemRelease)                           \
  X(cuMemExportToShareableHandle)           \
  X(cuMemImportFromShareableHandle)         \
  X(cuMemAddressReserve)                    \
  X(cuMemAddressFree)                       \
  X(cuMemMap)                               \
  X(cuMemUnmap)                             \
  X(cuMemSetAccess)                         \
  X(cuMemGetAllocationGranularity)          \
  X(cuMemRetainAllocationHandle)            \
  X(cuMemGetAllocationPropertiesFromHandle) \
  X(cuCtxSynchronize)                       \
  X(cuMemsetD8Async)                        \
  X(cuMemGetAddressRange)                   \
  X(cuModuleLoadData)                       \
  X(cuModuleGetFunction)                    \
  X(cuLaunchKernel)

// CUmemcpyAttributes (CUDA 12.8), spelled out so that the build takes any
// cuda.h of CUDA 12; checked against the header's where it has one.
// (CUmemcpyAttributes_v1: 24 bytes, every field 4 bytes wide.)
struct MemcpyAttributes {
  int src_access_order;   // CUmemcpySrcAccessOrder
  int src_location_type;  // srcLocHint: CUmemLocation {CUmemLocationType type; int id}
  int src_location_id;
  int dst_location_type;  // dstLocHint
  int dst_location_id;
  unsigned int flags;  // CUmemcpyFlags
};
static_assert(sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes_v1 is 24 bytes");
constexpr int kMemcpySrcAccessOrderStream = 0x1;           // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
constexpr unsigned kMemcpyPreferOverlapWithCompute = 0x1;  // CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE

// cuMemcpyBatchAsync as the driver gives it for ABI 12080 (PFN_cuMemcpyBatchAsync_v12080:
// with failIdx; CUDA 13's cuMemcpyBatchAsync_v2, ABI 13000, drops that argument).
using MemcpyBatchAsync = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                      MemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, size_t* fail_idx,
                                      CUstream stream);

struct DriverApi {
#define TORCH_IPC_DECLARE(name) decltype(&::name) name = nullptr;
  TORCH_IPC_DRIVER_FUNCTIONS(TORCH_IPC_DECLARE)
#undef TORCH_IPC_DECLARE
  // Note [optional driver entry points]
  // Entry points newer than kDriverAbi are resolved at their own ABI version
  // and may be missing (an older driver): null then, and *_missing says why.
  // The driver keeps every ABI version it ever gave, so asking for 12080 works
  // on a CUDA 13 driver too and one signature serves both.
  MemcpyBatchAsync cuMemcpyBatchAsync = nullptr;
  std::string cuMemcpyBatchAsync_missing;
};

// The loaded table; throws CudaUnavailable, saying why, when there is no
// usable driver (CPU-only machine, driver too old).
const DriverApi& driver();

// True when the driver loads and cuInit succeeds; never throws.
bool driver_available(std::string* why_not = nullptr);

// In a forked child, CUDA calls raise torch's error where the parent had
// initialised CUDA (registered reset); this forbids them when torch had
// (Python asks, Note [CUDA after fork]).
void forbid_cuda_after_fork();

// "cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (invalid argument)".
std::string driver_error_message(const char* call, CUresult result);

// Raise torch_ipc.CudaError naming `call` and the driver's name for `result`;
// `context`, when given, says what was being done ("<context>: <call> failed: ...").
[[noreturn]] void throw_driver_error(const char* call, CUresult result, const std::string& context = "");

}  // namespace torch_ipc

// Call a driver function; on failure raise torch_ipc.CudaError naming the call
// and the driver's name for the error.
#define TORCH_IPC_CU(call_name, ...)                                                                       \
  do {                                                                                                     \
    CUresult torch_ipc_result_ = ::torch_ipc::driver().call_name(__VA_ARGS__);                             \
    if (torch_ipc_result_ != CUDA_SUCCESS) ::torch_ipc::throw_driver_error(#call_name, torch_ipc_result_); \
  } while (0)

// Teardown variant: destructors never throw, they warn.
#define TORCH_IPC_CU_WARN(call_name, ...)                                           \
  do {                                                                              \
    CUresult torch_ipc_result_ = ::torch_ipc::driver().call_name(__VA_ARGS__);      \
    if (torch_ipc_result_ != CUDA_SUCCESS)                                          \
      TORCH_WARN(::torch_ipc::driver_error_message(#call_name, torch_ipc_result_)); \
  } while (0)
