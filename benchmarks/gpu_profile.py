"""GPU kernel times of a jitted function, read from JAX's profiler (CUPTI activity records).

A microsecond kernel cannot be timed from the host: a jitted call's dispatch alone costs tens
of microseconds. Instead each call runs under the profiler, with the host waiting for the
device and pausing between calls, and the device events (kernels, copies) that the profiler
records are split into calls at the idle gaps. Per call we report the sum of the kernels'
durations ("kernel time") and the span from the first kernel's start to the last one's end
("span", which adds the gaps between a multi-kernel call's kernels).
"""

from __future__ import annotations

import glob
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.profiler import ProfileData

PAUSE_S = 1e-3  # the host's sleep between calls (5 ms lengthened the spans of two-kernel
# calls at the 17-us scale by up to 8 us: the host's second launch came later)
GAP_NS = 300_000  # an idle gap this long ends a call: kernels of one call are far closer
# (a host hiccup between two launches of one call can idle the GPU for tens of us)
RECORD_ATTEMPTS = 3  # traces recorded before giving up on one that splits into the calls
Events = list[tuple[int, int, str]]  # (start ns, end ns, name)


@dataclass
class CallTimes:
    kernel_us: list[float]  # per call: sum of kernel durations
    span_us: list[float]  # per call: first start to last end
    names: list[str]  # distinct kernel names seen
    by_name_us: list[Counter] = field(default_factory=list)  # per call: kernel name -> us

    def named_us(self, names: set[str]) -> list[float]:
        """Per call: the summed durations of the kernels with these names."""
        return [sum(call[name] for name in names) for call in self.by_name_us]

    def summary(self, values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
        return {"median": statistics.median(values), "p10": pick(0.1), "p90": pick(0.9)}


def device_events_by_plane(xspace_path: str) -> dict[str, list[tuple[int, int, str]]]:
    """(start ns, end ns, kernel name) of each GPU plane's kernels and copies, time-sorted."""
    planes = {}
    for plane in ProfileData.from_file(xspace_path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = []
        for line in plane.lines:
            # Stream lines hold the kernels; XLA's op/module lines would double count.
            if line.name.startswith("Stream"):
                events.extend((e.start_ns, e.end_ns, e.name) for e in line.events)
        planes[plane.name] = sorted(events)
    return planes


def record(
    call: Callable[[], Any], calls: int, pause_s: float, keep: str | None = None
) -> dict[str, Events]:
    """Runs call() ``calls`` times under the profiler, the host waiting for each call and
    pausing ``pause_s`` after it; returns device_events_by_plane of the trace. ``keep``: copy
    the trace (xplane.pb, host planes included) to this path."""
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        try:
            for _ in range(calls):
                jax.block_until_ready(call())
                time.sleep(pause_s)
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if keep:
            shutil.copy(path, keep)
        return device_events_by_plane(path)


def split_at_gaps(events: Events, gap_ns: float) -> list[Events]:
    """Time-sorted events split wherever the device stayed idle longer than gap_ns."""
    groups, current, last_end = [], [], None
    for start, end, name in events:
        if last_end is not None and start - last_end > gap_ns:
            groups.append(current)
            current = []
        current.append((start, end, name))
        last_end = end if last_end is None else max(last_end, end)
    groups.append(current)
    return groups


def profile_calls(fn, args, calls: int) -> CallTimes:
    """Run ``fn(*args)`` ``calls`` times under the profiler; return per-call device times."""
    jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
    jax.block_until_ready(fn(*args))
    # A trace whose idle gaps do not split into exactly one group per call (seen once in a
    # few dozen traces: one group too many) is recorded again, not guessed at.
    for attempt in range(1, RECORD_ATTEMPTS + 1):
        planes = record(lambda: fn(*args), calls, pause_s=PAUSE_S)
        events = sorted(e for plane_events in planes.values() for e in plane_events)
        if not events:
            raise RuntimeError("the profiler recorded no GPU events (is this a GPU run?)")
        groups = split_at_gaps(events, GAP_NS)
        if len(groups) == calls:
            break
        sizes = Counter(len(group) for group in groups)
        print(
            f"gpu_profile: trace {attempt} of {RECORD_ATTEMPTS} split into {len(groups)} groups "
            f"for {calls} calls (events per group: {dict(sizes)})",
            file=sys.stderr,
        )
    else:
        raise RuntimeError(
            f"expected {calls} calls' device events separated by idle gaps, found "
            f"{len(groups)} in each of {RECORD_ATTEMPTS} traces"
        )
    kernel_us = [sum(e - s for s, e, _ in g) / 1e3 for g in groups]
    span_us = [(max(e for _, e, _ in g) - g[0][0]) / 1e3 for g in groups]
    names = sorted({n for _, _, n in events})
    by_name_us = []
    for group in groups:
        durations = Counter()
        for start, end, name in group:
            durations[name] += (end - start) / 1e3
        by_name_us.append(durations)
    return CallTimes(kernel_us, span_us, names, by_name_us)
