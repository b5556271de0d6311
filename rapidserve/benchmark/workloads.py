"""What is sent: prompts of random token ids with given or sampled lengths, and multi-turn chats.

Prompts are lists of token ids (sent as the `prompt` of /v1/completions), drawn uniformly from
[token_lo, token_hi) (default [1000, 20000): inside every common vocabulary and clear of the special
tokens at the low end). Token ids let the client measure servers without a tokenizer (presets) and
make the prompt length exact. Every request asks for exactly its output length (`max_tokens` =
`min_tokens` = length, `ignore_eos`). Request i's lengths depend only on (seed, i), so every rate of a
sweep sends the same lengths; its tokens also depend on a per-rate salt, so no rate finds the prompts
of an earlier one in a server's prefix cache.

Workloads:
- `fixed`: every prompt `input_len` tokens, every output `output_len` tokens.
- trace-shaped (`TRACES`): lengths drawn from a lognormal with the trace's published mean and a
  chosen log-space sigma (the traces are long-tailed; the sigmas are not fitted to them), rounded,
  clipped to [1, ...], and clipped so that prompt + output fits `max_model_len` (the output is kept
  first; clipping lowers the effective mean of the long-input traces when `max_model_len` is small):
  | name                | input mean | sigma | output mean | sigma | source                                   |
  | azure-code          | 2047       | 1.0   | 28          | 1.0   | Azure LLM inference trace 2023, code     |
  | azure-conv          | 1155       | 1.0   | 211         | 0.8   | Azure LLM inference trace 2023, conv.    |
  | mooncake            | 12035      | 0.8   | 343         | 0.8   | Mooncake conversation trace (FAST'25)    |
  | arxiv-summarization | 8000       | 0.5   | 200         | 0.5   | arXiv summarization (DistServe-style)    |
  | lmsys               | 69.5       | 1.2   | 214.5       | 0.9   | LMSYS-Chat-1M per-turn means (2023 paper)|
  The Azure means are those reported for the 2023 traces (Splitwise, ISCA'24), the Mooncake ones
  for its open-sourced conversation trace, the arXiv input ~8K tokens / output ~200 as in the
  summarization workloads of serving papers, LMSYS the per-turn averages of the LMSYS-Chat-1M paper
  (for long conversation contexts use `multiturn`).
- `multiturn`: conversations of `num_turns` turns. Turn 0's prompt is `input_len` new tokens; turn k's
  prompt is turn k-1's prompt + turn k-1's output + `turn_input_len` new tokens, so every later turn
  shares the earlier turns as a prefix (what prefix caching can reuse). The output tokens are the
  ones the server returned when it returns ids (token-id-only servers), otherwise a deterministic
  random stand-in of the same length. A conversation's turns are sent one after another; the
  arrival process and `--num-prompts` count conversations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WORKLOADS: tuple[str, ...] = ("fixed", "azure-code", "azure-conv", "mooncake", "arxiv-summarization", "lmsys",
                              "multiturn")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: lognormal with the given mean (sigma in log space)."""

    mean: float
    sigma: float

    def sample(self, rng: np.random.Generator) -> int:
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that E[X] = mean
        return max(1, int(round(float(rng.lognormal(mu, self.sigma)))))


@dataclass(frozen=True)
class TraceShape:
    input: LengthDist
    output: LengthDist
    source: str


TRACES: dict[str, TraceShape] = {
    "azure-code": TraceShape(LengthDist(2047, 1.0), LengthDist(28, 1.0), "Azure LLM inference trace 2023, code"),
    "azure-conv": TraceShape(LengthDist(1155, 1.0), LengthDist(211, 0.8),
                             "Azure LLM inference trace 2023, conversation"),
    "mooncake": TraceShape(LengthDist(12035, 0.8), LengthDist(343, 0.8), "Mooncake conversation trace (FAST'25)"),
    "arxiv-summarization": TraceShape(LengthDist(8000, 0.5), LengthDist(200, 0.5), "arXiv summarization"),
    "lmsys": TraceShape(LengthDist(69.5, 1.2), LengthDist(214.5, 0.9), "LMSYS-Chat-1M per-turn averages"),
}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "fixed"
    input_len: int = 1024
    output_len: int = 128
    num_turns: int = 4
    turn_input_len: int = 128
    token_lo: int = 1000
    token_hi: int = 20000
    max_model_len: int | None = None  # None: no clipping, no check

    def check(self) -> None:
        """ValueError (saying what is allowed) when the spec cannot produce valid requests."""
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is not one of {', '.join(WORKLOADS)}")
        for k in ("input_len", "output_len", "num_turns", "turn_input_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 1")
        if not 0 <= self.token_lo < self.token_hi:
            raise ValueError(f"token range [{self.token_lo}, {self.token_hi}) must satisfy 0 <= lo < hi")
        need = self.longest_sequence()
        if self.max_model_len is not None and need is not None and need > self.max_model_len:
            what = ("input_len + output_len" if self.name == "fixed" else
                    "input_len + (num_turns - 1) * turn_input_len + num_turns * output_len")
            raise ValueError(f"the {self.name} workload needs {need} tokens ({what}) but the server's "
                             f"max model length is {self.max_model_len}")
        if self.max_model_len is not None and self.name in TRACES and self.max_model_len < 2:
            raise ValueError(f"max model length {self.max_model_len} leaves no room for a prompt and an output")

    def longest_sequence(self) -> int | None:
        """Prompt + output tokens of the longest request (None for the sampled, clipped traces)."""
        if self.name == "fixed":
            return self.input_len + self.output_len
        if self.name == "multiturn":
            return self.input_len + (self.num_turns - 1) * self.turn_input_len + self.num_turns * self.output_len
        return None

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {"name": self.name, "token_range": [self.token_lo, self.token_hi],
                                "max_model_len": self.max_model_len}
        if self.name in ("fixed", "multiturn"):
            d.update(input_len=self.input_len, output_len=self.output_len)
        if self.name == "multiturn":
            d.update(num_turns=self.num_turns, turn_input_len=self.turn_input_len)
        if self.name in TRACES:
            t = TRACES[self.name]
            d.update(input_mean=t.input.mean, input_sigma=t.input.sigma, output_mean=t.output.mean,
                     output_sigma=t.output.sigma, source=t.source, distribution="lognormal, clipped")
        return d


@dataclass(frozen=True)
class BenchRequest:
    """One single-turn request: the prompt's token ids and the exact number of tokens to generate."""

    index: int
    prompt: list[int]
    output_len: int


@dataclass
class Conversation:
    """A multi-turn conversation: the new user tokens of each turn and each turn's output length."""

    index: int
    user_turns: list[list[int]]
    output_lens: list[int]
    rng: np.random.Generator  # draws the stand-ins for outputs the server did not return as ids

    def prompt(self, turn: int, history: Sequence[int]) -> list[int]:
        """The prompt of `turn`: the conversation so far (previous prompt + its output) + new tokens."""
        return [*history, *self.user_turns[turn]]

    def standin(self, n: int, spec: WorkloadSpec) -> list[int]:
        return random_tokens(self.rng, n, spec.token_lo, spec.token_hi)


def request_rng(seed: int, index: int, salt: int = 0) -> np.random.Generator:
    """A Generator of request (or conversation) `index`: depends only on (seed, index, salt)."""
    return np.random.default_rng([seed, index, salt, 0x3E9])


def random_tokens(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return rng.integers(lo, hi, size=n).tolist()


def sample_lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[int, int]:
    """(prompt tokens, output tokens) of one single-turn request of `spec`."""
    if spec.name == "fixed":
        return spec.input_len, spec.output_len
    trace = TRACES[spec.name]
    n_in, n_out = trace.input.sample(rng), trace.output.sample(rng)
    return clip_lengths(n_in, n_out, spec.max_model_len)


def clip_lengths(n_in: int, n_out: int, max_model_len: int | None) -> tuple[int, int]:
    """Clip so that prompt + output <= max_model_len, keeping >= 1 of each (the output first: it is
    capped at half the window, then the prompt takes what is left)."""
    n_in, n_out = max(1, n_in), max(1, n_out)
    if max_model_len is None or n_in + n_out <= max_model_len:
        return n_in, n_out
    n_out = max(1, min(n_out, max_model_len // 2))
    return max(1, min(n_in, max_model_len - n_out)), n_out


def make_request(spec: WorkloadSpec, seed: int, index: int, salt: int = 0) -> BenchRequest:
    """Request `index` of a single-turn workload: lengths from (seed, index), tokens from (seed,
    index, salt) (salt >= 0: one per rate of a sweep)."""
    if spec.name == "multiturn":
        raise ValueError("multiturn workloads are made of conversations: use make_conversation")
    n_in, n_out = sample_lengths(spec, request_rng(seed, index))
    return BenchRequest(index, random_tokens(request_rng(seed, index, salt + 1), n_in, spec.token_lo, spec.token_hi),
                        n_out)


def make_conversation(spec: WorkloadSpec, seed: int, index: int, salt: int = 0) -> Conversation:
    """Conversation `index` of a multiturn workload (tokens from (seed, index, salt))."""
    if spec.name != "multiturn":
        raise ValueError(f"the {spec.name} workload is single-turn: use make_request")
    rng = request_rng(seed, index, salt + 1)
    turns = [random_tokens(rng, spec.input_len if k == 0 else spec.turn_input_len, spec.token_lo, spec.token_hi)
             for k in range(spec.num_turns)]
    return Conversation(index, turns, [spec.output_len] * spec.num_turns, rng)
