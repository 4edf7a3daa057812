// One-sided DCP exchange (dcp_decode(exchange="push")): mailboxes, setup and the merge's launch.
//
// Setup (JaxSparseMlaDcpSetup, called eagerly from Python by jax_sparse_mla.dcp_setup, once per
// group of D devices along the mesh axis): on each device's primary context it allocates a data
// region (the mailbox proper, zeroed), enables peer access between all the group's devices and
// writes the device's header: every rank's data region, this rank, the timeout, the error
// record, its own data region again. The header, the host-mapped error record and the loaded
// merge kernel (the sm_90a cubin of kernel/exchange, which dcp_setup passes in) are made once
// per device and kept for the process: a later dcp_setup rewrites them in place, so kernel
// parameters captured into a CUDA graph stay valid and the handler can be command-buffer
// compatible. Nothing is allocated in execute.
//
// The exchange is one custom call ("jax_sparse_mla_decode_push", sparse_mla_ffi.cc), whose
// execute asks PushTargetFor for the header, the layout and the merge, launches the pushing
// decode and then LaunchMerge on the same stream. Each decode CTA first pushes its share of its
// rank's query heads into the other ranks' query rows and waits for theirs, and at its end
// stores its rows into the owners' mailboxes and releases a flag. The merge (grid (S, B),
// S = ceil(H / kChunkHeads)) runs under PDL behind the decode (one launch pair in one custom
// call: XLA's command buffers would put two custom calls in separate graph nodes, with no
// overlap), so its CTAs are polling before the decode ends. A failure the kernels detect
// (timeout, repeated step parity, rank mismatch) is written to the error record; an execute that
// sees it returns it as an error (a graph replay does not run execute: the rows are NaN either
// way), and JaxSparseMlaDcpStatus reads it for jax_sparse_mla.dcp_check().

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dcp_exchange.h"

#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using cudaStream_t = CUstream;

namespace {

// Header layout (bytes), shared with the exchange and decode kernels (kernel/exchange/config.py).
constexpr int kMaxRanks = 16;          // u64 data[kMaxRanks] at 0: every rank's data region
constexpr size_t kRankOffset = 128;    // u32 rank, has_last, last_step, error claimed
constexpr size_t kTimeoutOffset = 144;  // u64 timeout_ns
constexpr size_t kErrorOffset = 152;   // u64 the host-mapped error record's device address
constexpr size_t kOwnDataOffset = 160;  // u64 data[rank] again: one load for the kernels
constexpr size_t kHeaderBytes = 256;
// The decode kernels take the offsets as 32-bit parameters.
constexpr int64_t kMaxCapacity = INT32_MAX;
constexpr size_t kRegionAlign = 256;
constexpr unsigned int kChunkHeads = 4;  // heads per merge CTA (the cubin's CHUNK_HEADS)
constexpr unsigned int kThreads = 256;  // per merge CTA
constexpr int64_t kLatent = 512;
constexpr int64_t kQueryRow = 576;  // bytes of an FP8 query head
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kHeadGrain = 16;  // the decode pads its heads to a multiple of 16

// Error codes written by the kernels (the exchange's and the decode's).
constexpr uint32_t kTimeout = 1;
constexpr uint32_t kParity = 2;
constexpr uint32_t kRank = 3;
constexpr uint32_t kQueryTimeout = 4;
constexpr uint32_t kStepBehind = 5;  // the merge's (kernel/exchange/kernels.py)

struct Layout {
  uint64_t latent_offset;
  uint64_t lse_offset;
  uint64_t query_flags_offset;
  uint64_t query_offset;
  uint64_t bytes;
};

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

uint64_t Chunks(uint64_t heads) { return (heads + kChunkHeads - 1) / kChunkHeads; }

// The partials: flags u32[2][D][B][F] at 0 (F = the decode's CTAs per row), latents
// bf16[2][D][B][H][512], LSEs f32[2][D][B][H]; the queries: flags u32[2][D][B][F] (one per
// pushing decode CTA), rows fp8[2][B][Hp][576] (every rank's heads in gathered order, Hp = D * H
// padded to 16).
Layout MakeLayout(uint64_t dcp, uint64_t batch, uint64_t heads, uint64_t flags_per_row) {
  const uint64_t padded = (dcp * heads + kHeadGrain - 1) / kHeadGrain * kHeadGrain;
  Layout layout{};
  layout.latent_offset = AlignUp(4 * 2 * dcp * batch * flags_per_row, kRegionAlign);
  layout.lse_offset = layout.latent_offset + 2 * dcp * batch * heads * kLatent * 2;
  layout.query_flags_offset = AlignUp(layout.lse_offset + 2 * dcp * batch * heads * 4, kRegionAlign);
  layout.query_offset = AlignUp(
      layout.query_flags_offset + 4 * 2 * dcp * batch * flags_per_row, kRegionAlign);
  layout.bytes = layout.query_offset + 2 * batch * padded * kQueryRow;
  return layout;
}

// One device's exchange state. Entries are never removed (their header, error record and
// module must outlive every graph that captured them); dcp_setup rewrites them.
struct Mailbox {
  int ordinal = -1;
  int rank = -1;
  int dcp_size = 0;
  CUdevice device = 0;
  CUcontext context = nullptr;  // the device's primary context (retained for the process)
  CUdeviceptr header = 0;       // kHeaderBytes, permanent
  CUdeviceptr data = 0;         // the data region, replaced when the capacity changes
  uint64_t capacity = 0;
  volatile uint32_t* host_error = nullptr;  // u32[4]: code, step, row, source; permanent
  CUdeviceptr device_error = 0;
  CUmodule merge_module = nullptr;
  CUfunction merge = nullptr;
  bool ready = false;  // the last setup of this device succeeded
};

std::mutex registry_mutex;
std::vector<std::unique_ptr<Mailbox>> registry;

Mailbox* FindByContext(CUcontext context) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const auto& mailbox : registry) {
    if (mailbox->context == context && mailbox->ready) return mailbox.get();
  }
  return nullptr;
}

// The device's entry, created on first use.
Mailbox& EntryFor(int ordinal) {
  for (const auto& mailbox : registry) {
    if (mailbox->ordinal == ordinal) return *mailbox;
  }
  registry.push_back(std::make_unique<Mailbox>());
  registry.back()->ordinal = ordinal;
  return *registry.back();
}

// Runs `body` with `context` current.
template <typename Body>
std::string WithContext(const cu::Driver& d, CUcontext context, Body body) {
  if (CUresult result = d.CtxPushCurrent(context); result != CUDA_SUCCESS) {
    return cu::Describe(d, "cuCtxPushCurrent", result);
  }
  std::string error = body();
  CUcontext popped = nullptr;
  d.CtxPopCurrent(&popped);
  return error;
}

#define RETURN_IF_FAILED(call, expr)                                        \
  if (CUresult result_ = (expr); result_ != CUDA_SUCCESS) {                 \
    return cu::Describe(d, call, result_);                                  \
  }

// The merge's cubin, as dcp_setup passes it (kernel/exchange/compile.py).
struct Cubin {
  const void* image;
  const char* kernel_name;
};

// Makes the device's permanent parts once; (re)allocates and zeroes the data region. Waits for
// the device to be idle first: an exchange must not be running while dcp_setup does.
std::string Prepare(const cu::Driver& d, Mailbox& mailbox, uint64_t capacity, Cubin merge) {
  if (mailbox.context == nullptr) {
    RETURN_IF_FAILED("cuDeviceGet", d.DeviceGet(&mailbox.device, mailbox.ordinal));
    RETURN_IF_FAILED("cuDevicePrimaryCtxRetain",
                     d.DevicePrimaryCtxRetain(&mailbox.context, mailbox.device));
  }
  return WithContext(d, mailbox.context, [&]() -> std::string {
    RETURN_IF_FAILED("cuCtxSynchronize", d.CtxSynchronize());
    if (mailbox.header == 0) {
      RETURN_IF_FAILED("cuMemAlloc (header)", d.MemAlloc(&mailbox.header, kHeaderBytes));
      void* host = nullptr;
      RETURN_IF_FAILED("cuMemHostAlloc (error record)",
                       d.MemHostAlloc(&host, 16,
                                      CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
      mailbox.host_error = static_cast<volatile uint32_t*>(host);
      RETURN_IF_FAILED("cuMemHostGetDevicePointer",
                       d.MemHostGetDevicePointer(&mailbox.device_error, host, 0));
      RETURN_IF_FAILED("cuModuleLoadData (the merge's cubin)",
                       d.ModuleLoadData(&mailbox.merge_module, merge.image));
      RETURN_IF_FAILED("cuModuleGetFunction (the merge)",
                       d.ModuleGetFunction(&mailbox.merge, mailbox.merge_module,
                                           merge.kernel_name));
    }
    for (int i = 0; i < 4; ++i) mailbox.host_error[i] = 0;
    if (mailbox.data != 0 && mailbox.capacity != capacity) {
      RETURN_IF_FAILED("cuMemFree (data region)", d.MemFree(mailbox.data));
      mailbox.data = 0;
    }
    if (mailbox.data == 0) {
      RETURN_IF_FAILED("cuMemAlloc (data region)", d.MemAlloc(&mailbox.data, capacity));
      mailbox.capacity = capacity;
    }
    RETURN_IF_FAILED("cuMemsetD8 (data region)", d.MemsetD8(mailbox.data, 0, capacity));
    return "";
  });
}

// Peer access to every other device of the group, then the header.
std::string Connect(const cu::Driver& d, Mailbox& mailbox, const std::vector<Mailbox*>& group,
                    uint64_t timeout_ns) {
  return WithContext(d, mailbox.context, [&]() -> std::string {
    uint64_t header[kHeaderBytes / 8] = {};
    for (const Mailbox* peer : group) {
      header[peer->rank] = peer->data;
      if (peer == &mailbox) continue;
      int possible = 0;
      RETURN_IF_FAILED("cuDeviceCanAccessPeer",
                       d.DeviceCanAccessPeer(&possible, mailbox.device, peer->device));
      if (!possible) {
        return "device " + std::to_string(mailbox.ordinal) + " cannot access device " +
               std::to_string(peer->ordinal) + "'s memory (no peer access)";
      }
      CUresult result = d.CtxEnablePeerAccess(peer->context, 0);
      if (result != CUDA_SUCCESS && result != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
        return cu::Describe(d, "cuCtxEnablePeerAccess", result);
      }
    }
    header[kRankOffset / 8] = static_cast<uint32_t>(mailbox.rank);  // has_last = 0
    header[kTimeoutOffset / 8] = timeout_ns;
    header[kErrorOffset / 8] = mailbox.device_error;
    header[kOwnDataOffset / 8] = mailbox.data;
    RETURN_IF_FAILED("cuMemcpyHtoD (header)", d.MemcpyHtoD(mailbox.header, header, sizeof(header)));
    RETURN_IF_FAILED("cuCtxSynchronize", d.CtxSynchronize());
    return "";
  });
}

#undef RETURN_IF_FAILED

std::string Setup(const int32_t* ordinals, int32_t dcp_size, int64_t capacity, int64_t timeout_ns,
                  Cubin merge) {
  const cu::LoadedDriver& loaded = cu::GetDriver();
  if (!loaded.error.empty()) return loaded.error;
  const cu::Driver& d = loaded.driver;
  // A group of one exchanges with itself: not what dcp_decode does at D = 1 (a plain decode),
  // but the whole exchange on one GPU, for tests and bench_dcp.py --loopback.
  if (dcp_size < 1 || dcp_size > kMaxRanks) {
    return "the group must have 1 to " + std::to_string(kMaxRanks) + " devices, got " +
           std::to_string(dcp_size);
  }
  if (capacity < static_cast<int64_t>(kRegionAlign) || capacity > kMaxCapacity ||
      timeout_ns < 1) {
    return "capacity_bytes must be in [" + std::to_string(kRegionAlign) + ", " +
           std::to_string(kMaxCapacity) + "] and the timeout positive";
  }
  if (merge.image == nullptr || merge.kernel_name == nullptr) {
    return "the merge's cubin and kernel name are required";
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  // Setting a device up again resets its exchange (zeroed data region and error record); this
  // is also how an exchange that failed is recovered.
  std::vector<Mailbox*> group;
  for (int r = 0; r < dcp_size; ++r) {
    for (int s = 0; s < r; ++s) {
      if (ordinals[s] == ordinals[r]) return "device " + std::to_string(ordinals[r]) + " twice";
    }
    Mailbox& mailbox = EntryFor(ordinals[r]);
    mailbox.ready = false;
    mailbox.rank = r;
    mailbox.dcp_size = dcp_size;
    group.push_back(&mailbox);
  }
  std::string error;
  for (Mailbox* mailbox : group) {
    if (error.empty()) {
      error = Prepare(d, *mailbox, static_cast<uint64_t>(capacity), merge);
    }
  }
  for (Mailbox* mailbox : group) {
    if (error.empty()) error = Connect(d, *mailbox, group, static_cast<uint64_t>(timeout_ns));
  }
  if (!error.empty()) return error;
  for (Mailbox* mailbox : group) mailbox->ready = true;
  return "";
}

// What an error record's code says happened: the one source of these texts (execute's errors
// here, dcp_check's through JaxSparseMlaDcpErrorText).
const char* ErrorText(uint32_t code) {
  switch (code) {
    case kTimeout:
      return "timed out waiting for the partials of a rank";
    case kParity:
      return "was given a step with the previous exchange's parity (steps must alternate)";
    case kRank:
      return "ran with an axis rank that disagrees with dcp_setup's device order";
    case kQueryTimeout:
      return "timed out waiting for the query heads of a rank";
    case kStepBehind:
      return "was given a step that does not advance past the last exchange's by 1 to 2^30 - 1 "
             "(int32, wrapping): its mailbox slot may still hold an earlier exchange's rows of "
             "that step (e.g. 4, 5, 4 or a restarted counter); keep one counter that advances at "
             "every exchange";
    default:
      return "failed";
  }
}

ffi::Error Failed(std::string message) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jax_sparse_mla: " + std::move(message));
}

// The stream's mailbox, checked for a recorded failure and for the caller's group size.
ffi::ErrorOr<Mailbox*> MailboxFor(cudaStream_t stream, int64_t dcp_size) {
  using Unexpected = ffi::Unexpected<ffi::Error>;
  const cu::LoadedDriver& loaded = cu::GetDriver();
  if (!loaded.error.empty()) return Unexpected(Failed(loaded.error));
  const cu::Driver& d = loaded.driver;
  CUcontext context = nullptr;
  if (ffi::Error error = cu::Check(d, "cuStreamGetCtx", d.StreamGetCtx(stream, &context));
      error.failure()) {
    return Unexpected(error);
  }
  Mailbox* mailbox = FindByContext(context);
  if (mailbox == nullptr) {
    return Unexpected(Failed(
        "dcp_decode(exchange='push') ran on a device without a mailbox: call "
        "jax_sparse_mla.dcp_setup(mesh, axis_name) once before the first call"));
  }
  if (uint32_t code = mailbox->host_error[0]; code != 0) {
    return Unexpected(Failed(
        "an earlier push exchange on device " + std::to_string(mailbox->ordinal) + " " +
        ErrorText(code) +
        " (step " + std::to_string(static_cast<int32_t>(mailbox->host_error[1])) + ", row " +
        std::to_string(mailbox->host_error[2]) + ", source " +
        std::to_string(mailbox->host_error[3]) +
        "); its rows are NaN. Call jax_sparse_mla.dcp_setup again to reset the exchange"));
  }
  if (dcp_size != mailbox->dcp_size) {
    return Unexpected(Failed("dcp_decode runs over " + std::to_string(dcp_size) +
                             " ranks but dcp_setup made groups of " +
                             std::to_string(mailbox->dcp_size)));
  }
  return mailbox;
}

ffi::ErrorOr<Layout> CheckedLayout(const Mailbox& mailbox, int64_t batch, int64_t heads,
                                   int64_t flags_per_row) {
  using Unexpected = ffi::Unexpected<ffi::Error>;
  if (batch < 1 || batch > kMaxGridY || heads < 1 || flags_per_row < 1) {
    return Unexpected(ffi::Error::InvalidArgument(
        "jax_sparse_mla: push exchange sizes out of range: B=" + std::to_string(batch) +
        " (1.." + std::to_string(kMaxGridY) + "), H_own=" + std::to_string(heads)));
  }
  Layout layout = MakeLayout(mailbox.dcp_size, batch, heads, flags_per_row);
  if (layout.bytes > mailbox.capacity) {
    return Unexpected(Failed("the push exchange of B=" + std::to_string(batch) +
                             ", H_own=" + std::to_string(heads) + " needs " +
                             std::to_string(layout.bytes) + " mailbox bytes; dcp_setup gave " +
                             std::to_string(mailbox.capacity) + " (raise capacity_bytes)"));
  }
  return layout;
}

}  // namespace

ffi::ErrorOr<dcp::PushTarget> dcp::PushTargetFor(CUstream stream, int64_t dcp_size,
                                                 int64_t batch, int64_t heads_own,
                                                 int64_t flags_per_row) {
  ffi::ErrorOr<Mailbox*> found = MailboxFor(stream, dcp_size);
  if (found.has_error()) return ffi::Unexpected<ffi::Error>(found.error());
  ffi::ErrorOr<Layout> layout = CheckedLayout(*found.value(), batch, heads_own, flags_per_row);
  if (layout.has_error()) return ffi::Unexpected<ffi::Error>(layout.error());
  return PushTarget{found.value()->header, static_cast<uint32_t>(layout.value().latent_offset),
                    static_cast<uint32_t>(layout.value().lse_offset),
                    static_cast<uint32_t>(layout.value().query_offset),
                    static_cast<uint32_t>(layout.value().query_flags_offset),
                    found.value()->merge};
}

ffi::Error dcp::LaunchMerge(CUstream stream, const PushTarget& target, const MergeCall& call) {
  const cu::Driver& d = cu::GetDriver().driver;
  CUdeviceptr header = target.header;
  uint64_t latent_offset = target.latent_offset;
  uint64_t lse_offset = target.lse_offset;
  void* latent = call.latent;
  void* lse = call.lse;
  void* step = call.step;
  uint32_t sizes[6] = {static_cast<uint32_t>(call.batch),    static_cast<uint32_t>(call.heads_own),
                       static_cast<uint32_t>(call.dcp_size), static_cast<uint32_t>(call.head_tile),
                       static_cast<uint32_t>(call.split),
                       static_cast<uint32_t>(call.flags_per_row)};
  void* params[] = {&latent,   &lse,      &step,     &header,   &latent_offset, &lse_offset,
                    &sizes[0], &sizes[1], &sizes[2], &sizes[3], &sizes[4],      &sizes[5]};
  CUlaunchAttribute pdl{};
  pdl.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  pdl.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = static_cast<unsigned int>(Chunks(static_cast<uint64_t>(call.heads_own)));
  config.gridDimY = static_cast<unsigned int>(call.batch);
  config.gridDimZ = 1;
  config.blockDimX = kThreads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = stream;
  config.attrs = &pdl;
  config.numAttrs = 1;
  return cu::Check(d, "cuLaunchKernelEx (the merge)",
                   d.LaunchKernelEx(&config, target.merge, params, nullptr));
}

// Sets up one group (rank r is CUDA device ordinals[r]) with the merge from its cubin image
// (loaded on a device's first setup). Returns 0, or 1 with a NUL-terminated reason in
// `message`.
JAX_SPARSE_MLA_EXPORT int JaxSparseMlaDcpSetup(const int32_t* ordinals, int32_t dcp_size,
                                               int64_t capacity_bytes, int64_t timeout_ns,
                                               const void* merge_cubin, const char* merge_name,
                                               char* message, int64_t message_bytes) {
  std::string error = Setup(ordinals, dcp_size, capacity_bytes, timeout_ns,
                            Cubin{merge_cubin, merge_name});
  if (error.empty()) return 0;
  if (message_bytes > 0) {
    std::strncpy(message, error.c_str(), static_cast<size_t>(message_bytes - 1));
    message[message_bytes - 1] = '\0';
  }
  return 1;
}

// Copies device `ordinal`'s error record (code, step, row, source; code 0 = none) into
// `record`. Returns 0, or -1 when the device has no mailbox.
JAX_SPARSE_MLA_EXPORT int JaxSparseMlaDcpStatus(int32_t ordinal, uint32_t* record) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const auto& mailbox : registry) {
    if (mailbox->ordinal != ordinal || mailbox->host_error == nullptr) continue;
    for (int i = 0; i < 4; ++i) record[i] = mailbox->host_error[i];
    return 0;
  }
  return -1;
}

// The text of an error record's code (dcp_check's message).
JAX_SPARSE_MLA_EXPORT const char* JaxSparseMlaDcpErrorText(uint32_t code) {
  return ErrorText(code);
}
