"""Every request field through the hand-over path: a prompt chunked in the decode worker's fused steps, then handed to
the prefill worker by a split step (`DecodeScheduler.hand_over`), which computes the rest from the last full block
and samples the next token; decode streams the rest.

The real decode and prefill workers in this process (tests/test_step_shapes.py's harness; tests/test_worker_faults.py's
FakeIO, its rings carrying each message through msgpack as the real ones do) on the tiny preset given a small trained
tokenizer (stop strings, bad words, structured outputs). The policy fuses (16 prompt tokens a step) until a prompt
chunking here has `HERE` tokens computed here, then splits until it is handed over, with one configuration and with
a switch that synchronizes (the hand-over in the first split: tests/test_chunk_hand_over.py). Each case sends a long
prompt whose SamplingParams carry one non-default field (a few pair it with a logit_bias that makes the field bite:
EOS or "x" made certain), beside a short greedy request that decodes all along, and compares what comes out with
`LLM.generate` on the same prompt and params: the same tokens and finish (greedy, or seeded sampling), logprobs
and ranks close to LLM's, stop strings as the router matches them on the text (the workers carry them and go on).
Each also checks where the hand-over happened and that prefill sampled the token after it, that no request failed,
and that every KV block, penalty slot and grammar matcher is back at the end. `n` is the edge's fork
(`SamplingParams.for_sample`: each sample one engine request); `best_of` is no SamplingParams field (the HTTP server
refuses it by name: tests/test_request_fields.py). Beyond one field at a time: the same long prefix twice (the
second handed over after its cache hits), a preemption after the hand-over (chunked here again with its outputs,
handed over again), and prefill's inbox full at the hand-over (`DecodeScheduler.unadmit`: the prompt goes on
chunking here and is handed over at a later split).
"""
from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.block_manager import BlockManager
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.worker_io import RING_TYPES
from rapidserve.logit_controls import TokenState
from rapidserve.outputs import CompletionOutput
from rapidserve.partition.profile import OVERALLOCATED
from rapidserve.partition.shape import Fused, ShapeState, Split, StepShape
from rapidserve.partition.step_policies import ScriptedPolicy
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import StructuredOutputs, resolve_bad_words
from rapidserve.server.detokenizer import IncrementalDetokenizer
from tests.test_chunk_hand_over import Synced
from tests.test_step_shapes import MODEL, serve, streams, workers
from tests.test_structured_workers import tiny_tokenizer_dir
from tests.test_worker_faults import FakeIO, _Out

PROMPT, PREFIX = 120, 64  # a case's prompt; the prefix the prefix-cache cases share
POOL, PREEMPT_PROMPT = 10, 124  # "preempt": the decode worker's blocks, the prompt (8 blocks, a 9th at its 4th output)
COMPANION = [5, 9, 14, 3, 7, 11, 30, 8, 21]  # decodes all along, greedy
COMPANION_TOKENS = 24
EOS = 2
HERE = 32  # prompt tokens computed here before the policy splits: two fused chunks of 16
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ("red", "green", "blue")
REGEX = "[a-z]{3}-[0-9]{2}"


@dataclass(frozen=True)
class Ctx:
    """What a case's fields may be made of: the token id of "x" in the tokenizer, and LLM's plain greedy tokens for
    the case's prompt (a field that bans or stops on one of them)."""

    x: int
    greedy: list[int]


Fields = dict[str, Any] | Callable[[Ctx], dict[str, Any]]
Check = Callable[[Ctx, list[CompletionOutput]], None]


@dataclass(frozen=True)
class Case:
    """One field with a non-default value. `check`: what the field promises, of LLM's outputs (the workers' are
    compared with them); `shape`: "one" request; "n" (each sample its own request, arriving once the one before has
    ended, so each is handed over: the decode worker's prefix cache off, else the later samples would find the whole
    prompt there and compute only its last block); "n_together" (the samples sent at once, as the server does: the
    first is handed over, the second goes to prefill from the queue at that split); "prefix" (a long prefix twice:
    the second finds it in the cache); "preempt" (a pool of `POOL` blocks, no prefix cache: the request, handed over
    and decoding, is preempted by recompute, chunked here again, prompt and outputs, and handed over again with its
    outputs, which prefill computes after the prompt and samples the next token after); `refuse`:
    KVReadys of each request that prefill's full inbox refuses (the hand-over unadmitted); `resume`: after each
    refusal one fused step, so the prompt goes on chunking here before the next hand-over. `early` (a repetition
    penalty): the prompt is picked so that the first token (prefill's) depends on prompt tokens only decode computed:
    the token that the penalty moves away from (> 1) or towards (< 1) occurs among its first `HERE` tokens only, and
    the penalized first token differs from plain greedy's; a hand-over that left those tokens out of prefill's
    penalty would sample another."""

    name: str
    fields: Fields
    check: Check | None = None
    shape: str = "one"
    refuse: int = 0
    resume: bool = False
    early: bool = False


def _all(pred: Callable[[Ctx, CompletionOutput], bool], what: str) -> Check:
    def check(ctx: Ctx, outs: list[CompletionOutput]) -> None:
        assert outs and all(pred(ctx, o) for o in outs), f"{what}: {outs}"
    return check


def _person(text: str) -> bool:
    v = json.loads(text)
    return set(v) == {"name", "age"} and isinstance(v["age"], int) and 0 <= v["age"] <= 120 and len(v["name"]) <= 12


def _so(**kw: Any) -> dict[str, Any]:
    return {"structured_outputs": StructuredOutputs(**kw)}


def _stopped_or(pred: Callable[[str], bool]) -> Callable[[Ctx, CompletionOutput], bool]:
    """A constrained output: complete (finish "stop") and `pred` of its text, or cut by max_tokens."""
    return lambda ctx, o: o.finish_reason == "length" or (o.finish_reason == "stop" and pred(o.text))


CASES = [
    Case("greedy", {}),
    Case("n", {"n": 2, "temperature": 1.0, "seed": 5}, _all(lambda c, o: len(o.token_ids) == 8, "8 tokens"), "n"),
    Case("n_together", {"n": 2, "temperature": 1.0, "seed": 5, "logprobs": 1}, shape="n_together"),
    Case("seed", {"temperature": 0.8, "seed": 2**63 - 1}),
    Case("temperature", {"temperature": 1.5, "seed": 7}),
    Case("top_k", {"temperature": 1.0, "top_k": 5, "seed": 3}),
    Case("top_k_beyond_vocab", {"temperature": 1.0, "top_k": 2**31 - 1, "seed": 3}),
    Case("top_p", {"temperature": 1.0, "top_p": 0.5, "seed": 2}),
    Case("min_p", {"temperature": 1.0, "min_p": 0.2, "seed": 4}),
    Case("logprobs", {"logprobs": 3}),
    Case("logprobs_0", {"logprobs": 0}),
    Case("logprobs_sampled", {"logprobs": 2, "temperature": 1.0, "seed": 9}),
    # EOS made certain: min_tokens bans it from the first token (prefill's) to the fifth
    Case("min_tokens", {"min_tokens": 5, "logit_bias": {EOS: 100}},
         _all(lambda c, o: len(o.token_ids) == 6 and o.token_ids[-1] == EOS and o.finish_reason == "stop",
              "5 tokens, then EOS")),
    Case("min_tokens_with_stop_ids", lambda c: {"min_tokens": 3, "stop_token_ids": [c.x], "logit_bias": {c.x: 100}},
         _all(lambda c, o: len(o.token_ids) == 4 and o.token_ids[-1] == c.x, "3 tokens, then the stop id")),
    Case("stop_token_ids", lambda c: {"stop_token_ids": [c.greedy[2]]},
         _all(lambda c, o: o.finish_reason == "stop" and len(o.token_ids) <= 3, "stopped by the third token")),
    Case("stop_token_first", lambda c: {"stop_token_ids": [c.x], "logit_bias": {c.x: 100}},
         _all(lambda c, o: o.token_ids == [c.x] and o.finish_reason == "stop", "prefill's token ends it")),
    Case("eos_first", {"logit_bias": {EOS: 100}},
         _all(lambda c, o: o.token_ids == [EOS] and o.finish_reason == "stop", "prefill's EOS ends it")),
    Case("ignore_eos", {"ignore_eos": True, "logit_bias": {EOS: 100}, "max_tokens": 6},
         _all(lambda c, o: o.token_ids == [EOS] * 6 and o.finish_reason == "length", "6 EOS")),
    Case("max_tokens_1", {"max_tokens": 1},
         _all(lambda c, o: len(o.token_ids) == 1 and o.finish_reason == "length", "prefill's token ends it")),
    Case("max_tokens_1_logprobs", {"max_tokens": 1, "logprobs": 2, "temperature": 1.0, "seed": 1}),
    # stop strings are matched by the router on the text (the workers carry them and go on to max_tokens)
    Case("stop", lambda c: {"stop": ["xx"], "logit_bias": {c.x: 100}},
         _all(lambda c, o: o.text == "" and o.finish_reason == "stop", "nothing before the stop string")),
    Case("include_stop_str_in_output", lambda c: {"stop": ["xx"], "logit_bias": {c.x: 100},
                                                  "include_stop_str_in_output": True},
         _all(lambda c, o: o.text == "xx" and o.finish_reason == "stop", "the stop string kept")),
    Case("stop_with_min_tokens", lambda c: {"stop": ["x"], "min_tokens": 3, "logit_bias": {c.x: 100}},
         _all(lambda c, o: o.text == "xxx" and o.finish_reason == "stop", "3 tokens' text, then the stop")),
    Case("logit_bias_ban", lambda c: {"logit_bias": {c.greedy[0]: -100}},
         _all(lambda c, o: o.token_ids[0] != c.greedy[0], "the greedy first token banned")),
    Case("logit_bias_force", lambda c: {"logit_bias": {c.x: 100}},
         _all(lambda c, o: set(o.token_ids) == {c.x}, "x only")),
    Case("allowed_token_ids", lambda c: {"allowed_token_ids": [17, 47, c.x]},
         _all(lambda c, o: set(o.token_ids) <= {17, 47, c.x}, "allowed ids only")),
    # "x" made certain, "xx" banned (two tokens): prefill's x, then never two in a row (decode's history holds it)
    Case("bad_words", lambda c: {"bad_words": ["xx"], "logit_bias": {c.x: 100}},
         _all(lambda c, o: o.token_ids[0] == c.x and (c.x, c.x) not in zip(o.token_ids, o.token_ids[1:], strict=False),
              "x, never twice in a row")),
    # a two-token word whose first token is prefill's: decode bans the second from the history it fills after it
    Case("bad_words_token_ids", lambda c: {"bad_words_token_ids": [(c.greedy[0], c.greedy[1]), (c.greedy[3],)]},
         _all(lambda c, o: o.token_ids[0] == c.greedy[0] and o.token_ids[1] != c.greedy[1]
              and c.greedy[3] not in o.token_ids, "the words banned")),
    Case("repetition_penalty", {"repetition_penalty": 2.0}, early=True),
    Case("repetition_penalty_below_1", {"repetition_penalty": 0.3}, early=True),
    Case("presence_penalty", {"presence_penalty": 1.5, "max_tokens": 12}),
    Case("frequency_penalty", {"frequency_penalty": 2.0, "max_tokens": 12}),
    Case("penalties_negative", {"presence_penalty": -2.0, "frequency_penalty": -0.5, "max_tokens": 12}),
    Case("structured_json", {"max_tokens": 48, **_so(json=json.dumps(PERSON))}, _all(_stopped_or(_person), "a person")),
    Case("structured_json_closed", {"max_tokens": 48, **_so(json=json.dumps({k: v for k, v in PERSON.items()
                                                                          if k != "additionalProperties"}),
                                                            disable_additional_properties=True)},
         _all(_stopped_or(_person), "a person, nothing else")),
    Case("structured_regex", {"max_tokens": 16, **_so(regex=REGEX)},
         _all(_stopped_or(lambda t: re.fullmatch(REGEX, t) is not None), "matches the regex")),
    Case("structured_choice", _so(choice=WORDS), _all(_stopped_or(lambda t: t in WORDS), "one of the choices")),
    Case("structured_grammar", _so(grammar='start: "yes" | "no"'),
         _all(_stopped_or(lambda t: t in ("yes", "no")), "yes or no")),
    Case("structured_min_tokens", {"min_tokens": 6, **_so(choice=WORDS)},
         _all(lambda c, o: o.text in WORDS and o.finish_reason == "stop", "a choice, stopped below min_tokens")),
    Case("structured_json_object", {"max_tokens": 24, "temperature": 0.8, "seed": 4, **_so(json_object=True)},
         _all(_stopped_or(lambda t: isinstance(json.loads(t), dict)), "a JSON object")),
    Case("prefix_cache", {}, shape="prefix"),
    Case("skip_reading_prefix_cache", {"skip_reading_prefix_cache": True}, shape="prefix"),
    # fields the workers carry and leave to the edge
    Case("skip_special_tokens", {"skip_special_tokens": False}),
    Case("detokenize", {"detokenize": False}),
    # preempted after its hand-over, chunked here again (prompt and outputs) and handed over again
    Case("preempt_seeded_penalties", {"temperature": 1.0, "seed": 12, "max_tokens": 12, "repetition_penalty": 1.2,
                                      "frequency_penalty": 0.5}, shape="preempt"),
    Case("preempt_structured", {"max_tokens": 12, **_so(regex="[a-z]{4}-[0-9]{6}")}, shape="preempt"),
    Case("preempt_min_tokens_logprobs", {"max_tokens": 12, "min_tokens": 10, "logit_bias": {EOS: 100},
                                         "logprobs": 1}, shape="preempt"),
    # prefill's inbox full at the hand-over (`DecodeScheduler.unadmit`): handed over at the next split...
    Case("unadmit_structured", {"max_tokens": 16, **_so(regex=REGEX)}, refuse=1),
    Case("unadmit_n", {"n": 2, "temperature": 1.0, "seed": 8, **_so(choice=WORDS)}, shape="n", refuse=1),
    # ... or after a fused step that goes on chunking it here, from its last full block
    Case("unadmit_resume_penalties", {"repetition_penalty": 1.3, "presence_penalty": 1.0}, refuse=1, resume=True),
    Case("unadmit_resume_seeded_logprobs", {"temperature": 1.0, "seed": 6, "logprobs": 2}, refuse=2, resume=True),
]


def _prompt(i: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(3, 1200) for _ in range(n)]


@dataclass
class Plan:
    """A case's engine requests, in waves (a wave is sent once the one before has ended), and LLM's outputs."""

    waves: list[list[m.NewRequest]]
    want: dict[str, CompletionOutput]
    ctx: Ctx
    outs: list[CompletionOutput]  # the case request's (each sample's), for `Case.check`


@dataclass
class Setup:
    llm: LLM
    plans: dict[str, Plan]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """The LLM (tiny preset, a small trained tokenizer) and every case's outputs from it, all made before any
    worker runs: the workers write the same KV pool, so a later LLM call could hit blocks they overwrote."""
    tok = tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=512, num_kv_blocks=40,
              max_num_batched_tokens=48, tokenizer=tok)
    assert llm.tokenizer is not None
    x = llm.tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    hf = llm.tokenizer

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False)

    companion = SamplingParams(temperature=0.0, max_tokens=COMPANION_TOKENS, ignore_eos=True)
    want_c = llm.generate([COMPANION], companion, use_tqdm=False)[0].outputs[0]
    plans = {}
    for i, case in enumerate(CASES):
        prompt = _prompt(i, PREEMPT_PROMPT if case.shape == "preempt" else PROMPT)
        if case.early:
            prompt = _early_prompt(llm, i, SamplingParams(**{"temperature": 0.0, **case.fields}))  # type: ignore[arg-type]
        prompts = [prompt] if case.shape != "prefix" else [prompt[:PREFIX] + _prompt(i + 500, PROMPT - PREFIX),
                                                            prompt]
        ctx = Ctx(x[0], list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids))
        fields = case.fields(ctx) if callable(case.fields) else case.fields
        params = resolve_bad_words(SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **fields}), encode)
        outs = [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]
        if case.shape.startswith("n"):  # each sample its own request (the edge's fork)
            samples = [(f"{case.name}-{j}", prompt, params.for_sample(j), o) for j, o in enumerate(outs[0])]
        else:
            samples = [(f"{case.name}-{j}", pr, params, o[0]) for j, (pr, o) in enumerate(zip(prompts, outs,
                                                                                            strict=True))]
        waves: list[list[m.NewRequest]] = []
        want = {}
        for j, (rid, pr, p, o) in enumerate(samples):
            if case.shape != "n_together" or not waves:
                waves.append([m.NewRequest(f"companion-{j}", COMPANION, companion, 2.0 * j)])
                want[f"companion-{j}"] = want_c
            waves[-1].append(m.NewRequest(rid, pr, p, 2.0 * j + 1))
            want[rid] = o
        plans[case.name] = Plan(waves, want, ctx, [o for *_, o in samples])
    return Setup(llm, plans)


def _early_prompt(llm: LLM, i: int, params: SamplingParams) -> list[int]:
    """A prompt for `Case.early`: the first token `params` (a repetition penalty) sample depends on its first `HERE`
    tokens."""
    def first(prompt: list[int], p: SamplingParams) -> int:
        return llm.generate([prompt], p.replace(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]

    for k in range(200):
        prompt = _prompt(10_000 + 1000 * i + k)
        got, plain = first(prompt, params), first(prompt, params.replace(repetition_penalty=1.0))
        tell = got if params.repetition_penalty < 1 else plain
        if got != plain and tell in prompt[:HERE] and tell not in prompt[HERE:]:
            return prompt
    raise AssertionError("no prompt found")


class Rings(FakeIO):
    """FakeIO whose rings carry each message as the real ones do (msgpack, decoded as the reader's declared types:
    worker_io.RING_TYPES) and log it; the d2p ring refuses the first `refuse` KVReadys of each request (prefill's
    inbox full)."""

    def __init__(self, refuse: int = 0) -> None:
        super().__init__()
        self.refuse = refuse
        self.refused: list[str] = []
        self.log: list[tuple[str, Any]] = []

    def ring(self, label: str) -> _Out:
        io, wire = self, RING_TYPES[label]
        decode = msgspec.msgpack.Decoder(wire.types).decode

        class Ring(_Out):
            def send(self, msg: Any) -> None:
                msg = decode(msgspec.msgpack.encode(msg))
                io.log.append((label, msg))
                super().send(msg)

            def try_send(self, msg: Any) -> bool:
                if label == "d2p" and isinstance(msg, m.KVReady) and io.refused.count(msg.req_id) < io.refuse:
                    io.refused.append(msg.req_id)
                    return False
                self.send(msg)
                return True

        return Ring(self.sent[label])

    @property
    def to_router(self) -> _Out:
        return self.ring("d2r" if self.seat == "decode" else "p2r")

    @property
    def to_prefill(self) -> _Out:
        return self.ring("d2p")

    @property
    def to_decode(self) -> _Out:
        return self.ring("p2d")


def own_runner(runner: ModelRunner) -> ModelRunner:
    """The prefill worker's runner: the same weights and KV pool, its own penalty slots (a process of its own: it
    frees every slot after sampling, which here would free the decode worker's too)."""
    r = copy.copy(runner)
    r.tokens = TokenState(runner.device)
    r._unrecorded = None
    return r


def hand_over_policy(d: DecodeWorker, io: Rings, resume: bool, split: str) -> ScriptedPolicy:
    """Fused steps of 16 prompt tokens until a prompt chunking here has `HERE` tokens computed here (past its cached
    prefix), then split steps on `split` until it is handed over. `resume`: after each refusal (prefill's inbox full),
    one fused step."""
    seen = [0]

    def shape(k: int, st: ShapeState) -> StepShape:
        if resume and len(io.refused) > seen[0]:
            seen[0] = len(io.refused)
            return Fused(16)
        if any(r.computed - r.cached >= HERE for r in d.sched.chunking):
            return Split(split, 48)
        return Fused(16)

    return ScriptedPolicy(shape)


def _same(got: list[m.TokenOut], want: CompletionOutput, req: m.NewRequest, llm: LLM) -> None:
    """The workers' tokens against LLM's: the same ids and finish (stop strings: as the router matches them on the
    text), logprobs close."""
    p = req.params
    ids = [t.token_id for t in got]
    assert [t.index for t in got] == list(range(len(got))), [t.index for t in got]  # each token once, in order
    assert all(t.finish_reason is None for t in got[:-1]) and got[-1].finish_reason is not None
    n = len(got)
    if p.stop:  # the router's part: the workers go on to max_tokens, the router stops at the string
        detok = IncrementalDetokenizer(llm.tokenizer, req.prompt_token_ids, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output, p.min_tokens)
        text = ""
        for n, t in enumerate(got, 1):  # noqa: B007 - n: the tokens up to the stop
            text += detok.add(t.token_id)
            if detok.stopped:
                break
        assert detok.stopped == (want.finish_reason == "stop") and text == want.text, (text, want.text)
    else:
        assert got[-1].finish_reason == want.finish_reason, (got[-1], want)
    assert ids[:n] == list(want.token_ids), (ids, want.token_ids)
    if p.logprobs is None:
        assert all(t.logprob is None for t in got)
        return
    for t, lp in zip(got[:n], want.logprobs or [], strict=True):
        assert t.logprob == pytest.approx(lp[t.token_id].logprob, abs=2e-4) and t.rank == lp[t.token_id].rank
        top = sorted((v.rank, k, v.logprob) for k, v in lp.items() if v.rank is not None and v.rank <= p.logprobs)
        mine = t.top_logprobs or []
        assert [k for _, k, _ in top] == [k for k, _ in mine], (top, mine)
        assert [w for _, w in mine] == pytest.approx([v for *_, v in top], abs=2e-4)


# the cases also run with a switch that synchronizes (only when the hand-over happens differs: the fields' handling
# after it is the same), one of each kind
SYNCED = ("greedy", "n", "seed", "logprobs", "max_tokens_1", "bad_words", "repetition_penalty", "structured_json",
          "structured_choice", "prefix_cache", "preempt_structured", "unadmit_structured", "unadmit_resume_penalties")
RUNS = [pytest.param(c, False, id=f"{c.name}-one configuration") for c in CASES] + \
    [pytest.param(c, True, id=f"{c.name}-the switch synchronizes") for c in CASES if c.name in SYNCED]


@pytest.mark.parametrize(("case", "synced"), RUNS)
def test_field_through_the_hand_over(setup: Setup, case: Case, synced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`synced`: fused steps on the whole GPU, splits on split16, whose decode streams count synchronizes as a switch
    of configuration does on a GPU: the first split records the fused step in flight and hands the prompt over in
    that split (tests/test_chunk_hand_over.py); with one configuration it goes at the split after."""
    plan = setup.plans[case.name]
    if case.check is not None:  # the property, of LLM's outputs (the workers' are compared with them below)
        case.check(plan.ctx, plan.outs)
    llm = setup.llm
    io = Rings(case.refuse)
    d, p, _ = workers(llm, ScriptedPolicy([Fused(16)]), two_configs=synced)
    d.io = p.io = io  # type: ignore[assignment]
    d.policy = hand_over_policy(d, io, case.resume, "split16" if synced else OVERALLOCATED)
    if synced:
        for name in ("split16", OVERALLOCATED):
            d.backend._streams[(name, "decode")] = Synced()  # type: ignore[union-attr]
        monkeypatch.setattr(d, "step_stream", lambda: None)  # the steps themselves run on the CPU's current stream
    if case.shape in ("n", "preempt"):  # --no-enable-prefix-caching (a prompt computed whole each time), a small pool
        b = d.sched.blocks
        d.sched.blocks = BlockManager(POOL if case.shape == "preempt" else b.num_blocks, b.block_size)
    p.runner = own_runner(llm.engine.runner)
    free0 = d.sched.blocks.num_free
    at: list[int] = []  # the policy's decisions whose step handed a prompt over
    hand_over = d.sched.hand_over

    def spy() -> list[m.KVReady]:
        out = hand_over()
        at.extend(len(d.policy.states) - 1 for _ in out)  # type: ignore[attr-defined]
        return out

    monkeypatch.setattr(d.sched, "hand_over", spy)
    told: list[Any] = []
    r2d = msgspec.msgpack.Decoder(RING_TYPES["r2d"].types).decode
    for wave in plan.waves:  # the requests as the router's ring carries them
        told += serve(d, p, io, [r2d(msgspec.msgpack.encode(r)) for r in wave])
    got = streams(io)
    reqs = {r.req_id: r for wave in plan.waves for r in wave}
    assert set(got) == set(reqs), (set(got), set(reqs))
    for rid, want in plan.want.items():
        _same(got[rid], want, reqs[rid], llm)
    # each case request was handed over (the second of "n_together" went from the queue): a KVReady from past the
    # start of its prompt, decode's chunks; the companions never went to prefill
    cases = [rid for rid in reqs if not rid.startswith("companion")]
    kvs = [x for x in told if isinstance(x, m.KVReady)]
    handed = [x for x in kvs if x.computed_tokens >= x.cached_tokens + HERE]
    assert {x.req_id for x in kvs} == set(cases), kvs
    assert {x.req_id for x in handed} == set(cases[:1] if case.shape == "n_together" else cases), kvs
    expected = {"n_together": 1, "preempt": 2}.get(case.shape, len(cases))
    assert d.sched.num_hand_overs == len(handed) == expected, handed  # an unadmitted one taken back
    assert d.sched.stats(OVERALLOCATED, 0).num_hand_overs == expected
    # ... and the token after its prompt (and its outputs, if preempted) sampled by the prefill worker
    dones = [x for _, x in io.log if isinstance(x, m.PrefillDone)]
    assert sorted(x.req_id for x in dones) == sorted(x.req_id for x in kvs)
    assert all(got[x.req_id][x.token.index].token_id == x.token.token_id for x in dones)
    # the first token's usage counts the prompt tokens found in the cache (none of decode's chunks)
    assert all(got[x.req_id][0].cached_tokens == x.cached_tokens for x in kvs if not x.outputs)
    # at the first split after fused steps when the switch synchronizes (the fused step in flight recorded before the
    # admission), else at the split after it (the first found that step in flight)
    decided = [isinstance(x.current, Split) for x in d.policy.states[1:]]  # type: ignore[attr-defined]
    first_splits = [k for k, split in enumerate(decided) if split and (k == 0 or not decided[k - 1])]
    if not case.refuse:
        assert at == [k + (0 if synced else 1) for k in first_splits], (at, first_splits, decided)
    if case.shape == "preempt":  # handed over again after a preemption, with its outputs
        assert d.sched.num_preemptions >= 1 and [len(x.outputs) > 0 for x in handed] == [False, True], handed
        assert dones[-1].token.index == len(handed[-1].outputs) > 0
    if case.refuse:  # each refused (unadmitted) as often as asked, then handed over
        assert sorted(io.refused) == sorted(cases * case.refuse)
    if case.shape == "prefix":  # the second found the first's prefix in the cache, unless told not to read it
        second = next(x for x in handed if x.req_id == cases[1])
        assert second.cached_tokens == (0 if reqs[cases[1]].params.skip_reading_prefix_cache else PREFIX), second
    # no request failed, nothing left behind: every block, penalty slot, matcher and compile state back
    assert not io.of("d2r", m.Finished) and not io.sent["p2d"] and not p.waiting_prefill
    assert d.sched.blocks.num_free == free0 and not d.sched.reqs and not d.inflight
    assert d.runner.tokens.in_use == 0 and p.runner.tokens.in_use == 0
    assert len(d.grammar) == 0 and len(p.grammar) == 0
