#include "cuda_driver.h"

#include <dlfcn.h>

#include <utility>

namespace cu {

std::string Describe(const Driver& driver, std::string_view call, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.GetErrorName == nullptr || driver.GetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (driver.GetErrorString == nullptr || driver.GetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  std::string message(call);
  message += " failed: ";
  message += name != nullptr ? name : ("CUresult " + std::to_string(result));
  if (text != nullptr) {
    message += " (";
    message += text;
    message += ")";
  }
  return message;
}

xla::ffi::Error Check(const Driver& driver, std::string_view call, CUresult result) {
  if (result == CUDA_SUCCESS) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal("jax_sparse_mla: " + Describe(driver, call, result));
}

namespace {

LoadedDriver LoadDriver() {
  LoadedDriver loaded;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = dlerror();
    loaded.error = std::string("cannot load the CUDA driver libcuda.so.1: ") +
                   (reason != nullptr ? reason : "unknown dlopen error");
    return loaded;
  }
  auto get_proc =
      reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    loaded.error = "libcuda.so.1 has no cuGetProcAddress_v2: a CUDA 12.0 or newer driver is needed";
    return loaded;
  }
  Driver& d = loaded.driver;
  const std::pair<const char*, void**> entries[] = {
      {"cuGetErrorName", reinterpret_cast<void**>(&d.GetErrorName)},
      {"cuGetErrorString", reinterpret_cast<void**>(&d.GetErrorString)},
      {"cuInit", reinterpret_cast<void**>(&d.Init)},
      {"cuDeviceGetCount", reinterpret_cast<void**>(&d.DeviceGetCount)},
      {"cuDeviceGet", reinterpret_cast<void**>(&d.DeviceGet)},
      {"cuDeviceCanAccessPeer", reinterpret_cast<void**>(&d.DeviceCanAccessPeer)},
      {"cuDevicePrimaryCtxGetState", reinterpret_cast<void**>(&d.DevicePrimaryCtxGetState)},
      {"cuDevicePrimaryCtxRetain", reinterpret_cast<void**>(&d.DevicePrimaryCtxRetain)},
      {"cuDevicePrimaryCtxRelease", reinterpret_cast<void**>(&d.DevicePrimaryCtxRelease)},
      {"cuCtxGetCurrent", reinterpret_cast<void**>(&d.CtxGetCurrent)},
      {"cuCtxPushCurrent", reinterpret_cast<void**>(&d.CtxPushCurrent)},
      {"cuCtxPopCurrent", reinterpret_cast<void**>(&d.CtxPopCurrent)},
      {"cuCtxSynchronize", reinterpret_cast<void**>(&d.CtxSynchronize)},
      {"cuCtxEnablePeerAccess", reinterpret_cast<void**>(&d.CtxEnablePeerAccess)},
      {"cuMemAlloc", reinterpret_cast<void**>(&d.MemAlloc)},
      {"cuMemFree", reinterpret_cast<void**>(&d.MemFree)},
      {"cuMemsetD8", reinterpret_cast<void**>(&d.MemsetD8)},
      {"cuMemcpyHtoD", reinterpret_cast<void**>(&d.MemcpyHtoD)},
      {"cuMemHostAlloc", reinterpret_cast<void**>(&d.MemHostAlloc)},
      {"cuMemHostGetDevicePointer", reinterpret_cast<void**>(&d.MemHostGetDevicePointer)},
      {"cuModuleLoadData", reinterpret_cast<void**>(&d.ModuleLoadData)},
      {"cuModuleUnload", reinterpret_cast<void**>(&d.ModuleUnload)},
      {"cuModuleGetFunction", reinterpret_cast<void**>(&d.ModuleGetFunction)},
      {"cuFuncSetAttribute", reinterpret_cast<void**>(&d.FuncSetAttribute)},
      {"cuStreamGetCtx", reinterpret_cast<void**>(&d.StreamGetCtx)},
      {"cuLaunchKernelEx", reinterpret_cast<void**>(&d.LaunchKernelEx)},
  };
  for (const auto& [symbol, slot] : entries) {
    CUdriverProcAddressQueryResult found{};
    CUresult result = get_proc(symbol, slot, kProcAddressVersion, /*flags=*/0, &found);
    if (result != CUDA_SUCCESS || *slot == nullptr) {
      loaded.error = std::string("the CUDA driver lacks ") + symbol + " (CUDA 12.0 ABI)";
      return loaded;
    }
  }
  if (CUresult result = d.Init(0); result != CUDA_SUCCESS) {
    loaded.error = Describe(d, "cuInit", result);
  }
  return loaded;
}

}  // namespace

xla::ffi::Error ForEachExecutableContext(const Driver& d,
                                         const std::function<bool(CUcontext)>& is_loaded,
                                         const std::function<xla::ffi::Error(CUcontext)>& load) {
  int devices = 0;
  if (xla::ffi::Error error = Check(d, "cuDeviceGetCount", d.DeviceGetCount(&devices));
      error.failure()) {
    return error;
  }
  for (int ordinal = 0; ordinal < devices; ++ordinal) {
    CUdevice device = 0;
    unsigned int flags = 0;
    int active = 0;
    if (xla::ffi::Error error = Check(d, "cuDeviceGet", d.DeviceGet(&device, ordinal));
        error.failure()) {
      return error;
    }
    if (xla::ffi::Error error = Check(d, "cuDevicePrimaryCtxGetState",
                                      d.DevicePrimaryCtxGetState(device, &flags, &active));
        error.failure()) {
      return error;
    }
    if (!active) continue;
    CUcontext context = nullptr;
    if (xla::ffi::Error error = Check(d, "cuDevicePrimaryCtxRetain",
                                      d.DevicePrimaryCtxRetain(&context, device));
        error.failure()) {
      return error;
    }
    // The primary context stays alive while XLA holds it; our reference is only needed here.
    xla::ffi::Error error = load(context);
    d.DevicePrimaryCtxRelease(device);
    if (error.failure()) return error;
  }
  CUcontext current = nullptr;
  if (xla::ffi::Error error = Check(d, "cuCtxGetCurrent", d.CtxGetCurrent(&current));
      error.failure()) {
    return error;
  }
  if (current != nullptr && !is_loaded(current)) return load(current);
  return xla::ffi::Error::Success();
}

const LoadedDriver& GetDriver() {
  static const LoadedDriver* driver = new LoadedDriver(LoadDriver());
  return *driver;
}

}  // namespace cu
