"""The rates a time estimate assumes of a device: a roofline (peak FLOP/s, memory bandwidth) and a fixed cost per
operation. Torch-free: a device's specification gives one, and profiles/roofline.py applies it to each operation."""

import math
from dataclasses import dataclass
from typing import Optional

from planner.errors import MemschedError
from planner.validate import bandwidth, throughput


@dataclass(frozen=True)
class Rates:
    """``flops_per_s``: peak FLOP/s; ``bytes_per_s``: memory bandwidth, bytes per second (None: no memory term,
    FLOPs alone); ``op_overhead_s``: seconds every operation that computes or moves data costs on top (a kernel
    launch, the framework's dispatch; 0: none), added to the operation's work, or with ``overhead_overlaps`` its
    floor instead (a GPU's kernels are launched ahead of them by the host: an operation takes the longer of its
    launch and its kernel); ``low_precision_flops_per_s``: peak FLOP/s of an operation on
    16-bit (bf16 or fp16) inputs, a GPU's tensor cores (None: ``flops_per_s``). Which peak an operation gets
    follows its own inputs: a bf16-built model, and the matmuls autocast casts, at the 16-bit one; the fp32 ops
    autocast keeps (a norm, a softmax) at the fp32 one."""

    flops_per_s: float
    bytes_per_s: Optional[float] = None
    op_overhead_s: float = 0.0
    low_precision_flops_per_s: Optional[float] = None
    overhead_overlaps: bool = False

    def __post_init__(self):
        throughput(self.flops_per_s, "rates.flops_per_s")
        if self.low_precision_flops_per_s is not None:
            throughput(self.low_precision_flops_per_s, "rates.low_precision_flops_per_s")
        if self.bytes_per_s is not None:
            bandwidth(self.bytes_per_s, "rates.bytes_per_s")
        overhead = self.op_overhead_s
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 <= overhead < math.inf:
            raise MemschedError(f"rates.op_overhead_s must be seconds per operation, 0 or more and finite, "
                                f"got {overhead!r}")

    def seconds(self, flops: float, bytes_moved: float, low_precision: bool = False) -> float:
        """Seconds of one operation of ``flops`` FLOPs moving ``bytes_moved`` bytes (``low_precision``: on 16-bit
        inputs): the larger of its compute time and its memory time, plus the fixed cost per operation."""
        memory = 0.0 if self.bytes_per_s is None else bytes_moved / self.bytes_per_s
        peak = self.low_precision_flops_per_s if low_precision and self.low_precision_flops_per_s else self.flops_per_s
        work = max(flops / peak, memory)
        return max(work, self.op_overhead_s) if self.overhead_overlaps else work + self.op_overhead_s

    def describe(self) -> str:
        """One line, as a chain's device label says it: ``1e+12 FLOP/s, 2e+10 B/s, 5e-06 s/op`` (the terms given)."""
        terms = [f"{self.flops_per_s:.3g} FLOP/s"]
        if self.low_precision_flops_per_s not in (None, self.flops_per_s):
            terms[0] += f" ({self.low_precision_flops_per_s:.3g} in 16-bit)"
        if self.bytes_per_s is not None:
            terms.append(f"{self.bytes_per_s:.3g} B/s")
        if self.op_overhead_s:
            terms.append(f"{self.op_overhead_s:.3g} s/op" + (" at least" if self.overhead_overlaps else ""))
        return ", ".join(terms)
