"""Green-context partitions on the GPU: the decode and the prefill process get disjoint SM sets.

Two spawned processes open the partition backend as the engine's workers do (`open_streams` with
the role "decode" or "prefill", the same configurations in both). Each one, for every split, reads
the SM count of the green context behind its stream from the driver (`cuStreamGetGreenCtx` +
`cuGreenCtxGetDevResource`) and runs a Triton kernel on that stream whose blocks record the SM they
ran on (`%smid`). The test asserts that, per split, the two processes' SM sets are disjoint, cover
exactly the planned counts, and that the driver agrees.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp

from rapidserve.partition.backend import device_granularity, plan_configurations, static_configuration
from rapidserve.partition.plan import PlanWire, open_streams
from rapidserve.partition.profile import Configuration
from rapidserve.partition_config import PartitionConfig

TIMEOUT_S = 120
BLOCKS_PER_SM = 64  # every SM gets blocks in the first wave: the set observed is the whole partition


def _smid_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out_ptr):  # no annotation: Triton would read it as a parameter type
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    return smid


def _green_sm_count(stream: Any) -> int | None:
    """SMs of the green context behind `stream`, from the driver; None where it cannot say."""
    from cuda.bindings import driver as cu

    try:
        err, gctx = cu.cuStreamGetGreenCtx(stream.cuda_stream)
        if err != cu.CUresult.CUDA_SUCCESS or not int(gctx):
            return None
        err, res = cu.cuGreenCtxGetDevResource(gctx, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
    except (AttributeError, TypeError):  # cuda-bindings older than these calls
        return None
    return int(res.sm.smCount) if err == cu.CUresult.CUDA_SUCCESS else None


def _probe(role: str, configs: list[tuple[str, int, int]], total: int, outbox: Any) -> None:
    """Child: one role's streams for every configuration; per split, (SM ids seen, driver's count)."""
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        wire = PlanWire("cuda-green", [Configuration(*c) for c in configs], configs[0][0])
        backend = open_streams(wire, device, (role,))  # type: ignore[arg-type]
        kernel = _smid_kernel()
        seen: dict[str, tuple[list[int], int | None]] = {}
        for c in backend.configurations:
            if c.decode_units == 0:
                continue
            stream = backend.stream(c.name, role)
            out = torch.full((BLOCKS_PER_SM * total,), -1, dtype=torch.int32, device=device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the fill above lands first
            with torch.cuda.stream(stream):
                kernel[(out.numel(),)](out)
            stream.synchronize()
            assert int(out.min()) >= 0, "a block of the probe did not run"
            seen[c.name] = (sorted(set(out.tolist())), _green_sm_count(stream))
        backend.close()
        outbox.put(("ok", role, seen))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outbox.put(("error", role, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run_both(configs: list[Configuration], total: int) -> dict[str, dict[str, tuple[list[int], int | None]]]:
    ctx = tmp.get_context("spawn")
    outbox = ctx.Queue()
    wire = [(c.name, c.decode_units, c.prefill_units) for c in configs]
    procs = {role: ctx.Process(target=_probe, args=(role, wire, total, outbox), daemon=True)
             for role in ("decode", "prefill")}
    for p in procs.values():  # both at once, as the two workers run
        p.start()
    try:
        replies = [outbox.get(timeout=TIMEOUT_S) for _ in procs]
    finally:
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"{r[1]}: {r[2]}" for r in replies if r[0] != "ok"]
    assert not errors, errors[0]
    return {r[1]: r[2] for r in replies}


@pytest.mark.gpu
def test_decode_and_prefill_processes_get_disjoint_sm_sets_of_the_planned_sizes() -> None:
    device = torch.device("cuda", 0)
    g = device_granularity("cuda-green", device)
    total = int(torch.cuda.get_device_properties(device).multi_processor_count)
    assert g.total == total
    # every split `--partition adaptive` plans by default, and the static:0.25 one
    configs = plan_configurations(g, PartitionConfig().decode_shares)
    static = static_configuration(g, 0.25)
    if static.name not in {c.name for c in configs}:
        configs.append(static)
    splits = [c for c in configs if c.decode_units]
    assert splits
    got = _run_both(configs, total)
    report = []
    for c in splits:
        (dec, dec_n), (pre, pre_n) = got["decode"][c.name], got["prefill"][c.name]
        report.append(f"{c.name}: decode {len(dec)} SMs {dec[:4]}..., prefill {len(pre)} SMs {pre[:4]}...; "
                      f"driver counts {dec_n}/{pre_n}")
        assert not set(dec) & set(pre), f"{c.name}: SMs in both partitions: {sorted(set(dec) & set(pre))}"
        assert len(dec) == c.decode_units, (c.name, len(dec), c.decode_units)
        assert len(pre) == c.prefill_units, (c.name, len(pre), c.prefill_units)
        assert all(0 <= s < total for s in dec + pre)
        for n, want in ((dec_n, c.decode_units), (pre_n, c.prefill_units)):
            assert n is None or n == want, (c.name, n, want)
    print("\n".join(report))
