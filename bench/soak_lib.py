"""bench/soak.py's parts that need no server: the Prometheus text parser, the checks' arithmetic
(flatness, capacity, counter comparison), the request mix, and the /proc and /dev/shm probes.

Everything here is a plain function of its arguments (the probes read /proc and /dev/shm only), so
tests/test_soak.py checks it without a server.
"""

from __future__ import annotations

import glob
import math
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

SHM_DIR = "/dev/shm"

# ---------------------------------------------------------------- Prometheus text format

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"n": "\n", '"': '"', "\\": "\\"}

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), text)


def parse_prometheus(text: str) -> Series:
    """Every sample of a Prometheus text exposition: {(name, sorted label pairs): value}.

    Comments (# HELP/# TYPE) and blank lines are skipped; a line that is not a sample raises ValueError
    naming it. Values may be NaN or +Inf/-Inf; an optional timestamp is ignored.
    """
    out: Series = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"line {n} is not a Prometheus sample: {line[:120]!r}")
        labels: list[tuple[str, str]] = []
        body = m.group(2) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None or lm.end() == pos:
                raise ValueError(f"line {n} has malformed labels: {line[:120]!r}")
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        try:
            value = float(m.group(3))
        except ValueError:
            raise ValueError(f"line {n} has a value that is not a number: {line[:120]!r}") from None
        out[(m.group(1), tuple(sorted(labels)))] = value
    return out


SUCCESS = "vllm:request_success_total"
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total",
            "engine_restarts": "rapidserve:engine_restarts_total",
            "worker_deaths": "rapidserve:engine_worker_deaths_total"}


def soak_counters(series: Series) -> dict[str, float | None]:
    """The counters the soak compares, summed over model names: ``success_<reason>`` for every finished
    reason the server reports, ``prompt_tokens``, ``generation_tokens``, ``engine_restarts``, ``worker_deaths`` (None
    where the server does not expose them)."""
    out: dict[str, float | None] = dict.fromkeys(COUNTERS)
    for (name, labels), v in series.items():
        if name == SUCCESS:
            key = "success_" + dict(labels).get("finished_reason", "")
            out[key] = (out.get(key) or 0.0) + v
        for short, full in COUNTERS.items():
            if name == full:
                out[short] = (out[short] or 0.0) + v
    return out


def counter_delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """after - before per counter (a counter missing before counts from 0; missing after: None)."""
    return {k: (None if v is None else v - (before.get(k) or 0.0)) for k, v in after.items()}


def compare_counts(client: Mapping[str, int], server: Mapping[str, float | None],
                   raced: int = 0) -> dict[str, dict[str, Any]]:
    """Client counts against server counter deltas, per finished reason in `client`
    ({"stop": n, "length": n, "abort": n}): {reason: {"client", "server", "diff", "ok"}}. A reason the
    server has no series for counts 0 when it has others (a label not yet created), else None.

    `raced`: the client's stream aborts (a connection closed after some tokens) whose request the server may
    have finished before it saw the close: such a request is the client's abort and the server's stop or
    length. Up to `raced` aborts may so move: the abort count is short by k <= raced and stop and length are
    over by k between them, never under; then every reason reads ok, and the abort entry says how many raced."""
    family = any(k.startswith("success_") and v is not None for k, v in server.items())
    out: dict[str, dict[str, Any]] = {}
    for reason, n in client.items():
        s = server.get("success_" + reason, 0.0 if family else None)
        diff = None if s is None else s - n
        out[reason] = {"client": n, "server": s, "diff": diff, "ok": diff == 0}
    ends = [r for r in ("stop", "length") if r in out]
    if raced and "abort" in out and all(out[r]["diff"] is not None for r in ("abort", *ends)):
        moved = -out["abort"]["diff"]
        over = [out[r]["diff"] for r in ends]
        if 0 < moved <= raced and all(d >= 0 for d in over) and sum(over) == moved:
            for r in ("abort", *ends):
                out[r]["ok"] = True
            out["abort"]["raced"] = moved
    return out


# ---------------------------------------------------------------- checks' arithmetic


def flatness_windows(t_start: float, t_end: float, warmup_s: float, window_s: float = 300.0) -> dict[str, Any]:
    """The two windows a flatness check compares: after `warmup_s`, the first and last `window_s` when the
    rest of the run spans at least three of them, else its first and last fifth."""
    t0 = t_start + warmup_s
    span = t_end - t0
    if span <= 0:
        return {"first": None, "last": None, "rule": "no time left after the warm-up"}
    w, rule = (window_s, f"first/last {window_s:g} s") if span >= 3 * window_s else (span / 5, "first/last fifth")
    return {"first": (t0, t0 + w), "last": (t_end - w, t_end), "rule": f"{rule} after {warmup_s:g} s warm-up"}


def flatness(points: Sequence[tuple[float, float]], t_start: float, t_end: float, warmup_s: float,
             window_s: float = 300.0, rel_tol: float = 0.05, abs_tol: float = 0.0) -> dict[str, Any]:
    """Whether a series stayed flat: the mean of its last window is within `rel_tol` of its first window's
    mean (or within `abs_tol`, whichever is larger). `points` are (time, value). A window without a
    point takes the nearest point after the warm-up; "ok" is None when there are not two such points."""
    win = flatness_windows(t_start, t_end, warmup_s, window_s)
    res: dict[str, Any] = {"rule": win["rule"], "first_mean": None, "last_mean": None, "change": None, "ok": None}
    if win["first"] is None:
        return res
    (lo1, hi1), (lo2, hi2) = win["first"], win["last"]
    first_pts = [(t, v) for t, v in points if lo1 <= t <= hi1]
    last_pts = [(t, v) for t, v in points if lo2 <= t <= hi2]
    after = [(t, v) for t, v in points if lo1 <= t <= hi2]
    if after and (not first_pts or not last_pts):  # windows shorter than the sample interval
        first_pts, last_pts = first_pts or after[:1], last_pts or after[-1:]
        res["rule"] += " (nearest samples)"
    if not first_pts or not last_pts or first_pts == last_pts:
        res["rule"] += " (too few samples after the warm-up)"
        return res
    first = sum(v for _, v in first_pts) / len(first_pts)
    last = sum(v for _, v in last_pts) / len(last_pts)
    res.update(first_mean=first, last_mean=last)
    res["change"] = (last - first) / first if first else (0.0 if last == first else math.inf)
    res["ok"] = abs(last - first) <= max(rel_tol * abs(first), abs_tol)
    return res


def sustained_rate(finish_times: Iterable[float], t0: float, t1: float, skip_fraction: float = 0.2) -> float:
    """Completions per second over [t0 + skip_fraction * (t1 - t0), t1] (the ramp-up left out)."""
    lo = t0 + skip_fraction * (t1 - t0)
    if t1 <= lo:
        raise ValueError(f"empty window: t0={t0}, t1={t1}, skip_fraction={skip_fraction}")
    return sum(1 for t in finish_times if lo <= t <= t1) / (t1 - lo)


def target_rate(capacity: float, fraction: float) -> float:
    """The soak's arrival rate: `fraction` of the measured capacity (requests/s)."""
    if not capacity > 0:
        raise ValueError(f"the capacity probe measured {capacity:g} requests/s: nothing completed")
    if not 0 < fraction <= 1:
        raise ValueError(f"load fraction {fraction} must be in (0, 1]")
    return capacity * fraction


# ---------------------------------------------------------------- the request mix

# name: ((prompt tokens lo, hi), (max_tokens lo, hi), weight)
BUCKETS: dict[str, tuple[tuple[int, int], tuple[int, int], float]] = {
    "small": ((8, 64), (8, 32), 0.5),
    "medium": ((128, 512), (32, 128), 0.35),
    "long": ((1024, 2048), (128, 256), 0.15),
}
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired", "engineers",
         "watch", "server", "run", "for", "hours", "and", "count", "every", "token", "that", "streams", "past",
         "window", "on", "quiet", "night")

STOP_STRINGS = (".", " the")


@dataclass
class Mix:
    """What the request mix may draw (fractions are of all requests, of streams, of non-streams)."""

    max_model_len: int = 2048
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    stream_fraction: float = 0.5
    chat_fraction: float = 0.0  # 0 where the model has no tokenizer
    stop_fraction: float = 0.0  # requests with stop strings (0 where the model has no tokenizer)
    abort_stream_fraction: float = 0.1
    abort_timeout_fraction: float = 0.05
    abort_timeout_s: tuple[float, float] = (0.1, 0.5)
    token_ids: tuple[int, int] = (100, 5000)


@dataclass
class RequestSpec:
    """One request of the soak."""

    bucket: str
    chat: bool
    stream: bool
    prompt: list[int] | str  # token ids (/v1/completions) or text (chat)
    prompt_tokens: int  # exact for token ids, an estimate for text
    max_tokens: int
    ignore_eos: bool
    temperature: float
    seed: int
    abort_after_tokens: int | None = None  # a stream the client closes after this many tokens
    client_timeout_s: float | None = None  # a non-stream request the client gives up on
    stop: list[str] | None = None  # stop strings (text models): the server ends the request early with "stop"

    def payload(self, model: str) -> dict[str, Any]:
        """The JSON body."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "seed": self.seed, "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.stop:
            body["stop"] = self.stop
        return body

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt"] = self.prompt if isinstance(self.prompt, str) else f"<{len(self.prompt)} token ids>"
        return d


def _pick_bucket(rng: random.Random) -> str:
    names = list(BUCKETS)
    return rng.choices(names, weights=[BUCKETS[n][2] for n in names])[0]


def make_request(rng: random.Random, mix: Mix, allow_aborts: bool = True) -> RequestSpec:
    """Draw one request: bucket, endpoint, stream or not, lengths fitted to the model's context, and
    whether the client will abort it (aborted requests ignore EOS so that they are still running)."""
    bucket = _pick_bucket(rng)
    (plo, phi), (olo, ohi), _ = BUCKETS[bucket]
    pcap = mix.max_prompt_tokens or phi
    ocap = mix.max_output_tokens or ohi
    plen = max(1, min(rng.randint(plo, phi), pcap))
    out = max(1, min(rng.randint(olo, ohi), ocap))
    chat = rng.random() < mix.chat_fraction
    stream = rng.random() < mix.stream_fraction
    room = mix.max_model_len - 1
    if chat:  # text: ~1.3 tokens a word plus the chat template; leave a wide margin
        words = max(1, min(plen, (room - out - 64) // 2))
        prompt: list[int] | str = " ".join(rng.choice(WORDS) for _ in range(words))
        plen_est = 2 * words + 64
    else:
        plen = max(1, min(plen, room - 1))
        prompt = [rng.randrange(*mix.token_ids) for _ in range(plen)]
        plen_est = plen
    out = max(1, min(out, mix.max_model_len - plen_est))
    spec = RequestSpec(bucket, chat, stream, prompt, plen_est, out, ignore_eos=rng.random() < 0.5,
                       temperature=rng.choice((0.0, 0.8)), seed=rng.randrange(1 << 30))
    if allow_aborts and stream and out >= 4 and rng.random() < mix.abort_stream_fraction:
        spec.abort_after_tokens = rng.randint(1, out // 2)
        spec.ignore_eos = True
    elif allow_aborts and not stream and rng.random() < mix.abort_timeout_fraction:
        spec.client_timeout_s = rng.uniform(*mix.abort_timeout_s)
        spec.ignore_eos = True
        spec.max_tokens = max(out, min(ocap, mix.max_model_len - plen_est))
    elif rng.random() < mix.stop_fraction:
        spec.stop = list(STOP_STRINGS)
    return spec


# ---------------------------------------------------------------- processes (/proc) and /dev/shm


def _children_via_stat(pid: int) -> list[int]:
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/<pid>/task/*/children: a child belongs to the thread that
    started it; /proc/*/stat's ppid where the kernel has no children files)."""
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if not files:
        return _children_via_stat(pid) if os.path.exists(f"/proc/{pid}") else []
    kids: list[int] = []
    for path in files:
        try:
            with open(path) as f:
                kids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(kids))


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in out or not os.path.exists(f"/proc/{p}"):
            continue
        out.append(p)
        todo += child_pids(p)
    return out


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def proc_kind(pid: int) -> str:
    """A short name for a process: 'resource_tracker', 'spawned' (a multiprocessing worker) or its comm."""
    try:
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
    except OSError:
        return "?"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "spawn_main" in cmd or "forkserver" in cmd:
        return "spawned"
    try:
        return _read(f"/proc/{pid}/comm").strip()
    except OSError:
        return "?"


_PRIVATE = re.compile(r"^Private_(?:Clean|Dirty|Hugetlb):\s+(\d+)\s+kB", re.M)


def private_kb(smaps: str) -> int | None:
    """Private memory (USS, kB) from the text of /proc/PID/smaps_rollup (or /proc/PID/smaps, whose
    mappings are summed): Private_Clean + Private_Dirty + Private_Hugetlb. None when it holds no such field.
    Pages a process maps together with another (the KV pool the prefill worker maps from the decode
    worker's shared memory, shared libraries) are Shared_*, not counted here: they are in RSS, which is why
    RSS reads as growth while such a mapping is being touched and the process itself grows no memory."""
    fields = _PRIVATE.findall(smaps)
    return sum(int(v) for v in fields) if fields else None


def private_mb(pid: int) -> float | None:
    """The private memory (USS, MB) of `pid` (`private_kb`), from smaps_rollup or, on kernels before 4.14,
    smaps; None when neither can be read (the process is gone, or belongs to another user)."""
    for name in ("smaps_rollup", "smaps"):
        try:
            kb = private_kb(_read(f"/proc/{pid}/{name}"))
        except OSError:
            continue
        if kb is not None:
            return kb / 1024
    return None


def proc_stats(pid: int) -> dict[str, Any] | None:
    """Private memory (USS, MB; None when unreadable: `private_mb`), RSS (MB; shared mappings included, for
    information), open fds, of which sockets, and start time (clock ticks) of `pid`; None once it is gone."""
    try:
        status = _read(f"/proc/{pid}/status")
        stat = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError):
        return None
    if stat and stat[0] == "Z":
        return None
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.M)
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return {"uss_mb": private_mb(pid), "rss_mb": int(m.group(1)) / 1024 if m else 0.0, "fds": len(fds),
            "sockets": sockets, "start": int(stat[19]) if len(stat) > 19 else 0}


def label_processes(root: int, pids: Sequence[int]) -> dict[int, str]:
    """Names for a server's process tree: 'server' for the root, 'worker1', 'worker2', ... for spawned
    workers in the order they started (rapid mode: worker1 is decode, worker2 prefill), else their kind."""
    labels = {root: "server"}
    workers: list[tuple[int, int]] = []
    for p in pids:
        if p == root:
            continue
        kind = proc_kind(p)
        st = proc_stats(p)
        if kind == "spawned":
            workers.append((st["start"] if st else 0, p))
        else:
            labels[p] = f"{kind}-{p}" if kind != "resource_tracker" else "resource_tracker"
    for i, (_, p) in enumerate(sorted(workers), 1):
        labels[p] = f"worker{i}"
    return labels


def pid_listening_on(port: int) -> int | None:
    """The pid of the local process listening on TCP `port` (from /proc/net/tcp{,6} and /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = _read(table).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(os.path.join(fd_dir, fd)) in inodes:
                    return int(fd_dir.split("/")[2])
        except OSError:
            continue
    return None


def shm_entries(shm_dir: str = SHM_DIR) -> list[str]:
    """The names under /dev/shm (segments and ``sem.*`` semaphores)."""
    try:
        return sorted(os.listdir(shm_dir))
    except OSError:
        return []


def attributable(entries: Iterable[str], pids: Iterable[int], mp_sems: bool = True) -> list[str]:
    """The entries a server with these pids may have left: names carrying one of the pids as a
    separate field (``rapidserve-<pid>-...``, ``torch_<pid>_...``), and (with `mp_sems`) multiprocessing's
    ``sem.mp-*``, which carry no pid."""
    pids = list(pids)
    pid_re = re.compile(r"(?:^|[-_.])(" + "|".join(str(p) for p in pids) + r")(?=[-_.]|$)") if pids else None
    return [e for e in entries
            if (mp_sems and e.startswith("sem.mp-")) or (pid_re is not None and pid_re.search(e) is not None)]


def shm_summary(entries: Sequence[str], pids: Iterable[int] = ()) -> dict[str, int]:
    """Counts: all entries, ``sem.*`` ones, ``sem.mp-*`` ones, and those named after one of `pids`."""
    return {"total": len(entries), "sem": sum(e.startswith("sem.") for e in entries),
            "sem_mp": sum(e.startswith("sem.mp-") for e in entries),
            "server": len(attributable(entries, pids, mp_sems=False))}


def held_elsewhere(entries: Iterable[str], pids: Iterable[int], shm_dir: str = SHM_DIR) -> set[str]:
    """The entries that a live process outside `pids` has mapped: in use by another program (another test,
    another server), so not left behind by `pids` whatever the name says (``sem.mp-*`` carry no pid). Matched
    by inode: a POSIX semaphore is mapped under the temporary name it was created as, not its own."""
    inodes: dict[int, str] = {}
    for e in entries:
        try:
            inodes[os.stat(os.path.join(shm_dir, e)).st_ino] = e
        except OSError:  # gone meanwhile
            continue
    mine = {str(p) for p in pids}
    held: set[str] = set()
    for pid in os.listdir("/proc") if inodes else ():
        if not pid.isdigit() or pid in mine:
            continue
        try:
            maps = _read(f"/proc/{pid}/maps")
        except OSError:  # gone, or not ours to read
            continue
        for line in maps.splitlines():
            f = line.split(maxsplit=5)
            if len(f) == 6 and f[5].startswith(shm_dir + "/") and f[4].isdigit() and int(f[4]) in inodes:
                held.add(inodes[int(f[4])])
    return held
