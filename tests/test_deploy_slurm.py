"""deploy/slurm/rapidserve.sbatch under a real single-node Slurm, serving the embedded model on CPU.

The fixture starts munged, slurmctld and slurmd from Debian's packages with a generated slurm.conf
and munge key in a private folder (own ports, own sockets: nothing system-wide is touched), submits
the script, waits for /health, gets one completion, cancels the job with scancel and checks that
the servers drained and exited 0 and that nothing of the job is left: no process, no /dev/shm
entry. The teardown stops the daemons and checks they are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "slurm" / "rapidserve.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "squeue", "scontrol", "sinfo")
NODE = "rsnode"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 90.0

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], bool], timeout: float, what: str, detail: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{detail()}")
        time.sleep(0.5)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class Proc:
    pid: int
    cmd: str
    env: dict[str, str]


def cluster_processes(conf: Path) -> list[Proc]:
    """Live processes started by the test cluster: their environment has SLURM_CONF=conf (the daemons,
    slurmstepd, and the jobs, which inherit the submitting environment)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not pid_alive(int(entry)):
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        env = dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)
        if env.get("SLURM_CONF") == str(conf):
            found.append(Proc(int(entry), cmd.strip(), env))
    return found


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e})"


@dataclass
class Cluster:
    root: Path
    conf: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "-o", "show", "job", job, check=False)
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "UNKNOWN"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{tail(p, 30)}" for p in sorted((self.root / "log").glob("*.log")))


def start_cluster(root: Path) -> Cluster:
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    (root / "munge").chmod(0o711)  # the socket's folder must be searchable by clients
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.sock"
    user = pwd.getpwuid(os.getuid()).pw_name
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=rapidserve-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={sock}",
        "CredType=cred/munge",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",  # no cgroups needed
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "KillWait=60",  # above the script's drain wait (RAPIDSERVE_STOP_TIMEOUT, 25 s)
        f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
        f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAPIDSERVE_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = Cluster(root, conf, env)
    out = (root / "log" / "daemons.out").open("ab")
    cluster.daemons["munged"] = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
         f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed",
         f"--log-file={root}/log/munged.log"], env=env, stdout=out, stderr=out)
    wait_for(sock.exists, 20, "munged's socket", cluster.logs)
    cluster.daemons["slurmctld"] = subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                                    stdout=out, stderr=out)
    cluster.daemons["slurmd"] = subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", NODE], env=env,
                                                 stdout=out, stderr=out)
    wait_for(lambda: cluster.run("sinfo", "-h", "-n", NODE, "-o", "%t", check=False).strip() == "idle", 60,
             "the node to be idle", cluster.logs)
    return cluster


def stop_cluster(cluster: Cluster) -> list[Proc]:
    """Cancel what is left, wait for the job processes to end (SIGKILL after KillWait), stop the
    daemons. Returns the job processes that had to be killed here."""
    killed: list[Proc] = []
    if cluster.daemons.get("slurmctld") is not None:
        cluster.run("scancel", "--partition=test", check=False)

        def jobs_left() -> list[Proc]:
            return [p for p in cluster_processes(cluster.conf) if "SLURM_JOB_ID" in p.env or "slurmstepd" in p.cmd]

        deadline = time.monotonic() + 75
        while jobs_left() and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = jobs_left()
        for p in killed:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster.daemons.get(name)
        if proc is None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return killed


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm/munge binaries missing ({', '.join(missing)}): `bash deploy/install.sh --test` "
                    "installs them (as root, with apt)")
    root = Path(tempfile.mkdtemp(prefix="rs-slurm-"))  # short: the munge socket path has a length limit
    c: Cluster | None = None
    try:
        c = start_cluster(root)
        yield c
    finally:
        killed = stop_cluster(c) if c is not None else []
        left = cluster_processes(c.conf) if c is not None else []
        shutil.rmtree(root, ignore_errors=True)
        assert not killed, f"job processes still running at teardown (killed): {killed}"
        assert not left, f"processes of the test cluster still running after teardown: {left}"


def descendants(pids: set[int]) -> set[int]:
    """pids and every live process below them."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = set(pids), list(pids)
    while todo:
        p = todo.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in out:
                out.add(child)
                todo.append(child)
    return out


def shm_entries(pids: set[int]) -> list[str]:
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    pat = re.compile(r"^(?:sem\.)?rapidserve-(\d+)-")
    return [n for n in names if (m := pat.match(n)) and int(m.group(1)) in pids]


def test_sbatch_serves_on_cpu_and_scancel_stops_everything(cluster: Cluster) -> None:
    work = cluster.root / "job"
    work.mkdir()
    port = free_port()
    env = dict(cluster.env)
    env.update({
        "RAPIDSERVE_BIN": f"{sys.executable} -m rapidserve.cli",  # this checkout, whatever is installed
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        "RAPIDSERVE_HOST": "127.0.0.1",
        "RAPIDSERVE_BASE_PORT": str(port),
        "RAPIDSERVE_LOG_DIR": str(work / "logs"),
        "RAPIDSERVE_READY_TIMEOUT": str(int(READY_TIMEOUT_S)),
    })
    cluster_env, cluster.env = cluster.env, env
    try:
        job = cluster.run("sbatch", "--parsable", f"--chdir={work}", f"--output={work}/job-%j.out",
                          str(SCRIPT), "--max-num-seqs", "2").strip().split(";")[0]
    finally:
        cluster.env = cluster_env
    job_out = work / f"job-{job}.out"
    replica_log = work / "logs" / job / "replica-0.log"
    endpoints = work / "logs" / job / "endpoints"

    def report() -> str:
        return (f"job state: {cluster.job_state(job)}\n--- job output ---\n{tail(job_out)}\n"
                f"--- replica log ---\n{tail(replica_log)}\n{cluster.logs()}")

    def ready() -> bool:
        if cluster.job_state(job) in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            raise AssertionError(f"job {job} ended before it was ready\n{report()}")
        return endpoints.exists()

    wait_for(ready, READY_TIMEOUT_S, f"job {job}'s endpoints", report)
    url = f"http://127.0.0.1:{port}"
    assert endpoints.read_text().split() == [url], report()
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        assert r.status == 200
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        completion = json.loads(r.read())
    assert completion["object"] == "text_completion", completion
    assert completion["usage"]["completion_tokens"] >= 1 and completion["choices"][0]["text"], completion

    m = re.search(r"replica 0: pid (\d+)", job_out.read_text())
    assert m, report()
    listed = {int(line.split()[0]) for line in cluster.run("scontrol", "listpids", job).splitlines()[1:]
              if line.split() and line.split()[0].isdigit()}
    job_pids = descendants(listed | {int(m.group(1))})
    assert int(m.group(1)) in job_pids and len(job_pids) >= 3, (job_pids, report())  # script, server, workers
    assert shm_entries(job_pids), "the server's rings should exist while it runs"

    t0 = time.monotonic()
    cluster.run("scancel", job)
    wait_for(lambda: cluster.job_state(job) == "CANCELLED" and not any(pid_alive(p) for p in job_pids),
             STOP_TIMEOUT_S, f"job {job} and its processes to end", report)
    stopped_in = time.monotonic() - t0

    out = job_out.read_text()
    assert "replica 0 exited with code 0" in out, report()
    assert "rapidserve: stopped" in replica_log.read_text(), report()
    left = [p for p in cluster_processes(cluster.conf) if p.env.get("SLURM_JOB_ID") == job or "slurmstepd" in p.cmd]
    assert not left, f"still running after scancel: {left}\n{report()}"
    assert not shm_entries(job_pids), shm_entries(job_pids)
    assert stopped_in < STOP_TIMEOUT_S
