// The CUDA driver API as this library uses it: entry points resolved from libcuda.so.1 at run
// time (no toolkit, no link-time dependency), typed with the cudaTypedefs.h typedefs of the
// CUDA 12.0 ABI that cuGetProcAddress returns for kProcAddressVersion.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <functional>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

// Marks the library's exported symbols (it is built with hidden visibility).
#define JAX_SPARSE_MLA_EXPORT extern "C" __attribute__((visibility("default")))

namespace cu {

constexpr int kProcAddressVersion = 12000;

// Driver entry points, resolved once per process and immutable after that.
struct Driver {
  PFN_cuGetErrorName_v6000 GetErrorName;
  PFN_cuGetErrorString_v6000 GetErrorString;
  PFN_cuInit_v2000 Init;
  PFN_cuDeviceGetCount_v2000 DeviceGetCount;
  PFN_cuDeviceGet_v2000 DeviceGet;
  PFN_cuDeviceCanAccessPeer_v4000 DeviceCanAccessPeer;
  PFN_cuDevicePrimaryCtxGetState_v7000 DevicePrimaryCtxGetState;
  PFN_cuDevicePrimaryCtxRetain_v7000 DevicePrimaryCtxRetain;
  PFN_cuDevicePrimaryCtxRelease_v11000 DevicePrimaryCtxRelease;
  PFN_cuCtxGetCurrent_v4000 CtxGetCurrent;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent;
  PFN_cuCtxSynchronize_v2000 CtxSynchronize;
  PFN_cuCtxEnablePeerAccess_v4000 CtxEnablePeerAccess;
  PFN_cuMemAlloc_v3020 MemAlloc;
  PFN_cuMemFree_v3020 MemFree;
  PFN_cuMemsetD8_v3020 MemsetD8;
  PFN_cuMemcpyHtoD_v3020 MemcpyHtoD;
  PFN_cuMemHostAlloc_v2020 MemHostAlloc;
  PFN_cuMemHostGetDevicePointer_v3020 MemHostGetDevicePointer;
  PFN_cuModuleLoadData_v2000 ModuleLoadData;
  PFN_cuModuleUnload_v2000 ModuleUnload;
  PFN_cuModuleGetFunction_v2000 ModuleGetFunction;
  PFN_cuFuncSetAttribute_v9000 FuncSetAttribute;
  PFN_cuStreamGetCtx_v9020 StreamGetCtx;
  PFN_cuLaunchKernelEx_v11060 LaunchKernelEx;
};

struct LoadedDriver {
  Driver driver{};
  std::string error;  // empty when the driver loaded and initialized
};

// The process-wide driver table, or the reason it is unavailable.
const LoadedDriver& GetDriver();

// "<call> failed: CUDA_ERROR_NAME (description)".
std::string Describe(const Driver& driver, std::string_view call, CUresult result);

// Success, or an Internal error carrying Describe's text.
xla::ffi::Error Check(const Driver& driver, std::string_view call, CUresult result);

// Calls `load` for every CUDA context an executable may run in, at its instantiation (no
// stream given): the active primary context of each device (XLA's StreamExecutor runs on
// them; one executable's thunk serves all the devices it runs on) and the context current on
// the calling thread when `is_loaded` says it is not one of those. Stops at the first error.
xla::ffi::Error ForEachExecutableContext(const Driver& driver,
                                         const std::function<bool(CUcontext)>& is_loaded,
                                         const std::function<xla::ffi::Error(CUcontext)>& load);

}  // namespace cu
