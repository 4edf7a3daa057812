"""GPU time per phase of a jitted step, read from JAX's profiler (CUPTI device records).

A phase is a ``jax.named_scope`` around part of the step. The compiled HLO lists every
instruction that launches GPU work (fusions, cuBLAS custom calls, a kernel's custom call,
collectives, copies) with ``metadata={op_name="jit(step)/.../<phase>/..."}``. The profiler's
device plane (``/device:GPU:N``) records each kernel and copy on ``Stream #...`` lines, and XLA
tags each one with the thunk that launched it (the ``hlo_op`` stat). Outside a CUDA graph that
is the instruction; inside one (XLA's command buffers, on by default) it is the command
buffer, and the kernel's own name identifies the instruction instead: XLA names a fusion's
kernel after it ("<name>", extra kernels "<name>__<n>"), and our custom calls name their
kernels in their attributes (decode: kernel_name; index_topk: scores_kernel, topk_kernel).
So: device event -> instruction -> op_name -> phase, and the durations are summed per phase.
Collective instructions are a phase of their own ("collectives"; under DCP their time includes
waiting for the slowest rank). What cannot be attributed is counted as "other":
the phases always sum to the device's total kernel time, never less.

As benchmarks/gpu_profile.py: the host waits for each call and pauses between calls, so the
device events split into calls at the idle gaps. Used by examples/kimi_decode_step.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.profiler import ProfileData

COLLECTIVES = "collectives"
OTHER = "other"
XLA_OPS_LINE = "XLA Ops"  # xprof's derived per-instruction line, where a trace has one
PAUSE_S = 2e-3  # host sleep between profiled calls ...
GAP_NS = 500_000  # ... so an idle gap this long separates calls (a call's kernels are closer)

COLLECTIVE_OPCODES = frozenset(
    f"{op}{suffix}"
    for op in [
        "all-gather",
        "all-reduce",
        "all-to-all",
        "ragged-all-to-all",
        "reduce-scatter",
        "collective-permute",
        "collective-broadcast",
        "send",
        "recv",
    ]
    for suffix in ["", "-start", "-done"]
)
ASYNC_OPCODES = frozenset({"async-start", "async-update", "async-done"})
# Never launch work, and would spread a phase across its boundaries if they took one.
_NO_WORK = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})

# HLO text: "  ROOT %name = shape opcode(operands), attr=..., metadata={op_name="..." ...}".
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s+=\s+(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|\s)(?P<opcode>[a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="(?P<op_name>(?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"calls=(?P<calls>\{[^}]*\}|%?[\w.\-]+)")
# A custom call attribute that names a kernel it launches (ours: the cubin's entry, as
# kernel_name, or <stage>_kernel for a custom call of several kernels).
_KERNEL_NAME = re.compile(r'\b(?:\w+_)?kernel(?:_name)?\s*=\s*"(?P<kernel>[^"]+)"')
# Extra kernels of one instruction: XLA names them "<name>__<n>" (e.g. a multi-pass sort).
_KERNEL_PART = re.compile(r"__\d+$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    op_name: str  # "" when the instruction has no metadata op_name
    calls: tuple[str, ...]  # computations it calls (fusion body, async wrapped computation)
    operands: tuple[str, ...]
    kernels: tuple[str, ...] = ()  # the kernels a custom call launches, as its attributes say


@dataclasses.dataclass
class InstructionPhases:
    """Phase of each instruction of one compiled HLO module."""

    module: str
    phase: dict[str, str]  # instruction name -> phase (declared, COLLECTIVES or OTHER)
    opcode: dict[str, str]  # instruction name -> opcode
    inferred: set[str]  # instructions without metadata placed by their operands or users
    by_kernel_name: dict[str, str]  # sanitized instruction name ("fusion_3") -> name

    def phases_present(self) -> set[str]:
        return set(self.phase.values())


def parse_hlo(hlo_text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """(module name, computation name -> its instructions) of an HLO module's text."""
    module, computations, current = "", {}, None
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            rest = match["rest"]
            opcode = _OPCODE.search(rest)
            op_name = _OP_NAME.search(rest)
            calls = _CALLS.search(rest)
            kernels = tuple(found["kernel"] for found in _KERNEL_NAME.finditer(rest))
            called = ()
            if calls:
                called = tuple(c.strip().lstrip("%") for c in calls["calls"].strip("{}").split(","))
            current.append(
                Instruction(
                    match["name"].lstrip("%"),
                    opcode["opcode"] if opcode else "",
                    op_name["op_name"] if op_name else "",
                    called,
                    _operands(rest, opcode.end()) if opcode else (),
                    kernels,
                )
            )
            continue
        header = _COMPUTATION.match(line)
        if header and " = " not in line:
            current = computations.setdefault(header["name"], [])
    return module, computations


def _operands(rest: str, start: int) -> tuple[str, ...]:
    """%names inside the parentheses that open just before `start`."""
    depth = 1
    for index in range(start, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[index], 0)
        if depth == 0:
            return tuple(re.findall(r"%([\w.\-]+)", rest[start:index]))
    return ()


def phase_of_op_name(op_name: str, phases: Iterable[str]) -> str | None:
    """The innermost declared phase among the op_name's scopes ("a/query/dot" -> "query")."""
    wanted = set(phases)
    for part in reversed(op_name.split("/")):
        if part in wanted:
            return part
    return None


def instruction_phases(hlo_text: str, phases: Sequence[str]) -> InstructionPhases:
    """Maps every instruction of a compiled module to a phase. A collective (or an async
    wrapper of one) is COLLECTIVES; otherwise the phase in the instruction's own op_name (for
    a fusion: the fusion's own metadata). An instruction without one (XLA adds copies,
    transposes, converts, split reductions without metadata) takes the phase that its called
    computations agree on (a fusion whose fused ops are all in one phase), else the one its
    operands agree on, else its users; else it is OTHER."""
    module, computations = parse_hlo(hlo_text)
    if not computations:
        raise ValueError("no HLO computations found in the compiled text")
    own = {
        inst.name: phase_of_op_name(inst.op_name, phases)
        for insts in computations.values()
        for inst in insts
    }

    def is_collective(inst: Instruction) -> bool:
        if inst.opcode in COLLECTIVE_OPCODES:
            return True
        if re.sub(r"\.\d+$", "", inst.name) in COLLECTIVE_OPCODES:
            return True
        return inst.opcode in ASYNC_OPCODES and any(
            called.opcode in COLLECTIVE_OPCODES
            for name in inst.calls
            for called in computations.get(name, [])
        )

    def agreed(phases: Iterable[str | None]) -> str | None:
        found = {p for p in phases if p is not None}
        return found.pop() if len(found) == 1 else None

    phase: dict[str, str | None] = {}
    opcode, inferred, users = {}, set(), {}
    for insts in computations.values():
        for inst in insts:
            opcode[inst.name] = inst.opcode
            for operand in inst.operands:
                users.setdefault(operand, []).append(inst.name)
            if is_collective(inst):
                phase[inst.name] = COLLECTIVES
                continue
            phase[inst.name] = own[inst.name] or agreed(
                own[called.name] for name in inst.calls for called in computations.get(name, [])
            )
    # Instructions are printed after their operands: one forward pass reaches chains.
    for insts in computations.values():
        for inst in insts:
            if phase[inst.name] is None and inst.opcode not in _NO_WORK:
                phase[inst.name] = agreed(phase.get(o) for o in inst.operands)
                inferred.add(inst.name)
    for insts in computations.values():
        for inst in insts:
            if phase[inst.name] is None and inst.opcode not in _NO_WORK:
                phase[inst.name] = agreed(phase[u] for u in users.get(inst.name, []))
    final = {name: found or OTHER for name, found in phase.items()}
    inferred = {name for name in inferred if final[name] != OTHER}
    by_kernel_name = {sanitize(name): name for name in final}
    by_kernel_name.update(
        (kernel, inst.name)
        for insts in computations.values()
        for inst in insts
        for kernel in inst.kernels
    )
    return InstructionPhases(module, final, opcode, inferred, by_kernel_name)


def sanitize(name: str) -> str:
    """XLA's kernel name for an instruction name: '.' and '-' become '_'."""
    return re.sub(r"[.\-]", "_", name)


# ---------------------------------------------------------------------------------------------
# Profiler events
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Event:
    start_ns: float
    end_ns: float
    name: str
    hlo_op: str | None = None  # the "hlo_op" stat: instruction that launched it
    hlo_module: str | None = None

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


@dataclasses.dataclass
class DeviceTrace:
    """One device plane's events: the kernels and copies, and XLA's op line if present."""

    plane: str
    line_names: list[str]
    events: list[Event]  # from the "Stream ..." lines (or the lines `is_event_line` picks)
    xla_ops: list[Event]  # the "XLA Ops" line's events (named by instruction), often absent


def is_stream_line(name: str) -> bool:
    """Kernel and copy records; XLA's op/module lines would double count them."""
    return name.startswith("Stream")


def read_traces(
    xspace_path: str,
    plane_prefix: str = "/device:GPU",
    is_event_line: Callable[[str], bool] = is_stream_line,
    tagged_only: bool = False,
) -> dict[str, DeviceTrace]:
    """Device traces of the planes whose name starts with plane_prefix, by plane name.
    tagged_only keeps only events with an hlo_op stat (for the CPU's thunk events, whose
    lines also hold the runtime's own events)."""
    traces = {}
    for plane in ProfileData.from_file(xspace_path).planes:
        if not plane.name.startswith(plane_prefix):
            continue
        trace = DeviceTrace(plane.name, [], [], [])
        for line in plane.lines:
            trace.line_names.append(line.name)
            if line.name == XLA_OPS_LINE:
                trace.xla_ops.extend(Event(e.start_ns, e.end_ns, e.name) for e in line.events)
            elif is_event_line(line.name):
                events = (to_event(e) for e in line.events)
                trace.events.extend(e for e in events if e.hlo_op or not tagged_only)
        trace.events.sort(key=lambda e: (e.start_ns, e.end_ns))
        trace.xla_ops.sort(key=lambda e: (e.start_ns, e.end_ns))
        traces[plane.name] = trace
    return traces


def to_event(event: Any) -> Event:
    stats = {}
    for name, value in event.stats:
        stats.setdefault(name, value)
    hlo_op, hlo_module = stats.get("hlo_op"), stats.get("hlo_module")
    return Event(
        event.start_ns,
        event.end_ns,
        event.name,
        None if hlo_op is None else str(hlo_op),
        None if hlo_module is None else str(hlo_module),
    )


def trace_summary(path: str) -> str:
    """What the profile held, for error messages: planes, their lines and event counts."""
    parts = []
    for plane in ProfileData.from_file(path).planes:
        lines = [f"{line.name!r} ({sum(1 for _ in line.events)})" for line in plane.lines]
        parts.append(f"{plane.name}: lines {', '.join(lines) or 'none'}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Attribution and per-phase sums
# ---------------------------------------------------------------------------------------------

HOW = ("hlo_op stat", "XLA Ops line", "kernel name", "unattributed")


def attribute(
    trace: DeviceTrace, ops: InstructionPhases
) -> list[tuple[Event, str, str, str | None]]:
    """(event, phase, how, instruction) for every event of the trace. How: the event's hlo_op
    stat names an instruction of this module; else an "XLA Ops" event covers it; else its
    kernel name is an instruction's name (XLA names fusion kernels after them) or NCCL's;
    else OTHER."""
    op_starts = [op.start_ns for op in trace.xla_ops]
    attributed = []
    for event in trace.events:
        foreign = bool(event.hlo_module and ops.module and event.hlo_module != ops.module)
        covering = _covering_op(trace.xla_ops, op_starts, event)
        by_name = ops.by_kernel_name.get(event.name) or ops.by_kernel_name.get(
            _KERNEL_PART.sub("", sanitize(event.name))
        )
        if foreign:
            found = (OTHER, HOW[3], None)
        elif event.hlo_op in ops.phase:
            found = (ops.phase[event.hlo_op], HOW[0], event.hlo_op)
        elif covering is not None and covering.name in ops.phase:
            found = (ops.phase[covering.name], HOW[1], covering.name)
        elif by_name is not None:
            found = (ops.phase[by_name], HOW[2], by_name)
        elif event.name.lower().startswith("nccl"):
            found = (COLLECTIVES, HOW[2], None)
        else:
            found = (OTHER, HOW[3], None)
        attributed.append((event, *found))
    return attributed


def _covering_op(ops: list[Event], starts: list[float], event: Event) -> Event | None:
    """The op event (sorted by start) that covers the event's midpoint, if any."""
    middle = (event.start_ns + event.end_ns) / 2
    index = bisect.bisect_right(starts, middle)
    for candidate in reversed(ops[max(0, index - 8) : index]):  # ops barely nest
        if candidate.end_ns >= middle:
            return candidate
    return None


def split_calls(events: Sequence[Event], gap_ns: float = GAP_NS) -> list[list[Event]]:
    """Groups time-sorted events into calls at idle gaps longer than gap_ns."""
    groups: list[list[Event]] = []
    last_end = None
    for event in events:
        if last_end is None or event.start_ns - last_end > gap_ns:
            groups.append([])
        groups[-1].append(event)
        last_end = event.end_ns if last_end is None else max(last_end, event.end_ns)
    return groups


@dataclasses.dataclass
class PhaseTimes:
    """One device's GPU time per phase over `calls` profiled calls of a step."""

    device: str
    calls: int
    phases: list[str]  # table order: declared phases, then COLLECTIVES and OTHER
    total_ns: float  # all events' durations, summed directly (not through the phases)
    phase_ns: dict[str, float]  # summed over all calls
    events: Counter  # events per phase over all calls
    how: Counter  # events per attribution route
    per_call: list[dict[str, float]] | None  # ns per phase per call; None: calls not separable
    groups_found: int  # calls found at idle gaps (== calls when per_call is set)
    inferred_ns: float  # time of instructions without scope metadata, placed by data flow

    def mean_us(self, phase: str | None = None) -> float:
        """Mean per step: a phase's (or the total's) time over all calls / calls."""
        value = self.total_ns if phase is None else self.phase_ns.get(phase, 0.0)
        return value / self.calls / 1e3

    def median_us(self, phase: str | None = None) -> float:
        """Median over calls of a phase's (or the step's) time; the mean if calls could not
        be separated."""
        if self.per_call is None:
            return self.mean_us(phase)
        values = [
            sum(call.values()) if phase is None else call.get(phase, 0.0) for call in self.per_call
        ]
        return statistics.median(values) / 1e3

    def quantile_us(self, fraction: float) -> float:
        if self.per_call is None:
            return self.mean_us()
        ordered = sorted(sum(call.values()) for call in self.per_call)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1e3

    def shares(self) -> dict[str, float]:
        """Each phase's fraction of the total device time (sums to 1)."""
        total = sum(self.phase_ns.values())
        return {p: (self.phase_ns.get(p, 0.0) / total if total else 0.0) for p in self.phases}


def phase_times(
    trace: DeviceTrace, ops: InstructionPhases, declared: Sequence[str], calls: int
) -> PhaseTimes:
    """Sums a device trace per phase; raises RuntimeError when it holds no events."""
    if not trace.events:
        raise RuntimeError(
            f"no kernel or copy events on {trace.plane} (lines found: {trace.line_names})"
        )
    attributed = attribute(trace, ops)
    phases = [*declared, COLLECTIVES, OTHER]
    phase_ns: dict[str, float] = dict.fromkeys(phases, 0.0)
    events, how = Counter(), Counter()
    inferred_ns = 0.0
    for event, phase, route, instruction in attributed:
        phase_ns[phase] = phase_ns.get(phase, 0.0) + event.duration_ns
        events[phase] += 1
        how[route] += 1
        if instruction in ops.inferred:
            inferred_ns += event.duration_ns
    if any(p not in phases for p in phase_ns):
        phases += [p for p in phase_ns if p not in phases]
    phase_of = {id(event): phase for event, phase, _, _ in attributed}
    groups = split_calls(trace.events)
    per_call = None
    if len(groups) == calls:
        per_call = []
        for group in groups:
            sums = dict.fromkeys(phases, 0.0)
            for event in group:
                sums[phase_of[id(event)]] += event.duration_ns
            per_call.append(sums)
    total_ns = sum(event.duration_ns for event in trace.events)
    return PhaseTimes(
        trace.plane,
        calls,
        phases,
        total_ns,
        phase_ns,
        events,
        how,
        per_call,
        len(groups),
        inferred_ns,
    )


def profile(
    fn: Callable[[], Any],
    calls: int,
    ops: InstructionPhases,
    declared: Sequence[str],
    pause_s: float = PAUSE_S,
    **read_options: Any,
) -> dict[str, PhaseTimes]:
    """Runs fn() `calls` times under the profiler, the host waiting for each call and pausing
    pause_s after it; returns the time per phase of every GPU plane with events (or of the
    planes read_options select: see read_traces)."""
    jax.block_until_ready(fn())  # compile and warm up outside the trace
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        try:
            for _ in range(calls):
                jax.block_until_ready(fn())
                time.sleep(pause_s)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if len(paths) != 1:
            raise RuntimeError(f"expected one .xplane.pb from the profiler, found {paths}")
        traces = read_traces(paths[0], **read_options)
        busy = {name: trace for name, trace in traces.items() if trace.events}
        if not busy:
            raise RuntimeError(
                f"the profiler recorded no kernel events on the planes and lines read "
                f"({read_options or 'GPU planes, Stream lines'}); the profile held: "
                f"{trace_summary(paths[0])}"
            )
    return {name: phase_times(trace, ops, declared, calls) for name, trace in busy.items()}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def format_table(times: PhaseTimes) -> list[str]:
    """The per-phase table of one device: mean us/step (rows sum to the total), share of the
    device time, median us/step over the calls, events (kernels, copies) per step."""
    shares = times.shares()
    rows = [f"  {'phase':<18} {'us/step':>9} {'share':>7} {'median us':>10} {'events':>7}"]
    for phase in times.phases:
        if phase == COLLECTIVES and not times.events[phase]:
            continue  # no collectives in a single-device step
        rows.append(
            f"  {phase:<18} {times.mean_us(phase):9.1f} {100 * shares[phase]:6.1f}% "
            f"{times.median_us(phase):10.1f} {times.events[phase] / times.calls:7.1f}"
        )
    phase_sum_us = sum(times.phase_ns.values()) / times.calls / 1e3
    rows.append(
        f"  {'sum of phases':<18} {phase_sum_us:9.1f} {100 * sum(shares.values()):6.1f}% "
        f"{'':>10} {sum(times.events.values()) / times.calls:7.1f}"
    )
    return rows


def summary_line(label: str, times: PhaseTimes) -> str:
    """Two lines: the step's GPU time (median [p10, p90]; the mean, a direct total of all
    events that the table's rows add up to), then how the events were attributed."""
    if times.per_call is not None:
        spread = (
            f"median {times.median_us():.1f} us [p10 {times.quantile_us(0.1):.1f}, p90 "
            f"{times.quantile_us(0.9):.1f}] over {times.calls} profiled calls"
        )
    else:
        spread = (
            f"{times.calls} profiled calls not separable at idle gaps ({times.groups_found} "
            f"groups found): mean only"
        )
    routes = ", ".join(f"{route} {times.how[route]}" for route in HOW if times.how[route])
    inferred_us = times.inferred_ns / times.calls / 1e3
    return (
        f"GPU {label} ({times.device}): {spread}; mean {times.mean_us():.1f} us/step = all "
        f"kernels and copies summed directly\n  (events attributed by {routes}; "
        f"{inferred_us:.1f} us/step from instructions without scope metadata, placed by their "
        f"operands or users)"
    )
