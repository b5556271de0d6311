"""Occupancy a compiled kernel's resources allow: waves per SIMD on CDNA2/CDNA3, warps per SM sub-partition on
Hopper (the control). Pure functions of the numbers the compiler reports; bench/amd_compile_check.py feeds them.

CDNA3 (gfx942, MI300X) and CDNA2 (gfx90a, MI250X), wave64, per the CDNA3 ISA reference and LLVM's AMDGPU
backend (`AMDGPUBaseInfo.cpp`: getNumWavesPerEUWithNumVGPRs, getOccupancyWithNumSGPRs):
- a CU has 4 SIMDs; a SIMD holds at most 8 waves;
- VGPRs: one file of 512 registers per lane per SIMD, shared by the architectural VGPRs and the AGPRs
  (accumulation registers, placed after the VGPRs at a multiple of 4); a wave gets its total rounded up to
  a granule of 8, so waves = 512 // round8(total) (at most 8);
- SGPRs: 800 a SIMD, allocated to a wave in granules of 16 after the trap handler's 16, so waves =
  800 // round16(SGPRs + 16): 80 or fewer for 8 waves, 96 for 7, 112 for 6 (the LLVM in Triton 3.9's wheel,
  its `occupancy()` expression with the SGPR budget and trap reserve; the older rule, 8 waves up to 100 SGPRs,
  disagrees with it: a gfx942 compile of _route_kernel with 82 SGPRs and VGPRs for 8 waves reports 7);
- LDS: 64 KiB per CU, shared by the workgroups resident on it; a workgroup's waves spread over the 4 SIMDs.
  Triton allocates LDS dynamically (at launch: the compiled kernel's `metadata.shared`), so the code object's
  `group_segment_fixed_size` and LLVM's "; Occupancy:" line see 0 bytes and leave LDS out; this module does not.

Hopper (sm_90, H100): 64 K registers and 228 KiB shared memory per SM (1 KiB of it reserved per block), 64
warps and 32 blocks per SM at most, 4 sub-partitions; registers are allocated per warp in units of 256.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cdna:
    name: str
    max_waves_per_simd: int = 8
    vgprs_per_lane: int = 512
    vgpr_granule: int = 8
    sgprs_per_simd: int = 800
    sgpr_granule: int = 16
    sgpr_trap_reserve: int = 16  # a wave's SGPRs for the trap handler, counted before the granule
    lds_per_cu: int = 64 * 1024
    simds_per_cu: int = 4


CDNA: dict[str, Cdna] = {"gfx942": Cdna("CDNA3"), "gfx90a": Cdna("CDNA2")}


@dataclass(frozen=True)
class Occupancy:
    waves: int  # waves per SIMD (AMD) / warps per SM sub-partition (NVIDIA) the resources allow
    limiter: str  # which resource sets it ("-" when none is below the hardware's maximum)
    by: dict[str, int]  # each resource's own limit


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def total_vgprs(arch_vgprs: int, agprs: int) -> int:
    """Unified register file: the AGPRs start at the first multiple of 4 after the architectural VGPRs."""
    return _round_up(arch_vgprs, 4) + agprs if agprs else arch_vgprs


def vgpr_waves(total: int, spec: Cdna) -> int:
    if total < spec.vgpr_granule:
        return spec.max_waves_per_simd
    return max(1, min(spec.max_waves_per_simd, spec.vgprs_per_lane // _round_up(total, spec.vgpr_granule)))


def sgpr_waves(sgprs: int, spec: Cdna) -> int:
    """GFX9 family (gfx90a, gfx942 included): the SIMD's SGPRs over a wave's, its own and the trap handler's
    rounded up to the granule (at most 8 waves: 80 SGPRs or fewer; 96 for 7, 112 for 6)."""
    per_wave = _round_up(sgprs + spec.sgpr_trap_reserve, spec.sgpr_granule)
    return max(1, min(spec.max_waves_per_simd, spec.sgprs_per_simd // per_wave))


def lds_waves(lds_bytes: int, num_warps: int, spec: Cdna) -> int:
    """Waves per SIMD that the CU's LDS lets in: resident workgroups x their waves / 4 SIMDs (0: the kernel
    asks for more LDS than a CU has and cannot launch)."""
    if lds_bytes <= 0:
        return spec.max_waves_per_simd
    groups = spec.lds_per_cu // lds_bytes
    if groups == 0:
        return 0
    return min(spec.max_waves_per_simd, max(1, groups * num_warps // spec.simds_per_cu))


def cdna_occupancy(arch_vgprs: int, agprs: int, sgprs: int, lds_bytes: int, num_warps: int,
                   spec: Cdna) -> Occupancy:
    by = {"vgpr": vgpr_waves(total_vgprs(arch_vgprs, agprs), spec), "sgpr": sgpr_waves(sgprs, spec),
          "lds": lds_waves(lds_bytes, num_warps, spec)}
    return _pick(by, spec.max_waves_per_simd)


@dataclass(frozen=True)
class Hopper:
    regs_per_sm: int = 64 * 1024
    reg_unit: int = 256  # per warp
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    sub_partitions: int = 4


def hopper_occupancy(regs: int, shared_bytes: int, num_warps: int, spec: Hopper = Hopper()) -> Occupancy:
    """Warps per SM sub-partition (of at most 16), from whole blocks of `num_warps` warps."""
    per_warp = _round_up(max(regs, 1) * 32, spec.reg_unit)
    blocks = {"regs": spec.regs_per_sm // (per_warp * num_warps),
              "smem": spec.smem_per_sm // (shared_bytes + spec.smem_reserved_per_block),
              "blocks": spec.max_blocks_per_sm, "warps": spec.max_warps_per_sm // num_warps}
    most = spec.max_warps_per_sm // spec.sub_partitions
    by = {k: min(most, b * num_warps // spec.sub_partitions) for k, b in blocks.items() if k != "warps"}
    return _pick(by, min(most, blocks["warps"] * num_warps // spec.sub_partitions))


def _pick(by: dict[str, int], most: int) -> Occupancy:
    waves = min(most, *by.values())
    limiter = "-" if waves == most else ",".join(k for k, v in by.items() if v == waves)
    return Occupancy(waves, limiter, by)
