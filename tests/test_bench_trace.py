"""Trace replay, offline: reading the formats (tests/data excerpts), the window, time scaling, Poisson
arrivals, clip/skip counts, prompts from Mooncake hash ids, the ideal prefix-cache hit rate, bad files."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from rapidserve.benchmark.arrivals import arrival_times, rate_rng
from rapidserve.benchmark.replay import ReplayItem, build_replay, hash_block_tokens, ideal_hits, run_key
from rapidserve.benchmark.traces import HASH_BLOCK_TOKENS, TraceError, TraceSpec, load_trace
from rapidserve.benchmark.workloads import WorkloadSpec

DATA = Path(__file__).parent / "data"
CODE = str(DATA / "azure_code_2023_excerpt.csv.gz")
CONV = str(DATA / "azure_conv_2023_excerpt.csv.gz")
MOON = str(DATA / "mooncake_conversation_excerpt.jsonl.gz")


def moon_rows() -> list[dict[str, object]]:
    with gzip.open(MOON, "rt") as f:
        return [json.loads(ln) for ln in f]


def spec(path: str, mml: int | None = None, **kw: object) -> WorkloadSpec:
    return WorkloadSpec("trace", max_model_len=mml, trace=TraceSpec(path, **kw))  # type: ignore[arg-type]


def test_azure_csv() -> None:
    t = load_trace(CODE)
    assert t.format == "azure" and len(t.requests) == 40 and not t.has_hash_ids
    first, second = t.requests[:2]
    assert (first.line, first.t_s, first.input_len, first.output_len) == (2, 0.0, 4808, 10)
    assert second.line == 3 and second.t_s == pytest.approx(0.052) and second.input_len == 3180
    assert t.span_s == pytest.approx(38.264399 - 3.97996)  # 18:17:03.9799600 .. 18:17:38.2643990
    conv = load_trace(CONV)
    assert conv.format == "azure" and len(conv.requests) == 40 and conv.requests[0].output_len == 44
    assert conv.span_s == pytest.approx(24.146296)


def test_mooncake_jsonl() -> None:
    t = load_trace(MOON)
    rows = moon_rows()
    assert t.format == "mooncake" and len(t.requests) == 40 and t.has_hash_ids
    r = t.requests[0]
    assert (r.line, r.t_s, r.input_len, r.output_len) == (1, 0.0, 13423, 381)
    assert r.hash_ids == tuple(rows[0]["hash_ids"])  # type: ignore[arg-type]
    assert t.span_s == pytest.approx(12.001)  # 1352999 .. 1365000 ms, relative to the first


def test_unsorted_lines_are_sorted_and_plain_text_works(tmp_path: Path) -> None:
    p = tmp_path / "trace.txt"  # neither gzipped nor named .jsonl: detected from the contents
    p.write_text('{"timestamp": 2000, "input_length": 3, "output_length": 1}\n\n'
                 '{"timestamp": 500, "input_length": 4, "output_length": 2}\n')
    t = load_trace(str(p))
    assert [(r.line, r.t_s) for r in t.requests] == [(3, 0.0), (1, 1.5)] and t.requests[0].hash_ids is None
    c = tmp_path / "t.csv"
    c.write_text("GeneratedTokens,TIMESTAMP,ContextTokens,Extra\n5,10.5,7,x\n6,12,0,y\n")
    t = load_trace(str(c))
    assert [(r.t_s, r.input_len, r.output_len) for r in t.requests] == [(0.0, 7, 5), (1.5, 0, 6)]


@pytest.mark.parametrize("content,needle", [
    (b"", "the file is empty"),
    (b"hello world\n", "line 1: neither an Azure CSV"),
    (b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n', "line 2: not a JSON object"),
    (b'{"timestamp": 0, "input_length": 5}\n', "line 1: missing output_length"),
    (b'{"timestamp": 0, "input_length": -5, "output_length": 1}\n', "line 1: input_length -5 is not an integer >= 0"),
    (b'{"timestamp": "x", "input_length": 5, "output_length": 1}\n', "timestamp 'x' is not a number"),
    (b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
     "hash_ids has 1 ids but input_length 600 needs ceil(600 / 512) = 2"),
    (b'{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [-1]}\n', "not a list of integers >= 0"),
    (b"[1, 2]\n", "neither an Azure CSV"),
    (b"TIMESTAMP,ContextTokens\n1,2\n", "line 1: the CSV header 'TIMESTAMP,ContextTokens' lacks generatedtokens"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\n", "line 2: 2 fields where the header has 3"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,2,3\n", "line 3: TIMESTAMP 'yesterday' is neither"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-01 00:00:00,2,3\n", "line 2: TIMESTAMP"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n1,many,3\n", "line 2: contexttokens 'many' is not an integer"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "it holds no requests"),
    (b"\x1f\x8b\x08\x00garbage", "cannot read it"),
    (b"\xff\xfe\x00{", "not UTF-8"),
])
def test_bad_files_name_the_flag_and_line(tmp_path: Path, content: bytes, needle: str) -> None:
    p = tmp_path / "bad.trace"
    p.write_bytes(content)
    with pytest.raises(TraceError, match="^--trace ") as ei:
        load_trace(str(p))
    assert needle in str(ei.value) and str(p) in str(ei.value)


def test_missing_file() -> None:
    with pytest.raises(ValueError, match="--trace /no/such.csv: cannot read it: No such file"):
        load_trace("/no/such.csv")


def test_timezone_suffix(tmp_path: Path) -> None:
    p = tmp_path / "tz.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 01:00:00.5+01:00,1,1\n"
                 "2024-05-10 00:00:01Z,1,1\n")
    assert [r.t_s for r in load_trace(str(p)).requests] == [0.0, 0.5]


def test_window_and_cap() -> None:
    full = load_trace(CONV).requests
    r = build_replay(spec(CONV, start_s=5.0), num_prompts=None, duration_s=10.0)
    want = [q for q in full if 5.0 <= q.t_s < 15.0]
    assert [it.line for it in r.items] == [q.line for q in want] and r.in_window == len(want) > 3
    assert r.window_s == (5.0, 15.0) and r.clipped == r.skipped == r.beyond_cap == 0
    capped = build_replay(spec(CONV, start_s=5.0), num_prompts=3, duration_s=10.0)
    assert len(capped.items) == 3 and capped.beyond_cap == len(want) - 3 and capped.in_window == len(want)
    whole = build_replay(spec(CODE), None, None)
    assert len(whole.items) == 40 and whole.window_s == (0.0, None)
    with pytest.raises(ValueError, match="--trace-start 100 is past the end"):
        build_replay(spec(CODE, start_s=100.0), None, None)
    with pytest.raises(ValueError, match=r"no request of --trace .* in the window \[5, 15\) s"):
        build_replay(spec(CODE, start_s=5.0), None, 10.0)  # the code excerpt is quiet from 1.4 s to 29.5 s


def test_time_scale_divides_inter_arrival_times() -> None:
    r = build_replay(spec(CONV), None, None)
    t = np.array([it.t_s for it in r.items])
    rng = rate_rng(0, 0)
    assert r.offsets(1.0, rng).tolist() == pytest.approx((t - t[0]).tolist())
    assert r.offsets(2.0, rng).tolist() == pytest.approx(((t - t[0]) / 2).tolist())  # twice as fast
    assert r.offered_rate(1.0) == pytest.approx(39 / t[-1]) and r.offered_rate(4.0) == pytest.approx(4 * 39 / t[-1])
    late = build_replay(spec(CONV, start_s=10.0), None, None)
    assert late.offsets(1.0, rng)[0] == 0.0  # the first replayed request is released at once


def test_poisson_arrivals_use_the_trace_lengths() -> None:
    r = build_replay(spec(MOON, arrivals="poisson"), None, None)
    a = r.offsets(5.0, rate_rng(3, 1))
    assert a.tolist() == arrival_times(5.0, "poisson", rate_rng(3, 1), num=40).tolist()
    assert r.offsets(5.0, rate_rng(3, 1)).tolist() == a.tolist()  # seeded
    assert r.offsets(5.0, rate_rng(4, 1)).tolist() != a.tolist()
    assert r.offered_rate(5.0) == 5.0 and math.isinf(r.offered_rate(math.inf))
    assert [it.input_len for it in r.items] == [row["input_length"] for row in moon_rows()]


def test_clip_and_skip_counts() -> None:
    rows = moon_rows()
    over = [r for r in rows if r["input_length"] + r["output_length"] > 8192]  # type: ignore[operator]
    clipped = build_replay(spec(MOON, 8192), None, None)
    assert clipped.clipped == len(over) > 0 and clipped.skipped == 0 and len(clipped.items) == 40
    assert all(it.input_len + it.output_len <= 8192 for it in clipped.items)
    assert sum(it.clipped for it in clipped.items) == len(over)
    for it in clipped.items:  # a clipped prompt keeps the hash ids of the blocks it still has
        assert it.hash_ids is not None and len(it.hash_ids) == -(-it.input_len // HASH_BLOCK_TOKENS)
    skipped = build_replay(spec(MOON, 8192, overflow="skip"), None, None)
    assert skipped.skipped == len(over) and skipped.clipped == 0 and len(skipped.items) == 40 - len(over)
    capped = build_replay(spec(MOON, 8192, overflow="skip"), 5, None)
    assert len(capped.items) == 5 and capped.skipped + capped.beyond_cap == 40 - 5
    with pytest.raises(ValueError, match="skipped as longer than the max model length 500"):
        build_replay(spec(MOON, 500, overflow="skip"), None, None)


def test_hash_block_tokens() -> None:
    key = run_key(0, 0)
    a = hash_block_tokens([7, 8, 9], 1100, 1000, 20000, key)
    b = hash_block_tokens([7, 8, 5], 1500, 1000, 20000, key)
    assert len(a) == 1100 and len(b) == 1500 and a.min() >= 1000 and a.max() < 20000
    assert a[:1024].tolist() == b[:1024].tolist()  # equal ids, equal blocks
    assert (a[1024:1100] != b[1024:1100]).mean() > 0.9  # a different id, a different block
    partial = hash_block_tokens([7, 8, 9], 1030, 1000, 20000, key)
    assert partial.tolist() == a[:1030].tolist()  # a last partial block: the first tokens of its block
    assert hash_block_tokens([7], 512, 1000, 20000, key).tolist() == a[:512].tolist()
    other = hash_block_tokens([7, 8, 9], 1100, 1000, 20000, run_key(0, 1))  # another run: other tokens
    assert (other != a).mean() > 0.9 and run_key(1, 0) != key
    blocks = [hash_block_tokens([h], 512, 0, 50000, key).tolist() for h in range(200)]
    assert len({tuple(x) for x in blocks}) == 200
    with pytest.raises(ValueError, match="cover 512 tokens, not 600"):
        hash_block_tokens([1], 600, 0, 10, key)


def test_replayed_prompts_share_prefixes_where_the_ids_do() -> None:
    r = build_replay(spec(MOON), None, None)
    reqs = [r.request(i, 0, 0, 1000, 20000) for i in range(len(r.items))]
    i, j = [k for k, it in enumerate(r.items) if it.hash_ids and it.hash_ids[1:3] == (43957, 48109)]
    shared = 0
    for x, y in zip(r.items[i].hash_ids or (), r.items[j].hash_ids or (), strict=False):
        if x != y:
            break
        shared += 1
    assert shared == 54  # then the first's last (partial) block and the second's full one differ
    n = shared * HASH_BLOCK_TOKENS
    assert reqs[i].prompt[:n] == reqs[j].prompt[:n] and reqs[i].prompt[n:n + 512] != reqs[j].prompt[n:n + 512]
    assert [len(q.prompt) for q in reqs] == [it.input_len for it in r.items]
    assert [q.output_len for q in reqs] == [it.output_len for it in r.items]
    again = r.request(i, 0, 0, 1000, 20000)
    assert again.prompt == reqs[i].prompt and r.request(i, 0, 1, 1000, 20000).prompt[:512] != reqs[i].prompt[:512]
    azure = build_replay(spec(CODE), None, None)
    a0, a1 = azure.request(0, 0, 0, 1000, 20000), azure.request(1, 0, 0, 1000, 20000)
    assert len(a0.prompt) == 4808 and a0.prompt[:16] != a1.prompt[:16]  # no hash ids: nothing shared


def item(ids: Sequence[int], n: int) -> ReplayItem:
    return ReplayItem(0, 0.0, n, 1, tuple(ids))


def test_ideal_hit_rate_by_hand() -> None:
    items = [item([1, 2, 3], 1300), item([1, 2, 4], 1100), item([1, 2, 3], 1500), item([5], 100), item([1], 10)]
    h = ideal_hits(items, 16)
    # 2nd: ids 1,2 seen -> 1024 tokens; 3rd: 1,2,3 seen -> all 1500 in hash blocks, but only the 1300
    # tokens the 1st had (1296 in full 16-token blocks) in token blocks; 5th: id 1 seen, 10 tokens (no full block)
    assert h["ideal_hit_tokens_hash_blocks"] == 1024 + 1500 + 10
    assert h["ideal_hit_tokens"] == 1024 + 1296
    assert h["ideal_hit_rate"] == pytest.approx(2320 / 4010)
    assert h["ideal_hit_rate_hash_blocks"] == pytest.approx(2534 / 4010)
    assert ideal_hits(items, 1000)["ideal_hit_tokens"] == 1000 + 1000  # floor to whole blocks of any size
    assert ideal_hits([], 16)["ideal_hit_rate"] == 0.0


def brute_force_hits(prompts: Sequence[Sequence[int]], bs: int) -> int:
    """Full bs-token blocks whose whole chain of blocks appeared in an earlier prompt, from the tokens."""
    seen: set[int] = set()
    hits = 0
    for p in prompts:
        keys, key = [], 0
        for j in range(len(p) // bs):
            key = hash((key, tuple(p[j * bs:(j + 1) * bs])))
            keys.append(key)
        k = 0
        while k < len(keys) and keys[k] in seen:
            k += 1
        hits += k * bs
        seen.update(keys)
    return hits


@pytest.mark.parametrize("mml,bs", [(None, 16), (8192, 16), (8192, 24), (3000, 512)])
def test_ideal_hit_rate_matches_the_tokens_sent(mml: int | None, bs: int) -> None:
    r = build_replay(spec(MOON, mml, block_size=bs), None, None)
    prompts = [r.request(i, 0, 0, 1000, 20000).prompt for i in range(len(r.items))]
    total = sum(len(p) for p in prompts)
    assert r.hits["ideal_hit_tokens"] == brute_force_hits(prompts, bs) > 0
    assert r.hits["ideal_hit_rate"] == pytest.approx(r.hits["ideal_hit_tokens"] / total)
    d = r.describe()
    assert d["replayed"] == 40 and d["block_size"] == bs and d["prompt_tokens"] == total
    assert 0 < d["ideal_hit_rate"] <= d["ideal_hit_rate_hash_blocks"] < 1


def test_azure_has_no_reuse() -> None:
    d = build_replay(spec(CODE), None, None).describe()
    assert d["ideal_hit_rate"] == 0.0 and "ideal_hit_rate_hash_blocks" not in d and "no hash ids" in d["hit_rate_note"]


@pytest.mark.parametrize("kw,needle", [
    (dict(arrivals="now"), "--trace-arrivals 'now' is not one of timestamps, poisson"),
    (dict(overflow="wrap"), "--trace-overflow 'wrap' is not one of clip, skip"),
    (dict(start_s=-1.0), "--trace-start -1.0 must be"),
    (dict(block_size=0), "--block-size 0 must be"),
])
def test_trace_spec_check(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        spec(CODE, **kw).check()
    with pytest.raises(ValueError, match="--trace PATH goes with --workload trace"):
        WorkloadSpec("trace").check()
    with pytest.raises(ValueError, match="--trace PATH goes with --workload trace"):
        WorkloadSpec("fixed", trace=TraceSpec(CODE)).check()
