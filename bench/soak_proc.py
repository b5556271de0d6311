"""bench/soak.py's process and shared-memory probes (split from soak_lib.py): a server's process tree and each
process's kind, private memory (USS, from smaps_rollup) and fds, the pid listening on a port, and the /dev/shm entries
a soak attributes to the server or finds held by another program.

Plain functions of their arguments that read /proc and /dev/shm only, so tests/test_soak.py checks them without a
server.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

SHM_DIR = "/dev/shm"


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
