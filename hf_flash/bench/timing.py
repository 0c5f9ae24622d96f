"""Timing shared by the benchmarks: backends take turns in rounds (the first of a round rotates), medians
over rounds with their spread, and a per-call timer that gives GPU time and host time from one batch of
back-to-back calls (or, sustained, GPU time once the power limit has settled the clock)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable


def rotated(names: list, round_index: int) -> list:
    """The order of one round: every name leads some rounds, so drift over a process falls on all alike."""
    if not names:
        return []
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def take_turns(fns: dict, rounds: int, measure: Callable) -> tuple[dict, dict]:
    """Calls ``measure(name, fns[name])`` for every name in each of ``rounds`` rounds, in rotated order.
    Returns ({name: [one value per round]}, {name: exception}); a name whose measurement raises is dropped
    from the later rounds and from the values."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    values, failed = {name: [] for name in fns}, {}
    for r in range(rounds):
        for name in rotated([n for n in fns if n not in failed], r):
            try:
                values[name].append(measure(name, fns[name]))
            except Exception as e:  # noqa: BLE001  (a backend that cannot run is a result, not a crash)
                failed[name] = e
                del values[name]
    return values, failed


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the rounds' values."""
    if not values:
        raise ValueError("median_spread needs at least one value")
    return statistics.median(values), min(values), max(values)


def relative_spread(values: list[float]) -> float:
    """(max - min) / median, the run-to-run spread the targets bound (<= 5%)."""
    mid, lo, hi = median_spread(values)
    return (hi - lo) / mid if mid else float("nan")


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:120]


class CallTimer:
    """GPU and host time per call of ``fn`` from ``calls`` back-to-back calls enqueued behind a sleep kernel.

    The sleep keeps the GPU busy while the host enqueues, so CUDA events around the calls measure the GPU's
    time alone (no launch gaps), and the wall time of the enqueueing is the host's cost per call, never
    waiting on the GPU. The sleep is sized from the host time seen so far; a batch whose enqueueing
    outlasted the sleep is repeated with a longer one."""

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda._sleep(1000)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_ms = cycles / start.elapsed_time(end)

    def __call__(self, fn: Callable, calls: int, host_ms_guess: float) -> tuple[float, float]:
        """(GPU ms per call, host µs per call). ``host_ms_guess``: expected host ms of the whole batch."""
        ahead = 1.5 * host_ms_guess + 1.0
        for _ in range(3):
            gpu_ms, host_ms = self._batch(fn, calls, ahead)
            if host_ms < ahead:
                return gpu_ms / calls, host_ms * 1e3 / calls
            ahead = 2 * host_ms + 1.0
        # Still outlasting longer sleeps: the call waits on the GPU (a host sync), so host time includes GPU
        # time whatever we do; time the batch without a sleep.
        gpu_ms, host_ms = self._batch(fn, calls, 0.0)
        return gpu_ms / calls, host_ms * 1e3 / calls

    def _batch(self, fn: Callable, calls: int, ahead_ms: float) -> tuple[float, float]:
        """(GPU ms, host ms) of ``calls`` calls enqueued behind ``ahead_ms`` of sleep."""
        torch = self.torch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead_ms > 0:
            torch.cuda._sleep(int(ahead_ms * self.cycles_per_ms))
        start.record()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        host_ms = (time.perf_counter_ns() - t0) * 1e-6
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host_ms

    def warm_up(self, fn: Callable, target_ms: float, max_calls: int) -> tuple[int, float]:
        """Runs ``fn`` (compiles, autotunes), then sizes a batch: (calls giving ~target_ms of GPU or host time,
        host ms guess for that batch)."""
        torch = self.torch
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        once_ms = (time.perf_counter() - t0) * 1e3  # host + GPU: an upper bound of either
        calls = max(2, min(max_calls, round(target_ms / once_ms)))
        return calls, calls * once_ms


@dataclass(frozen=True)
class Power:
    """What a sustained measurement saw: mean SM clock (MHz), board power (W) and energy per call (mJ), NaN
    where NVML could not be read; and the host's µs per call meanwhile (enqueueing only: near the GPU's time per
    call the GPU waits for the host, and its time is the host's)."""
    clock_mhz: float = math.nan
    watts: float = math.nan
    mj_per_call: float = math.nan
    enqueue_us: float = math.nan


HOST_BOUND = 0.75


def host_bound(enqueue_us: float, gpu_ms: float) -> bool:
    """Whether enqueueing a call took so much of the GPU's time for it (HOST_BOUND) that the GPU waited for the host
    at the host's jitter: the time is then partly the host's, and the cell ranks nothing."""
    return enqueue_us >= HOST_BOUND * gpu_ms * 1e3


class SustainedTimer(CallTimer):
    """GPU time per call once the board's power limit has settled the clock, as in a long training run.

    ``fn`` runs in groups of ``calls`` back-to-back calls for ``seconds``, the first half untimed; CUDA events
    around the second half's groups give GPU ms per call, and ``meter`` (a ``power.Meter``, or None) the mean SM
    clock and the energy per call over them. The host waits for the group before the one it has just queued, so
    the GPU never waits for the host and the queue stays short. Host µs per call come from one sleep-ahead batch
    first (CallTimer). ``last`` holds the Power of the latest measurement. (A burst of ~20 ms after a sleep, as
    CallTimer times, runs at up to the boost clock instead: the two rank kernels differently when one draws more
    power per FLOP.)"""

    def __init__(self, seconds: float, meter=None):
        if not seconds > 0:
            raise ValueError(f"sustained timing needs seconds > 0, got {seconds}")
        super().__init__()
        self.seconds, self.meter, self.last = seconds, meter, Power()

    def __call__(self, fn: Callable, calls: int, host_ms_guess: float) -> tuple[float, float]:
        _, host_us = super().__call__(fn, calls, host_ms_guess)
        gpu_ms, self.last = self._sustain(fn, calls)
        return gpu_ms, host_us

    def _sustain(self, fn: Callable, calls: int) -> tuple[float, Power]:
        torch, meter, half = self.torch, self.meter, self.seconds / 2
        enqueue_s = 0.0  # the host's time spent queueing the timed groups

        def group():
            nonlocal enqueue_s
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            done = torch.cuda.Event()
            done.record()
            enqueue_s += time.perf_counter() - t
            return done

        before = group()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < half:  # untimed: the clock falls to where the power limit holds it
            before, queued = group(), before
            queued.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # runs as the groups queued so far finish
        enqueue_s = 0.0
        energy0, wall0, clocks, n = meter.energy_mj() if meter else math.nan, time.perf_counter(), [], 0
        while True:
            before, queued = group(), before
            n += calls
            queued.synchronize()
            if meter:
                clocks.append(meter.clock_mhz())
            if time.perf_counter() - wall0 >= half:
                break
        end.record()
        end.synchronize()
        wall = time.perf_counter() - wall0
        gpu_ms, enqueue_us = start.elapsed_time(end) / n, enqueue_s * 1e6 / n
        if not meter:
            return gpu_ms, Power(enqueue_us=enqueue_us)
        watts = (meter.energy_mj() - energy0) * 1e-3 / wall  # a steady draw: the window's ends need not match the GPU's
        return gpu_ms, Power(statistics.fmean(clocks), watts, watts * gpu_ms, enqueue_us)
