// The push exchange as the decode handler (sparse_mla_ffi.cc) sees it: where a decode that
// pushes its rows finds the stream device's mailbox.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace dcp {

// The decode kernel's exchange parameters (config.PARAMS): the device's mailbox header and the
// byte offsets of the latents, the LSEs, the query rows and the query flags in every rank's
// data region.
struct PushTarget {
  CUdeviceptr header;
  uint32_t latent_offset;
  uint32_t lse_offset;
  uint32_t query_offset;
  uint32_t query_flags_offset;
};

// The mailbox of the stream's device for a decode of `batch` rows whose heads belong to
// `dcp_size` ranks of `heads_own` heads each, launched with `flags_per_row` CTAs per row; an
// error when dcp_setup has not run there, an earlier exchange failed, or it does not fit.
xla::ffi::ErrorOr<PushTarget> PushTargetFor(CUstream stream, int64_t dcp_size, int64_t batch,
                                            int64_t heads_own, int64_t flags_per_row);

// F, the decode's CTAs per row: ceil(Hp / head_tile) * split for Hp = D * H_own padded to 16.
int64_t FlagsPerRow(int64_t dcp_size, int64_t heads_own, int64_t head_tile, int64_t split);

}  // namespace dcp
