"""`rapidserve bench`: a load generator and report for any OpenAI-compatible server (issue 6).

Modules by concept: `arrivals` (when requests are released), `workloads` (what is sent), `traces` (reading Azure and
Mooncake trace files), `replay` (a trace's window, arrivals, prompts from hash ids, ideal prefix-cache hit rate),
`client` (streamed HTTP requests and their timings), `stats` (per-request records, percentiles, per-rate SLO goodput),
`serving_result` (a run as vLLM's `bench serve` reports it: its printed table and its --save-result JSON), `progress`
(a progress bar per run), `runner` (a load sweep: `BenchConfig` -> result dict), `goodput` (the papers' goodput and the
pure steps of its rate search), `sustain` (probes judged at a load the server sustains: each probe's warm-up past the
ramp of requests in flight, the ramp rule, and above a server's closed-loop peak their length), `backlog` (the backlog
rule that fails a load the server did not sustain), `search` (the search loop), `search_run` (its run against a
server), `results` (reading a result), `step_mix` (a rapidserve server's steps by shape kind over a run, from its
/metrics), `report` (a sweep's JSON and markdown), `goodput_report` (a search's), `plot` (throughput / p99 ITL / p99
TTFT against offered load, and goodput against the ITL bound, one line per system), `save` (what is written where: only
where asked), `flags`, `search_flags` and `vllm_flags` (argument types, the search's flags, vLLM `bench serve`'s flag
names), `cli`.

In-process use (as bench/compare.py does):

    import asyncio
    from rapidserve.benchmark import BenchConfig, WorkloadSpec, run_benchmark, write_outputs
    cfg = BenchConfig(base_url="http://127.0.0.1:8000", workload=WorkloadSpec("fixed", 4096, 64),
                      rates=(1.0, 2.0, float("inf")), num_prompts=32, label="rapid")
    result = asyncio.run(run_benchmark(cfg))
    write_outputs(result, "out", "rapid_4096-64")

    from rapidserve.benchmark.search_config import SearchConfig
    from rapidserve.benchmark.search_run import run_goodput_search
    found = asyncio.run(run_goodput_search(cfg, SearchConfig(budget_s=300)))  # cfg.num_prompts per probe
"""

from rapidserve.benchmark.report import load_result, to_markdown, write_outputs
from rapidserve.benchmark.runner import BenchConfig, run_benchmark
from rapidserve.benchmark.workloads import WorkloadSpec

__all__ = ["BenchConfig", "WorkloadSpec", "load_result", "run_benchmark", "to_markdown", "write_outputs"]
