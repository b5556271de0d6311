"""bench/soak.py's server side: a server the soak launches (`--launch`) and stops, its /health and text-prompt
probes, and the Sampler that reads its processes' memory and fds, /dev/shm, /metrics and /health every
`--sample-interval-s`; SoakError, the reason a soak could not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import signal
import subprocess
import threading
import time
import urllib.parse
from typing import Any

import aiohttp
import soak_lib as sl
import soak_proc as sp
from soak_client import Tally

from rapidserve.benchmark.client import Target


class SoakError(RuntimeError):
    """The soak could not run (server not healthy, nothing measured): a FAIL with this reason."""


class Launched:
    """A server started by the soak (`--launch`): its output goes to `log_path`."""

    def __init__(self, command: str, log_path: str) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.url: str | None = None
        self._found = threading.Event()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            m = re.search(r"serving \S+ on (https?://\S+)", line)
            if m and self.url is None:
                self.url = m.group(1).replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
                self._found.set()
        self._found.set()

    def wait_url(self, timeout_s: float) -> str:
        if not self._found.wait(timeout_s) or self.url is None:
            rc = self.proc.poll()
            raise SoakError(f"the launched server {'exited with ' + str(rc) if rc is not None else 'did not start'}"
                            f" within {timeout_s:g} s (no 'serving NAME on http://HOST:PORT' line; see server.log)")
        return self.url

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM, wait; SIGKILL past `timeout_s` (then None: it did not exit by itself)."""
        rc: int | None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            rc = None
        time.sleep(0.2)
        self.log.close()
        return rc


async def get_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, await r.text()


async def wait_healthy(session: aiohttp.ClientSession, base: str, timeout_s: float) -> None:
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = await get_text(session, base + "/health", 5.0)
            if status == 200:
                return
            last = f"HTTP {status}: {body[:200]}"
        except (aiohttp.ClientError, OSError) as e:
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(1.0)
    raise SoakError(f"{base}/health did not answer 200 within {timeout_s:g} s (last: {last})")


async def text_supported(session: aiohttp.ClientSession, target: Target) -> bool:
    """Whether the server takes text prompts (a model with a tokenizer): one 1-token request."""
    async with session.post(target.base_url + "/v1/completions", headers=target.headers(),
                            json={"model": target.model, "prompt": "Hello", "max_tokens": 1},
                            timeout=aiohttp.ClientTimeout(total=120)) as r:
        await r.read()
        return r.status == 200


class Sampler:
    """Samples of the server's processes, /dev/shm, /metrics and /health, every `interval_s`."""

    def __init__(self, base: str, root_pid: int | None, tally: Tally, t0: float, duration_s: float) -> None:
        self.base, self.root, self.tally, self.t0, self.duration_s = base, root_pid, tally, t0, duration_s
        self.samples: list[dict[str, Any]] = []
        self.labels: dict[int, str] = {}

    async def sample(self, session: aiohttp.ClientSession, phase: str) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 3), "phase": phase}
        try:
            s["health"] = (await get_text(session, self.base + "/health"))[0]
            status, body = await get_text(session, self.base + "/metrics")
            s["metrics"] = sl.soak_counters(sl.parse_prometheus(body)) if status == 200 else None
            if status != 200:
                s["metrics_error"] = f"HTTP {status}"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            s.setdefault("health", None)
            s["metrics"], s["metrics_error"] = None, f"{type(e).__name__}: {e}"[:200]
        pids = sp.process_tree(self.root) if self.root else []
        if not self.labels and pids:
            self.labels = sp.label_processes(self.root or 0, pids)
        procs = {}
        for p in pids:
            st = sp.proc_stats(p)
            if st is not None:
                self.labels.setdefault(p, f"{sp.proc_kind(p)}-{p}")
                procs[str(p)] = {"label": self.labels[p], **st}
        s["procs"] = procs
        s["shm"] = sp.shm_summary(sp.shm_entries(), pids)
        s["client"] = self.tally.snapshot()
        self.samples.append(s)
        return s

    def progress(self, s: dict[str, Any]) -> str:
        c = self.tally
        rss = ", ".join(f"{p['label']} {_mb(p.get('uss_mb'))}/{p['rss_mb']:.0f} MB" for p in s["procs"].values())
        rss = rss or "no pid"
        fds = sum(p["fds"] for p in s["procs"].values())
        return (f"[{s['t']:6.0f}/{self.duration_s:g} s] sent {c.sent} done {sum(c.completed.values())} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(c.completed.items())) or '-'}) "
                f"aborted {sum(c.aborted.values())} failed {sum(c.failed.values())} in flight {c.inflight} | "
                f"private/RSS {rss} | fds {fds} | shm {s['shm']['total']} | health {s['health']}")

    async def run(self, session: aiohttp.ClientSession, interval_s: float, stop: asyncio.Event) -> None:
        """Sample at t0 + k * interval_s (no drift) until `stop`."""
        k = 0
        while not stop.is_set():
            s = await self.sample(session, "load")
            print(self.progress(s), flush=True)
            k = max(k + 1, int((time.monotonic() - self.t0) / interval_s) + 1)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self.t0 + k * interval_s - time.monotonic()))


def _mb(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"


def local_pid(base: str) -> int | None:
    """The pid listening on `base`'s port when the host is this machine's loopback, else None."""
    u = urllib.parse.urlsplit(base)
    if u.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    return sp.pid_listening_on(u.port or (443 if u.scheme == "https" else 80))
