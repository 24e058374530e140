"""The CUDA caching allocator's rounding, torch-free: the bytes ``torch.cuda.memory_allocated`` counts for a tensor.

PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp; the constants in c10/core/AllocatorConfig.h of torch
2.13) never hands out a block of the size asked for. With its default settings (no ``PYTORCH_CUDA_ALLOC_CONF``:
no ``expandable_segments``, ``roundup_power2_divisions`` or ``max_split_size_mb``) a request of ``n`` bytes
(a storage's ``nbytes``) gets:

1. ``round_size``: nothing for 0 bytes (no block at all); else ``n`` rounded up to a multiple of
   :data:`MIN_BLOCK` (512 bytes), at least 512.
2. ``get_pool`` / ``get_allocation_size``: a rounded size up to :data:`SMALL_SIZE` (1 MiB) comes from the
   small pool, whose segments (one ``cudaMalloc`` each) are :data:`SMALL_BUFFER` (2 MiB); a larger one from the
   large pool, in a :data:`LARGE_BUFFER` (20 MiB) segment below :data:`MIN_LARGE_ALLOC` (10 MiB), else in a
   segment of its own rounded up to a multiple of :data:`ROUND_LARGE` (2 MiB).
3. ``should_split``: the free block found (best fit, or the new segment) is split when what it leaves is at
   least 512 bytes (small pool) or more than 1 MiB (large pool); otherwise the whole block is handed out.
4. ``memory_allocated`` counts the block's size (``alloc_found_block`` adds ``block->size``).

So a small-pool block is exactly the rounded size; a large-pool block is the rounded size when split, and
at most 1 MiB more when not. docs/model.md ("The CUDA caching allocator") states the rules and what this
module does not model (reuse of cached blocks, fragmentation, the non-default settings).
"""

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request (1 MiB)
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment (2 MiB)
LARGE_BUFFER = 20 << 20  # kLargeBuffer (large_segment_size): the segment of a 1-10 MiB request (20 MiB)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a request gets a segment of its own (10 MiB)
ROUND_LARGE = 2 << 20  # kRoundLarge: such a segment is a multiple of it (2 MiB)


def _multiple(size: int, unit: int) -> int:
    return -(-size // unit) * unit


def block_bytes(size: int) -> int:
    """Bytes of the block a request of ``size`` bytes asks the pools for (``round_size``): 0 for 0, else ``size``
    rounded up to a multiple of 512 bytes. The least ``memory_allocated`` counts for it, and exactly what it
    counts whenever the block is split off a larger free one (always in the small pool)."""
    return 0 if size == 0 else _multiple(size, MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """Bytes of the segment (one ``cudaMalloc``) a request of ``size`` bytes opens when no cached block fits it
    (``get_allocation_size``): 2 MiB for a block up to 1 MiB, 20 MiB below 10 MiB, else the block rounded up to a
    multiple of 2 MiB; 0 for 0 bytes."""
    block = block_bytes(size)
    if block == 0:
        return 0
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    return LARGE_BUFFER if block < MIN_LARGE_ALLOC else _multiple(block, ROUND_LARGE)


def _kept_whole(block: int, free: int) -> bool:
    """Whether a free block of ``free`` bytes, chosen for a ``block``-byte request, is handed out unsplit."""
    remaining = free - block
    return remaining < MIN_BLOCK if block <= SMALL_SIZE else remaining <= SMALL_SIZE


def allocated_bytes(size: int) -> int:
    """Bytes ``torch.cuda.memory_allocated`` counts for one tensor of ``size`` bytes (its storage's ``nbytes``) when
    its block is carved from a fresh segment, as in a fresh process, or reuses the block a tensor of the same size
    freed: the rounded size (:func:`block_bytes`), or the whole segment when what a request of 10 MiB or more
    leaves of its own segment (under 2 MiB) is 1 MiB or less and so is not split off (11.5 MiB: a 12 MiB block).
    A block reused from a larger cached one may count up to 1 MiB more (:func:`allocated_bound`)."""
    block = block_bytes(size)
    segment = segment_bytes(size)
    return segment if block and _kept_whole(block, segment) else block


def allocated_bound(size: int) -> int:
    """The most ``memory_allocated`` can count for one tensor of ``size`` bytes, whatever the cache holds: the
    rounded size in the small pool (every remainder there is split off), and up to 1 MiB more in the large pool
    (a free block leaving 1 MiB or less is handed out whole)."""
    block = block_bytes(size)
    return block if block <= SMALL_SIZE else block + SMALL_SIZE


def rounding(allocator: str):
    """The function from a storage's bytes to the bytes its device's allocator counts: :func:`allocated_bytes`
    for ``"cuda"``, the bytes themselves for ``"cpu"`` (whose memory tracker counts storages as they are)."""
    return allocated_bytes if allocator == "cuda" else _exact


def _exact(size: int) -> int:
    return size
