"""The decode worker: owns the weights, the KV pool and the block tables; decodes the running batch.

Loop: drain the inbox, choose the compute partition for this step (the adaptive manager; a switch
is told to prefill before any KVReady it concerns), admit waiting requests (allocate their blocks,
hand them to prefill), launch one decode step on the partition's stream and graphs, then record the
previous step's tokens while this one runs (async scheduling one step ahead), publish.

Request states here: waiting (needs blocks) -> prefilling (KVReady sent; prefill owns the writes)
-> running (in the decode batch) -> done. Preemption by recompute sends a running request back to
waiting with its outputs, to be recomputed by prefill.

Block ownership (DESIGN.md): only this worker changes block tables. A request's blocks are freed
only when nothing can still write into them:
- while prefilling, prefill writes them: an abort sends Drop and frees on Dropped or PrefillDone;
- while a decode step that includes the request is in flight, that step writes its newest K/V: a
  request finished or aborted meanwhile is freed once the step completes (`inflight` reaches 0), and
  that step's token for it is dropped, so no extra token is ever emitted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rapidserve.block_manager import BlockManager, blocks_for
from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.faults import RequestsFailed, describe, is_fatal, sample_or_blame
from rapidserve.engine.worker_io import WorkerIO
from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.partition.runtime import DecodePartition
from rapidserve.runner import DecodeItem, ModelRunner
from rapidserve.sampler import SamplerOutput
from rapidserve.sampling_params import SamplingParams
from rapidserve.sequence import check_stop


@dataclass
class DReq:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    order: int
    outputs: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting | prefilling | running | done
    attempt: int = 0
    inflight: int = 0  # launched decode steps whose token is not recorded yet (0 or 1)
    aborting: bool = False  # abort asked while prefilling: waiting for prefill to let go
    freed: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


@dataclass
class InFlight:
    """A launched decode step: its sampled tokens stay on the device until the step has landed."""

    reqs: list[DReq]
    out: SamplerOutput  # on the device: token_ids [n] feed the next step's inputs directly
    host: SamplerOutput  # the same, copied to pinned host memory without waiting
    done: torch.cuda.Event | None


class DecodeWorker:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, eos: tuple[int, ...],
                 partition: DecodePartition, backend: PartitionBackend) -> None:
        self.cfg, self.runner, self.io, self.eos = cfg, runner, io, eos
        self.partition, self.backend = partition, backend
        self.blocks = BlockManager(runner.kv_pool.num_blocks, cfg.cache.block_size)
        self.reqs: dict[str, DReq] = {}
        self.waiting: deque[DReq] = deque()
        self.running: list[DReq] = []
        self.inflight: InFlight | None = None
        self.max_seqs = min(cfg.scheduler.max_num_seqs, max(cfg.runner.graph_batch_sizes))
        self.num_preemptions = 0
        self._orders = 0
        self._last_stats = 0.0
        self._stop = False
        self._out: list[m.TokenOut] = []

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop:
            for msg in self.io.drain():
                self.handle(msg)
            self.repartition()
            self.admit()
            if self.running or self.inflight is not None:
                self.step()
            else:
                self.io.wait(0.1)
            self.publish()
            if not self.io.others_alive():
                return

    def step(self) -> None:
        """One decode step. A request never takes the worker down (engine/faults.py): rows whose
        sampling raises fail alone (the others decode again next step; the step in flight still
        lands); any other error of the step (device still usable) fails its whole batch."""
        try:
            try:
                self._step()
            except RequestsFailed as e:
                self._quiesce()  # the failed step's forward may still write the blocks freed below
                for r in e.reqs:
                    self._finish(r, "error", message=describe(e.error, "sampling"))
                self._complete()
        except Exception as e:  # noqa: BLE001 - the batch fails, the worker lives
            if is_fatal(e):
                raise
            self._fail_batch(e)

    def _quiesce(self) -> None:
        """Wait until nothing this worker launched still runs (raises if the device is broken)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()

    def _fail_batch(self, e: Exception) -> None:
        self._quiesce()  # nothing in flight writes the blocks freed below
        f, self.inflight = self.inflight, None
        why = describe(e, "decode step")
        for r in list(self.running) + (f.reqs if f is not None else []):
            r.inflight = 0
            if r.state == "running":
                self._finish(r, "error", message=why)
            else:
                self._release(r)

    # ---- inbox ------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, m.NewRequest):
            self._new(msg)
        elif isinstance(msg, m.PrefillDone):
            self._prefill_done(msg)
        elif isinstance(msg, m.PrefillFailed):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.state == "prefilling" and msg.attempt == r.attempt:
                self._finish(r, "abort" if r.aborting else "error", message=msg.message)
        elif isinstance(msg, m.Dropped):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.aborting:
                self._finish(r, "abort")
        elif isinstance(msg, m.Abort):
            self._abort(msg.req_id)
        elif isinstance(msg, m.Shutdown):
            self._stop = True

    def _new(self, msg: m.NewRequest) -> None:
        need = blocks_for(len(msg.prompt_token_ids) + 1, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            why = (f"prompt of {len(msg.prompt_token_ids)} tokens needs {need} KV blocks; "
                   f"the pool has {self.blocks.num_blocks}")
            self.io.send["d2r"].send(m.Finished(msg.req_id, "error", why))
            self.io.send["d2p"].send(m.Drop(msg.req_id))
            return
        self._orders += 1
        r = DReq(msg.req_id, list(msg.prompt_token_ids), msg.params, self._orders)
        self.reqs[r.req_id] = r
        self.waiting.append(r)

    def _prefill_done(self, msg: m.PrefillDone) -> None:
        r = self.reqs.get(msg.req_id)
        if r is None or r.state != "prefilling" or msg.attempt != r.attempt:
            return
        if r.aborting:
            self._finish(r, "abort")
            return
        r.outputs.append(msg.token.token_id)
        if msg.token.finish_reason is not None:
            self._finish(r, msg.token.finish_reason, notify=False)  # prefill sent the token to the router
            return
        self._out.append(msg.token)  # streamed with this loop's publish, once the next step is launched
        r.state = "running"
        self.running.append(r)

    def _abort(self, req_id: str) -> None:
        r = self.reqs.get(req_id)
        if r is None or r.state == "done":
            return
        if r.state == "prefilling":
            r.aborting = True  # freed when prefill answers Dropped or PrefillDone
            self.io.send["d2p"].send(m.Drop(req_id))
        elif r.state == "waiting":
            self.waiting.remove(r)
            self.io.send["d2p"].send(m.Drop(req_id))  # prefill forgets its copy of the request
            self._finish(r, "abort")
        else:
            self._finish(r, "abort")

    def _finish(self, r: DReq, reason: str, notify: bool = True, message: str = "") -> None:
        """Done: out of every queue now; blocks back once no in-flight step writes them."""
        if r in self.running:
            self.running.remove(r)
        r.state = "done"
        if notify:
            self.io.send["d2r"].send(m.Finished(r.req_id, reason, message))
        self._release(r)

    def _release(self, r: DReq) -> None:
        if r.state == "done" and r.inflight == 0 and not r.freed:
            self.blocks.free(r.req_id)
            r.freed = True
            del self.reqs[r.req_id]

    # ---- admission: blocks for waiting requests, handed to prefill --------------------------
    def admit(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            busy = len(self.running) + sum(1 for x in self.reqs.values() if x.state == "prefilling")
            if busy >= self.max_seqs:
                return
            alone = busy == 0 and self.inflight is None
            if not (self.blocks.can_allocate(r.num_tokens)
                    or (alone and self.blocks.num_free * self.blocks.block_size >= r.num_tokens)):
                return
            table = self.blocks.allocate(r.req_id, r.num_tokens)
            if r.outputs:  # recompute after a preemption: prompt + outputs, and the request again
                again = m.NewRequest(r.req_id, r.prompt, r.params, 0.0)
                msg = m.KVReady(r.req_id, table, r.prompt + r.outputs, r.attempt, again)
            else:
                msg = m.KVReady(r.req_id, table, [], r.attempt)
            if not self.io.send["d2p"].try_send(msg):
                # prefill's inbox is full: admit later. Decode never blocks on prefill, so it keeps
                # stepping and sending heartbeats, and a hung prefill is the one taken as hung.
                self.blocks.free(r.req_id)
                return
            self.waiting.popleft()
            r.state = "prefilling"

    # ---- compute partition (adaptive manager, applied at step boundaries) ----------------------
    def repartition(self) -> None:
        """Decide this step's configuration before admission, so prefill hears of a switch before
        the KVReady of the work it concerns (same ring, in order)."""
        pending = bool(self.waiting) or any(r.state == "prefilling" for r in self.reqs.values())
        batch = len(self.running)
        context = sum(r.num_tokens for r in self.running) // batch if batch else 0
        sw = self.partition.advance(batch, context, pending)
        if sw is None:
            return
        old = self.backend.stream(sw.old, "decode")
        if old is not None:
            # Stream ordering: the step in flight ran on the old stream. Its sampled tokens, its KV
            # writes and the graphs' static inputs (shared by every configuration's graphs) are read
            # or overwritten by the next step on the new stream, which nothing else orders after it.
            old.synchronize()
        self.io.send["d2p"].send(m.SetPartition(sw.new))

    # ---- decode -----------------------------------------------------------------------------
    def _step(self) -> None:
        if not self.running:
            self._complete()
            return
        if not self._ensure_blocks():
            self._complete()  # preemption needs a quiet pool: let the in-flight step land first
            if not self._ensure_blocks(preempt=True) or not self.running:
                return
        with on_stream(self.backend.stream(self.partition.current, "decode")):
            launched = self._launch()
        self._complete()
        self.inflight = launched

    def _tokens_needed(self, r: DReq) -> int:
        return r.num_tokens + r.inflight

    def _ensure_blocks(self, preempt: bool = False) -> bool:
        for r in list(self.running):
            if r not in self.running:  # preempted as a victim earlier in this pass
                continue
            while not self.blocks.can_grow(r.req_id, self._tokens_needed(r)):
                if not preempt:
                    return False
                victim = max(self.running, key=lambda x: x.order)
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.blocks.grow(r.req_id, self._tokens_needed(r))
        return True

    def _preempt(self, r: DReq) -> None:
        self.running.remove(r)
        self.blocks.free(r.req_id)
        r.state, r.attempt = "waiting", r.attempt + 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _launch(self) -> InFlight:
        reqs = list(self.running)
        prev = self.inflight
        prev_index = {id(r): i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        items = [DecodeItem(r.outputs[-1] if not r.inflight else 0, self._tokens_needed(r) - 1,
                            self.blocks.table(r.req_id)) for r in reqs]
        input_ids = None
        carried = [(i, prev_index[id(r)]) for i, r in enumerate(reqs) if r.inflight]
        if carried and prev is not None:  # tokens of the step still in flight, straight from the device
            # Stream ordering: this step runs on the current partition's stream (step() made it current).
            # The step in flight ran on this stream, or on another one that repartition() synchronized
            # before switching, so its token_ids are written before this read. They were allocated on
            # that stream and are freed while this step may still read them: record_stream keeps the
            # allocator from reusing the memory there first (a no-op when it is this stream).
            # Caveat, not measured: the inputs come from pageable host memory, and CUDA orders such a
            # copy after the stream's earlier work, so this may still wait for the step in flight;
            # staging them in pinned memory would remove that wait.
            dev = self.runner.device
            input_ids = torch.tensor([it.token_id for it in items]).to(dev, non_blocking=True)
            dst = torch.tensor([c[0] for c in carried]).to(dev, non_blocking=True)
            src = torch.tensor([c[1] for c in carried]).to(dev, non_blocking=True)
            input_ids[dst] = prev.out.token_ids[src]
            if dev.type == "cuda":
                prev.out.token_ids.record_stream(torch.cuda.current_stream(dev))
        logits = self.runner.decode(items, input_ids=input_ids, graph_key=self.partition.current)
        index = [len(r.outputs) + r.inflight for r in reqs]  # output index of this step's token
        try:
            out = sample_or_blame(self.runner, logits, [r.params for r in reqs], index, self.eos)
        except RequestsFailed as e:
            e.reqs = [reqs[i] for i in e.rows]
            raise
        host = out.to_host()  # queued before the next step: reading it later never waits for that step
        event = None
        if self.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for r in reqs:
            r.inflight += 1
        return InFlight(reqs, out, host, event)

    def _complete(self) -> None:
        """Record the in-flight step's tokens: emit, stop, free what finished."""
        f = self.inflight  # cleared only once recorded: if this raises, _fail_batch still sees its requests
        if f is None:
            return
        if f.done is not None:
            f.done.synchronize()
        rows = f.host.rows([r.params for r in f.reqs])
        self.inflight = None
        for r, (tok, lp, top) in zip(f.reqs, rows, strict=True):
            r.inflight -= 1
            if r.state != "running":  # finished or aborted after launch: its token is dropped
                self._release(r)
                continue
            r.outputs.append(tok)
            reason = check_stop_tokens(r, self.eos, self.runner.max_model_len)
            self._out.append(m.TokenOut(r.req_id, len(r.outputs) - 1, tok, lp, top, reason))
            if reason is not None:
                self._finish(r, reason, notify=False)

    # ---- publishing ---------------------------------------------------------------------------
    def publish(self) -> None:
        if self._out:
            self.io.send["d2r"].send(m.TokenBatch(self._out))
            self._out = []
        now = time.monotonic()
        if now - self._last_stats >= self.cfg.launch.stats_interval_s:
            self._last_stats = now
            prefilling = sum(1 for r in self.reqs.values() if r.state == "prefilling")
            self.io.send["d2r"].try_send(m.Stats(len(self.running), len(self.waiting), prefilling,
                                                 self.blocks.num_blocks, self.blocks.num_free,
                                                 self.num_preemptions, self.partition.current,
                                                 self.partition.num_switches))


def check_stop_tokens(r: DReq, eos: tuple[int, ...], max_model_len: int) -> str | None:
    """`check_stop` for a decode-side request (same rules as the single-process engine)."""
    from rapidserve.sequence import Sequence

    seq = Sequence(r.req_id, r.prompt, r.params, output_token_ids=r.outputs)
    return check_stop(seq, eos, max_model_len)
