"""A/B of sparse decode cubins on one GPU: each variant launched back to back, CUDA graph replay.

    python benchmarks/ab_cubins.py DIR [DIR ...] [--shape B,H,KEYS ...] [--launches 500]

Every ``*.cubin`` (with its ``.json``) under the DIRs is one variant; each must have the
package's kernel ABI (config.PARAMS). Make variants from edited kernel sources on any machine
with the DSL, e.g. in a git worktree: ``python -m jax_sparse_mla.aot --out DIR``.

Method: one process, the same inputs for every variant (latency-h96-like: N = 131072 cache
rows, K = 2048 slots, KEYS valid distinct rows per query row), launched through the CUDA
driver (cuda.bindings) with the cluster dims but without PDL, so launches serialize. The
``--launches`` launches are captured once into a CUDA graph per variant and shape; CUDA events
around a replay of that graph give the time per launch (the graph's launch gaps included, the
same for all variants; launched one by one from Python, small kernels measured the host's
~18-30 us per launch instead). After one untimed round, the variants are interleaved over
``--repeats`` rounds; the median is reported with the [min, max] spread. With ``--push``
the kernels run as rank 0 under dcp_decode(exchange="push") of a group of ``--dcp`` D ranks
on this GPU, the others simulated (``PushMailboxes``): each CTA stores its share of rank 0's
query heads into the others' mailboxes, finds theirs already there, and stores its rows into
the owners' mailboxes and releases their flags, as the FFI's push target asks (no merge
runs; the rows compared are the mailboxes'; D > 1 needs the ``-push`` cubins, which take
the global top-k tokens: K = 2048, rank 0's KEYS of them first, the rest other ranks'; they
compact rank 0's themselves). Meant for
comparing kernel variants with each other, not for absolute latency
(benchmarks/bench_decode.py measures that through JAX). Each variant's outputs of one more
launch are compared with the first variant's, the first DIR's first cubin (max differences,
NaN count): a check that the variants compute the same thing, not a correctness test
(tests/gpu does that). Variants keep the DIRs' order and are named by their DIR.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from cubin_launch import Buffer, Context, CubinKernel, check, grid_columns
from cuda.bindings import driver as cu
from push_layout import mailbox_header, mailbox_layout

from jax_sparse_mla.kernel.config import LATENT, ROW

CACHE_ROWS, WIDTH = 131072, 2048
MAX_RANKS = 16  # data regions in a mailbox header (ffi/dcp_exchange.cc's kMaxRanks)


def _shape(text: str) -> tuple[int, int, int]:
    try:
        batch, heads, keys = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants B,H,KEYS, got {text!r}") from None
    if heads % 16 or not 0 < keys <= WIDTH or batch < 1:
        raise argparse.ArgumentTypeError(f"need H % 16 == 0, 0 < KEYS <= {WIDTH}: {text!r}")
    return batch, heads, keys


def inputs(batch: int, heads: int, keys: int) -> list[Buffer]:
    rng = np.random.default_rng(0)
    fp8 = ml_dtypes.float8_e4m3fn
    q = rng.standard_normal((batch, heads, 576)).astype(fp8)
    kv = rng.standard_normal((CACHE_ROWS, 576)).astype(fp8)
    rows = np.stack([rng.choice(CACHE_ROWS, WIDTH, replace=False) for _ in range(batch)])
    return rows, [
        Buffer(q.view(np.uint8)),
        Buffer(kv.view(np.uint8)),
        Buffer(rows.astype(np.int32)),
        Buffer(np.full((batch,), keys, np.int32)),
        Buffer(np.array([0.1, 1.0], np.float32)),
        Buffer(np.empty((batch, heads, 512), np.uint16), upload=False),
        Buffer(np.empty((batch, heads), np.float32), upload=False),
    ]


class PushMailboxes:
    """Rank 0's push target of a group of D ranks on this GPU, the other ranks simulated: D
    data regions of the layout the FFI's push target gives (``push_layout``), rank 0's header
    listing them (its own region again at HEADER_OWN_DATA; no previous exchange; a 10 ms
    timeout, so that a broken variant cannot hang the run; an error record), step 0 (slot 0,
    flag 1). With D > 1 the other ranks' query heads of slot 0 and their flags are in rank 0's
    region already, as if their decodes had pushed them: rank 0's decode stores its own heads
    into their regions, finds theirs at once (no wait) and pushes its partial rows into the
    owners' regions. So it times the pushing decode's own work at D, not a wait for other GPUs
    or NVLink's latency. ``keys`` [B, K] are the plain decode's rows, its first ``valid`` of
    each row valid: they become rank 0's first global tokens (``pointers``)."""

    def __init__(self, dcp: int, q: np.ndarray, keys: np.ndarray, valid: int, flags_per_row: int):
        batch, heads, _ = q.shape
        self.dcp, self.batch, self.heads, self.heads_own = dcp, batch, heads, heads // dcp
        places = mailbox_layout(dcp, batch, self.heads_own, flags_per_row)
        self.latent_offset, self.lse_offset = places["latent"], places["lse"]
        self.query_flags_offset, self.query_offset = places["query_flags"], places["queries"]
        size = places["bytes"]
        # Slot 0's query rows and query flags of the other ranks (flag 1 = step 0's).
        own = np.zeros(size, np.uint8)
        rows = own[self.query_offset : self.query_offset + batch * heads * ROW]
        rows[:] = q.reshape(-1)
        # Slot 0 of every source (rank 0's own are never polled), whatever the kernel's F.
        slot_flags = 4 * dcp * batch * flags_per_row
        own[self.query_flags_offset : self.query_flags_offset + slot_flags].view(np.uint32)[:] = 1
        self.regions = [Buffer(own)] + [Buffer(np.zeros(size, np.uint8)) for _ in range(dcp - 1)]
        self.error = Buffer(np.zeros(4, np.uint32))
        addresses = [region.address for region in self.regions]
        # A 10 ms timeout: a broken variant cannot hang the run.
        header = mailbox_header(addresses, 0, 10_000_000, self.error.address)
        self.header = Buffer(header)
        self.rank, self.step = Buffer(np.zeros(1, np.int32)), Buffer(np.zeros(1, np.int32))
        # The decode takes rank 0's own heads.
        self.own_queries = Buffer(np.ascontiguousarray(q[:, : self.heads_own]))
        # A push cubin's global tokens: rank 0's (the plain decode's keys, in their order)
        # first, then the other ranks' (none at D = 1); and the scratch of its CTAs' lists.
        tokens = keys.astype(np.int64) * dcp
        others = 1 + np.arange(keys.shape[1] - valid) % max(dcp - 1, 1)
        tokens[:, valid:] = np.where(dcp > 1, tokens[:, valid:] + others, -1)
        self.tokens = Buffer(tokens.astype(np.int32))
        self.scratch = Buffer(np.zeros(batch * flags_per_row * keys.shape[1], np.int32))

    def pointers(self, pointers: list[int]) -> list[int]:
        """A push cubin's operand pointers: rank 0's heads, the tokens, the scratch."""
        pointers = list(pointers)
        pointers[0] = self.own_queries.address  # the kernel takes H / D heads
        pointers[2], pointers[3] = self.tokens.address, self.scratch.address
        return pointers

    def exchange(self) -> tuple:
        """cubin_launch's exchange parameters."""
        return (self.header.address, self.rank.address, self.step.address, self.dcp,
                self.heads_own, self.latent_offset, self.lse_offset, self.query_offset,
                self.query_flags_offset)  # fmt: skip

    def fill(self, byte: int) -> None:
        """Every owner's slot 0 rows of source 0 (what one launch writes) set to ``byte``."""
        rows = self.batch * self.heads_own
        for region in self.regions:
            check(cu.cuMemsetD8(region.address + self.latent_offset, byte, rows * LATENT * 2))
            check(cu.cuMemsetD8(region.address + self.lse_offset, byte, rows * 4))

    def results(self):
        """(latent as float32 [B, H, 512], lse [B, H]) of source 0 in slot 0, from the owners'
        regions; raises if rank 0 recorded an error."""
        if self.error.download()[0]:
            raise RuntimeError(f"the pushing decode recorded {self.error.download().tolist()}")
        rows = self.batch * self.heads_own
        latents, lses = [], []
        for region in self.regions:
            data = region.download()
            latent = data[self.latent_offset : self.latent_offset + rows * LATENT * 2]
            lse = data[self.lse_offset : self.lse_offset + rows * 4]
            latent = (latent.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            latents.append(latent.reshape(self.batch, self.heads_own, LATENT))
            lses.append(lse.view(np.float32).reshape(self.batch, self.heads_own))
        return np.concatenate(latents, axis=1), np.concatenate(lses, axis=1)

    def free(self) -> None:
        for buffer in (*self.regions, self.error, self.header, self.rank, self.step,
                       self.own_queries, self.tokens, self.scratch):  # fmt: skip
            buffer.free()


class GraphOfLaunches:
    """``launches`` back-to-back launches of one kernel (no PDL), captured into a CUDA graph
    on the context's stream: replaying it times the kernels, not Python's launch calls."""

    def __init__(
        self, context: Context, kernel: CubinKernel, launch_args: tuple, launches: int, exchange
    ):
        self.context, self.launches = context, launches
        stream = context.stream
        kernel.launch(stream, *launch_args, pdl=False, exchange=exchange)  # loaded before capture
        context.synchronize()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream, mode))
        for _ in range(launches):
            kernel.launch(stream, *launch_args, pdl=False, exchange=exchange)
        self.graph = check(cu.cuStreamEndCapture(stream))
        self.executable = check(cu.cuGraphInstantiate(self.graph, 0))

    def time(self) -> float:
        """Microseconds per launch over one replay of the graph."""
        stream = self.context.stream
        start, end = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
        check(cu.cuEventRecord(start, stream))
        check(cu.cuGraphLaunch(self.executable, stream))
        check(cu.cuEventRecord(end, stream))
        check(cu.cuEventSynchronize(end))
        elapsed = check(cu.cuEventElapsedTime(start, end))
        check(cu.cuEventDestroy(start))
        check(cu.cuEventDestroy(end))
        return elapsed * 1e3 / self.launches

    def free(self) -> None:
        check(cu.cuGraphExecDestroy(self.executable))
        check(cu.cuGraphDestroy(self.graph))


def time_interleaved(
    context: Context, kernels: dict, launch_args: dict, launches: int, repeats: int, exchange=None
) -> dict[str, list[float]]:
    """Us per launch of each kernel (by name; ``launch_args`` by name too) over ``repeats``
    rounds: a graph of ``launches`` launches per kernel, one untimed round, then the kernels
    interleaved round by round."""
    graphs = {
        name: GraphOfLaunches(context, kernel, launch_args[name], launches, exchange)
        for name, kernel in kernels.items()
    }
    times = {name: [] for name in graphs}
    for graph in graphs.values():  # untimed: clocks ramp up, modules load
        graph.time()
    for _ in range(repeats):
        for name, graph in graphs.items():
            times[name].append(graph.time())
    for graph in graphs.values():
        graph.free()
    return times


def run_once(context: Context, kernel: CubinKernel, buffers: list[Buffer], launch_args, mailbox):
    """One launch on NaN-filled outputs (the mailbox's rows with --push): (latent as float32,
    lse), to check that variants agree (a variant that computes something else shows here,
    not only in its time)."""
    latent_buffer, lse_buffer = buffers[5], buffers[6]
    if mailbox is None:
        latent_buffer.fill(0xFF)
        lse_buffer.fill(0xFF)
    else:
        mailbox.fill(0xFF)
    exchange = None if mailbox is None else mailbox.exchange()
    kernel.launch(context.stream, *launch_args, pdl=False, exchange=exchange)
    check(cu.cuStreamSynchronize(context.stream))
    if mailbox is not None:
        return mailbox.results()
    latent = (latent_buffer.download().astype(np.uint32) << 16).view(np.float32)
    return latent, lse_buffer.download()


def variant_paths(dirs: list[pathlib.Path]) -> list[tuple[str, pathlib.Path]]:
    """(name, cubin) of every variant in the order of ``dirs`` (sorted within each), named by
    its DIR as given: the first DIR's first cubin is the reference of the output check, and
    the same cubin in two DIRs stays two variants."""
    return [(f"{d}/{path.stem}", path) for d in dirs for path in sorted(d.glob("*.cubin"))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dirs", nargs="+", type=pathlib.Path, help="folders of cubin variants")
    parser.add_argument(
        "--shape",
        action="append",
        type=_shape,
        help="B,H,KEYS (repeatable; default: latency-h96, rank-full, throughput shapes)",
    )
    parser.add_argument("--launches", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--push",
        action="store_true",
        help="launch as rank 0 under dcp_decode(exchange='push') (see PushMailboxes)",
    )
    parser.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="with --push: D, the group's ranks (the others simulated); H = gathered heads",
    )
    args = parser.parse_args()
    if not 1 <= args.dcp <= MAX_RANKS:
        parser.error(f"--dcp must be in [1, {MAX_RANKS}], got {args.dcp}")
    if args.dcp != 1 and not args.push:
        parser.error("--dcp needs --push")
    shapes = args.shape or [(5, 96, 256), (5, 128, 256), (5, 128, 2048), (64, 128, 2048)]
    if any(heads % args.dcp for _, heads, _ in shapes):
        parser.error(f"--dcp {args.dcp} must divide every shape's gathered heads H")
    context = Context()
    variants = {
        name: CubinKernel(path.read_bytes(), json.loads(path.with_suffix(".json").read_text()))
        for name, path in variant_paths(args.dirs)
    }
    if not variants:
        raise SystemExit(f"no *.cubin in {[str(d) for d in args.dirs]}")
    plain = [n for n, kernel in variants.items() if not kernel.meta["config"].get("exchange")]
    if args.dcp > 1 and plain:  # they would read all H heads from q, which holds H / D
        raise SystemExit(f"--dcp > 1 needs the push exchange's cubins (*-push), not {plain}")
    print(
        f"{len(variants)} variant(s); {args.launches} launches x {args.repeats} rounds each"
        + (f"; rank 0 pushing into D = {args.dcp} mailboxes on this GPU" if args.push else "")
    )
    for batch, heads, keys in shapes:
        rows, buffers = inputs(batch, heads, keys)
        pointers = [b.address for b in buffers]
        sizes = (CACHE_ROWS, WIDTH, heads, 576)
        launch_args = {name: (pointers, sizes, batch) for name in variants}
        mailbox = None
        if args.push:
            flags_per_row = max(grid_columns(kernel, heads) for kernel in variants.values())
            mailbox = PushMailboxes(args.dcp, buffers[0].download(), rows, keys, flags_per_row)
            for name, kernel in variants.items():
                if kernel.meta["config"].get("exchange"):
                    launch_args[name] = (mailbox.pointers(pointers), sizes, batch)
                else:  # a plain cubin pushing (D = 1): rows and valid
                    launch_args[name] = ([mailbox.own_queries.address, *pointers[1:]], sizes, batch)
        exchange = None if mailbox is None else mailbox.exchange()
        times = time_interleaved(
            context, variants, launch_args, args.launches, args.repeats, exchange
        )
        outputs = {
            name: run_once(context, kernel, buffers, launch_args[name], mailbox)
            for name, kernel in variants.items()
        }
        first = next(iter(outputs.values()))
        print(f"B={batch} H={heads} keys={keys}:")
        for name, values in times.items():
            spread = f"[{min(values):.2f}, {max(values):.2f}]"
            latent, lse = outputs[name]
            differs = (
                f"max |latent - first| {np.nanmax(np.abs(latent - first[0])):.3g}, "
                f"|lse - first| {np.nanmax(np.abs(lse - first[1])):.3g}, "
                f"NaN {int(np.isnan(latent).sum() + np.isnan(lse).sum())}"
            )
            print(f"  {statistics.median(values):9.3f} us/launch {spread:>18}  {name}  ({differs})")
        for buffer in buffers:
            buffer.free()
        if mailbox is not None:
            mailbox.free()


if __name__ == "__main__":
    main()
