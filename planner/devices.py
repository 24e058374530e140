"""A target device as data, torch-free: :class:`DeviceSpec`, by name (:data:`DEVICES`) or from a JSON file.

A spec says what a plan for a device you may not have needs to know of it: its memory (bytes), its peak dense
throughput in bf16 on tensor cores and in plain fp32 (FLOP/s), its memory bandwidth and its host link, each
way (bytes/s), its allocator (``"cuda"``: planner/allocator.py rounds every block as PyTorch's caching
allocator does; ``"cpu"``: bytes as they are), a cost per operation (seconds: on a CUDA device the host's launch of
its kernel, which runs ahead of the device, so that an operation takes at least that long; on a CPU the
framework's dispatch before its kernel, added to it) and, for a CUDA device, its compute capability ("9.0":
it sets the cuBLAS workspace the device holds, planner/blas_workspace.py; left out, that workspace is not
counted). The built-in figures are the vendors' data sheets',
dense (half the "with sparsity" tensor-core figures), each spec naming its source. Memory is the board's, the
data sheets' "GB" read as GiB (an A100 80GB reports 81920 MiB; a board may report somewhat less, ECC or reserved
memory taken); what one process can allocate is less again (the CUDA context and the driver take some). A file
is ``memsched.device/1`` (docs/formats.md, "Device specs").
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import planner.validate as validate
from planner.blas_workspace import BlasWorkspace, blas_workspace
from planner.errors import MemschedError
from planner.jsonio import read_json
from planner.rates import Rates
from planner.transfer import Transfer
from planner.units import parse_bandwidth, parse_budget

DEVICE_FORMAT = "memsched.device/1"
ALLOCATORS = ("cuda", "cpu")
MIN_MEMORY = 1 << 20  # bytes: a device smaller than 1 MiB holds no model
_FIELDS = ("format", "name", "memory_bytes", "bf16_flops", "fp32_flops", "memory_bandwidth", "d2h_bandwidth",
           "h2d_bandwidth", "allocator", "source", "op_overhead_s", "compute_capability")
_CAPABILITY = re.compile(r"([1-9][0-9]?)\.([0-9])")  # "MAJOR.MINOR", as nvidia-smi --query-gpu=compute_cap prints
GIB, TERA, GIGA = 1 << 30, 1e12, 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One device: ``memory_bytes`` (bytes), ``bf16_flops`` and ``fp32_flops`` (peak dense FLOP/s),
    ``memory_bandwidth``, ``d2h_bandwidth`` and ``h2d_bandwidth`` (bytes/s), ``allocator`` ("cuda" or "cpu")
    ``source`` (where the figures come from), ``op_overhead_s`` (seconds of each operation's launch: on CUDA the
    least an operation takes, on a CPU added to its roofline; 0: none) and ``compute_capability`` (a CUDA
    device's, "MAJOR.MINOR"; None: not known)."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    d2h_bandwidth: float
    h2d_bandwidth: float
    allocator: str = "cuda"
    source: str = ""
    op_overhead_s: float = 0.0
    compute_capability: str = None

    def __post_init__(self):
        """Each figure checked as a device file's are (:func:`device_from_dict`), in one line naming it."""
        where = f"DeviceSpec {self.name!r}:"
        if not isinstance(self.name, str) or not self.name.strip():
            raise MemschedError(f"DeviceSpec name must be a non-empty string, got {self.name!r}")
        if self.allocator not in ALLOCATORS:
            raise MemschedError(f"{where} allocator must be \"cuda\" (PyTorch's caching allocator) or \"cpu\", "
                                f"got {self.allocator!r}")
        numbers = {"memory_bytes": self.memory_bytes, "bf16_flops": self.bf16_flops, "fp32_flops": self.fp32_flops,
                   "memory_bandwidth": self.memory_bandwidth, "d2h_bandwidth": self.d2h_bandwidth,
                   "h2d_bandwidth": self.h2d_bandwidth, "op_overhead_s": self.op_overhead_s}
        for key, value in numbers.items():
            if isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
                raise MemschedError(f"{where} {key} must be a number, got {value!r}")
        _memory(self.memory_bytes, f"{where} memory_bytes")
        for key in ("bf16_flops", "fp32_flops"):
            _flops(numbers[key], f"{where} {key}")
        for key in ("memory_bandwidth", "d2h_bandwidth", "h2d_bandwidth"):
            _rate(numbers[key], f"{where} {key}")
        _overhead(self.op_overhead_s, f"{where} op_overhead_s")
        _capability(self.compute_capability, self.allocator, f"{where} compute_capability")

    def rates(self) -> Rates:
        """The :class:`Rates` an estimate for this device assumes: fp32 peak FLOP/s, its bf16/fp16 peak for
        operations on 16-bit inputs, its memory bandwidth and its cost per operation (a CUDA device's the floor of
        each operation's time, a CPU's added to it)."""
        return Rates(self.fp32_flops, self.memory_bandwidth, self.op_overhead_s, self.bf16_flops,
                     overhead_overlaps=self.allocator == "cuda")

    def transfer(self) -> Transfer:
        """The host link as a copy channel (planner/transfer.py): the data sheet's peak each way, no latency; a
        measured channel (``memsched profile`` on the device) is slower."""
        return Transfer(d2h_bandwidth=self.d2h_bandwidth, h2d_bandwidth=self.h2d_bandwidth)

    def blas_workspace(self, environ=None) -> BlasWorkspace:
        """The cuBLAS workspaces a training step on this device holds (planner/blas_workspace.py), under the
        environment ``environ`` (default: this process's)."""
        return blas_workspace(self.allocator, self.compute_capability, environ)

    def step_memory_bytes(self, memory_bytes: int = None, environ=None) -> int:
        """Bytes of the device's memory (``memory_bytes`` when given, else the spec's) a training step and its
        resident state can use: less the cuBLAS workspaces (:meth:`blas_workspace`)."""
        return (self.memory_bytes if memory_bytes is None else memory_bytes) - self.blas_workspace(environ).held

    def to_dict(self) -> dict:
        fields = [field for field in _FIELDS[1:] if field != "compute_capability" or self.compute_capability]
        return {"format": DEVICE_FORMAT, **{field: getattr(self, field) for field in fields}}




def device_spec(name_or_path, where: str = "--device-spec") -> DeviceSpec:
    """The :class:`DeviceSpec` named ``name_or_path`` (a key of :data:`DEVICES`) or stored in that JSON file."""
    text = str(name_or_path)
    if text.lower() in DEVICES:
        return DEVICES[text.lower()]
    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):  # a name longer than a path can be, or with a NUL: no such file
        is_file = False
    if is_file:
        return load_device_spec(text)
    raise MemschedError(f"{where} {text[:80]!r}{'...' if len(text) > 80 else ''}: no such device and no such file; "
                        "known devices are "
                        f"{', '.join(DEVICES)}, or give a {DEVICE_FORMAT} JSON file (docs/formats.md, "
                        "\"Device specs\")")


def load_device_spec(path) -> DeviceSpec:
    """Read a ``memsched.device/1`` file: every figure checked, one line naming a field that is wrong."""
    data = read_json(path)
    validate.document(data, "device", 1, _FIELDS, str(path))
    return device_from_dict(data, str(path))


def device_from_dict(data: dict, where: str) -> DeviceSpec:
    """A :class:`DeviceSpec` from a dict of the file's fields (``format`` left out of the check)."""
    def field(key):
        return f"{where}: {key}"

    name = validate.text(validate.require(data, "name", where), field("name")).strip()
    if not name:
        raise MemschedError(f"{field('name')} is empty; name the device (e.g. \"h100-80gb\")")
    allocator = validate.require(data, "allocator", where)
    if allocator not in ALLOCATORS:
        raise MemschedError(f"{field('allocator')} must be \"cuda\" (PyTorch's caching allocator) or \"cpu\", "
                            f"got {allocator!r}")
    return DeviceSpec(
        name=name, memory_bytes=_memory(validate.require(data, "memory_bytes", where), field("memory_bytes")),
        bf16_flops=_flops(validate.require(data, "bf16_flops", where), field("bf16_flops")),
        fp32_flops=_flops(validate.require(data, "fp32_flops", where), field("fp32_flops")),
        memory_bandwidth=_rate(validate.require(data, "memory_bandwidth", where), field("memory_bandwidth")),
        d2h_bandwidth=_rate(validate.require(data, "d2h_bandwidth", where), field("d2h_bandwidth")),
        h2d_bandwidth=_rate(validate.require(data, "h2d_bandwidth", where), field("h2d_bandwidth")),
        allocator=allocator, source=validate.text(data.get("source", ""), field("source")),
        op_overhead_s=_overhead(data.get("op_overhead_s", 0.0), field("op_overhead_s")),
        compute_capability=_capability(data.get("compute_capability"), allocator, field("compute_capability")))


def _memory(value, where: str) -> int:
    """Bytes of device memory: a whole number or a string with a unit ("80GiB"), at least :data:`MIN_MEMORY`."""
    if isinstance(value, str):
        value = parse_budget(value, what=where)
    elif isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        raise MemschedError(f"{where} must be a whole number of bytes (or a string such as \"80GiB\"), got {value!r}")
    value = validate.non_negative_bytes(value, where)
    if value < MIN_MEMORY:
        raise MemschedError(f"{where} = {value} bytes is below 1 MiB, smaller than any device that trains a model; "
                            "give the device's memory in bytes (80GiB is 85899345920)")
    return value


def _flops(value, where: str) -> float:
    """Peak FLOP/s, a number (1e15, not "1 PFLOPS")."""
    if isinstance(value, str):
        raise MemschedError(f"{where} must be a number of FLOP/s (e.g. 9.895e14), got the string {value!r}")
    return validate.throughput(value, where)


def _rate(value, where: str) -> float:
    """Bytes per second: a number, or a string with a unit ("3.35TB/s")."""
    if isinstance(value, str):
        return parse_bandwidth(value, where)
    return validate.bandwidth(value, where)


def _overhead(value, where: str) -> float:
    """Seconds per operation: a number, 0 or more, under a second (a kernel launch is microseconds)."""
    if isinstance(value, str):
        raise MemschedError(f"{where} must be a number of seconds per operation (e.g. 5e-06), got the string "
                            f"{value!r}")
    value = validate.non_negative_seconds(value, where)
    if value >= 1:
        raise MemschedError(f"{where} = {value:g} seconds per operation is no device's (a launch takes "
                            "microseconds): give seconds, e.g. 5e-06")
    return value


def _capability(value, allocator: str, where: str):
    """A CUDA device's compute capability, "MAJOR.MINOR" ("9.0"), or None when left out."""
    if value is None:
        return None
    if allocator != "cuda":
        raise MemschedError(f"{where} is a CUDA device's; a \"{allocator}\" device has none: leave it out")
    if not isinstance(value, str) or not _CAPABILITY.fullmatch(value):
        raise MemschedError(f"{where} must be a string \"MAJOR.MINOR\" as nvidia-smi --query-gpu=compute_cap "
                            f"prints it (\"9.0\" for an H100, \"8.0\" for an A100), got {value!r}")
    return value


# Seconds the host takes to launch one CUDA kernel from PyTorch's eager mode: the low end of the 5-20 us that Meta's
# Holistic Trace Analysis documentation ("CUDA kernel launch statistics") gives as the usual CPU-side launch time.
# A kernel shorter than its launch leaves the device waiting: each operation takes at least this long.
LAUNCH_S = 5e-6
_LAUNCH = ("; a kernel launch 5 us: the low end of the usual 5-20 us CPU-side launch time (Holistic Trace "
           "Analysis documentation, CUDA kernel launch statistics)")


def _pcie(gigabytes_per_second: float, name: str, memory_gib: int, bf16_tflops: float, fp32_tflops: float,
          bandwidth_gbps: float, source: str, capability: str) -> DeviceSpec:
    """A CUDA board on PCIe whose data sheet gives the link's both directions together (``gigabytes_per_second``):
    half of it each way; ``capability``: its compute capability (NVIDIA's CUDA GPUs table); each operation at
    least a kernel launch (:data:`LAUNCH_S`)."""
    each_way = gigabytes_per_second * GIGA / 2
    return DeviceSpec(name, memory_gib * GIB, bf16_tflops * TERA, fp32_tflops * TERA, bandwidth_gbps * GIGA,
                      each_way, each_way, "cuda", source + _LAUNCH, LAUNCH_S, compute_capability=capability)


_H100 = "NVIDIA H100 Tensor Core GPU data sheet (2023): BF16 1,979 TFLOPS with sparsity"
_A100 = "NVIDIA A100 Tensor Core GPU data sheet (2021): BF16 624 TFLOPS with sparsity"
_DEVICES = (
    _pcie(128, "h100-80gb", 80, 989.5, 67, 3350, f"{_H100} (SXM); FP32 67 TFLOPS; HBM3 3.35 TB/s; PCIe Gen5 128 GB/s",
          "9.0"),
    _pcie(128, "h100-pcie-80gb", 80, 756.5, 51, 2000,
          "NVIDIA H100 Tensor Core GPU data sheet (2023), H100 PCIe: BF16 1,513 TFLOPS with sparsity; FP32 51 "
          "TFLOPS; HBM2e 2 TB/s; PCIe Gen5 128 GB/s", "9.0"),
    _pcie(128, "h200-141gb", 141, 989.5, 67, 4800,
          "NVIDIA H200 Tensor Core GPU data sheet (2024), H200 SXM: BF16 1,979 TFLOPS with sparsity; FP32 67 TFLOPS; "
          "HBM3e 4.8 TB/s; PCIe Gen5 128 GB/s", "9.0"),
    _pcie(64, "a100-80gb", 80, 312, 19.5, 2039, f"{_A100}; FP32 19.5 TFLOPS; A100 80GB SXM HBM2e 2,039 GB/s; "
          "PCIe Gen4 64 GB/s", "8.0"),
    _pcie(64, "a100-40gb", 40, 312, 19.5, 1555, f"{_A100}; FP32 19.5 TFLOPS; A100 40GB HBM2 1,555 GB/s; "
          "PCIe Gen4 64 GB/s", "8.0"),
    _pcie(64, "l4", 24, 121, 30.3, 300,
          "NVIDIA L4 Tensor Core GPU data sheet (2023): BF16 242 TFLOPS with sparsity; FP32 30.3 TFLOPS; GDDR6 "
          "300 GB/s; PCIe Gen4 x16 64 GB/s", "8.9"),
    _pcie(64, "rtx-4090", 24, 165.2, 82.6, 1008,
          "NVIDIA Ada GPU Architecture whitepaper (v2.02), GeForce RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS "
          "dense (twice that with sparsity); FP32 82.6 TFLOPS; GDDR6X 1,008 GB/s; PCIe Gen4 x16 64 GB/s", "8.9"),
)
DEVICES = {spec.name: spec for spec in _DEVICES}
