// The push exchange as the decode handler (sparse_mla_ffi.cc) sees it: where a decode that
// pushes its rows finds the stream device's mailbox.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace dcp {

// The decode kernel's exchange parameters (config.PARAMS): the device's mailbox header and the
// byte offsets of the latents, the LSEs, the query rows and the query flags in every rank's
// data region; and the device's merge kernel.
struct PushTarget {
  CUdeviceptr header;
  uint32_t latent_offset;
  uint32_t lse_offset;
  uint32_t query_offset;
  uint32_t query_flags_offset;
  CUfunction merge;
};

// What the owners' merge reads besides the target: the step, the pushing decode's launch (its
// head tile, CTAs per tile and per row, whose flags to await) and the sizes; it writes the
// merged latent [B, H_own, 512] bf16 and LSE [B, H_own] f32.
struct MergeCall {
  void* latent;
  void* lse;
  void* step;
  int64_t dcp_size;
  int64_t batch;
  int64_t heads_own;
  int64_t head_tile;
  int64_t split;
  int64_t flags_per_row;
};

// The mailbox of the stream's device for a decode of `batch` rows whose heads belong to
// `dcp_size` ranks of `heads_own` heads each, launched with `flags_per_row` CTAs per row; an
// error when dcp_setup has not run there, an earlier exchange failed, or it does not fit.
xla::ffi::ErrorOr<PushTarget> PushTargetFor(CUstream stream, int64_t dcp_size, int64_t batch,
                                            int64_t heads_own, int64_t flags_per_row);

// Launches the merge of `call` on `stream` right behind the pushing decode, under PDL: its CTAs
// poll the flags while the decode runs and store nothing before it has finished.
xla::ffi::Error LaunchMerge(CUstream stream, const PushTarget& target, const MergeCall& call);

}  // namespace dcp
