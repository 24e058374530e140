"""The copy channel between device and host memory, used by offload plans.

Two copy engines run concurrently with compute and with each other, one per
direction, each copying one transfer at a time in the order transfers are
issued. A transfer of ``n`` bytes occupies its engine ``latency + n /
bandwidth`` seconds. Bandwidths are bytes per second; a bandwidth of 0 means
no channel in that direction (nothing can be offloaded).

``memsched profile`` measures the channel on CUDA with pinned host memory; elsewhere the user gives it
(``--bandwidth 12GB/s``, read by :func:`planner.units.parse_bandwidth`). In a chain file it is the optional
``transfer`` object; a plan that moves data records the channel it was solved for, so its prediction does
not depend on where the chain came from.
"""

import math
from dataclasses import dataclass

import planner.validate as validate
from planner.errors import MemschedError
from planner.units import parse_bandwidth

TRANSFER_FIELDS = ("d2h_bandwidth", "h2d_bandwidth", "latency")


@dataclass(frozen=True)
class Transfer:
    """Device-to-host and host-to-device bandwidths (bytes/s) and the fixed cost of one transfer (s)."""

    d2h_bandwidth: float
    h2d_bandwidth: float
    latency: float = 0.0

    def seconds(self, nbytes: int, direction: str) -> float:
        """How long one transfer of ``nbytes`` occupies the ``"d2h"`` or ``"h2d"`` engine (inf without a channel)."""
        bandwidth = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
        return self.latency + nbytes / bandwidth if bandwidth > 0 else math.inf

    @property
    def usable(self) -> bool:
        """True when data can go both ways (an offload needs both)."""
        return self.d2h_bandwidth > 0 and self.h2d_bandwidth > 0

    def to_dict(self) -> dict:
        return {"d2h_bandwidth": self.d2h_bandwidth, "h2d_bandwidth": self.h2d_bandwidth, "latency": self.latency}

    @classmethod
    def from_dict(cls, raw, where: str = "transfer") -> "Transfer":
        """Validate a ``transfer`` object; a bad field raises a one-line :class:`MemschedError`."""
        if not isinstance(raw, dict):
            raise MemschedError(f"{where} must be an object with fields {', '.join(TRANSFER_FIELDS)}")
        validate.reject_unknown(raw, TRANSFER_FIELDS, where)
        values = {}
        for field in ("d2h_bandwidth", "h2d_bandwidth"):
            values[field] = _bandwidth(validate.require(raw, field, where), f"{where}.{field}")
        values["latency"] = validate.non_negative_seconds(raw.get("latency", 0.0), f"{where}.latency")
        return cls(**values)


def _bandwidth(value, where: str) -> float:
    return validate.bandwidth(value, where, zero="no channel that way")


def channel_from(bandwidth, h2d_bandwidth, latency, known=None, needed_by: str = None):
    """The channel of the command-line flags ``--bandwidth`` (both ways unless ``--h2d-bandwidth``) and
    ``--latency`` (None when not given), else ``known`` (a chain's), else None; a flag without ``--bandwidth``,
    or no channel for ``needed_by`` (what needs one), is a one-line :class:`MemschedError`."""
    if bandwidth is None:
        if h2d_bandwidth is not None or latency is not None:
            raise MemschedError("--h2d-bandwidth and --latency describe a channel: give its --bandwidth too")
        if needed_by and known is None:
            raise MemschedError(f"{needed_by} moves data to host memory and needs the copy channel: give --bandwidth "
                                "(e.g. 16GB/s), or profile the chain on CUDA, which measures it")
        return known
    d2h = parse_bandwidth(bandwidth)
    h2d = d2h if h2d_bandwidth is None else parse_bandwidth(h2d_bandwidth, "--h2d-bandwidth")
    return Transfer(d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency=latency or 0.0)
