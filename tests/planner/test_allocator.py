"""The CUDA caching allocator's rounding (planner/allocator.py), checked against the rules of PyTorch's
c10/cuda/CUDACachingAllocator.cpp as docs/model.md ("The CUDA caching allocator") states them: tables of request
sizes and the blocks, segments and bounds the rules give, worked out by hand."""

import pytest

from planner.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    allocated_bound,
    allocated_bytes,
    block_bytes,
    rounding,
    segment_bytes,
)

KiB, MiB = 1 << 10, 1 << 20


def test_constants_are_pytorchs():
    """kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge (torch 2.13)."""
    assert (MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER, LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE) == (
        512, 1048576, 2097152, 20971520, 10485760, 2097152)


# size -> (block: round_size, segment: get_allocation_size, allocated from a fresh segment, bound)
TABLE = [
    pytest.param(0, 0, 0, 0, 0, id="empty-no-block"),
    pytest.param(1, 512, 2 * MiB, 512, 512, id="1-byte"),
    pytest.param(4, 512, 2 * MiB, 512, 512, id="a-scalar"),
    pytest.param(511, 512, 2 * MiB, 512, 512, id="511"),
    pytest.param(512, 512, 2 * MiB, 512, 512, id="512-exact"),
    pytest.param(513, 1024, 2 * MiB, 1024, 1024, id="513"),
    pytest.param(84, 512, 2 * MiB, 512, 512, id="3x7-fp32"),
    pytest.param(1000, 1024, 2 * MiB, 1024, 1024, id="1000"),
    pytest.param(MiB - 1, MiB, 2 * MiB, MiB, MiB, id="just-under-1MiB"),
    pytest.param(MiB, MiB, 2 * MiB, MiB, MiB, id="1MiB-still-small"),
    pytest.param(MiB + 1, MiB + 512, 20 * MiB, MiB + 512, 2 * MiB + 512, id="just-over-1MiB-large-pool"),
    pytest.param(5 * MiB + 100, 5 * MiB + 512, 20 * MiB, 5 * MiB + 512, 6 * MiB + 512, id="5MiB-in-20MiB"),
    pytest.param(10 * MiB - 1, 10 * MiB, 10 * MiB, 10 * MiB, 11 * MiB, id="rounds-to-10MiB-own-segment"),
    pytest.param(10 * MiB - 512, 10 * MiB - 512, 20 * MiB, 10 * MiB - 512, 11 * MiB - 512, id="last-20MiB-request"),
    pytest.param(10 * MiB + 1, 10 * MiB + 512, 12 * MiB, 10 * MiB + 512, 11 * MiB + 512,
                 id="10MiB+1-leaves-2MiB-512-split"),
    pytest.param(11 * MiB - 512, 11 * MiB - 512, 12 * MiB, 11 * MiB - 512, 12 * MiB - 512,
                 id="leaves-1MiB+512-split"),
    pytest.param(11 * MiB, 11 * MiB, 12 * MiB, 12 * MiB, 12 * MiB, id="leaves-1MiB-whole-segment"),
    pytest.param(12_000_000, 12_000_256, 12 * MiB, 12 * MiB, 12_000_256 + MiB, id="12MB-whole-12MiB-segment"),
    pytest.param(24 * MiB, 24 * MiB, 24 * MiB, 24 * MiB, 25 * MiB, id="24MiB-exact"),
    pytest.param(3 * 2**30 + 1, 3 * 2**30 + 512, 3 * 2**30 + 2 * MiB, 3 * 2**30 + 512, 3 * 2**30 + 512 + MiB,
                 id="3GiB+1-split"),
]


@pytest.mark.parametrize("size, block, segment, allocated, bound", TABLE)
def test_rounding_table(size, block, segment, allocated, bound):
    assert block_bytes(size) == block
    assert segment_bytes(size) == segment
    assert allocated_bytes(size) == allocated
    assert allocated_bound(size) == bound


@pytest.mark.parametrize("size", [0, 1, 7, 512, 513, 65_537, MiB, MiB + 1, 9 * MiB + 3, 10 * MiB, 10 * MiB + 1,
                                  11 * MiB + 7, 37 * MiB + 5, 2**33 + 1])
def test_every_block_is_a_whole_number_of_512_bytes_between_the_request_and_its_bound(size):
    allocated = allocated_bytes(size)
    assert allocated % MIN_BLOCK == 0
    assert size <= block_bytes(size) <= allocated <= allocated_bound(size) <= segment_bytes(size) + SMALL_SIZE
    assert allocated - block_bytes(size) <= SMALL_SIZE  # an unsplit remainder is at most 1 MiB


def test_a_cpu_device_counts_storages_as_they_are():
    assert [rounding("cpu")(n) for n in (0, 1, 84, 12_000_000)] == [0, 1, 84, 12_000_000]
    assert [rounding("cuda")(n) for n in (0, 1, 84, 12_000_000)] == [0, 512, 512, 12 * MiB]
