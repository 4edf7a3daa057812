// XLA FFI handler for the sparse MLA decode kernel (target "jax_sparse_mla_decode", CUDA).
//
// The custom call carries the kernel's sm_90a cubin and its launch metadata as attributes, so
// a lowered, exported or cached executable is self-contained:
//   cubin        u8[]     the cubin bytes (an ELF image; NUL bytes included)
//   kernel_name  string   the entry symbol inside the cubin
//   head_tile    i64      query heads per cluster: the grid is (ceil(Hp / head_tile) * cluster.x,
//                         B, 1); a last partial tile's missing heads are neither read nor written
//   block        i64[3]   block dimensions in threads
//   cluster      i64[3]   cluster dimensions in blocks
//   smem_bytes   i64      dynamic shared memory per block
// Parameter ABI of the entry (PARAMS in jax_sparse_mla/kernel/config.py): q, kv, rows, valid,
// scales, latent, lse as device pointers, then n_rows = kv.shape[0], width = rows.shape[1],
// heads = Hp (q.shape[1]; with the push exchange D * H_own padded to 16) and row_bytes =
// kv.shape[1] as i32, then the push exchange's parameters: the mailbox header, rank and step
// pointers, D, H_own and the mailbox offsets (null pointers, 1, Hp and zeros for a plain
// decode). Nothing about the shape is compiled into the cubin: the grid and the sizes come from
// the buffers of each call.
//
// Two targets share the instantiate stage: "jax_sparse_mla_decode" (results latent, lse) and
// "jax_sparse_mla_decode_push" (dcp_decode(exchange="push"): q is this rank's own heads [B, H_own,
// 576], the GLOBAL top-k tokens [B, K] in place of rows and valid, operands rank and step,
// attributes dcp_size, heads_own and split, results the merged latent [B, H_own, 512] and lse
// [B, H_own] of this rank's heads and the kernel's scratch, s32[B * CTAs per row * ceil(K /
// split)] (passed as the ABI's valid: each CTA lists its keys' rows there); the kernel
// compacts this rank's tokens, exchanges the query heads with the other ranks' decodes and
// stores the rows into the owners' mailboxes, and the exchange's merge follows it on the
// stream, see dcp_exchange.cc).
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
// No CUDA toolkit is needed to build this file: the driver's types and entry-point typedefs
// come from cuda.h and cudaTypedefs.h of the nvidia-cuda-runtime wheel (a build requirement),
// and the entry points are resolved from libcuda.so.1 at run time with cuGetProcAddress,
// requesting the CUDA 12.0 ABI of each (so a 12.x driver still works); see cuda_driver.h.

#include "cuda_driver.h"
#include "dcp_exchange.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The stream type of PlatformStream, as the CUDA runtime spells it (the same type as CUstream).
using cudaStream_t = CUstream;

namespace cu {

constexpr unsigned int kPortableClusterSize = 8;
constexpr int64_t kMaxGridY = 65535;

}  // namespace cu

// What the custom call's attributes say about the kernel and its launch.
struct LaunchSpec {
  ffi::Span<const uint8_t> cubin;
  std::string_view kernel_name;
  int64_t head_tile;
  ffi::Span<const int64_t> block;
  ffi::Span<const int64_t> cluster;
  int64_t smem_bytes;
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(LaunchSpec,
                                      ffi::StructMember<ffi::Span<const uint8_t>>("cubin"),
                                      ffi::StructMember<std::string_view>("kernel_name"),
                                      ffi::StructMember<int64_t>("head_tile"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("block"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("cluster"),
                                      ffi::StructMember<int64_t>("smem_bytes"));

// The push target's attributes: the launch spec's and the exchange's sizes (read in execute).
struct PushLaunchSpec {
  ffi::Span<const uint8_t> cubin;
  std::string_view kernel_name;
  int64_t head_tile;
  ffi::Span<const int64_t> block;
  ffi::Span<const int64_t> cluster;
  int64_t smem_bytes;
  int64_t dcp_size;
  int64_t heads_own;
  int64_t split;  // the cubin's split: its CTAs' scratch lists hold ceil(K / split) rows
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(PushLaunchSpec,
                                      ffi::StructMember<ffi::Span<const uint8_t>>("cubin"),
                                      ffi::StructMember<std::string_view>("kernel_name"),
                                      ffi::StructMember<int64_t>("head_tile"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("block"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("cluster"),
                                      ffi::StructMember<int64_t>("smem_bytes"),
                                      ffi::StructMember<int64_t>("dcp_size"),
                                      ffi::StructMember<int64_t>("heads_own"),
                                      ffi::StructMember<int64_t>("split"));

// The kernel loaded into each CUDA context the executable can run in, plus its launch shape.
struct KernelState {
  static ffi::TypeId id;

  struct Loaded {
    CUcontext context;
    CUmodule module;
    CUfunction function;
  };

  const cu::Driver* driver = nullptr;
  std::vector<Loaded> loaded;
  unsigned int head_tile = 0;
  unsigned int block[3] = {};
  unsigned int cluster[3] = {};
  unsigned int smem_bytes = 0;
  unsigned int split = 0;  // the push target's (its scratch's size); 0 for the plain target

  KernelState() = default;
  KernelState(const KernelState&) = delete;
  KernelState& operator=(const KernelState&) = delete;

  ~KernelState() {
    // Errors are ignored: at process exit the driver may already be torn down.
    for (const Loaded& entry : loaded) {
      if (driver->CtxPushCurrent(entry.context) != CUDA_SUCCESS) continue;
      driver->ModuleUnload(entry.module);
      CUcontext popped = nullptr;
      driver->CtxPopCurrent(&popped);
    }
  }

  const Loaded* Find(CUcontext context) const {
    for (const Loaded& entry : loaded) {
      if (entry.context == context) return &entry;
    }
    return nullptr;
  }
};

ffi::TypeId KernelState::id = {};

constexpr int64_t kRowBytes = 576;  // a query row; a cache row's first 576 bytes
constexpr int64_t kLatent = 512;
constexpr int64_t kHeadGrain = 16;  // Hp is padded to a multiple of 16 (validation.HEAD_TILE)

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
ffi::Error LoadInto(KernelState& state, CUcontext context, const LaunchSpec& spec,
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
                      d.FuncSetAttribute(entry.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         static_cast<int>(state.smem_bytes)));
  }
  const unsigned int cluster_size = state.cluster[0] * state.cluster[1] * state.cluster[2];
  if (error.success() && cluster_size > cu::kPortableClusterSize) {
    error = cu::Check(d, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                      d.FuncSetAttribute(entry.function,
                                         CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1));
  }
  if (error.failure() && entry.module != nullptr) {
    d.ModuleUnload(entry.module);
  } else if (error.success()) {
    state.loaded.push_back(entry);
  }
  CUcontext popped = nullptr;
  ffi::Error pop = cu::Check(d, "cuCtxPopCurrent", d.CtxPopCurrent(&popped));
  return error.failure() ? error : pop;
}

ffi::ErrorOr<std::unique_ptr<KernelState>> Instantiate(LaunchSpec spec) {
  using Failed = ffi::Unexpected<ffi::Error>;
  if (spec.cubin.size() == 0 || spec.kernel_name.empty()) {
    return Failed(ffi::Error::InvalidArgument("jax_sparse_mla: empty cubin or kernel_name"));
  }
  for (auto [name, dims, limit] : {std::tuple<const char*, ffi::Span<const int64_t>, int64_t>{
                                       "block", spec.block, 1024},
                                   {"cluster", spec.cluster, 16}}) {
    if (ffi::Error error = CheckDims(name, dims, limit); error.failure()) return Failed(error);
  }
  if (spec.head_tile < 1 || spec.head_tile > 1024) {
    return Failed(ffi::Error::InvalidArgument("jax_sparse_mla: bad head_tile " +
                                              std::to_string(spec.head_tile)));
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
    state->block[i] = static_cast<unsigned int>(spec.block[i]);
    state->cluster[i] = static_cast<unsigned int>(spec.cluster[i]);
  }
  state->smem_bytes = static_cast<unsigned int>(spec.smem_bytes);
  state->head_tile = static_cast<unsigned int>(spec.head_tile);

  const std::string kernel_name(spec.kernel_name);
  ffi::Error error = cu::ForEachExecutableContext(
      loaded.driver, [&](CUcontext context) { return state->Find(context) != nullptr; },
      [&](CUcontext context) { return LoadInto(*state, context, spec, kernel_name); });
  if (error.failure()) return Failed(error);
  if (state->loaded.empty()) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "jax_sparse_mla: no active CUDA context to load the kernel into "
                             "while XLA instantiated the executable"));
  }
  return state;
}

ffi::ErrorOr<std::unique_ptr<KernelState>> InstantiatePush(PushLaunchSpec spec) {
  // A cluster holds split CTAs of each of its one or two head tiles.
  if (spec.split < 1 || spec.split > 8 || (spec.split & (spec.split - 1)) != 0 ||
      spec.cluster.size() < 1 || spec.cluster[0] % spec.split != 0) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        "jax_sparse_mla: bad split " + std::to_string(spec.split) + " of the push target"));
  }
  ffi::ErrorOr<std::unique_ptr<KernelState>> state = Instantiate(LaunchSpec{
      spec.cubin, spec.kernel_name, spec.head_tile, spec.block, spec.cluster, spec.smem_bytes});
  if (state.has_value()) state.value()->split = static_cast<unsigned int>(spec.split);
  return state;
}

// Typed buffers of the kernel's operands. The FFI headers have no native type for FP8, so q
// and kv are untyped here and their dtype and rank are checked in Execute.
using Fp8Buffer = ffi::AnyBuffer;
using RowsBuffer = ffi::Buffer<ffi::S32, 2>;
using ValidBuffer = ffi::Buffer<ffi::S32, 1>;
using ScratchBuffer = ffi::Buffer<ffi::S32, 1>;
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

ffi::Error InvalidShape(std::string message) {
  return ffi::Error::InvalidArgument("jax_sparse_mla: " + std::move(message));
}

// Where the kernel's results go (the ABI's last nine parameters besides latent and lse).
struct Outputs {
  void* latent = nullptr;
  void* lse = nullptr;
  void* exchange = nullptr;  // the mailbox header, or null
  void* rank = nullptr;
  void* step = nullptr;
  int32_t dcp = 1;
  int32_t heads_own = 0;  // Hp without an exchange
  int32_t latent_offset = 0;
  int32_t lse_offset = 0;
  int32_t query_offset = 0;
  int32_t query_flags_offset = 0;
};

// The launch's grid columns (CTAs per row) for Hp padded heads.
int64_t CtasPerRow(const KernelState& state, int64_t heads) {
  return (heads + state.head_tile - 1) / state.head_tile * state.cluster[0];
}

// Launches the decode of `heads` (Hp) padded heads: q holds them all, or with an exchange this
// rank's H_own; `valid` is valid [B] (checked by the caller), or with an exchange the scratch.
ffi::Error Launch(cudaStream_t stream, KernelState* state, Fp8Buffer q, Fp8Buffer kv,
                  RowsBuffer rows, void* valid_ptr, ScalesBuffer scales, int64_t heads,
                  Outputs out) {
  const cu::Driver& d = *state->driver;
  if (ffi::Error error = CheckFp8("q", q, 3); error.failure()) return error;
  if (ffi::Error error = CheckFp8("kv", kv, 2); error.failure()) return error;
  // Python normalizes the operands; these checks keep a malformed call from reading out of
  // bounds.
  const int64_t batch = q.dimensions()[0];
  const int64_t q_heads = out.exchange == nullptr ? heads : out.heads_own;
  const int64_t kv_rows = kv.dimensions()[0];
  const int64_t row_bytes = kv.dimensions()[1];
  const int64_t width = rows.dimensions()[1];
  if (q.dimensions()[2] != kRowBytes || row_bytes < kRowBytes || row_bytes % 16 != 0 ||
      row_bytes > INT32_MAX) {
    return InvalidShape("q rows must be " + std::to_string(kRowBytes) +
                        " bytes and kv rows at least that, a multiple of 16; got q [.., .., " +
                        std::to_string(q.dimensions()[2]) + "], kv [.., " +
                        std::to_string(row_bytes) + "]");
  }
  if (rows.dimensions()[0] != batch || scales.dimensions()[0] != 2 ||
      q.dimensions()[1] != q_heads) {
    return InvalidShape("operand shapes disagree with q [" + std::to_string(batch) + ", " +
                        std::to_string(q_heads) + ", 576]");
  }
  if (batch < 1 || batch > cu::kMaxGridY || heads < 1 || heads % kHeadGrain != 0 ||
      CtasPerRow(*state, heads) > INT32_MAX || width < 1 || width > INT32_MAX ||
      kv_rows > INT32_MAX) {
    return InvalidShape("unsupported sizes: B=" + std::to_string(batch) +
                        " (1.." + std::to_string(cu::kMaxGridY) + "), Hp=" + std::to_string(heads) +
                        " (a multiple of " + std::to_string(kHeadGrain) +
                        "), K=" + std::to_string(width) + ", N=" + std::to_string(kv_rows) +
                        " (int32)");
  }
  CUcontext context = nullptr;
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
  void* scales_ptr = scales.untyped_data();
  int32_t n_rows = static_cast<int32_t>(kv_rows);
  int32_t width_param = static_cast<int32_t>(width);
  int32_t heads_param = static_cast<int32_t>(heads);
  int32_t row_bytes_param = static_cast<int32_t>(row_bytes);
  if (out.exchange == nullptr) out.heads_own = heads_param;
  void* params[] = {&q_ptr,          &kv_ptr,       &rows_ptr,          &valid_ptr,
                    &scales_ptr,     &out.latent,   &out.lse,           &n_rows,
                    &width_param,    &heads_param,  &row_bytes_param,   &out.exchange,
                    &out.rank,       &out.step,     &out.dcp,           &out.heads_own,
                    &out.latent_offset, &out.lse_offset, &out.query_offset,
                    &out.query_flags_offset};

  CUlaunchAttribute attrs[2] = {};
  attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attrs[0].value.clusterDim.x = state->cluster[0];
  attrs[0].value.clusterDim.y = state->cluster[1];
  attrs[0].value.clusterDim.z = state->cluster[2];
  attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attrs[1].value.programmaticStreamSerializationAllowed = 1;

  CUlaunchConfig config{};
  config.gridDimX = static_cast<unsigned int>(CtasPerRow(*state, heads));
  config.gridDimY = static_cast<unsigned int>(batch);
  config.gridDimZ = 1;
  config.blockDimX = state->block[0];
  config.blockDimY = state->block[1];
  config.blockDimZ = state->block[2];
  config.sharedMemBytes = state->smem_bytes;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = 2;
  return cu::Check(d, "cuLaunchKernelEx",
                   d.LaunchKernelEx(&config, entry->function, params, /*extra=*/nullptr));
}

ffi::Error Execute(cudaStream_t stream, KernelState* state, Fp8Buffer q, Fp8Buffer kv,
                   RowsBuffer rows, ValidBuffer valid, ScalesBuffer scales,
                   ffi::Result<LatentBuffer> latent, ffi::Result<LseBuffer> lse,
                   ffi::Dictionary /*spec*/) {
  const int64_t batch = q.dimensions()[0];
  const int64_t heads = q.dimensions()[1];
  if (latent->dimensions()[0] != batch || latent->dimensions()[1] != heads ||
      latent->dimensions()[2] != kLatent || lse->dimensions()[0] != batch ||
      lse->dimensions()[1] != heads) {
    return InvalidShape("results latent, lse disagree with q [" + std::to_string(batch) + ", " +
                        std::to_string(heads) + ", 576]");
  }
  if (valid.dimensions()[0] != batch) {
    return InvalidShape("valid [" + std::to_string(valid.dimensions()[0]) +
                        "] disagrees with q [" + std::to_string(batch) + ", ..]");
  }
  Outputs out;
  out.latent = latent->untyped_data();
  out.lse = lse->untyped_data();
  return Launch(stream, state, q, kv, rows, valid.untyped_data(), scales, heads, out);
}

using ScalarBuffer = ffi::Buffer<ffi::S32, 0>;

ffi::Error ExecutePush(cudaStream_t stream, KernelState* state, Fp8Buffer q, Fp8Buffer kv,
                       RowsBuffer tokens, ScalesBuffer scales, ScalarBuffer rank,
                       ScalarBuffer step, ffi::Result<LatentBuffer> latent,
                       ffi::Result<LseBuffer> lse, ffi::Result<ScratchBuffer> scratch,
                       ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> dcp_size = attrs.get<int64_t>("dcp_size");
  ffi::ErrorOr<int64_t> heads_own = attrs.get<int64_t>("heads_own");
  if (dcp_size.has_error() || heads_own.has_error()) {
    return ffi::Error::InvalidArgument("jax_sparse_mla: decode_push needs the int64 attributes "
                                       "dcp_size and heads_own");
  }
  if (dcp_size.value() < 1 || dcp_size.value() > 16 || heads_own.value() < 1 ||
      heads_own.value() > 4096 || q.dimensions().size() != 3 ||
      q.dimensions()[1] != heads_own.value()) {
    return InvalidShape("decode_push: q must hold this rank's heads_own=" +
                        std::to_string(heads_own.value()) + " heads of D=" +
                        std::to_string(dcp_size.value()) + " ranks (1..16)");
  }
  const int64_t batch = q.dimensions()[0];
  if (latent->dimensions()[0] != batch || latent->dimensions()[1] != heads_own.value() ||
      latent->dimensions()[2] != kLatent || lse->dimensions()[0] != batch ||
      lse->dimensions()[1] != heads_own.value()) {
    return InvalidShape("decode_push: results latent, lse disagree with q [" +
                        std::to_string(batch) + ", " + std::to_string(heads_own.value()) +
                        ", 576]");
  }
  const int64_t heads =
      (dcp_size.value() * heads_own.value() + kHeadGrain - 1) / kHeadGrain * kHeadGrain;
  const int64_t flags_per_row = CtasPerRow(*state, heads);
  const int64_t split = state->split;  // >= 1: InstantiatePush checked it
  const int64_t lists = batch * flags_per_row * ((tokens.dimensions()[1] + split - 1) / split);
  if (static_cast<int64_t>(scratch->element_count()) < lists) {
    return InvalidShape("decode_push: the scratch holds " +
                        std::to_string(scratch->element_count()) + " rows, the CTAs' lists " +
                        std::to_string(lists));
  }
  ffi::ErrorOr<dcp::PushTarget> target =
      dcp::PushTargetFor(stream, dcp_size.value(), batch, heads_own.value(), flags_per_row);
  if (target.has_error()) return target.error();
  Outputs out;
  out.exchange = reinterpret_cast<void*>(target.value().header);
  out.rank = rank.untyped_data();
  out.step = step.untyped_data();
  out.dcp = static_cast<int32_t>(dcp_size.value());
  out.heads_own = static_cast<int32_t>(heads_own.value());
  out.latent_offset = static_cast<int32_t>(target.value().latent_offset);
  out.lse_offset = static_cast<int32_t>(target.value().lse_offset);
  out.query_offset = static_cast<int32_t>(target.value().query_offset);
  out.query_flags_offset = static_cast<int32_t>(target.value().query_flags_offset);
  if (ffi::Error error =
          Launch(stream, state, q, kv, tokens, scratch->untyped_data(), scales, heads, out);
      error.failure()) {
    return error;
  }
  // The owners' merge awaits the flags of this launch's CTAs: its tile and CTAs per tile.
  const dcp::MergeCall merge{latent->untyped_data(), lse->untyped_data(), step.untyped_data(),
                             dcp_size.value(),       batch,               heads_own.value(),
                             state->head_tile,       state->cluster[0],   flags_per_row};
  return dcp::LaunchMerge(stream, target.value(), merge);
}

}  // namespace

// Exported symbols of the decode handler (the library is built with hidden visibility).
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodeInstantiate(XLA_FFI_CallFrame* call_frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodeExecute(XLA_FFI_CallFrame* call_frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodePushInstantiate(
    XLA_FFI_CallFrame* call_frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaDecodePushExecute(XLA_FFI_CallFrame* call_frame);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaDecodePushInstantiate, InstantiatePush,
                              ffi::Ffi::BindInstantiate().Attrs<PushLaunchSpec>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaDecodePushExecute, ExecutePush,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::State<KernelState>>()            // state
                                  .Arg<Fp8Buffer>()                          // q (own heads)
                                  .Arg<Fp8Buffer>()                          // kv
                                  .Arg<RowsBuffer>()                         // tokens
                                  .Arg<ScalesBuffer>()                       // scales
                                  .Arg<ScalarBuffer>()                       // rank
                                  .Arg<ScalarBuffer>()                       // step
                                  .Ret<LatentBuffer>()  // merged rows of this rank's heads
                                  .Ret<LseBuffer>()
                                  .Ret<ScratchBuffer>()  // the CTAs' lists of their keys
                                  .Attrs(),  // launch spec, dcp_size, heads_own, split
                              {ffi::Traits::kCmdBufferCompatible});

// The state's type, registered from Python with jax.ffi.register_ffi_type.
XLA_FFI_TypeId* JaxSparseMlaDecodeStateTypeId() { return &KernelState::id; }

const XLA_FFI_TypeInfo* JaxSparseMlaDecodeStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<KernelState>();
  return &info;
}
