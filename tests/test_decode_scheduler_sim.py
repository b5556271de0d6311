"""A seeded simulation of the decode scheduler (`rapidserve/engine/decode_scheduler.py`), with the prefix cache off
and on, driving it as `decode_worker.py` does, with a fake prefill worker, router and model over a fake KV pool.

It checks block ownership, that no block is written while shared or cached, that a cached block holds what its
hash names, token order, that outputs do not depend on the cache, that everything is freed at the end, and that
the seeds together reach every path (preemptions, deferrals, aborts in each state, failures, cache hits).
"""

from __future__ import annotations

import functools
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from rapidserve.block_manager import BlockManager, block_hash
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler, Row
from rapidserve.sampling_params import SamplingParams
from rapidserve.stop_rules import check_stop
from tests.decode_sched_fakes import BS, EOS, PROMPT0, SALT, STOP, TOK, admit, all_free, check, ids, params

# ---- 10. randomized simulation, driven as decode_worker.py drives it -------------------------------
M61 = (1 << 61) - 1
GARBAGE = -1  # what a dropped, failed or broken computation leaves in a slot


def kv_of(prev: int, token: int) -> int:
    """The fake model's K/V at a position: a function of the K/V before it (as read from the pool) and the
    token there, so of every token up to it."""
    return (prev * 1_000_003 + token + 1) % M61


def kvs_of(tokens: list[int]) -> list[int]:
    out: list[int] = []
    for t in tokens:
        out.append(kv_of(out[-1] if out else 0, t))
    return out


def next_token(kv: int) -> int:
    """The fake model's sampled token after a position whose K/V is `kv`: it depends only on the tokens so far."""
    x = (kv * 0x9E3779B97F4A7C15 >> 17) % 1000
    return EOS if x < 80 else STOP if x < 140 else PROMPT0 + 20 + x % 70


def ideal(prompt: list[int], p: SamplingParams, cap: int) -> list[int]:
    """A request's outputs with nothing in the way (no abort, failure or preemption)."""
    outs: list[int] = []
    kv = kvs_of(prompt)[-1]
    while True:
        outs.append(next_token(kv))
        if check_stop(p, outs, len(prompt) + len(outs), (EOS,), cap) is not None:
            return outs
        kv = kv_of(kv, outs[-1])


@dataclass
class Seen:
    """What the router got for one request."""

    tokens: list[m.TokenOut] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)  # "prefill:<reason>", "decode:<reason>", "finished:<reason>"
    aborted: bool = False  # the router sent Abort (possibly racing with the end)


@dataclass
class Outcome:
    counts: Counter[str]
    streams: dict[str, tuple[list[int], bool]]  # per request: the tokens the router got, whether a token ended it


Write = tuple[DecodeRequest, int]  # a decode step's row: the request and the position its input token is written to


class Sim:
    """The decode worker's loop around the scheduler, with a fake prefill worker (FIFO, answers every Drop
    with Dropped, as prefill_worker.py does), a fake router checking what it receives, and a fake model over a
    fake KV pool: prefill and decode steps read K/V from the blocks of their table and write theirs there, and
    a sampled token depends on what they read. So a cache hit on a block with other content, or a block written
    while another request reads it, changes the outputs; the Sim also asserts each directly: every write goes to
    a block that only its writer holds and that is not registered, and every registered block holds the K/V of
    the tokens its hash names."""

    def __init__(self, seed: int, cache: bool) -> None:
        self.rng = rng = random.Random(seed)
        num_blocks = rng.randint(5, 12)
        self.cap = num_blocks * BS - rng.choice([0, 0, 3])
        self.cache = cache
        # share_min_tokens from a generator of its own, so the other draws stay as they were for each seed
        share_min = random.Random(seed + 7).choice([BS, 2 * BS, 512])
        self.s = DecodeScheduler(BlockManager(num_blocks, BS, rng.choice([0.0, 0.1, 0.25]), enable_caching=cache,
                                              salt=SALT), rng.randint(1, 5), (EOS,), self.cap, share_min)
        self.prefill: list[m.KVReady] = []  # prefill's queue: it writes these blocks
        self.p2d: deque[m.PrefillDone | m.PrefillFailed | m.Dropped] = deque()
        self.inflight: tuple[list[DecodeRequest], list[Write]] | None = None
        self.seen: dict[str, Seen] = {}
        self.objs: dict[str, DecodeRequest] = {}
        self.counts: Counter[str] = Counter()
        # the workload: its own generator, so a seed gives the same requests with the cache on and off
        self.wl = random.Random(seed + 1_000_003)
        # prompts are made of a few block-sized chunks, so one block's tokens come after different prefixes
        self.chunks = [[self.wl.randint(PROMPT0, PROMPT0 + 29) for _ in range(BS)] for _ in range(3)]
        self.systems = [self.chunked(2) + self.tail(0, 2) for _ in range(3)]
        self.prompts: list[list[int]] = []
        self.ideals: dict[str, list[int]] = {}
        # the fake pool: per block and slot, the K/V written there and by whom ("p"refill, "d"ecode)
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.by: list[list[str]] = [[""] * BS for _ in range(num_blocks)]
        self.expect: dict[bytes, list[int]] = {}  # a block hash -> the K/V its block must hold
        self.known: dict[str, tuple[list[bytes], list[int]]] = {}  # per request: its block hashes and K/V so far

    def chunked(self, most: int) -> list[int]:
        return [t for _ in range(self.wl.randint(1, most)) for t in self.wl.choice(self.chunks)]

    def tail(self, least: int, most: int) -> list[int]:
        return [self.wl.randint(PROMPT0, PROMPT0 + 29) for _ in range(self.wl.randint(least, most))]

    # -- the fake model ---------------------------------------------------------------------------
    def learn(self, r: DecodeRequest) -> list[int]:
        """The true K/V of `r`'s tokens so far, and the block hashes they give (the cache's truth)."""
        hs, kvs = self.known.setdefault(r.req_id, ([], []))
        toks = r.tokens
        while len(kvs) < len(toks):
            kvs.append(kv_of(kvs[-1] if kvs else 0, toks[len(kvs)]))
        while self.cache and (len(hs) + 1) * BS <= len(toks):
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else SALT, toks[i * BS:(i + 1) * BS]))
            want = kvs[i * BS:(i + 1) * BS]
            assert self.expect.setdefault(hs[-1], want) == want, "two prefixes with one hash"
        return kvs

    def read(self, table: list[int], pos: int) -> int | None:
        return self.pool[table[pos // BS]][pos % BS]

    def write(self, table: list[int], pos: int, kv: int, by: str) -> None:
        blk = table[pos // BS]
        b = self.s.blocks
        assert b._ref[blk] == 1, f"a write into block {blk}, which {b._ref[blk]} tables hold"
        assert blk not in b._hash_of, f"a write into block {blk}, which is in the prefix cache"
        self.pool[blk][pos % BS] = kv
        self.by[blk][pos % BS] = by

    def owned(self, table: list[int], pos: int) -> None:
        """The block of `pos` may be written now: only its request holds it and it is not registered."""
        blk = table[pos // BS]
        assert self.s.blocks._ref[blk] == 1 and blk not in self.s.blocks._hash_of, f"block {blk} is shared"

    # -- the router ------------------------------------------------------------------------------
    def emit(self, t: m.TokenOut, by: str) -> None:
        v = self.seen[t.req_id]
        assert not v.ends and not v.aborted, f"token {t} after the end ({v.ends}, aborted={v.aborted})"
        assert t.index == len(v.tokens), f"token {t} after {len(v.tokens)} tokens"
        v.tokens.append(t)
        if t.finish_reason is not None:
            v.ends.append(f"{by}:{t.finish_reason}")

    def publish(self) -> None:
        for f in self.s.finished:
            v = self.seen[f.req_id]
            if f.reason == "abort":
                assert v.aborted
            if v.ends:  # only: aborted while prefill held it, and prefill's first token had ended it
                assert f.reason == "abort" and len(v.ends) == 1 and v.ends[0].startswith("prefill:"), (f, v.ends)
            v.ends.append(f"finished:{f.reason}")
        self.s.finished.clear()

    # -- events ----------------------------------------------------------------------------------
    def arrive(self) -> None:
        """The next request of the workload: a system prompt and a tail, a few chunks and a tail, an earlier
        prompt again, or an earlier prompt continued by that request's outputs."""
        wl = self.wl
        rid = f"q{len(self.seen)}"
        mt = None if wl.random() < 0.15 else wl.randint(1, 12)
        p = params(max_tokens=mt, min_tokens=wl.randint(0, min(3, mt or 3)), ignore_eos=wl.random() < 0.2,
                   stop_token_ids=wl.choice([(), (STOP,)]))
        x = wl.random()
        if self.prompts and x < 0.2:
            prompt = list(wl.choice(self.prompts))
        elif self.prompts and x < 0.35:
            j = wl.randrange(len(self.prompts))
            prompt = self.prompts[j] + self.ideals[f"q{j}"][:wl.randint(1, 8)]
        elif x < 0.7:
            prompt = wl.choice(self.systems) + self.tail(0, 6)
        elif x < 0.9:
            prompt = self.chunked(3) + self.tail(0, 4)
        else:
            prompt = self.tail(1, 12)
        prompt = prompt[:min(18, self.cap - 1)]
        self.prompts.append(prompt)
        self.ideals[rid] = ideal(prompt, p, self.cap)
        self.seen[rid] = Seen()
        self.s.add(m.NewRequest(rid, prompt, p, 0.0))
        self.objs[rid] = self.s.reqs[rid]

    def abort(self) -> None:
        live = list(self.s.reqs)
        rid = self.rng.choice(live if live and self.rng.random() < 0.7 else list(self.seen))
        r = self.s.reqs.get(rid)
        self.counts["abort " + ("gone" if r is None else f"{r.state}{'+' if r.writing or r.aborting else ''}")] += 1
        self.seen[rid].aborted = True
        for kv in [kv for kv in self.prefill if kv.req_id == rid]:  # prefill may have written part of it
            for pos in range(kv.start_tokens, self.rng.randint(kv.start_tokens, self.s.reqs[rid].num_tokens)):
                self.write(kv.block_ids, pos, GARBAGE, "p")
        if self.s.abort(rid):  # Drop: prefill forgets the job if it still has it, and answers Dropped
            self.prefill = [kv for kv in self.prefill if kv.req_id != rid]
            self.p2d.append(m.Dropped(rid))

    def admit(self) -> None:
        b = self.s.blocks
        in_use, registered = list(b._ref), set(b._hash_of)
        waits = {r.req_id for r in self.s.waiting if self.s.blocks.pending_prefix(r.req_id, r.tokens)
                 >= self.s.share_min_tokens}
        handed = admit(self.s)
        assert not waits & {kv.req_id for kv in handed}, "admitted while its prefix was still being written"
        self.counts["waited for a prefix in flight"] += len(waits)
        for kv in handed:
            k = kv.cached_tokens // BS
            for blk in kv.block_ids[:k]:
                self.counts["hit, in use" if in_use[blk] else "hit, revived"] += 1
                if "d" in self.by[blk]:
                    self.counts["hit on decode's K/V"] += 1
            self.counts["evicted"] += sum(1 for blk in kv.block_ids[k:] if blk in registered)
        if handed and self.rng.random() < 0.2:  # prefill's inbox is full from handed[i] on
            i = self.rng.randrange(len(handed))
            self.s.unadmit(handed[i:])
            handed = handed[:i]
            self.counts["unadmit"] += 1
        self.prefill += handed

    def prefill_step(self) -> None:
        if not self.prefill:
            return
        kv = self.prefill.pop(0)
        toks = kv.request.prompt_token_ids + kv.outputs
        c, t = kv.start_tokens, kv.block_ids  # the cached prefix, or up to where decode's chunks wrote it
        truth = kvs_of(toks)
        assert [self.read(t, pos) for pos in range(c)] == truth[:c], "a cache hit or a chunk handed over holds " \
            "other K/V"
        if self.rng.random() < 0.05:  # it broke, part way
            for pos in range(c, self.rng.randint(c, len(toks))):
                self.write(t, pos, GARBAGE, "p")
            self.p2d.append(m.PrefillFailed(kv.req_id, kv.attempt, "prefill broke"))
            return
        kv_prev = self.read(t, c - 1) if c else 0
        for pos in range(c, len(toks)):
            assert kv_prev is not None
            kv_prev = kv_of(kv_prev, toks[pos])
            self.write(t, pos, kv_prev, "p")
        assert kv_prev is not None
        tok = next_token(kv_prev)
        outs = [*kv.outputs, tok]
        reason = check_stop(kv.request.params, outs, len(kv.request.prompt_token_ids) + len(outs), (EOS,), self.cap)
        first = m.TokenOut(kv.req_id, len(kv.outputs), tok, None, None, reason)
        if reason is not None:  # prefill sends a first token that ends the request to the router itself
            self.emit(first, "prefill")
        self.p2d.append(m.PrefillDone(kv.req_id, kv.attempt, first))

    def deliver(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            if not self.p2d:
                return
            msg = self.p2d.popleft()
            if isinstance(msg, m.PrefillDone):
                first = self.s.prefill_done(msg)
                self.learn(self.objs[msg.req_id])  # its prompt's blocks may be registered now
                if first is not None:
                    assert first is msg.token and first.finish_reason is None
                    self.emit(first, "decode")
            elif isinstance(msg, m.PrefillFailed):
                self.counts["prefill failed"] += 1
                self.s.prefill_failed(msg)
            else:
                self.s.dropped(msg.req_id)

    def complete(self) -> None:
        """The step in flight lands: each row reads the K/V before its position, writes its input token's and
        samples from it. A row whose request was aborted meanwhile had an input that was dropped: garbage."""
        if self.inflight is None:
            return
        batch, writes = self.inflight
        self.inflight = None
        rows: list[Row] = []
        for r, pos in writes:
            t = self.s.blocks.table(r.req_id)
            if pos < r.num_tokens:
                truth = self.learn(r)
                kv_prev = self.read(t, pos - 1)
                assert kv_prev == truth[pos - 1], f"{r.req_id} read other K/V at {pos - 1}"
                kv = kv_of(kv_prev, r.tokens[pos])
                self.write(t, pos, kv, "d")
                rows.append((next_token(kv), -1.0, None, None))
            else:
                assert r.state != "running"
                self.write(t, pos, GARBAGE, "d")
                rows.append((TOK, -1.0, None, None))
        for out in self.s.record(batch, rows):
            self.emit(out, "decode")
        for r in batch:
            self.learn(r)  # its decode blocks may be registered now

    def decode_step(self) -> None:
        s, rng = self.s, self.rng
        if not s.running and self.inflight is None:
            return
        if rng.random() < 0.02:  # the step fails for no single row
            self.counts["fail_batch"] += 1
            f, self.inflight = self.inflight, None
            if f is not None:
                for r, pos in f[1]:  # it wrote what it wrote
                    self.write(s.blocks.table(r.req_id), pos, GARBAGE, "d")
            s.fail_batch(f[0] if f is not None else [], "decode step broke")
            return
        batch = s.schedule(quiet=self.inflight is None)
        if batch is None:  # preemption needs a quiet pool: the step in flight lands first
            self.counts["deferred"] += 1
            self.complete()
            batch = s.schedule(quiet=True)
            assert batch is not None
        for r in batch:
            assert r.state == "running" and len(s.blocks.table(r.req_id)) * BS >= r.tokens_needed
        if not batch:
            self.complete()
            return
        if rng.random() < 0.03:  # sampling raised for some rows (RequestsFailed): they fail, the rest go on
            self.counts["fail"] += 1
            s.fail(rng.sample(batch, rng.randint(1, len(batch))), "sampling broke")
            self.complete()
            return
        writes = [(r, r.tokens_needed - 1) for r in batch]
        for r, pos in writes:
            self.owned(s.blocks.table(r.req_id), pos)
        s.launched(batch)
        self.complete()
        self.inflight = (batch, writes)

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        s = self.s
        b = s.blocks
        check(s)
        for kv in self.prefill:  # prefill may write these blocks: still that request's, and its own
            r = s.reqs[kv.req_id]
            assert r.state == "prefilling" and r.attempt == kv.attempt and b.table(kv.req_id) == kv.block_ids
            assert all(blk in b._hash_of for blk in kv.block_ids[:kv.cached_tokens // BS])  # what it reads
            for pos in range(kv.start_tokens, r.num_tokens, BS):
                self.owned(kv.block_ids, pos)
        if self.inflight is not None:  # the step in flight writes these blocks: still theirs, and their own
            for r, pos in self.inflight[1]:
                assert b.has(r.req_id)
                self.owned(b.table(r.req_id), pos)
        for blk, h in b._hash_of.items():  # a registered block holds what its hash names
            assert h in self.expect and self.pool[blk] == self.expect[h], f"block {blk} holds other K/V"
        assert s.num_preemptions == sum(r.attempt for r in self.objs.values())
        assert not {kv.req_id for kv in self.prefill} & set(ids(s.waiting))

    def tick(self, arrivals: bool) -> None:
        actions: list[tuple[Callable[[], None], float]] = [
            (self.abort, 0.4 if arrivals else 0.2), (self.admit, 1.0), (self.prefill_step, 1.0),
            (self.deliver, 1.0), (self.decode_step, 2.0)]
        if arrivals:
            actions.append((self.arrive, 1.2))
        fn = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        if fn != self.abort or self.seen:
            fn()
        self.publish()
        self.check()

    def idle(self) -> bool:
        return not self.s.reqs and self.inflight is None and not self.p2d and not self.prefill

    def run(self, steps: int) -> Outcome:
        for _ in range(steps):
            self.tick(arrivals=True)
        for _ in range(20_000):  # no arrivals: everything must end, every answer be delivered
            if self.idle():
                break
            self.tick(arrivals=False)
        s, b = self.s, self.s.blocks
        assert self.idle() and all_free(s), "the simulation did not drain"
        b.check()
        assert b._ref == [0] * b.num_blocks and not b._tables
        assert not b._chains and not b._committed, "the block manager still keeps state of ended requests"
        streams: dict[str, tuple[list[int], bool]] = {}
        for rid, v in self.seen.items():
            assert [t.index for t in v.tokens] == list(range(len(v.tokens)))
            # every token streamed is an output, but for a first token prefill streamed itself while an abort
            # was on its way: decode drops it (and sends Finished(abort))
            sent = v.tokens[:-1] if v.ends[1:] == ["finished:abort"] else v.tokens
            assert [t.token_id for t in sent] == self.objs[rid].outputs
            assert v.ends, f"{rid} never ended"
            if not v.ends[0].startswith("finished"):
                assert v.tokens[-1].finish_reason is not None
            # the model's tokens depend only on the tokens so far: whatever happened (preemptions, cache hits),
            # a request streams a prefix of its ideal outputs, all of them when a token ended it
            got = [t.token_id for t in v.tokens]
            ended = bool(v.tokens) and v.tokens[-1].finish_reason is not None
            assert got == (self.ideals[rid] if ended else self.ideals[rid][:len(got)]), rid
            streams[rid] = (got, ended)
        self.counts["preemptions"] += s.num_preemptions
        self.counts["requests"] += len(self.seen)
        self.counts["hits"] += b.hits
        self.counts["queries"] += b.queries
        self.counts["ended by a token"] += sum(1 for _, e in streams.values() if e)
        return Outcome(self.counts, streams)


SEEDS = list(range(30))


@functools.cache
def simulate(seed: int, cache: bool) -> Outcome:
    return Sim(seed, cache).run(200)


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
@pytest.mark.parametrize("seed", SEEDS)
def test_simulation_keeps_every_invariant(seed: int, cache: bool) -> None:
    counts = simulate(seed, cache).counts
    assert counts["requests"] > 20
    assert cache or counts["hits"] == counts["queries"] == 0


def test_simulation_outputs_do_not_depend_on_the_cache() -> None:
    """The same workload with the cache off and on: each request streams the same tokens, up to where an abort
    or a failure (which fall differently in the two runs) cut one of them short."""
    compared = 0
    for seed in SEEDS:
        off, on = simulate(seed, False).streams, simulate(seed, True).streams
        both = set(off) & set(on)
        assert len(both) > 20
        for rid in both:
            (a, a_ended), (b, b_ended) = off[rid], on[rid]
            n = min(len(a), len(b))
            assert a[:n] == b[:n], (seed, rid)
            if a_ended and b_ended:
                assert a == b, (seed, rid)
                compared += 1
    assert compared > 100


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
def test_simulation_reaches_every_path(cache: bool) -> None:
    total: Counter[str] = Counter()
    seeds_with_hits = 0
    for seed in SEEDS:
        counts = simulate(seed, cache).counts
        total += counts
        seeds_with_hits += counts["hits"] > 0
    paths = ["preemptions", "deferred", "unadmit", "fail", "fail_batch", "prefill failed", "abort waiting",
             "abort prefilling", "abort prefilling+", "abort running", "abort running+", "abort done+",
             "abort gone", "ended by a token"]
    if cache:
        paths += ["hit, in use", "hit, revived", "hit on decode's K/V", "evicted", "waited for a prefix in flight"]
        assert seeds_with_hits >= len(SEEDS) * 3 // 4, f"{seeds_with_hits} seeds with hits"
        assert total["hits"] * 5 > total["queries"], dict(total)  # prefixes do repeat
    for what in paths:
        assert total[what] > 0, f"no {what!r} in {dict(total)}"
