// XLA FFI handler for the DSA indexer's top-k (target "jax_sparse_mla_index_topk", CUDA).
//
// One custom call launches two kernels on the stream, both under PDL: the scores kernel
// (jax_sparse_mla/kernel/index/scores.py) writes every (verify row, token) score's order key
// into the scratch result, and the radix top-k kernel (kernel/index/topk.py) selects from
// them. Attributes (the cubins travel with the executable):
//   scores_cubin, topk_cubin   u8[]    the two sm_90a cubins
//   scores_kernel, topk_kernel string  their entry symbols
//   topk_cluster               i64     the top-k's CTAs per verify row (its cubin's cluster)
//   span                       i64     key tiles per scores CTA (the lowering's choice)
//   dcp_size                   i64     D: the cache is this rank's shard of D (1: no DCP)
// Operands: q [B, T, Hp, 128] f8e4m3fn (Hp a multiple of 64), weights [B, T, Hp] f32, keys
// [num_blocks, block_size, 128] f8e4m3fn, key_scales [num_blocks, block_size] f32,
// block_table [B, max_blocks] s32, lengths [B] s32 (global context lengths, any value: the
// kernels clamp them as index_validation.row_limits does) and rank [1] s32 (this rank, < D).
// Results: tokens [B, T, top_k] s32, scores [B, T, top_k] f32, order_keys [B, T, pitch] s32
// (scratch; pitch = ceil(max_blocks * block_size / 64) * 64).
//
// Stages as in sparse_mla_ffi.cc: instantiate loads both cubins into every active primary
// context (and the current one); execute allocates, synchronizes and loads nothing
// (command-buffer compatible).

#include "cuda_driver.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using cudaStream_t = CUstream;

namespace {

// Mirrors jax_sparse_mla/kernel/index/config.py.
constexpr int64_t kDim = 128;
constexpr int64_t kTokens = 64;
constexpr int64_t kHeads = 64;
constexpr unsigned int kScoreThreads = 256;
constexpr int64_t kScoreSmemFixed = 8 * 8192 + 2 * 8 * 64 * 4;
constexpr int64_t kScoreSmemPerQueryTile = 8192 + 64 * 4;
constexpr int64_t kMaxQueryTiles = 16;
constexpr unsigned int kTopkThreads = 512;
constexpr unsigned int kTopkSmem =
    3 * 2048 * 4 + 3 * 1024 * 4 + 2 * 4 * 16 * 4 + 2 * 16 * 4 + 3 * 16 * 4 + 3 * 16 + 16 +
    3 * 8192 * 4;
constexpr int64_t kMaxGridY = 65535;

struct IndexSpec {
  ffi::Span<const uint8_t> scores_cubin;
  std::string_view scores_kernel;
  ffi::Span<const uint8_t> topk_cubin;
  std::string_view topk_kernel;
  int64_t topk_cluster;
  int64_t span;
  int64_t dcp_size;
};

}  // namespace

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(IndexSpec,
                                      ffi::StructMember<ffi::Span<const uint8_t>>("scores_cubin"),
                                      ffi::StructMember<std::string_view>("scores_kernel"),
                                      ffi::StructMember<ffi::Span<const uint8_t>>("topk_cubin"),
                                      ffi::StructMember<std::string_view>("topk_kernel"),
                                      ffi::StructMember<int64_t>("topk_cluster"),
                                      ffi::StructMember<int64_t>("span"),
                                      ffi::StructMember<int64_t>("dcp_size"));

// Both kernels loaded into each CUDA context the executable can run in.
struct IndexState {
  static ffi::TypeId id;

  struct Loaded {
    CUcontext context;
    CUmodule scores_module;
    CUmodule topk_module;
    CUfunction scores;
    CUfunction topk;
  };

  const cu::Driver* driver = nullptr;
  std::vector<Loaded> loaded;
  int64_t span = 1;
  int64_t dcp_size = 1;
  unsigned int topk_cluster = 1;

  IndexState() = default;
  IndexState(const IndexState&) = delete;
  IndexState& operator=(const IndexState&) = delete;

  ~IndexState() {
    for (const Loaded& entry : loaded) {  // errors ignored: the driver may be torn down
      if (driver->CtxPushCurrent(entry.context) != CUDA_SUCCESS) continue;
      driver->ModuleUnload(entry.scores_module);
      driver->ModuleUnload(entry.topk_module);
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

ffi::TypeId IndexState::id = {};

namespace {

// One cubin's module and entry, with its dynamic shared memory opt-in.
ffi::Error LoadFunction(const cu::Driver& d, ffi::Span<const uint8_t> cubin,
                        std::string_view name, int smem_bytes, CUmodule* module,
                        CUfunction* function) {
  const std::string entry(name);
  ffi::Error error = cu::Check(d, "cuModuleLoadData (cubin of " + entry + ")",
                               d.ModuleLoadData(module, cubin.begin()));
  if (error.success()) {
    error = cu::Check(d, "cuModuleGetFunction(" + entry + ")",
                      d.ModuleGetFunction(function, *module, entry.c_str()));
  }
  if (error.success()) {
    error = cu::Check(d, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                      d.FuncSetAttribute(*function,
                                         CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         smem_bytes));
  }
  if (error.failure() && *module != nullptr) {
    d.ModuleUnload(*module);
    *module = nullptr;
  }
  return error;
}

ffi::Error LoadInto(IndexState& state, CUcontext context, const IndexSpec& spec) {
  const cu::Driver& d = *state.driver;
  if (ffi::Error error = cu::Check(d, "cuCtxPushCurrent", d.CtxPushCurrent(context));
      error.failure()) {
    return error;
  }
  IndexState::Loaded entry{context, nullptr, nullptr, nullptr, nullptr};
  ffi::Error error = LoadFunction(
      d, spec.scores_cubin, spec.scores_kernel,
      static_cast<int>(kScoreSmemFixed + kMaxQueryTiles * kScoreSmemPerQueryTile),
      &entry.scores_module, &entry.scores);
  if (error.success()) {
    error = LoadFunction(d, spec.topk_cubin, spec.topk_kernel, static_cast<int>(kTopkSmem),
                         &entry.topk_module, &entry.topk);
    if (error.success() && spec.topk_cluster > 8) {  // beyond the portable cluster size
      error = cu::Check(d, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                        d.FuncSetAttribute(entry.topk,
                                           CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1));
      if (error.failure()) d.ModuleUnload(entry.topk_module);
    }
    if (error.failure()) d.ModuleUnload(entry.scores_module);
  }
  if (error.success()) state.loaded.push_back(entry);
  CUcontext popped = nullptr;
  ffi::Error pop = cu::Check(d, "cuCtxPopCurrent", d.CtxPopCurrent(&popped));
  return error.failure() ? error : pop;
}

ffi::ErrorOr<std::unique_ptr<IndexState>> Instantiate(IndexSpec spec) {
  using Failed = ffi::Unexpected<ffi::Error>;
  if (spec.scores_cubin.size() == 0 || spec.topk_cubin.size() == 0 ||
      spec.scores_kernel.empty() || spec.topk_kernel.empty() || spec.span < 1 ||
      spec.span > INT32_MAX || spec.topk_cluster < 1 || spec.topk_cluster > 16 ||
      spec.dcp_size < 1 || spec.dcp_size > INT32_MAX) {
    return Failed(ffi::Error::InvalidArgument(
        "jax_sparse_mla index_topk: empty cubin or kernel name, span outside [1, 2^31) or "
        "topk_cluster outside [1, 16] or dcp_size outside [1, 2^31)"));
  }
  const cu::LoadedDriver& loaded = cu::GetDriver();
  if (!loaded.error.empty()) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "jax_sparse_mla: " + loaded.error));
  }
  auto state = std::make_unique<IndexState>();
  state->driver = &loaded.driver;
  state->span = spec.span;
  state->dcp_size = spec.dcp_size;
  state->topk_cluster = static_cast<unsigned int>(spec.topk_cluster);
  ffi::Error error = cu::ForEachExecutableContext(
      loaded.driver, [&](CUcontext context) { return state->Find(context) != nullptr; },
      [&](CUcontext context) { return LoadInto(*state, context, spec); });
  if (error.failure()) return Failed(error);
  if (state->loaded.empty()) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "jax_sparse_mla: no active CUDA context to load the index_topk "
                             "kernels into while XLA instantiated the executable"));
  }
  return state;
}

ffi::Error Invalid(std::string message) {
  return ffi::Error::InvalidArgument("jax_sparse_mla index_topk: " + std::move(message));
}

// Launches under PDL, in clusters of `cluster` CTAs along x.
ffi::Error LaunchPdl(const cu::Driver& d, CUfunction function, cudaStream_t stream,
                     unsigned int grid_x, unsigned int grid_y, unsigned int cluster,
                     unsigned int threads, unsigned int smem, void** params) {
  CUlaunchAttribute attrs[2] = {};
  attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attrs[0].value.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attrs[1].value.clusterDim.x = cluster;
  attrs[1].value.clusterDim.y = 1;
  attrs[1].value.clusterDim.z = 1;
  CUlaunchConfig config{};
  config.gridDimX = grid_x;
  config.gridDimY = grid_y;
  config.gridDimZ = 1;
  config.blockDimX = threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = smem;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = 2;
  return cu::Check(d, "cuLaunchKernelEx", d.LaunchKernelEx(&config, function, params, nullptr));
}

// Typed buffers (aliases: the binding macro cannot take template commas). FP8 has no
// native FFI type: q and keys are untyped and checked in Execute.
using Fp8Buffer = ffi::AnyBuffer;
using WeightsBuffer = ffi::Buffer<ffi::F32, 3>;
using KeyScalesBuffer = ffi::Buffer<ffi::F32, 2>;
using TableBuffer = ffi::Buffer<ffi::S32, 2>;  // block_table
using VectorBuffer = ffi::Buffer<ffi::S32, 1>;  // lengths, rank
using TokensBuffer = ffi::Buffer<ffi::S32, 3>;  // tokens, order_keys
using ScoresBuffer = ffi::Buffer<ffi::F32, 3>;

ffi::Error Execute(cudaStream_t stream, IndexState* state, Fp8Buffer q, WeightsBuffer weights,
                   Fp8Buffer keys, KeyScalesBuffer key_scales, TableBuffer block_table,
                   VectorBuffer lengths, VectorBuffer rank, ffi::Result<TokensBuffer> tokens,
                   ffi::Result<ScoresBuffer> scores, ffi::Result<TokensBuffer> order_keys,
                   ffi::Dictionary /*spec*/) {
  const cu::Driver& d = *state->driver;
  if (q.element_type() != ffi::F8E4M3FN || q.dimensions().size() != 4 ||
      keys.element_type() != ffi::F8E4M3FN || keys.dimensions().size() != 3) {
    return Invalid("q must be f8e4m3fn [B, T, Hp, 128] and keys f8e4m3fn [blocks, size, 128]");
  }
  // Python normalizes the operands; these checks keep a malformed call from reading out of
  // bounds.
  const int64_t batch = q.dimensions()[0];
  const int64_t steps = q.dimensions()[1];
  const int64_t heads = q.dimensions()[2];
  const int64_t num_blocks = keys.dimensions()[0];
  const int64_t block_size = keys.dimensions()[1];
  const int64_t max_blocks = block_table.dimensions()[1];
  const int64_t top_k = tokens->dimensions()[2];
  const int64_t capacity = max_blocks * block_size;
  const int64_t pitch = (capacity + kTokens - 1) / kTokens * kTokens;
  const int64_t head_tiles = heads / kHeads;
  const bool shapes_agree =
      q.dimensions()[3] == kDim && keys.dimensions()[2] == kDim && heads % kHeads == 0 &&
      weights.dimensions()[0] == batch && weights.dimensions()[1] == steps &&
      weights.dimensions()[2] == heads && key_scales.dimensions()[0] == num_blocks &&
      key_scales.dimensions()[1] == block_size && block_table.dimensions()[0] == batch &&
      lengths.dimensions()[0] == batch && rank.dimensions()[0] == 1 &&
      tokens->dimensions()[0] == batch && tokens->dimensions()[1] == steps &&
      scores->dimensions()[0] == batch && scores->dimensions()[1] == steps &&
      scores->dimensions()[2] == top_k && order_keys->dimensions()[0] == batch &&
      order_keys->dimensions()[1] == steps && order_keys->dimensions()[2] == pitch;
  if (!shapes_agree) return Invalid("operand and result shapes disagree");
  if (batch < 1 || batch > kMaxGridY || steps < 1 || steps > kMaxGridY || head_tiles < 1 ||
      steps * head_tiles > kMaxQueryTiles || block_size < 1 || max_blocks < 1 ||
      pitch >= INT32_MAX || num_blocks * block_size >= INT32_MAX || top_k < 1 ||
      top_k >= INT32_MAX || steps * pitch >= INT32_MAX || steps * top_k >= INT32_MAX ||
      state->dcp_size * capacity >= INT32_MAX) {
    return Invalid("unsupported sizes: B=" + std::to_string(batch) + ", T=" +
                   std::to_string(steps) + ", Hp=" + std::to_string(heads) + ", capacity=" +
                   std::to_string(capacity) + ", top_k=" + std::to_string(top_k));
  }
  CUcontext context = nullptr;
  if (ffi::Error error = cu::Check(d, "cuStreamGetCtx", d.StreamGetCtx(stream, &context));
      error.failure()) {
    return error;
  }
  const IndexState::Loaded* entry = state->Find(context);
  if (entry == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_sparse_mla index_topk: the kernels were not loaded into this "
                      "stream's CUDA context");
  }
  void* q_ptr = q.untyped_data();
  void* weights_ptr = weights.untyped_data();
  void* keys_ptr = keys.untyped_data();
  void* key_scales_ptr = key_scales.untyped_data();
  void* table_ptr = block_table.untyped_data();
  void* lengths_ptr = lengths.untyped_data();
  void* rank_ptr = rank.untyped_data();
  void* order_ptr = order_keys->untyped_data();
  void* tokens_ptr = tokens->untyped_data();
  void* scores_ptr = scores->untyped_data();
  int32_t steps_param = static_cast<int32_t>(steps);
  int32_t head_tiles_param = static_cast<int32_t>(head_tiles);
  int32_t block_size_param = static_cast<int32_t>(block_size);
  int32_t num_blocks_param = static_cast<int32_t>(num_blocks);
  int32_t max_blocks_param = static_cast<int32_t>(max_blocks);
  int32_t pitch_param = static_cast<int32_t>(pitch);
  int32_t span_param = static_cast<int32_t>(state->span);
  int32_t top_k_param = static_cast<int32_t>(top_k);
  int32_t capacity_param = static_cast<int32_t>(capacity);
  int32_t dcp_size_param = static_cast<int32_t>(state->dcp_size);
  void* score_params[] = {&q_ptr,           &weights_ptr,      &keys_ptr,
                          &key_scales_ptr,  &table_ptr,        &lengths_ptr,
                          &rank_ptr,        &order_ptr,        &steps_param,
                          &head_tiles_param, &block_size_param, &num_blocks_param,
                          &max_blocks_param, &pitch_param,      &span_param,
                          &dcp_size_param};
  const int64_t tiles = pitch / kTokens;
  const int64_t grid_x = (tiles + state->span - 1) / state->span;
  const int64_t smem = kScoreSmemFixed + steps * head_tiles * kScoreSmemPerQueryTile;
  if (ffi::Error error = LaunchPdl(d, entry->scores, stream, static_cast<unsigned int>(grid_x),
                                   static_cast<unsigned int>(batch), 1, kScoreThreads,
                                   static_cast<unsigned int>(smem), score_params);
      error.failure()) {
    return error;
  }
  void* topk_params[] = {&order_ptr,   &lengths_ptr, &rank_ptr,       &tokens_ptr,
                         &scores_ptr,  &steps_param, &pitch_param,    &top_k_param,
                         &capacity_param, &dcp_size_param};
  return LaunchPdl(d, entry->topk, stream,
                   static_cast<unsigned int>(steps * state->topk_cluster),
                   static_cast<unsigned int>(batch), state->topk_cluster, kTopkThreads, kTopkSmem,
                   topk_params);
}

}  // namespace

JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaIndexTopkInstantiate(XLA_FFI_CallFrame* frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_Error* JaxSparseMlaIndexTopkExecute(XLA_FFI_CallFrame* frame);
JAX_SPARSE_MLA_EXPORT XLA_FFI_TypeId* JaxSparseMlaIndexTopkStateTypeId();
JAX_SPARSE_MLA_EXPORT const XLA_FFI_TypeInfo* JaxSparseMlaIndexTopkStateTypeInfo();

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaIndexTopkInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<IndexSpec>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaIndexTopkExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::State<IndexState>>()             // state
                                  .Arg<Fp8Buffer>()                          // q
                                  .Arg<WeightsBuffer>()                      // weights
                                  .Arg<Fp8Buffer>()                          // keys
                                  .Arg<KeyScalesBuffer>()                    // key_scales
                                  .Arg<TableBuffer>()                        // block_table
                                  .Arg<VectorBuffer>()                       // lengths
                                  .Arg<VectorBuffer>()                       // rank
                                  .Ret<TokensBuffer>()                       // tokens
                                  .Ret<ScoresBuffer>()                       // scores
                                  .Ret<TokensBuffer>()                       // order_keys
                                  .Attrs(),  // cubins and span: read at instantiation
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_TypeId* JaxSparseMlaIndexTopkStateTypeId() { return &IndexState::id; }

const XLA_FFI_TypeInfo* JaxSparseMlaIndexTopkStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<IndexState>();
  return &info;
}
