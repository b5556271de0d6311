"""A rapid-mode engine pinned to a GPU other than the first (CUDA_VISIBLE_DEVICES=1) under its own MPS daemon.

On 2 x H200 (2026-11-29) such a server's decode worker found no GPU and ran the model on the CPU: the private
daemon had inherited CUDA_VISIBLE_DEVICES=1 and renumbered that GPU as 0, so the workers' request for GPU 1 was
invalid under MPS. The test forces it: a child process pinned to GPU 1, MPS "on" with a private daemon (the
default pipe folder pointed at an empty one), and asserts the workers ran on the GPU under MPS and answered as
`LLM` does on that GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

CHILD = r'''
import asyncio, dataclasses, json, sys
from rapidserve import LLM, SamplingParams
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config

PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + i)] for i in range(4)]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm = LLM("preset:tiny-llama", dtype="float32", device="cuda", show_progress=False, max_model_len=256,
          num_kv_blocks=64)
want = [o.outputs[0].token_ids for o in llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)]
del llm

async def main():
    cfg, _ = build_engine_config("preset:tiny-llama", dtype="float32", num_kv_blocks=64, max_model_len=256)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode="rapid", mps="on", startup_timeout_s=300))
    e = await AsyncEngine.start(cfg)
    try:
        got = []
        for i, p in enumerate(PROMPTS):
            got.append([t.token_id async for t in e.generate(f"r{i}", p, params)])
        return {"device": e.workers.ready["decode"].info["device"], "mps_active": e.mps_plan.active,
                "mps_ours": e.mps_plan.started_by_us, "same": got == want}
    finally:
        await e.shutdown()

print("RESULT " + json.dumps(asyncio.run(main())))
'''


@pytest.mark.gpu
def test_rapid_engine_on_the_second_gpu_under_its_own_mps_daemon_two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    no_daemon = tempfile.mkdtemp(prefix="rs-no-mps-")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PIPE_DIRECTORY": no_daemon}
    env.pop("CUDA_MPS_LOG_DIRECTORY", None)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(no_daemon, ignore_errors=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got == {"device": "cuda:0", "mps_active": True, "mps_ours": True, "same": True}, got
