"""bench/soak.py's checks and verdict, and its outputs (soak.json, soak.md, soak.png), all computed from
the report dict that soak.py fills (settings, client counts, counters, samples, processes, shm).

A check is {"name", "ok", "detail"}: ok True or False, or None where it could not be computed (no
server pid, so no memory samples; a counter the server does not expose). The verdict is FAIL when any
check is False.

Memory is judged by each process's private memory (USS: Private_Clean + Private_Dirty from
/proc/PID/smaps_rollup, soak_proc.private_mb), not RSS: RSS counts pages shared with another process,
and the prefill worker's RSS grows while it touches more of the KV pool it maps from the decode worker
(+19% in a soak whose private memory was flat). RSS is reported beside it for information only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import soak_lib as sl

Check = dict[str, Any]
MEM_ABS_TOL_MB = 2.0  # small processes (the resource tracker) move by a page or two
FD_ABS_TOL = 2
SOCKET_ABS_TOL = 2


def _check(name: str, ok: bool | None, detail: str, data: Any = None) -> Check:
    c: Check = {"name": name, "ok": ok, "detail": detail}
    if data is not None:
        c["data"] = data
    return c


def phase(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The samples of one phase: 'idle-before', 'load' or 'idle-after'."""
    return [s for s in report.get("samples") or [] if s.get("phase") == name]


def process_series(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pid: its label and (t, private MB) (the samples that have it), (t, RSS MB), (t, non-socket fds),
    (t, fds) series."""
    out: dict[str, dict[str, Any]] = {}
    for s in samples:
        for pid, p in (s.get("procs") or {}).items():
            d = out.setdefault(pid, {"label": p["label"], "uss": [], "rss": [], "files": [], "fds": []})
            if p.get("uss_mb") is not None:
                d["uss"].append((s["t"], p["uss_mb"]))
            d["rss"].append((s["t"], p["rss_mb"]))
            d["files"].append((s["t"], p["fds"] - p["sockets"]))
            d["fds"].append((s["t"], p["fds"]))
    return out


def _flat_detail(f: dict[str, Any], unit: str) -> str:
    if f["ok"] is None:
        return f"not computed ({f['rule']})"
    return (f"{f['first_mean']:.1f} -> {f['last_mean']:.1f} {unit} ({100 * f['change']:+.1f}%), "
            f"{f['rule']}")


def _counter_checks(report: dict[str, Any], sent: int, completion_tokens: int) -> list[Check]:
    counters = report.get("counters") or {}
    cmp = counters.get("compare")
    if cmp is None:
        return [_check("/metrics counters = client counts", False if sent else None,
                       "could not read /metrics before and after the load")]
    out = [_check(f"request_success{{{reason}}} = client", c["ok"],
                  f"server +{c['server']:g} vs client {c['client']}" if c["server"] is not None
                  else f"the server reports no {reason} counter (client {c['client']})")
           for reason, c in cmp.items()]
    delta = counters["delta"]
    gen = delta.get("generation_tokens")
    out.append(_check("generation_tokens covers the completed requests",
                      None if gen is None else gen >= completion_tokens,
                      "not exposed" if gen is None else f"server +{gen:g} >= client {completion_tokens} expected"))
    for key, name in (("engine_restarts", "no engine restarts"), ("worker_deaths", "no worker deaths")):
        n = delta.get(key)
        out.append(_check(name, None if n is None else n == 0,
                          f"{sl.COUNTERS[key]} not exposed" if n is None else f"+{n:g}"))
    return out


def memory_check(label: str, uss: Sequence[tuple[float, float]], rss: Sequence[tuple[float, float]],
                 settings: dict[str, Any]) -> Check:
    """The memory check of one process: its private memory (USS) flat over the load (soak_lib.flatness with
    the run's tolerance, at least MEM_ABS_TOL_MB); its RSS only quoted in the detail, never judged."""
    args = (0.0, settings["duration_s"], settings["warmup_s"])
    r = sl.flatness(rss, *args, rel_tol=settings["flat_tolerance"], abs_tol=MEM_ABS_TOL_MB)
    info = (f"; RSS {r['first_mean']:.1f} -> {r['last_mean']:.1f} MB ({100 * r['change']:+.1f}%, shared pages "
            "included, not judged)" if r["ok"] is not None else "")
    if not uss:
        return _check(f"private memory flat: {label}", None,
                      "not computed (no private memory samples: /proc/PID/smaps_rollup unreadable)" + info)
    f = sl.flatness(uss, *args, rel_tol=settings["flat_tolerance"], abs_tol=MEM_ABS_TOL_MB)
    return _check(f"private memory flat: {label}", f["ok"], _flat_detail(f, "MB") + info, {**f, "rss": r})


def _process_checks(report: dict[str, Any], load: list[dict[str, Any]]) -> list[Check]:
    st = report["settings"]
    series = process_series(load)
    if not series:
        return [_check("memory and fds flat", None, "no server pid: processes not sampled")]
    out: list[Check] = []
    procs = report.get("processes") or {}
    if "gone" in procs:
        out.append(_check("server processes alive at the end", not procs["gone"],
                          f"gone: {procs['gone']}" if procs["gone"] else f"{len(procs['seen'])} processes"))
    for d in series.values():
        out.append(memory_check(d["label"], d["uss"], d["rss"], st))
        g = sl.flatness(d["files"], 0.0, st["duration_s"], st["warmup_s"], rel_tol=st["flat_tolerance"],
                        abs_tol=FD_ABS_TOL)
        out.append(_check(f"non-socket fds flat: {d['label']}", g["ok"], _flat_detail(g, "fds"), g))
    before, after = phase(report, "idle-before"), phase(report, "idle-after")
    if before and after and before[0]["procs"] and after[-1]["procs"]:
        sb = sum(p["sockets"] for p in before[0]["procs"].values())
        sa = sum(p["sockets"] for p in after[-1]["procs"].values())
        out.append(_check("sockets back to idle", sa <= sb + SOCKET_ABS_TOL, f"{sb} before the load, {sa} after"))
    return out


def _shm_checks(report: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    before, after = phase(report, "idle-before"), phase(report, "idle-after")
    if before and after:
        b, a = before[0]["shm"], after[-1]["shm"]
        named = "entries named after the server's pids" if before[0].get("procs") else "entries (no pid: all)"
        key = "server" if before[0].get("procs") else "total"
        out.append(_check("/dev/shm not growing", a[key] <= b[key],
                          f"{named}: {b[key]} -> {a[key]}; all entries {b['total']} -> {a['total']}, "
                          f"sem.* {b['sem']} -> {a['sem']}, sem.mp-* {b['sem_mp']} -> {a['sem_mp']}"))
    ex = report.get("server_exit")
    if ex is not None:
        ok = ex["code"] == 0 and not ex["still_running"]
        out.append(_check("launched server exits 0 on SIGTERM", ok,
                          f"exit code {ex['code']}" + (f", still running: {ex['still_running']}"
                                                       if ex["still_running"] else "")))
    se = report.get("shm_after_exit")
    if se is not None:
        left = se["left_by_server"]
        out.append(_check("/dev/shm clean after exit", not left,
                          f"left behind: {left}" if left else
                          f"{se['before_launch']} entries before launch, {se['after_exit']} after exit"
                          + (f" (new, not the server's: {se['new']})" if se["new"] else "")))
    return out


def evaluate(report: dict[str, Any]) -> list[Check]:
    """Every check of a soak report."""
    st = report["settings"]
    checks: list[Check] = []
    if report.get("error"):
        checks.append(_check("the soak ran", False, report["error"]))
    client = report.get("client") or {}
    sent, failed, skipped = client.get("sent", 0), client.get("failed", 0), client.get("skipped_at_cap", 0)
    checks.append(_check("requests sent", sent > 0, f"{sent} sent"))
    kinds = "; ".join(f"{k} x{n}" for k, n in (client.get("failed_by_kind") or {}).items())
    checks.append(_check("failed requests", failed <= st["max_failed_fraction"] * sent if sent else None,
                         f"{failed} of {sent} failed" + (f" ({kinds})" if kinds else "")))
    arrivals = sent + skipped
    checks.append(_check("arrivals skipped at the concurrency cap",
                         skipped <= st["max_skipped_fraction"] * arrivals if arrivals else None,
                         f"{skipped} of {arrivals} (cap {st['concurrency']})"))
    checks += _counter_checks(report, sent, client.get("completion_tokens", 0))
    load = phase(report, "load")
    health = [s.get("health") for s in load]
    checks.append(_check("/health 200 at every sample", all(h == 200 for h in health) if health else None,
                         f"{sum(h == 200 for h in health)} of {len(health)} samples"
                         + (f"; other answers: {sorted({str(h) for h in health if h != 200})}"
                            if any(h != 200 for h in health) else "")))
    readable = [s.get("metrics") is not None for s in load]
    checks.append(_check("/metrics readable at every sample", all(readable) if readable else None,
                         f"{sum(readable)} of {len(readable)} samples"))
    checks += _process_checks(report, load)
    checks += _shm_checks(report)
    return checks


def verdict(report: dict[str, Any]) -> tuple[bool, list[str]]:
    """(passed, reasons): the failed checks, or a one-line summary when none failed."""
    checks = report.get("checks") or evaluate(report)
    bad = [f"{c['name']}: {c['detail']}" for c in checks if c["ok"] is False]
    if bad:
        return False, bad
    skipped = [c["name"] for c in checks if c["ok"] is None]
    client = report.get("client") or {}
    line = (f"{client.get('sent', 0)} requests over {report['settings']['duration_s']:g} s at "
            f"{report.get('rate_rps') or 0:.3f} requests/s; {sum(c['ok'] is True for c in checks)} checks passed")
    return True, [line + (f", not computed: {', '.join(skipped)}" if skipped else "")]


# ---------------------------------------------------------------- outputs


def markdown(report: dict[str, Any]) -> str:
    """The tables: checks, processes, counts."""
    st, client = report["settings"], report.get("client") or {}
    server = report.get("server") or {}
    lines = [f"## Soak of {report.get('url', '?')} ({server.get('model', '?')}): {st['duration_s']:g} s at "
             f"{report.get('rate_rps') or 0:.3f} requests/s", ""]
    probe = report.get("capacity_probe")
    if probe:
        lines += [f"Capacity probe: {probe['capacity_rps']:.3f} requests/s at concurrency {probe['concurrency']} "
                  f"({probe['completed']} completed in {probe['duration_s']:g} s); load fraction "
                  f"{st['load_fraction']:g}.", ""]
    lines += ["| check | result | detail |", "|---|---|---|"]
    for c in report.get("checks") or []:
        mark = {True: "pass", False: "**FAIL**", None: "-"}[c["ok"]]
        lines.append(f"| {c['name']} | {mark} | {c['detail']} |")
    series = process_series(phase(report, "load"))
    if series:
        lines += ["", "| process | pid | private first -> last (MB) | private max (MB) | RSS first -> last (MB, "
                  "information) | fds first -> last | sockets max |", "|---|---|---|---|---|---|---|"]
        for pid, d in series.items():
            uss, rss, fds = [v for _, v in d["uss"]], [v for _, v in d["rss"]], [v for _, v in d["fds"]]
            socks = [f - g for (_, f), (_, g) in zip(d["fds"], d["files"], strict=True)]
            private = f"{uss[0]:.0f} -> {uss[-1]:.0f} | {max(uss):.0f}" if uss else "- | -"
            lines.append(f"| {d['label']} | {pid} | {private} | {rss[0]:.0f} -> {rss[-1]:.0f} | "
                         f"{fds[0]} -> {fds[-1]} | {max(socks)} |")
    cmp = (report.get("counters") or {}).get("compare") or {}
    lines += ["", "| requests | client | server (/metrics delta) |", "|---|---|---|",
              f"| sent | {client.get('sent', 0)} | |"]
    for reason in ("stop", "length", "abort"):
        srv = cmp.get(reason, {}).get("server")
        lines.append(f"| {reason} | {cmp.get(reason, {}).get('client', '-')} | {'-' if srv is None else f'{srv:g}'} |")
    lines += [f"| aborted by kind | {client.get('aborted_by_kind', {})} | |",
              f"| failed | {client.get('failed', 0)} | |",
              f"| skipped at the cap | {client.get('skipped_at_cap', 0)} | |"]
    for f in client.get("failure_samples", [])[:5]:
        lines.append(f"\nfailure at {f['t']:.1f} s: {f['error']}")
    return "\n".join(lines)


def _rates(load: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    ts, vs = [], []
    for a, b in zip(load, load[1:], strict=False):
        dt = b["t"] - a["t"]
        if dt > 0:
            ts.append(b["t"] / 60)
            vs.append((b["client"][key] - a["client"][key]) / dt)
    return ts, vs


def plot(report: dict[str, Any], path: str) -> None:
    """soak.png: private memory (RSS dotted) per process, fds per process, /dev/shm entries, request rates,
    against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = phase(report, "load")
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for d in process_series(load).values():
        line = axes[0].plot([t / 60 for t, _ in d["uss"]], [v for _, v in d["uss"]], label=d["label"])[0]
        axes[0].plot([t / 60 for t, _ in d["rss"]], [v for _, v in d["rss"]], ":", color=line.get_color(),
                     label=f"{d['label']} RSS")
        axes[1].plot([t / 60 for t, _ in d["fds"]], [v for _, v in d["fds"]], label=d["label"])
    axes[0].set_ylabel("private memory (MB; RSS dotted)")
    axes[1].set_ylabel("open fds")
    t = [s["t"] / 60 for s in load]
    for key, name in (("total", "all entries"), ("sem", "sem.*"), ("server", "named after the server's pids")):
        axes[2].plot(t, [s["shm"][key] for s in load], label=name)
    axes[2].set_ylabel("/dev/shm entries")
    for key in ("sent", "completed", "aborted", "failed"):
        axes[3].plot(*_rates(load, key), label=f"client {key}")
    st, sv = [], []
    for a, b in zip(load, load[1:], strict=False):
        if a.get("metrics") and b.get("metrics") and b["t"] > a["t"]:
            done = [sum(v or 0 for k, v in m.items() if k.startswith("success_")) for m in (a["metrics"], b["metrics"])]
            st.append(b["t"] / 60)
            sv.append((done[1] - done[0]) / (b["t"] - a["t"]))
    axes[3].plot(st, sv, "k--", label="server request_success (all reasons)")
    axes[3].set_ylabel("requests/s")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    ok = (report.get("verdict") or {}).get("pass")
    fig.suptitle(f"soak {report.get('url', '')}: {report['settings']['duration_s']:g} s at "
                 f"{report.get('rate_rps') or 0:.2f} req/s - {'PASS' if ok else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict[str, Any], out_dir: str) -> list[str]:
    """soak.json, soak.md and soak.png in `out_dir`; returns the paths written."""
    paths = [os.path.join(out_dir, n) for n in ("soak.json", "soak.md", "soak.png")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(paths[1], "w") as f:
        f.write(markdown(report) + "\n")
    try:
        plot(report, paths[2])
    except Exception as e:  # a plot is a nicety: the JSON and tables are the record
        print(f"soak: no plot ({type(e).__name__}: {e})")
        paths.pop()
    return paths
