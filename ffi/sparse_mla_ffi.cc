// XLA FFI handler for the sparse MLA decode kernel (target "jax_sparse_mla_decode", CUDA).
//
// The custom call carries the kernel's sm_90a cubin and its launch metadata as attributes, so
// a lowered, exported or cached executable is self-contained:
//   cubin        u8[]     the cubin bytes (an ELF image; NUL bytes included)
//   kernel_name  string   the entry symbol inside the cubin
//   grid         i64[3]   grid dimensions in blocks
//   block        i64[3]   block dimensions in threads
//   cluster      i64[3]   cluster dimensions in blocks
//   smem_bytes   i64      dynamic shared memory per block
// Parameter ABI of the entry (PARAMS in jax_sparse_mla/kernel/config.py): q, kv, rows, valid, scales, latent, lse
// as device pointers, then n_rows = kv.shape[0] as i32.
//
// Stages:
// - instantiate (once per executable, while XLA builds its thunks; no stream, no device is
//   given): loads the cubin into every CUDA context the process uses, i.e. the active primary
//   context of each device (XLA's StreamExecutor runs on primary contexts) plus the context
//   current on the calling thread if it is another one. One executable's thunk is shared by
//   all the devices it runs on (SPMD), so loading into a single context would not do. The
//   modules, functions and attributes (dynamic shared memory opt-in, non-portable cluster size)
//   live in an ffi::State owned by the executable and unloaded with it.
// - execute: looks the function up by the stream's context and calls cuLaunchKernelEx with
//   the cluster-dimension and programmatic-stream-serialization (PDL) attributes. It allocates
//   nothing, synchronizes nothing and loads nothing, so it is declared command-buffer
//   compatible and XLA may capture it into a CUDA graph.
//
// No CUDA toolkit is needed to build this file: the few driver types and entry points it uses
// are declared below and resolved from libcuda.so.1 at run time (cuGetProcAddress, requesting
// the CUDA 12.0 ABI of each entry point).

#include <dlfcn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The stream type of PlatformStream, as the CUDA runtime spells it (same type as CUstream).
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace cu {

// The subset of cuda.h this handler uses (layouts and values as in CUDA 12.0 through 13.0).
using Result = int;
using Device = int;
using Context = struct CUctx_st*;
using Module = struct CUmod_st*;
using Function = struct CUfunc_st*;
using Stream = cudaStream_t;

constexpr Result kSuccess = 0;
constexpr int kFuncAttrMaxDynamicSharedSizeBytes = 8;
constexpr int kFuncAttrNonPortableClusterSizeAllowed = 14;
constexpr int kLaunchAttrClusterDimension = 4;
constexpr int kLaunchAttrProgrammaticStreamSerialization = 6;
constexpr int kProcAddressVersion = 12000;
constexpr int kPortableClusterSize = 8;

union LaunchAttributeValue {
  char pad[64];
  struct {
    unsigned int x, y, z;
  } cluster_dim;
  int programmatic_stream_serialization_allowed;
};

struct LaunchAttribute {
  int id;
  char pad[8 - sizeof(int)];
  LaunchAttributeValue value;
};

struct LaunchConfig {
  unsigned int grid_dim_x, grid_dim_y, grid_dim_z;
  unsigned int block_dim_x, block_dim_y, block_dim_z;
  unsigned int shared_mem_bytes;
  Stream stream;
  LaunchAttribute* attrs;
  unsigned int num_attrs;
};

static_assert(sizeof(LaunchAttributeValue) == 64);
static_assert(sizeof(LaunchAttribute) == 72);
static_assert(sizeof(LaunchConfig) == 56);

// Driver entry points, resolved once per process. Immutable after that; the per-executable
// state lives in KernelState.
struct Driver {
  Result (*GetErrorName)(Result, const char**);
  Result (*GetErrorString)(Result, const char**);
  Result (*Init)(unsigned int);
  Result (*DeviceGetCount)(int*);
  Result (*DeviceGet)(Device*, int);
  Result (*DevicePrimaryCtxGetState)(Device, unsigned int*, int*);
  Result (*DevicePrimaryCtxRetain)(Context*, Device);
  Result (*DevicePrimaryCtxRelease)(Device);
  Result (*CtxGetCurrent)(Context*);
  Result (*CtxPushCurrent)(Context);
  Result (*CtxPopCurrent)(Context*);
  Result (*ModuleLoadData)(Module*, const void*);
  Result (*ModuleUnload)(Module);
  Result (*ModuleGetFunction)(Function*, Module, const char*);
  Result (*FuncSetAttribute)(Function, int, int);
  Result (*StreamGetCtx)(Stream, Context*);
  Result (*LaunchKernelEx)(const LaunchConfig*, Function, void**, void**);
};

// Formats a failed driver call as "<call>: CUDA_ERROR_NAME (description)".
std::string Describe(const Driver& driver, std::string_view call, Result result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.GetErrorName == nullptr || driver.GetErrorName(result, &name) != kSuccess) {
    name = nullptr;
  }
  if (driver.GetErrorString == nullptr || driver.GetErrorString(result, &text) != kSuccess) {
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

ffi::Error Check(const Driver& driver, std::string_view call, Result result) {
  if (result == kSuccess) return ffi::Error::Success();
  return ffi::Error::Internal("jax_sparse_mla: " + Describe(driver, call, result));
}

struct LoadedDriver {
  Driver driver{};
  std::string error;  // empty when the driver loaded and initialized
};

LoadedDriver LoadDriver() {
  LoadedDriver loaded;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = dlerror();
    loaded.error = std::string("cannot load the CUDA driver libcuda.so.1: ") +
                   (reason != nullptr ? reason : "unknown dlopen error");
    return loaded;
  }
  using GetProcAddress = Result (*)(const char*, void**, int, std::uint64_t, int*);
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(library, "cuGetProcAddress_v2"));
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
      {"cuDevicePrimaryCtxGetState", reinterpret_cast<void**>(&d.DevicePrimaryCtxGetState)},
      {"cuDevicePrimaryCtxRetain", reinterpret_cast<void**>(&d.DevicePrimaryCtxRetain)},
      {"cuDevicePrimaryCtxRelease", reinterpret_cast<void**>(&d.DevicePrimaryCtxRelease)},
      {"cuCtxGetCurrent", reinterpret_cast<void**>(&d.CtxGetCurrent)},
      {"cuCtxPushCurrent", reinterpret_cast<void**>(&d.CtxPushCurrent)},
      {"cuCtxPopCurrent", reinterpret_cast<void**>(&d.CtxPopCurrent)},
      {"cuModuleLoadData", reinterpret_cast<void**>(&d.ModuleLoadData)},
      {"cuModuleUnload", reinterpret_cast<void**>(&d.ModuleUnload)},
      {"cuModuleGetFunction", reinterpret_cast<void**>(&d.ModuleGetFunction)},
      {"cuFuncSetAttribute", reinterpret_cast<void**>(&d.FuncSetAttribute)},
      {"cuStreamGetCtx", reinterpret_cast<void**>(&d.StreamGetCtx)},
      {"cuLaunchKernelEx", reinterpret_cast<void**>(&d.LaunchKernelEx)},
  };
  for (const auto& [symbol, slot] : entries) {
    int found = 0;
    Result result = get_proc(symbol, slot, kProcAddressVersion, /*flags=*/0, &found);
    if (result != kSuccess || *slot == nullptr) {
      loaded.error = std::string("the CUDA driver lacks ") + symbol + " (CUDA 12.0 ABI)";
      return loaded;
    }
  }
  if (Result result = d.Init(0); result != kSuccess) {
    loaded.error = Describe(d, "cuInit", result);
  }
  return loaded;
}

// The process-wide driver table, or the reason it is unavailable.
const LoadedDriver& GetDriver() {
  static const LoadedDriver* driver = new LoadedDriver(LoadDriver());
  return *driver;
}

}  // namespace cu

// What the custom call's attributes say about the kernel and its launch.
struct LaunchSpec {
  ffi::Span<const uint8_t> cubin;
  std::string_view kernel_name;
  ffi::Span<const int64_t> grid;
  ffi::Span<const int64_t> block;
  ffi::Span<const int64_t> cluster;
  int64_t smem_bytes;
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(LaunchSpec,
                                      ffi::StructMember<ffi::Span<const uint8_t>>("cubin"),
                                      ffi::StructMember<std::string_view>("kernel_name"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("grid"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("block"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("cluster"),
                                      ffi::StructMember<int64_t>("smem_bytes"));

// The kernel loaded into each CUDA context the executable can run in, plus its launch shape.
struct KernelState {
  static ffi::TypeId id;

  struct Loaded {
    cu::Context context;
    cu::Module module;
    cu::Function function;
  };

  const cu::Driver* driver = nullptr;
  std::vector<Loaded> loaded;
  unsigned int grid[3] = {};
  unsigned int block[3] = {};
  unsigned int cluster[3] = {};
  unsigned int smem_bytes = 0;

  KernelState() = default;
  KernelState(const KernelState&) = delete;
  KernelState& operator=(const KernelState&) = delete;

  ~KernelState() {
    // Errors are ignored: at process exit the driver may already be torn down.
    for (const Loaded& entry : loaded) {
      if (driver->CtxPushCurrent(entry.context) != cu::kSuccess) continue;
      driver->ModuleUnload(entry.module);
      cu::Context popped = nullptr;
      driver->CtxPopCurrent(&popped);
    }
  }

  const Loaded* Find(cu::Context context) const {
    for (const Loaded& entry : loaded) {
      if (entry.context == context) return &entry;
    }
    return nullptr;
  }
};

ffi::TypeId KernelState::id = {};

namespace {

ffi::Error CheckDims(std::string_view name, ffi::Span<const int64_t> dims, int64_t limit) {
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument("jax_sparse_mla: attribute " + std::string(name) +
                                       " must have 3 entries, got " +
                                       std::to_string(dims.size()));
  }
  for (int64_t d : dims) {
    if (d < 1 || d > limit) {
      return ffi::Error::InvalidArgument("jax_sparse_mla: attribute " + std::string(name) +
                                         " has entry " + std::to_string(d) + " outside [1, " +
                                         std::to_string(limit) + "]");
    }
  }
  return ffi::Error::Success();
}

// Loads the cubin into `context` and prepares its entry function for the launch shape.
ffi::Error LoadInto(KernelState& state, cu::Context context, const LaunchSpec& spec,
                    const std::string& kernel_name) {
  const cu::Driver& d = *state.driver;
  if (ffi::Error error = cu::Check(d, "cuCtxPushCurrent", d.CtxPushCurrent(context));
      error.failure()) {
    return error;
  }
  KernelState::Loaded entry{context, nullptr, nullptr};
  ffi::Error error = cu::Check(d, "cuModuleLoadData (cubin of " + kernel_name + ")",
                               d.ModuleLoadData(&entry.module, spec.cubin.begin()));
  if (error.success()) {
    error = cu::Check(d, "cuModuleGetFunction(" + kernel_name + ")",
                      d.ModuleGetFunction(&entry.function, entry.module, kernel_name.c_str()));
  }
  if (error.success()) {
    error = cu::Check(d, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                      d.FuncSetAttribute(entry.function, cu::kFuncAttrMaxDynamicSharedSizeBytes,
                                         static_cast<int>(state.smem_bytes)));
  }
  const unsigned int cluster_size = state.cluster[0] * state.cluster[1] * state.cluster[2];
  if (error.success() && cluster_size > cu::kPortableClusterSize) {
    error = cu::Check(d, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                      d.FuncSetAttribute(entry.function,
                                         cu::kFuncAttrNonPortableClusterSizeAllowed, 1));
  }
  if (error.failure() && entry.module != nullptr) {
    d.ModuleUnload(entry.module);
  } else if (error.success()) {
    state.loaded.push_back(entry);
  }
  cu::Context popped = nullptr;
  ffi::Error pop = cu::Check(d, "cuCtxPopCurrent", d.CtxPopCurrent(&popped));
  return error.failure() ? error : pop;
}

ffi::ErrorOr<std::unique_ptr<KernelState>> Instantiate(LaunchSpec spec) {
  using Failed = ffi::Unexpected<ffi::Error>;
  if (spec.cubin.size() == 0 || spec.kernel_name.empty()) {
    return Failed(ffi::Error::InvalidArgument("jax_sparse_mla: empty cubin or kernel_name"));
  }
  for (auto [name, dims, limit] : {std::tuple<const char*, ffi::Span<const int64_t>, int64_t>{
                                       "grid", spec.grid, int64_t{0x7fffffff}},
                                   {"block", spec.block, 1024},
                                   {"cluster", spec.cluster, 16}}) {
    if (ffi::Error error = CheckDims(name, dims, limit); error.failure()) return Failed(error);
  }
  if (spec.smem_bytes < 0 || spec.smem_bytes > (1 << 30)) {
    return Failed(ffi::Error::InvalidArgument("jax_sparse_mla: bad smem_bytes " +
                                              std::to_string(spec.smem_bytes)));
  }
  const cu::LoadedDriver& loaded = cu::GetDriver();
  if (!loaded.error.empty()) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "jax_sparse_mla: " + loaded.error));
  }
  auto state = std::make_unique<KernelState>();
  state->driver = &loaded.driver;
  for (int i = 0; i < 3; ++i) {
    state->grid[i] = static_cast<unsigned int>(spec.grid[i]);
    state->block[i] = static_cast<unsigned int>(spec.block[i]);
    state->cluster[i] = static_cast<unsigned int>(spec.cluster[i]);
  }
  state->smem_bytes = static_cast<unsigned int>(spec.smem_bytes);

  const cu::Driver& d = loaded.driver;
  const std::string kernel_name(spec.kernel_name);
  int devices = 0;
  if (ffi::Error error = cu::Check(d, "cuDeviceGetCount", d.DeviceGetCount(&devices));
      error.failure()) {
    return Failed(error);
  }
  for (int ordinal = 0; ordinal < devices; ++ordinal) {
    cu::Device device = 0;
    unsigned int flags = 0;
    int active = 0;
    if (ffi::Error error = cu::Check(d, "cuDeviceGet", d.DeviceGet(&device, ordinal));
        error.failure()) {
      return Failed(error);
    }
    if (ffi::Error error = cu::Check(d, "cuDevicePrimaryCtxGetState",
                                     d.DevicePrimaryCtxGetState(device, &flags, &active));
        error.failure()) {
      return Failed(error);
    }
    if (!active) continue;
    cu::Context context = nullptr;
    if (ffi::Error error = cu::Check(d, "cuDevicePrimaryCtxRetain",
                                     d.DevicePrimaryCtxRetain(&context, device));
        error.failure()) {
      return Failed(error);
    }
    // The primary context stays alive while XLA holds it; our reference is only needed here.
    ffi::Error error = LoadInto(*state, context, spec, kernel_name);
    d.DevicePrimaryCtxRelease(device);
    if (error.failure()) return Failed(error);
  }
  cu::Context current = nullptr;
  if (ffi::Error error = cu::Check(d, "cuCtxGetCurrent", d.CtxGetCurrent(&current));
      error.failure()) {
    return Failed(error);
  }
  if (current != nullptr && state->Find(current) == nullptr) {
    if (ffi::Error error = LoadInto(*state, current, spec, kernel_name); error.failure()) {
      return Failed(error);
    }
  }
  if (state->loaded.empty()) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "jax_sparse_mla: no active CUDA context to load the kernel into "
                             "while XLA instantiated the executable"));
  }
  return state;
}

// Typed buffers of the kernel's operands. The FFI headers have no native type for FP8, so q
// and kv are untyped here and their dtype and rank are checked in Execute.
using Fp8Buffer = ffi::AnyBuffer;
using RowsBuffer = ffi::Buffer<ffi::S32, 2>;
using ValidBuffer = ffi::Buffer<ffi::S32, 1>;
using ScalesBuffer = ffi::Buffer<ffi::F32, 1>;
using LatentBuffer = ffi::Buffer<ffi::BF16, 3>;
using LseBuffer = ffi::Buffer<ffi::F32, 2>;

ffi::Error CheckFp8(std::string_view name, const Fp8Buffer& buffer, size_t rank) {
  if (buffer.element_type() != ffi::F8E4M3FN || buffer.dimensions().size() != rank) {
    return ffi::Error::InvalidArgument("jax_sparse_mla: " + std::string(name) +
                                       " must be a float8_e4m3fn array of rank " +
                                       std::to_string(rank));
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, KernelState* state, Fp8Buffer q, Fp8Buffer kv,
                   RowsBuffer rows, ValidBuffer valid, ScalesBuffer scales,
                   ffi::Result<LatentBuffer> latent, ffi::Result<LseBuffer> lse,
                   ffi::Dictionary /*spec*/) {
  const cu::Driver& d = *state->driver;
  if (ffi::Error error = CheckFp8("q", q, 3); error.failure()) return error;
  if (ffi::Error error = CheckFp8("kv", kv, 2); error.failure()) return error;
  const int64_t kv_rows = kv.dimensions()[0];
  if (kv_rows > INT32_MAX) {
    return ffi::Error::InvalidArgument("jax_sparse_mla: kv has " + std::to_string(kv_rows) +
                                       " rows; the kernel indexes rows with int32");
  }
  cu::Context context = nullptr;
  if (ffi::Error error = cu::Check(d, "cuStreamGetCtx", d.StreamGetCtx(stream, &context));
      error.failure()) {
    return error;
  }
  const KernelState::Loaded* entry = state->Find(context);
  if (entry == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_sparse_mla: the kernel was not loaded into this stream's CUDA "
                      "context (the context did not exist when the executable was built)");
  }

  void* q_ptr = q.untyped_data();
  void* kv_ptr = kv.untyped_data();
  void* rows_ptr = rows.untyped_data();
  void* valid_ptr = valid.untyped_data();
  void* scales_ptr = scales.untyped_data();
  void* latent_ptr = latent->untyped_data();
  void* lse_ptr = lse->untyped_data();
  int32_t n_rows = static_cast<int32_t>(kv_rows);
  void* params[] = {&q_ptr,      &kv_ptr,     &rows_ptr, &valid_ptr,
                    &scales_ptr, &latent_ptr, &lse_ptr,  &n_rows};

  cu::LaunchAttribute attrs[2] = {};
  attrs[0].id = cu::kLaunchAttrClusterDimension;
  attrs[0].value.cluster_dim = {state->cluster[0], state->cluster[1], state->cluster[2]};
  attrs[1].id = cu::kLaunchAttrProgrammaticStreamSerialization;
  attrs[1].value.programmatic_stream_serialization_allowed = 1;

  cu::LaunchConfig config{};
  config.grid_dim_x = state->grid[0];
  config.grid_dim_y = state->grid[1];
  config.grid_dim_z = state->grid[2];
  config.block_dim_x = state->block[0];
  config.block_dim_y = state->block[1];
  config.block_dim_z = state->block[2];
  config.shared_mem_bytes = state->smem_bytes;
  config.stream = stream;
  config.attrs = attrs;
  config.num_attrs = 2;
  return cu::Check(d, "cuLaunchKernelEx",
                   d.LaunchKernelEx(&config, entry->function, params, /*extra=*/nullptr));
}

}  // namespace

// The library's only exported symbols (it is built with hidden visibility).
#define JAX_SPARSE_MLA_EXPORT extern "C" __attribute__((visibility("default")))
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodeInstantiate(XLA_FFI_CallFrame* call_frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodeExecute(XLA_FFI_CallFrame* call_frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_TypeId* JaxSparseMlaDecodeStateTypeId();
JAX_SPARSE_MLA_EXPORT const XLA_FFI_TypeInfo* JaxSparseMlaDecodeStateTypeInfo();

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaDecodeInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<LaunchSpec>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaDecodeExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::State<KernelState>>()            // state
                                  .Arg<Fp8Buffer>()                          // q
                                  .Arg<Fp8Buffer>()                          // kv
                                  .Arg<RowsBuffer>()                         // rows
                                  .Arg<ValidBuffer>()                        // valid
                                  .Arg<ScalesBuffer>()                       // scales
                                  .Ret<LatentBuffer>()                       // latent
                                  .Ret<LseBuffer>()                          // lse
                                  .Attrs(),  // launch spec: read at instantiation
                              {ffi::Traits::kCmdBufferCompatible});

// The state's type, registered from Python with jax.ffi.register_ffi_type.
XLA_FFI_TypeId* JaxSparseMlaDecodeStateTypeId() { return &KernelState::id; }

const XLA_FFI_TypeInfo* JaxSparseMlaDecodeStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<KernelState>();
  return &info;
}
