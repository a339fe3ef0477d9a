"""Known accelerators for `--dry-run-device`: memory, dense peak FLOP/s (bf16, fp32 and, where
the part has FP8 tensor cores, FP8), link bandwidths, and the compute capability the runtime's
own rules read (the plan asks them with it: grouped GEMM, FP8 support).

FLOP/s are the vendors' datasheet numbers (dense, no sparsity); memory is what the driver
reports, of which the plan keeps 2 GiB as headroom for the CUDA context, cuBLAS workspaces
and the allocator's fragmentation. `intra_node` is the per-GPU NVLink (or PCIe) bandwidth
one way; `inter_node` the per-GPU network bandwidth of a typical cluster node (8 GPUs, one
400 Gb/s NIC each for H100/H200, 200 Gb/s for A100). `gpus_per_node` decides which groups
cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GB = 1e9
_MIB = 2**20
_HOPPER = (9, 0)  # sm_90: H100 and H200


@dataclass(frozen=True)
class Device:
    """One accelerator's capacity as the roofline uses it."""

    name: str
    memory_bytes: float
    bf16_flops: float
    """Dense bf16/fp16 tensor-core peak, FLOP/s."""
    fp32_flops: float
    """fp32 peak (TF32 tensor cores where the device has them), FLOP/s."""
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    reserved_bytes: float = 2 * 2**30
    """Held by the CUDA context, cuBLAS workspaces and the allocator's fragmentation."""
    fp8_flops: float | None = None
    """Dense FP8 tensor-core peak, FLOP/s; None where the table has none (no FP8 tensor cores
    before sm_89; MI300X's is not tabulated): its FP8 matmuls are timed at the bf16 peak."""
    compute_capability: tuple[int, int] = field(kw_only=True)
    """(major, minor) as `torch.cuda.get_device_capability` reports it: what the runtime's
    rules read (`moe_experts.grouped_mm_runs`, `fp8.has_fp8_tensor_cores`)."""

    @property
    def usable_bytes(self) -> float:
        """Memory the plan may fill."""
        return self.memory_bytes - self.reserved_bytes


DEVICES: dict[str, Device] = {
    device.name: device
    for device in (
        # Memory as the driver reports it (nvidia-smi's MiB; rocm-smi for MI300X). FP8: the
        # datasheets' dense figures (half the "with sparsity" ones), for the parts with FP8
        # tensor cores (Ada, Hopper, Blackwell; not Ampere, Volta, nor here MI300X, whose
        # FP8 peak is not tabulated). Compute capability: NVIDIA's CUDA GPUs list.
        # H100 SXM (NVIDIA H100 datasheet: 3,958 TFLOPS FP8 with sparsity).
        Device(
            "H100",
            81559 * _MIB,
            989e12,
            494e12,
            450 * _GB,
            50 * _GB,
            fp8_flops=1979e12,
            compute_capability=_HOPPER,
        ),
        # H100 PCIe: 3,026 TFLOPS FP8 with sparsity.
        Device(
            "H100-PCIe",
            81559 * _MIB,
            756e12,
            378e12,
            64 * _GB,
            50 * _GB,
            fp8_flops=1513e12,
            compute_capability=_HOPPER,
        ),
        # The 96 GB H100 (six HBM3 stacks: GH200 Grace Hopper's GPU, and the H100 SXM5 96GB):
        # the H100 SXM's compute (NVIDIA GH200 datasheet: 989 TFLOPS dense bf16, 3,958 FP8
        # with sparsity) and NVLink 4; 96 GiB less the same 0.44% the driver keeps back on
        # the 80 GB part (81,559 of 81,920 MiB).
        Device(
            "H100-96GB",
            97871 * _MIB,
            989e12,
            494e12,
            450 * _GB,
            50 * _GB,
            fp8_flops=1979e12,
            compute_capability=_HOPPER,
        ),
        # H200 SXM: 141 GB HBM3e, the H100's compute and NVLink 4 (NVIDIA H200 datasheet,
        # https://www.nvidia.com/en-us/data-center/h200/: 1,979 TFLOPS bf16 and 3,958 FP8
        # with sparsity).
        Device(
            "H200",
            143771 * _MIB,
            989e12,
            494e12,
            450 * _GB,
            50 * _GB,
            fp8_flops=1979e12,
            compute_capability=_HOPPER,
        ),
        # B200 in an HGX B200 (1,000 W): 2.25 PFLOPS dense bf16, 1.1 PFLOPS dense TF32
        # (NVIDIA Blackwell datasheet, HGX figures halved from sparse; tabulated at
        # https://glennklockwood.com/garden/processors/B200); NVLink 5 at 1.8 TB/s both ways;
        # 180 GB HBM3e, of which nvidia-smi reports 179 GiB (Vultr's HGX B200 overview,
        # https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview);
        # one 400 Gb/s ConnectX-7 per GPU (DGX B200).
        # Dense FP8: 4.5 PFLOPS (the same sources: 9 with sparsity).
        Device(
            "B200",
            183359 * _MIB,
            2250e12,
            1100e12,
            900 * _GB,
            50 * _GB,
            fp8_flops=4500e12,
            compute_capability=(10, 0),
        ),
        Device(
            "A100-80GB",
            81920 * _MIB,
            312e12,
            156e12,
            300 * _GB,
            25 * _GB,
            compute_capability=(8, 0),
        ),
        Device(
            "A100-40GB",
            40960 * _MIB,
            312e12,
            156e12,
            300 * _GB,
            25 * _GB,
            compute_capability=(8, 0),
        ),
        # L40S (Ada; NVIDIA L40S datasheet: 1,466 TFLOPS FP8 with sparsity).
        Device(
            "L40S",
            46068 * _MIB,
            362e12,
            183e12,
            32 * _GB,
            12.5 * _GB,
            fp8_flops=733e12,
            compute_capability=(8, 9),
        ),
        # A10G: Ampere GA102 (sm_86).
        Device(
            "A10G", 23028 * _MIB, 125e12, 31e12, 32 * _GB, 12.5 * _GB, compute_capability=(8, 6)
        ),
        Device(
            "V100-32GB",
            32768 * _MIB,
            125e12,
            15.7e12,
            150 * _GB,
            12.5 * _GB,
            compute_capability=(7, 0),
        ),
        # MI300X (gfx942): ROCm's torch reports HIP's (major, minor), (9, 4), through the same
        # torch.cuda.get_device_capability the runtime's rules read.
        Device(
            "MI300X", 196592 * _MIB, 1307e12, 654e12, 448 * _GB, 50 * _GB, compute_capability=(9, 4)
        ),
    )
}

# Spellings users type for the same parts.
_ALIASES = {
    "H100-SXM": "H100",
    "H100-80GB": "H100",
    "GH200": "H100-96GB",
    "H100-SXM5-96GB": "H100-96GB",
    "H200-SXM": "H200",
    "HGX-B200": "B200",
    "A100": "A100-80GB",
    "A100-SXM": "A100-80GB",
    "V100": "V100-32GB",
}


def find_device(name: str) -> Device:
    """The table's entry for `name` (case-insensitive); ValueError naming the choices."""
    wanted = name.strip().upper()
    for known in list(DEVICES) + list(_ALIASES):
        if known.upper() == wanted:
            return DEVICES[_ALIASES.get(known, known)]
    raise ValueError(
        f"--dry-run-device {name}: not a known device; choose one of {', '.join(DEVICES)}"
    )
