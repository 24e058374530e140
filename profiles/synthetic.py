"""Synthetic chain problems: random chains for tests and benchmarks, shaped like real networks.

Sizes in bytes, times in seconds. A heterogeneous chain draws each stage's
forward time, backward/forward ratio, output size and saved/output ratio
independently; a homogeneous chain repeats one stage (Revolve's setting).
"""

import numpy as np

from planner.chain import Chain, Loss, Stage


def random_chain(length: int, seed: int = 0, *, homogeneous: bool = False, tmp: bool = False, params: bool = False,
                 scale_bytes: int = 10**7, name: str = None) -> Chain:
    """A chain of ``length`` stages drawn from ``seed``.

    ``tmp`` adds forward/backward temporaries and a loss temporary; ``params``
    adds parameter gradients. ``scale_bytes`` is the typical activation size.
    """
    rng = np.random.default_rng(seed)
    count = 1 if homogeneous else length
    fwd = rng.uniform(0.002, 0.008, count)
    bwd = fwd * rng.uniform(1.5, 2.5, count)
    out = rng.integers(scale_bytes // 5, 3 * scale_bytes, count)
    saved = out * rng.uniform(1.0, 4.0, count)
    fwd_tmp = rng.integers(0, scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    nograd_tmp = rng.integers(0, scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    bwd_tmp = rng.integers(0, 2 * scale_bytes, count) if tmp else np.zeros(count, dtype=np.int64)
    param = rng.integers(0, scale_bytes // 2, count) if params else np.zeros(count, dtype=np.int64)
    pick = (lambda i: 0) if homogeneous else (lambda i: i)
    stages = tuple(
        Stage(name=f"stage{i}", fwd_time=float(round(fwd[pick(i)], 6)), bwd_time=float(round(bwd[pick(i)], 6)),
              out_bytes=int(out[pick(i)]), saved_bytes=int(saved[pick(i)]), fwd_tmp_bytes=int(fwd_tmp[pick(i)]),
              nograd_tmp_bytes=int(nograd_tmp[pick(i)]),
              bwd_tmp_bytes=int(bwd_tmp[pick(i)]), param_bytes=int(param[pick(i)]))
        for i in range(length)
    )
    loss = Loss(bwd_time=float(round(rng.uniform(0.0, 0.002), 6)), tmp_bytes=int(rng.integers(0, scale_bytes)) if tmp else 0)
    return Chain(name=name or f"synthetic_L{length}_s{seed}", device="synthetic",
                 input_bytes=int(rng.integers(scale_bytes // 5, 2 * scale_bytes)), stages=stages, loss=loss)
