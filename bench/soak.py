"""Soak a server for a long time at ~80% of its capacity and say whether it stayed healthy (issue 13).

    python bench/soak.py --url http://127.0.0.1:8000 --server-pid PID --capacity-probe --duration-s 1800
    python bench/soak.py --launch "rapidserve serve --device cpu --port 0" --rate 1 --duration-s 600 \\
        --check-shm-after-exit --out-dir bench/results/soak

Load: Poisson arrivals (seeded) at `--rate` requests/s, or at `--load-fraction` (0.8) of the completion
rate a `--capacity-probe` measures first (closed loop at `--probe-concurrency` for `--probe-s`). A mix
of small/medium/long prompts and outputs (soak_lib.BUCKETS) as token ids on /v1/completions, and as text
on /v1/chat/completions where the model has a tokenizer (which also gets some requests with stop strings);
streaming and not; client aborts (streams closed after a random number of tokens, non-stream requests
with a short client timeout). At most
`--concurrency` requests in flight (an arrival that finds them all busy is skipped and counted); at the
end of the duration the in-flight ones get `--drain-s` to finish, then are cancelled (client aborts too).

Every `--sample-interval-s`: private memory (USS, from /proc/PID/smaps_rollup), RSS (information only:
it counts pages shared between processes, such as the KV pool the prefill worker maps) and open fds
(sockets apart) of the server process and its descendants
(`--server-pid`, the `--launch`ed process, or the local process listening on the URL's port), /dev/shm
entries, the server's /metrics counters and /health.

Checks (FAIL when any fails): no failed requests (non-2xx, connection errors, streams without [DONE] or
with an error event, other finish reasons); few arrivals skipped at the cap; /metrics'
request_success{stop,length,abort} deltas equal the client's completed-by-reason and aborted counts
(read again for up to `--settle-s` so a late abort can land); generation_tokens delta covers the
completed requests' tokens; no engine restarts or worker deaths; /health 200 at every sample; every process alive at
the end; private memory (not RSS) and non-socket fds flat (soak_lib.flatness); sockets back to their idle count; no new
/dev/shm entries named after the server's pids; with `--launch`: exit 0 on SIGTERM, and with
`--check-shm-after-exit` no /dev/shm entry left behind by it (its pids, or ``sem.mp-*``).

Outputs in --out-dir: soak.json (settings, every sample, counts, checks), soak.md (tables), soak.png,
server.log (with --launch); the verdict line is printed last. Exit 0 PASS, 1 FAIL, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import soak_lib as sl  # noqa: E402
import soak_proc as sp  # noqa: E402
import soak_report  # noqa: E402
from soak_client import Tally, capacity_probe, counters_report, open_loop  # noqa: E402
from soak_server import Launched, Sampler, SoakError, local_pid, text_supported, wait_healthy  # noqa: E402

from rapidserve.benchmark.client import Target, fetch_models  # noqa: E402
from rapidserve.benchmark.flags import base_url_arg, positive_float, positive_int, token_range_arg  # noqa: E402
from rapidserve.redaction import redact_mapping, redact_text, scrub_file, secret_values  # noqa: E402

# ---------------------------------------------------------------- the soak


async def soak(a: argparse.Namespace, launched: Launched | None, report: dict[str, Any]) -> None:
    """Everything up to the final /metrics read; fills `report` as it goes (an error leaves it partial)."""
    base = launched.wait_url(a.launch_timeout_s) if launched else a.url
    report["url"] = base
    tally = Tally()
    report["client"] = tally  # replaced by its JSON at the end
    async with aiohttp.ClientSession() as side:
        await wait_healthy(side, base, a.health_timeout_s)
        models = await fetch_models(side, base, a.api_key)
        if not models:
            raise SoakError(f"{base}/v1/models lists no model")
        model, max_len = str(models[0]["id"]), int(models[0].get("max_model_len") or 2048)
        target = Target(base, model, a.api_key, a.request_timeout_s)
        text = await text_supported(side, target) if a.text == "auto" else a.text == "on"
        root = launched.proc.pid if launched else (a.server_pid or local_pid(base))
        mix = sl.Mix(max_len, a.max_prompt_tokens, a.max_output_tokens, a.stream_fraction,
                     a.chat_fraction if text else 0.0, a.stop_fraction if text else 0.0, a.abort_stream_fraction,
                     a.abort_timeout_fraction, a.abort_timeout_s, a.token_ids)
        report["server"] = {"model": model, "max_model_len": max_len, "text_prompts": text, "pid": root}
        print(f"soak: {redact_text(base)} serving {model} (max_model_len {max_len}, "
              f"text prompts {'yes' if text else 'no'}), "
              f"server pid {root or 'unknown: no memory/fd samples'}", flush=True)
        rate = a.rate
        if a.capacity_probe:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.probe_concurrency + 8)) as ps:
                probe = await capacity_probe(ps, target, mix, a.probe_concurrency, a.probe_s, a.drain_s, a.seed)
            report["capacity_probe"] = probe
            try:
                rate = sl.target_rate(probe["capacity_rps"], a.load_fraction)
            except ValueError as e:
                raise SoakError(str(e)) from None
            await asyncio.sleep(a.settle_s)
        report["rate_rps"] = rate
        t0 = time.monotonic()
        sampler = Sampler(base, root, tally, t0, a.duration_s)
        report["samples"] = sampler.samples
        first = await sampler.sample(side, "idle-before")
        report["shm"] = {"before": sp.shm_entries()}
        print(f"soak: {a.duration_s:g} s of Poisson arrivals at {rate:.3f} requests/s (at most {a.concurrency} "
              f"in flight), a sample every {a.sample_interval_s:g} s", flush=True)
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.concurrency + 8)) as load:
            sampling = asyncio.create_task(sampler.run(side, a.sample_interval_s, stop))
            try:
                await open_loop(load, target, mix, rate, a.duration_s, a.concurrency, a.drain_s, a.seed, tally, t0)
            finally:
                stop.set()
                await sampling
        print(f"soak: load over ({tally.sent} sent); waiting up to {a.settle_s:g} s for the counters to settle",
              flush=True)
        deadline = time.monotonic() + a.settle_s
        await asyncio.sleep(min(2.0, a.settle_s))
        while True:  # an abort the server had not yet seen may land late
            last = await sampler.sample(side, "idle-after")
            report["counters"] = counters_report(first["metrics"], last["metrics"], tally)
            cmp = report["counters"]["compare"]
            if (cmp is not None and all(c["ok"] for c in cmp.values())) or time.monotonic() >= deadline:
                break
            sampler.samples.pop()
            await asyncio.sleep(1.0)
        print(sampler.progress(last), flush=True)
        report["shm"]["after"] = sp.shm_entries()
        load_pids = {int(p) for s in sampler.samples if s["phase"] == "load" for p in s["procs"]}
        first_pids = [int(p) for p in next((s["procs"] for s in sampler.samples if s["phase"] == "load"), {})]
        report["processes"] = {"labels": {str(p): lab for p, lab in sampler.labels.items()},
                               "seen": sorted(load_pids),
                               "gone": [p for p in first_pids if sp.proc_stats(p) is None]}


def finish_launched(a: argparse.Namespace, launched: Launched, report: dict[str, Any], shm_pre: list[str]) -> None:
    """SIGTERM the launched server, wait for its whole tree, and (asked) look for what it left in /dev/shm."""
    pids = set(sp.process_tree(launched.proc.pid)) | {launched.proc.pid}
    pids |= {int(p) for s in report.get("samples") or [] for p in s.get("procs", {})}
    print(f"soak: stopping the launched server (pid {launched.proc.pid}) with SIGTERM", flush=True)
    rc = launched.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(sp.proc_stats(p) is not None for p in pids):
        time.sleep(0.2)
    report["server_exit"] = {"code": rc, "still_running": [p for p in pids if sp.proc_stats(p) is not None]}
    if not a.check_shm_after_exit:
        return
    deadline = time.monotonic() + 10
    while True:  # the resource tracker may unlink a moment after the rest has gone
        after = sp.shm_entries()
        new = sorted(set(after) - set(shm_pre))
        left = sp.attributable(new, pids)
        left = sorted(set(left) - sp.held_elsewhere(left, pids))  # sem.mp-* another program holds: not the server's
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    report["shm_after_exit"] = {"before_launch": len(shm_pre), "after_exit": len(after), "new": new,
                                "left_by_server": left}


# ---------------------------------------------------------------- arguments and main


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} must be a fraction between 0 and 1")
    return v


def _seconds_range(text: str) -> tuple[float, float]:
    m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", text)
    try:
        lo, hi = (float(m.group(1)), float(m.group(2))) if m else (0.0, -1.0)
    except ValueError:
        lo, hi = 0.0, -1.0
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI seconds with 0 < LO <= HI, e.g. 0.1:0.5")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--url", type=base_url_arg, default=None, help="base URL (default http://127.0.0.1:8000)")
    g.add_argument("--launch", metavar="COMMAND", help="start this server command, soak it, SIGTERM it")
    g.add_argument("--server-pid", type=positive_int, help="the server's pid (default: whoever listens on the port)")
    g.add_argument("--check-shm-after-exit", action="store_true",
                   help="with --launch: no /dev/shm entry left behind after the server exits")
    g.add_argument("--api-key", default=None)
    g.add_argument("--launch-timeout-s", type=positive_float, default=600.0)
    g.add_argument("--health-timeout-s", type=positive_float, default=300.0)
    g = p.add_argument_group("load")
    g.add_argument("--duration-s", "--duration", type=positive_float, default=1800.0,
                   help="soak duration, seconds (default 1800)")
    rate = g.add_mutually_exclusive_group(required=True)
    rate.add_argument("--rate", type=positive_float, help="arrival rate, requests/s")
    rate.add_argument("--capacity-probe", action="store_true", help="measure the capacity first, load a fraction")
    g.add_argument("--load-fraction", type=_fraction, default=None, help="with --capacity-probe (default 0.8)")
    g.add_argument("--probe-concurrency", type=positive_int, default=8)
    g.add_argument("--probe-s", type=positive_float, default=30.0)
    g.add_argument("--concurrency", type=positive_int, default=64, help="most requests in flight (default 64)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("request mix")
    g.add_argument("--stream-fraction", type=_fraction, default=0.5)
    g.add_argument("--chat-fraction", type=_fraction, default=0.3, help="text chat requests, if the model has a "
                   "tokenizer")
    g.add_argument("--stop-fraction", type=_fraction, default=0.2, help="requests with stop strings, if the "
                   "model has a tokenizer")
    g.add_argument("--text", choices=("auto", "on", "off"), default="auto", help="text prompts (auto: probe once)")
    g.add_argument("--abort-stream-fraction", type=_fraction, default=0.1, help="streams closed early")
    g.add_argument("--abort-timeout-fraction", type=_fraction, default=0.05, help="non-streams given up on")
    g.add_argument("--abort-timeout-s", type=_seconds_range, default=(0.1, 0.5), help="their client timeout, LO:HI")
    g.add_argument("--max-prompt-tokens", type=positive_int, default=None, help="cap on the buckets' prompts")
    g.add_argument("--max-output-tokens", type=positive_int, default=None, help="cap on the buckets' outputs")
    g.add_argument("--token-ids", type=token_range_arg, default=(100, 5000),
                   help="token-id prompts draw from [LO, HI) (default 100:5000; keep HI <= the vocabulary)")
    g.add_argument("--request-timeout-s", type=positive_float, default=600.0)
    g = p.add_argument_group("samples and checks")
    g.add_argument("--sample-interval-s", type=positive_float, default=10.0)
    g.add_argument("--warmup-s", type=float, default=None, help="left out of flatness (default min(120, 10%%))")
    g.add_argument("--flat-tolerance", type=_fraction, default=0.05)
    g.add_argument("--max-failed-fraction", type=_fraction, default=0.0)
    g.add_argument("--max-skipped-fraction", type=_fraction, default=0.01)
    g.add_argument("--drain-s", type=positive_float, default=60.0, help="in-flight requests' time at the end")
    g.add_argument("--settle-s", type=positive_float, default=10.0, help="wait for the counters to settle")
    g.add_argument("--out-dir", default=os.path.join("bench", "results", "soak"))
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    a = p.parse_args(argv)
    if a.launch is not None:
        try:
            words = shlex.split(a.launch)
        except ValueError as e:
            p.error(f"--launch: {e}")
        if not words:
            p.error("--launch: an empty command")
        if a.url is not None or a.server_pid is not None:
            p.error("--launch: the launched server's URL and pid are used; leave out --url and --server-pid")
    elif a.check_shm_after_exit:
        p.error("--check-shm-after-exit needs --launch (a server this soak starts and stops)")
    a.url = a.url or "http://127.0.0.1:8000"
    if a.load_fraction is not None and not a.capacity_probe:
        p.error("--load-fraction needs --capacity-probe (with --rate, the rate is the load)")
    if a.load_fraction == 0:
        p.error("--load-fraction must be > 0")
    a.load_fraction = 0.8 if a.load_fraction is None else a.load_fraction
    if a.sample_interval_s >= a.duration_s:
        p.error(f"--sample-interval-s {a.sample_interval_s:g} must be shorter than --duration-s {a.duration_s:g}")
    if a.warmup_s is None:
        a.warmup_s = min(120.0, 0.1 * a.duration_s)
    elif not 0 <= a.warmup_s < a.duration_s:
        p.error(f"--warmup-s {a.warmup_s:g} must be >= 0 and shorter than --duration-s {a.duration_s:g}")
    if a.server_pid is not None and not os.path.exists(f"/proc/{a.server_pid}"):
        p.error(f"--server-pid {a.server_pid}: no such process")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    # the settings as recorded: --api-key, a --launch command's secrets, a URL's userinfo as REDACTED
    known = [a.api_key or "", *secret_values(shlex.split(a.launch or ""))]  # also where no flag names them
    report: dict[str, Any] = {"settings": redact_mapping(dict(vars(a)), known), "started": time.strftime("%FT%T%z")}
    launched: Launched | None = None
    shm_pre = sp.shm_entries()
    try:
        if a.launch:
            print(f"soak: launching {report['settings']['launch']}", flush=True)
            launched = Launched(a.launch, os.path.join(a.out_dir, "server.log"))
        asyncio.run(soak(a, launched, report))
    except SoakError as e:
        report["error"] = str(e)
    except Exception as e:  # still a report and a verdict; the traceback for a bug
        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:
        report["error"] = "interrupted"
    finally:
        if launched is not None:
            finish_launched(a, launched, report, shm_pre)
            scrub_file(os.path.join(a.out_dir, "server.log"), known)
    if isinstance(report.get("client"), Tally):
        report["client"] = report["client"].to_json()
    report["checks"] = soak_report.evaluate(report)
    ok, reasons = soak_report.verdict(report)
    report["verdict"] = {"pass": ok, "reasons": reasons}
    paths = soak_report.write(report, a.out_dir)
    print(soak_report.markdown(report))
    print("soak: wrote " + ", ".join(paths), flush=True)
    print(("PASS" if ok else "FAIL") + ": " + "; ".join(reasons), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
