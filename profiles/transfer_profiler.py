"""Measure the device-host copy channel (:class:`planner.transfer.Transfer`) on CUDA.

Copies between a device tensor and a *pinned* host buffer run asynchronously
on a side stream, as the offload executor makes them. Each direction is timed
with CUDA events for a small and a large transfer (median of ``repeats``); the
line through the two points gives the per-transfer latency (intercept) and the
bandwidth (slope). A CPU has no such channel: :func:`measure_transfer` returns
None there and the user gives the channel (``--bandwidth``).
"""

import statistics

import torch

from planner.transfer import Transfer

SMALL_BYTES = 1 << 20  # 1 MiB
LARGE_BYTES = 64 << 20  # 64 MiB


def measure_transfer(device, repeats: int = 5, small: int = SMALL_BYTES, large: int = LARGE_BYTES):
    """The channel between ``device`` and pinned host memory, or None when ``device`` is not CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    seconds = {}
    for nbytes in (small, large):
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        seconds["d2h", nbytes] = _median_copy(stream, on_host, on_device, repeats)
        seconds["h2d", nbytes] = _median_copy(stream, on_device, on_host, repeats)
        del on_device, on_host
    fitted = {}
    for direction in ("d2h", "h2d"):
        slope = (seconds[direction, large] - seconds[direction, small]) / (large - small)
        fitted[direction] = (1.0 / slope if slope > 0 else 0.0,
                             max(0.0, seconds[direction, small] - small * max(slope, 0.0)))
    latency = min(fitted["d2h"][1], fitted["h2d"][1])
    return Transfer(d2h_bandwidth=fitted["d2h"][0], h2d_bandwidth=fitted["h2d"][0], latency=latency)


def _median_copy(stream, destination, source, repeats: int) -> float:
    """Seconds of one ``destination.copy_(source, non_blocking=True)`` on ``stream`` (CUDA events, median)."""
    times = []
    with torch.cuda.stream(stream):
        destination.copy_(source, non_blocking=True)  # warm-up
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            destination.copy_(source, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times)
