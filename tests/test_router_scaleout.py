"""Scale-out behind vllm-router (PyPI `vllm-router`): three `rapidserve serve` replicas on CPU, as
deploy/router/run_local.sh starts them, behind the router's cache-aware policy.

The replicas serve a tiny model (tiny-llama's shapes, random weights: `--load-format dummy`) with the embedded
model's tokenizer (SmolLM2's, vocabulary and all), so the router tokenizes prompts through /tokenize exactly as
it would for the real model while each request's one forward costs next to nothing: what is measured is the
prefix cache (prompt tokens), which the model's weights do not change.

The workload: 208 completions, 4 in 13 (31%) sharing one of 4 system prompts (the issue's 200 requests, 30% sharing
4 prefixes). It arrives as a steady mix: 16 rounds of 13
requests (one for each system prompt, 9 unique ones between them). Each replica
has a small KV pool (--num-kv-blocks 32: about one round of its share of the traffic), so a system prompt stays
cached on a replica only if it comes back there within about a round. Round-robin sends a round's prompts to one
replica and the next round's to the next (13 is not a multiple of 3), so a replica sees a system prompt every third
round, evicted by then; cache-aware routing (the router tokenizes each prompt through the replicas' vLLM-style
/tokenize and keeps each prefix on one replica) brings it back every round. The hit rate is the replicas' own
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, summed over the three. Each policy gets fresh
prompts (a new seed), so the second run finds nothing of the first in the caches.

Then one replica is killed (SIGKILL) mid-load: no request the survivors took fails, the router retries what the
dead one had, marks it unhealthy within its health-check interval, and sends it nothing after that.

Marked slow: three servers start (about a minute on two loaded CPU cores), then about 200 requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm_router", reason="needs the `test` extra (vllm-router)")
aiohttp = pytest.importorskip("aiohttp")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
POOL_BLOCKS = "32"  # each replica's KV pool: 32 blocks of 16 tokens
ROUNDS = 16  # of the hit-rate workload (208 requests): each system prompt comes back 15 times
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"]


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    url: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def tiny_model_folder(folder: Path) -> Path:
    """A Hugging Face folder of tiny-llama's architecture widened to SmolLM2's vocabulary, with SmolLM2's
    tokenizer: served with --load-format dummy (random weights, no weight file needed)."""
    from rapidserve.loader import resolve_model
    from rapidserve.loader.presets import hf_config_dict, preset_config
    from rapidserve.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))  # the embedded model's
    assert tok is not None
    config = preset_config("tiny-llama").replace(vocab_size=len(tok.hf), name="tiny-llama-smol-vocab")
    (folder / "config.json").write_text(json.dumps(hf_config_dict(config)))
    tok.hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Three servers of the tiny model, started at once (rapid mode, CPU), each on a free port."""
    model = tiny_model_folder(tmp_path_factory.mktemp("model"))
    logs = tmp_path_factory.mktemp("replicas")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONHASHSEED="0")
    env.pop("RAPIDSERVE_API_KEY", None)
    procs = []
    for i in range(3):
        with open(logs / f"replica{i}.log", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rapidserve.cli", "serve", str(model), "--load-format", "dummy",
                 "--device", "cpu", "--port", "0", "--max-model-len", "1024", "--num-kv-blocks", POOL_BLOCKS,
                 "--max-num-seqs", "8"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True))
    out: list[Replica] = []
    try:
        for p in procs:
            assert p.stdout is not None
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                assert line, f"a replica exited with {p.wait()}: see {logs}"
                m = re.search(r"serving .* on (http://\S+)", line)
                if m:
                    out.append(Replica(p, m.group(1)))
                    break
            else:
                raise AssertionError("a replica did not start")
        yield out
    finally:
        for p in procs:  # the whole session: the server and its workers
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    url: str
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        for fam in text_string_to_metric_families(get(self.metrics_url)):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0


def start_router(policy: str, urls: list[str], *extra: str) -> Router:
    port, mport = free_port(), free_port()
    proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                             "--worker-urls", *urls, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
                             "--log-level", "warning", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = Router(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics")
    deadline = time.monotonic() + 60
    while True:
        try:
            get(r.url + "/health")
            return r
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.2)


def stop_router(r: Router) -> None:
    r.proc.terminate()
    r.proc.wait(30)


def workload(seed: int) -> list[str]:
    """ROUNDS rounds of 13 prompts: [system prompt k + question, 2 or 3 unique] for k = 0..3."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [f"System prompt {seed}-{k}: {words(36)}\n" for k in range(4)]  # about 3 blocks each
    unique = iter(f"{i} Unique {seed}: {words(50)}" for i in range(9 * ROUNDS))  # about 4 blocks each
    prompts: list[str] = []
    for _ in range(ROUNDS):
        for k, s in enumerate(systems):
            prompts.append(s + "Question: " + words(3))
            prompts += [next(unique) for _ in range(3 if k == 3 else 2)]
    assert len(prompts) == 13 * ROUNDS and sum(p.startswith("System") for p in prompts) == 4 * ROUNDS
    assert next(unique, None) is None
    return prompts


async def send_all(url: str, prompts: list[str], concurrency: int = 6,
                   on_done: asyncio.Event | None = None, after: int = 0) -> list[int]:
    """POST each prompt (max_tokens 1) in order, `concurrency` at a time; their HTTP statuses (-1: no answer).
    Sets `on_done` once `after` have answered."""
    sem = asyncio.Semaphore(concurrency)
    statuses: list[int] = [0] * len(prompts)
    answered = 0
    async with aiohttp.ClientSession() as s:
        async def one(i: int, p: str) -> None:
            nonlocal answered
            async with sem:
                try:
                    async with s.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 1},
                                      timeout=aiohttp.ClientTimeout(total=300)) as r:
                        await r.read()
                        statuses[i] = r.status
                except aiohttp.ClientError:
                    statuses[i] = -1
                answered += 1
                if on_done is not None and answered >= after:
                    on_done.set()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return statuses


def counts(url: str) -> dict[str, float]:
    """A replica's prefix-cache tokens and finished requests by reason."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(get(url + "/metrics")):
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == "vllm:request_success_total":
                out[s.labels["finished_reason"]] = out.get(s.labels["finished_reason"], 0.0) + s.value
    return out


def hit_rate(replicas: list[Replica], policy: str, seed: int) -> float:
    router = start_router(policy, [r.url for r in replicas])
    try:
        before = [counts(r.url) for r in replicas]
        prompts = workload(seed)
        statuses = asyncio.run(send_all(router.url, prompts))
        assert statuses == [200] * len(prompts), statuses
        decisions = [router.metric("vllm_router_processed_requests_total", worker=r.url) for r in replicas]
    finally:
        stop_router(router)
    after = [counts(r.url) for r in replicas]
    queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                  for a, b in zip(after, before, strict=True))
    hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
               for a, b in zip(after, before, strict=True))
    print(f"{policy}: requests per replica {decisions}, prefix cache hit rate {hits / queries:.3f} "
          f"({hits:.0f} of {queries:.0f} prompt tokens)")
    assert all(d >= len(prompts) / 6 for d in decisions), decisions  # every replica took its share (at least half)
    return hits / queries


def test_cache_aware_routing_at_least_doubles_the_prefix_hit_rate(replicas: list[Replica]) -> None:
    round_robin = hit_rate(replicas, "round_robin", seed=1)
    cache_aware = hit_rate(replicas, "cache_aware", seed=2)
    assert cache_aware >= 2 * round_robin and cache_aware > 0.1, (cache_aware, round_robin)


def test_a_killed_replica_fails_no_request_of_the_survivors(replicas: list[Replica]) -> None:
    """SIGKILL one replica after 10 of 30 requests have answered; then 15 more once the router saw it die."""
    urls = [r.url for r in replicas]
    victim, survivors = replicas[2], replicas[:2]
    router = start_router("cache_aware", urls, "--health-check-interval-secs", "1",
                          "--health-failure-threshold", "1")
    try:
        before = [counts(r.url) for r in survivors]
        rng = random.Random(3)
        load = [f"{i} after a death: " + " ".join(rng.choice(WORDS) for _ in range(30)) for i in range(30)]

        async def phase_a() -> list[int]:
            ten = asyncio.Event()
            task = asyncio.ensure_future(send_all(router.url, load, on_done=ten, after=10))
            await ten.wait()
            victim.proc.kill()  # SIGKILL to the server; its workers see it gone and exit
            return await task

        statuses = asyncio.run(phase_a())
        to_victim = router.metric("vllm_router_processed_requests_total", worker=victim.url)
        failed = sum(s != 200 for s in statuses)
        # a failure can only be a request the router had sent to the dead replica (each counted there)
        assert failed <= to_victim, (statuses, to_victim)
        deadline = time.monotonic() + 30
        while router.metric("vllm_router_worker_health", worker=victim.url) != 0:
            assert time.monotonic() < deadline, "the router did not mark the dead replica unhealthy"
            time.sleep(0.2)
        after_a = [counts(r.url) for r in survivors]
        for b, a in zip(before, after_a, strict=True):  # nothing the survivors took ended in an error or abort
            assert a.get("error", 0) == b.get("error", 0) and a.get("abort", 0) == b.get("abort", 0), (b, a)

        seen = router.metric("vllm_router_processed_requests_total", worker=victim.url)
        more = [f"{i} after the router noticed: " + " ".join(rng.choice(WORDS) for _ in range(30)) for i in range(15)]
        assert asyncio.run(send_all(router.url, more)) == [200] * 15
        assert router.metric("vllm_router_processed_requests_total", worker=victim.url) == seen  # none sent there
        after_b = [counts(r.url) for r in survivors]
        served = sum(b[k] - a.get(k, 0) for a, b in zip(after_a, after_b, strict=True) for k in b
                     if not k.startswith("vllm:"))
        assert served == 15  # the survivors finished every one of them
        print(f"killed {victim.url}: {failed} of 30 requests failed, "
              f"{router.metric('vllm_router_retries_total', route='/v1/completions'):.0f} retried elsewhere")
    finally:
        stop_router(router)
