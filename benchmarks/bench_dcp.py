"""dcp_decode on D GPUs, both exchanges: GPU time per decode step, per kernel.

    python benchmarks/bench_dcp.py                 # 2 GPUs (device kind nvidia-h200-x2)
    python benchmarks/bench_dcp.py --dcp 2 --steps 64 --calls 5 --exchanges push
    python benchmarks/bench_dcp.py --unroll --steps 32   # no while loop: kernels back to back
    python benchmarks/bench_dcp.py --loopback       # ONE GPU: the push exchange with itself
    python benchmarks/bench_dcp.py --paged 64       # a paged cache: blocks of 64, block tables

Per case (DESIGN.md's shapes per rank: B = 5 rows, the gathered heads H split over the D ranks,
`keys` local keys per row on every rank, N = 131072 local cache rows), one jitted `lax.scan` of
--steps decode steps runs `dcp_decode_tokens` inside `jax.shard_map` (a new query per step,
scaled from one query by a small fusion, and new global top-k tokens every step, tied to the
previous step's result as a model's are: `step_tokens`; the collectives run `local_rows` +
`dcp_decode` on them, the push exchange's decode compacts them itself; with --paged the cache
is a pool of blocks and each rank maps its positions through its block table [B, N / block]).
Each call of the scan runs under the JAX profiler (CUPTI kernel records, host waiting between
calls); per device we report the span of a call's kernels divided by the steps (loop overhead
included; with --unroll the scan is unrolled, so no while loop runs between steps: XLA's GPU
while loop copies its predicate to the host every iteration), and per kernel the summed
duration per step (NCCL kernels include their wait for the other ranks, the push exchange's
merge its wait for the peers' flags; the merge runs under PDL beside the pushing decode, so its
duration includes the decode's and the sums overlap: the span is the step), and where each
microsecond of a step goes (a decode's start to the next one's; each instant counted once: the
decode's where it runs, else the merge's, NCCL's, XLA's, else idle). The kernel path is
implementation="cute": no fallback to the reference; the push exchange's custom call is checked
in the compiled program and its error records (dcp_check) after the run.

--loopback runs the push exchange's custom call (the pushing decode, the merge) on
one GPU set up as a group of one that exchanges with itself, at the cases' shapes with D = 1
(all the heads, all the keys on the one GPU). It is not a DCP step (dcp_decode at D = 1 is a
plain decode; nothing crosses NVLink and no peer is waited for): it times the exchange's own
kernels and launches where no multi-GPU machine is available.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
from gpu_profile import Events, record, split_at_gaps

import jax_sparse_mla
from jax_sparse_mla import push_exchange
from jax_sparse_mla.dcp import paged_as_tokens

AXIS = "dcp"
CALL_GAP_NS = 10_000_000  # an idle GPU this long separates two calls (the host sleeps 5x it)
LOCAL_ROWS = 131072
IDLE = "idle (no kernel: launch gaps, the host)"
CASES = {  # name -> (rows B, gathered heads H, local keys per row)
    "latency-h96": (5, 96, 256),
    "rank-full": (5, 128, 2048),
}


def make_step(mesh: Mesh, dcp: int, exchange: str, unroll: bool, block_size: int | None):
    """The loop of steps; ``block_size``: the cache is (kv pool, block table), else (kv,)."""
    if exchange == "loopback":
        return make_loop(functools.partial(loopback_step, block_size=block_size), unroll, dcp)

    def per_rank(q, cache, tokens, t, link):
        kv, *table = cache
        latent, lse = jax_sparse_mla.dcp_decode_tokens(
            q,
            kv,
            step_tokens(tokens, t, link, dcp),
            axis_name=AXIS,
            softmax_scale=192**-0.5,
            block_table=table[0] if table else None,
            block_size=block_size,
            implementation="cute",
            exchange=exchange,
            step=t,
        )
        return latent, lse, lse[:1, 0]

    cache_specs = (P(AXIS),) if block_size is None else (P(AXIS), P(AXIS))
    step = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(None, AXIS), cache_specs, P(), P(), P(AXIS)),
        out_specs=(P(None, AXIS), P(None, AXIS), P(AXIS)),
    )
    return make_loop(step, unroll, dcp)


def step_tokens(tokens, t, link, dcp: int):
    """Step t's global top-k tokens: ``tokens`` shifted by D t modulo the D * N global tokens
    (on the same ranks, distinct in each row), computed from this rank's part of the previous
    step's result (``link``) as a model's tokens are from its last output: none (-1) where it
    is NaN (never, unless an exchange failed). With the same tokens every step XLA computed
    ``local_rows`` once for the whole loop; untied, unrolled, it computed the steps' together
    (session 42). Only a value XLA cannot fold orders the steps: tied by an
    optimization_barrier, a scan unrolled by 8 ran a push exchange before its predecessor
    (the exchange refused its parity; session 45)."""
    shifted = (tokens + dcp * t) % (dcp * LOCAL_ROWS)
    return jnp.where(jnp.isnan(link).any(), -1, shifted)


def loopback_step(q, cache, tokens, t, link, *, block_size):
    """dcp_decode_tokens' push path for a group of one GPU (see --loopback): the kernel takes
    the global tokens (at D = 1 all of them its own; on a paged cache mapped through the
    block table first, as dcp_decode_tokens does)."""
    kv, *table = cache
    tokens = step_tokens(tokens, t, link, 1)
    if table:
        n_rows = kv.shape[0] * kv.shape[1]
        tokens = paged_as_tokens(
            tokens, table[0], block_size=block_size, n_rows=n_rows, rank=0, dcp_size=1
        )
    latent, lse = push_exchange.decode_and_exchange_tokens(
        q, kv, tokens, rank=jnp.int32(0), step=t, dcp_size=1, softmax_scale=192**-0.5,
        q_scale=1.0, kv_scale=1.0, valid_hint=None, kernel_config=None,
    )  # fmt: skip
    return latent, lse, lse[:1, 0]


def make_loop(step, unroll: bool, dcp: int):
    """The jitted loop of ``step(q_t, cache, tokens, t, link) -> (latent, lse, link)``: the
    link (one f32 per rank) carries each step's result into the next step's tokens."""

    def loop(q, cache, tokens, first_step, steps):
        def body(link, t):
            # A new query each step from one small elementwise fusion. (Scanning over a
            # stacked [steps, B, H, 576] query instead made XLA transpose the whole stack in
            # every iteration: ~21 us per step at rank-full that belongs to no decode.)
            scale = 1.0 + (t % 8).astype(jnp.float32) * 2.0**-3  # E4M3 steps are 2**-3
            q_t = (q.astype(jnp.float32) * scale).astype(q.dtype)
            latent, lse, link = step(q_t, cache, tokens, t, link)
            return link, (latent, lse)

        steps_array = first_step + jnp.arange(steps, dtype=jnp.int32)
        link = jnp.zeros((dcp,), jnp.float32)
        outputs = lax.scan(body, link, steps_array, unroll=steps if unroll else 1)[1]
        return outputs, first_step + steps

    return jax.jit(loop, static_argnums=4)


class Calls:
    """The loop called with one step counter that continues across calls and cases (the push
    exchange's parity must alternate from each exchange to the next). The counter stays on
    the device (the loop returns the next one): no host transfer between profiled calls."""

    next_step = None

    def __init__(self, fn, q, cache, tokens, steps):
        self.fn, self.args, self.steps = fn, (q, cache, tokens), steps

    def __call__(self):
        first = jnp.int32(0) if Calls.next_step is None else Calls.next_step
        outputs, Calls.next_step = self.fn(*self.args, first, self.steps)
        return outputs


def inputs(mesh: Mesh, dcp: int, batch: int, heads: int, keys: int, block_size: int | None):
    """The query [B, H, 576] (heads sharded), the cache (rank r holds global tokens r, r + D,
    ...: local position p is token p * D + r) and the global top-k tokens (`keys` tokens of
    every rank per row). The cache is (kv [D * N, 576],), or with ``block_size`` (a pool [D *
    N / block_size, block_size, 576], block tables [D * B, N / block_size]): each rank's
    blocks in a random order, the same for all its rows."""
    rng = np.random.default_rng(0)
    fp8 = jnp.float8_e4m3fn
    q = rng.standard_normal((batch, heads, 576)).astype(fp8)
    kv = rng.standard_normal((dcp * LOCAL_ROWS, 576)).astype(fp8)  # rank-major shards
    per_rank = [rng.choice(LOCAL_ROWS, (batch, keys)) * dcp + r for r in range(dcp)]
    tokens = np.concatenate(per_rank, axis=1).astype(np.int32)
    ranks = NamedSharding(mesh, P(AXIS))
    cache = (jax.device_put(kv, ranks),)
    if block_size is not None:
        blocks = LOCAL_ROWS // block_size
        pool = kv.reshape(dcp * blocks, block_size, 576)
        tables = [np.tile(rng.permutation(blocks), (batch, 1)) for _ in range(dcp)]
        table = np.concatenate(tables).astype(np.int32)
        cache = (jax.device_put(pool, ranks), jax.device_put(table, ranks))
    return (
        jax.device_put(q, NamedSharding(mesh, P(None, AXIS))),
        cache,
        jax.device_put(tokens, NamedSharding(mesh, P())),
    )


def category(name: str) -> str:
    lower = name.lower()
    if "dcpmerge" in lower:  # the exchange's cubin (its entry names the class)
        return "push exchange: merge (incl. wait; beside the decode)"
    if "nccl" in lower:
        return "nccl " + ("all-gather" if "allgather" in lower else "all-to-all / send-recv")
    if "jax_sparse_mla" in lower:  # both variants' entries (SparseDecode, WgmmaDecode)
        return "decode kernel (with push: incl. the query heads' exchange and wait)"
    return "XLA fusions and copies"


def part_rank(part: str) -> int:
    """Which part of a step an instant belongs to where kernels overlap: the decode's, else
    the merge's (it runs beside the decode under PDL), else NCCL's, else XLA's; idle last."""
    prefixes = ("decode kernel", "push exchange", "nccl", "XLA")
    return next((i for i, prefix in enumerate(prefixes) if part.startswith(prefix)), 4)


def step_breakdown(events: Events) -> list[dict[str, float]]:
    """Where each microsecond of a call's steps goes: per step (a decode's start to the next
    decode's start), the us each kernel category holds the GPU, every instant counted once
    (part_rank picks among overlapping kernels) and "idle" where no kernel runs (launch gaps,
    the host): the parts sum to the step."""
    events = sorted(events)
    decodes = [start for start, _, name in events if part_rank(category(name)) == 0]
    steps = []
    for first, last in itertools.pairwise(decodes):
        inside = [
            (max(start, first), min(end, last), category(name))
            for start, end, name in events
            if start < last and end > first
        ]
        cuts = sorted({first, last, *(t for start, end, _ in inside for t in (start, end))})
        parts = collections.defaultdict(float)
        for a, b in itertools.pairwise(cuts):
            running = [part for start, end, part in inside if start <= a and end >= b]
            parts[min(running, key=part_rank) if running else IDLE] += (b - a) / 1e3
        steps.append(dict(parts))
    return steps


def profile(call, calls: int, keep: str | None = None) -> dict[str, list[Events]]:
    """Per GPU plane, the kernels of each call (split at the host's idle gaps). ``keep``: copy
    the trace (xplane.pb, host planes included) to this path."""
    jax.block_until_ready(call())
    planes = record(call, calls, pause_s=CALL_GAP_NS * 5 / 1e9, keep=keep)
    per_plane = {}
    for plane, events in planes.items():
        groups = split_at_gaps(events, CALL_GAP_NS)
        # A stray copy or memset outside the calls (seen: one event before the first call)
        # forms a group of its own; calls have hundreds of kernels.
        typical = statistics.median(len(g) for g in groups)
        strays = [g for g in groups if len(g) < typical / 2]
        if strays:
            print(f"  {plane}: ignored {len(strays)} stray event group(s): {strays}")
            groups = [g for g in groups if len(g) >= typical / 2]
        if len(groups) != calls:
            sizes = [len(g) for g in groups]
            raise RuntimeError(
                f"{plane}: expected {calls} calls' events, found {len(groups)} groups of "
                f"{sizes} kernels (split at idle gaps > {CALL_GAP_NS / 1e6} ms)"
            )
        per_plane[plane] = groups
    return per_plane


def report(
    name: str, exchange: str, unrolled: bool, per_plane: dict, steps: int, top: int
) -> list[dict]:
    records = []
    for plane, calls in per_plane.items():
        spans = [(max(e for _, e, _ in c) - c[0][0]) / 1e3 / steps for c in calls]
        by_kernel = collections.defaultdict(float)
        by_name = collections.defaultdict(float)
        for c in calls:
            for start, end, kernel in c:
                by_kernel[category(kernel)] += (end - start) / 1e3 / steps / len(calls)
                by_name[kernel] += (end - start) / 1e3 / steps / len(calls)
        span = statistics.median(spans)
        print(f"  {plane}: span {span:.1f} us/step [{min(spans):.1f}, {max(spans):.1f}]")
        print(f"    kernels {sum(by_kernel.values()):.1f} us/step:")
        for kernel, us in sorted(by_kernel.items(), key=lambda item: -item[1]):
            print(f"    {us:8.2f} us  {kernel}")
        steps_parts = [parts for c in calls for parts in step_breakdown(c)]
        names = sorted({name for parts in steps_parts for name in parts}, key=part_rank)
        breakdown = {
            name: statistics.median(parts.get(name, 0.0) for parts in steps_parts) for name in names
        }
        if steps_parts:
            step = statistics.median(sum(parts.values()) for parts in steps_parts)
            print(
                f"    a step, decode start to the next decode's start: {step:.2f} us (median "
                f"of {len(steps_parts)}; each instant counted once; medians per part):"
            )
            for name, us in breakdown.items():
                print(f"    {us:8.2f} us  {name}")
        if top:
            print(f"    the {top} largest kernels by name:")
            for kernel, us in sorted(by_name.items(), key=lambda item: -item[1])[:top]:
                print(f"      {us:8.2f} us  {kernel[:90]}")
        records.append(
            {
                "case": name,
                "exchange": exchange,
                "unrolled": unrolled,
                "plane": plane,
                "span_us_per_step": span,
                "kernels": dict(by_kernel),
                "step_breakdown_us": breakdown,
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dcp", type=int, default=2, help="GPUs (ranks), default 2")
    parser.add_argument(
        "--loopback",
        action="store_true",
        help="one GPU: the push exchange's kernels with itself (not a DCP step; see above)",
    )
    parser.add_argument("--steps", type=int, default=64, help="decode steps per call")
    parser.add_argument(
        "--unroll", action="store_true", help="unroll the scan (no while loop between steps)"
    )
    parser.add_argument("--calls", type=int, default=5, help="profiled calls")
    parser.add_argument(
        "--paged",
        type=int,
        metavar="BLOCK",
        help=f"a paged cache of blocks of BLOCK tokens (a divisor of {LOCAL_ROWS}) and tables",
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--exchanges", nargs="+", default=["collectives", "push"], choices=["collectives", "push"]
    )
    parser.add_argument(
        "--timeout-s", type=float, default=1.0, help="the push exchange's bounded wait"
    )
    parser.add_argument("--top", type=int, default=0, help="also list the N largest kernels")
    parser.add_argument("--out", help="write dcp_results.json (and HLO) into this folder")
    parser.add_argument(
        "--keep-traces", action="store_true", help="also copy each profile to --out"
    )
    args = parser.parse_args()
    if args.paged is not None and (args.paged < 1 or LOCAL_ROWS % args.paged):
        parser.error(f"--paged must divide {LOCAL_ROWS}, got {args.paged}")
    if args.loopback:
        args.dcp, args.exchanges = 1, ["loopback"]
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < args.dcp:
        raise SystemExit(f"needs {args.dcp} GPUs, jax sees {jax.devices()}")
    mesh = Mesh(np.array(gpus[: args.dcp]), (AXIS,))
    if args.loopback:
        push_exchange.setup_group([gpus[0].local_hardware_id], 64 << 20, args.timeout_s)
    elif "push" in args.exchanges and not jax_sparse_mla.dcp_setup(
        mesh, AXIS, timeout_s=args.timeout_s
    ):
        raise SystemExit("dcp_setup found no CUDA mesh: the push exchange would not run")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.cases:
        batch, heads, keys = CASES[name]
        own = heads // args.dcp
        data = inputs(mesh, args.dcp, batch, heads, keys, args.paged)
        for exchange in args.exchanges:
            print(
                f"[{name}, {exchange}] B={batch} H={heads} ({own} per rank), local keys {keys}",
                flush=True,
            )
            fn = make_step(mesh, args.dcp, exchange, args.unroll, args.paged)
            compiled = fn.lower(*data, jnp.int32(0), args.steps).compile()
            if exchange != "collectives" and "jax_sparse_mla_decode_push" not in compiled.as_text():
                raise SystemExit("the push exchange's custom call is not in the program")
            if args.out:
                with open(os.path.join(args.out, f"hlo-{name}-{exchange}.txt"), "w") as f:
                    f.write(compiled.as_text())
            keep = None
            if args.out and args.keep_traces:
                keep = os.path.join(args.out, f"trace-{name}-{exchange}.xplane.pb")
            per_plane = profile(Calls(fn, *data, args.steps), args.calls, keep)
            jax_sparse_mla.dcp_check()
            results += report(name, exchange, args.unroll, per_plane, args.steps, args.top)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dcp_results.json"), "w") as f:
            run = {"date": time.strftime("%Y-%m-%d"), "paged": args.paged, "results": results}
            json.dump(run, f, indent=1)


if __name__ == "__main__":
    main()
