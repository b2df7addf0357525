"""Request length distributions: how long prompts and outputs are, sampled reproducibly.

The ShareGPT and GSM8K tables below are the 0..100th percentiles of prompt and output token counts
from `shared/data/{sharegpt,gsm8k}_length_percentiles.csv` (ShareGPT: 92,735 conversations; GSM8K:
8,792 problems), embedded so that a benchmark needs no data files at run time. Sampling is the
inverse CDF: draw u ~ U[0, 100], interpolate linearly between the two neighbouring percentile
points, round to an integer. Prompt and output lengths are drawn independently: the tables hold only
the two marginals, not their joint distribution.

Every length is clipped so prompt + output fits a maximum context (the paper uses 2048), which also
tames the extreme top percentile (ShareGPT's p100 prompt is 161,281 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graph_ir.errors import UserError

# Percentiles 0..100 (index = percentile) of token counts, copied from shared/data/*_length_percentiles.csv.
_SHAREGPT_PROMPT = (
    1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 5.0, 5.0,
    6.0, 6.0, 7.0, 7.0, 7.0, 8.0, 8.0, 8.0, 9.0, 9.0,
    9.0, 10.0, 10.0, 10.0, 11.0, 11.0, 11.0, 12.0, 12.0, 12.0,
    13.0, 13.0, 14.0, 14.0, 14.0, 15.0, 15.0, 16.0, 16.0, 17.0,
    17.0, 18.0, 18.0, 19.0, 19.0, 20.0, 21.0, 21.0, 22.0, 23.0,
    23.0, 24.0, 25.0, 26.0, 27.0, 28.0, 29.0, 30.0, 32.0, 33.0,
    35.0, 36.0, 38.0, 39.0, 41.0, 43.0, 46.0, 48.0, 51.0, 53.0,
    57.0, 60.0, 64.0, 68.0, 73.0, 78.0, 84.0, 91.0, 98.0, 107.0,
    117.0, 130.0, 142.9, 159.0, 180.0, 203.0, 231.0, 265.6, 309.0, 352.0,
    406.0, 476.0, 564.0, 671.0, 802.0, 958.0, 1129.0, 1411.0, 1817.0, 2476.6,
    161281.0,
)
_SHAREGPT_OUTPUT = (
    1.0, 3.0, 9.0, 12.0, 19.0, 23.0, 27.0, 31.0, 36.0, 41.0,
    48.0, 56.0, 63.0, 70.0, 77.0, 84.0, 89.0, 95.0, 101.0, 106.0,
    112.0, 118.0, 124.0, 129.0, 135.0, 141.0, 147.0, 153.0, 159.0, 165.0,
    171.0, 176.0, 182.0, 188.0, 194.0, 199.0, 204.0, 209.0, 214.0, 219.0,
    224.0, 229.0, 234.0, 238.0, 243.0, 248.0, 253.0, 257.0, 262.0, 267.0,
    272.0, 277.0, 282.0, 287.0, 291.0, 296.0, 301.0, 306.0, 311.0, 316.0,
    321.0, 326.0, 331.0, 337.0, 342.0, 349.0, 354.0, 360.0, 366.0, 372.0,
    379.0, 386.0, 393.0, 401.0, 409.0, 418.0, 427.0, 435.0, 445.0, 455.0,
    466.0, 477.0, 490.0, 502.0, 516.0, 530.0, 546.0, 562.0, 578.0, 596.0,
    614.0, 636.0, 660.0, 688.0, 716.0, 745.0, 767.0, 767.0, 769.0, 770.0,
    22267.0,
)

_GSM8K_PROMPT = (
    11.0, 25.0, 27.0, 29.0, 30.0, 31.0, 32.0, 33.0, 34.0, 34.0,
    35.0, 35.0, 36.0, 36.8, 37.0, 38.0, 38.0, 39.0, 39.0, 40.0,
    40.0, 40.0, 41.0, 41.0, 42.0, 42.0, 43.0, 43.0, 43.5, 44.0,
    44.0, 45.0, 45.0, 46.0, 46.0, 47.0, 47.0, 48.0, 48.0, 48.0,
    49.0, 50.0, 50.0, 50.0, 51.0, 51.0, 52.0, 52.0, 53.0, 53.0,
    54.0, 54.0, 55.0, 55.0, 56.0, 56.0, 57.0, 57.0, 58.0, 58.0,
    59.0, 59.0, 60.0, 60.0, 61.0, 62.0, 62.0, 63.0, 63.0, 64.0,
    65.0, 65.0, 66.0, 67.0, 67.0, 68.0, 69.0, 70.0, 71.0, 71.0,
    73.0, 74.0, 75.0, 76.0, 77.0, 78.0, 79.0, 81.0, 83.0, 84.0,
    86.0, 88.0, 90.0, 92.0, 94.0, 98.0, 102.0, 106.0, 113.0, 124.0,
    209.0,
)
_GSM8K_OUTPUT = (
    22.0, 39.0, 42.0, 43.0, 45.0, 46.0, 48.0, 49.0, 50.0, 51.0,
    52.0, 53.0, 54.0, 55.8, 57.0, 58.0, 59.0, 60.0, 61.0, 62.0,
    63.0, 64.0, 65.0, 66.0, 67.0, 68.0, 69.0, 70.0, 70.0, 71.0,
    72.0, 73.0, 74.0, 75.0, 76.0, 77.0, 78.0, 79.0, 80.0, 81.0,
    82.0, 83.0, 84.0, 85.0, 86.0, 87.0, 88.0, 89.0, 90.0, 91.0,
    92.0, 93.0, 94.0, 95.0, 97.0, 98.0, 99.0, 100.0, 101.0, 102.0,
    104.0, 105.0, 106.0, 108.0, 109.0, 110.0, 111.0, 113.0, 114.0, 116.0,
    117.0, 119.0, 120.0, 122.0, 123.0, 125.0, 127.0, 128.0, 130.0, 131.0,
    133.0, 135.0, 138.0, 140.0, 142.0, 145.0, 148.0, 151.0, 154.0, 157.0,
    160.0, 164.0, 168.0, 173.0, 179.0, 186.0, 194.0, 203.0, 214.2, 233.0,
    361.0,
)

_TABLES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "sharegpt": (_SHAREGPT_PROMPT, _SHAREGPT_OUTPUT),
    "gsm8k": (_GSM8K_PROMPT, _GSM8K_OUTPUT),
}
_PERCENTILES = np.arange(101, dtype=np.float64)


@dataclass(frozen=True)
class Lengths:
    """One request's shape: `prompt` tokens in, at most `output` tokens generated."""

    prompt: int
    output: int


def clip_to_context(prompt: int, output: int, max_context: int) -> Lengths:
    """Fit (prompt, output) into `max_context` tokens, keeping at least one of each.

    The prompt is cut first to leave room for one output token, then the output to what is left:
    long prompts are what overflows in practice, and cutting the output of a short-prompt request
    would distort the decode-heavy load the benchmark is about.
    """
    if max_context < 2:
        raise UserError(f"max_context must be at least 2 (one prompt + one output token), got {max_context}")
    p = int(min(max(prompt, 1), max_context - 1))
    o = int(min(max(output, 1), max_context - p))
    return Lengths(p, o)


@dataclass(frozen=True)
class PercentileLengths:
    """Lengths drawn from percentile tables (101 points each, percentile 0..100, non-decreasing)."""

    name: str
    prompt_table: tuple[float, ...]
    output_table: tuple[float, ...]
    max_context: int = 2048

    def __post_init__(self) -> None:
        for which, table in (("prompt", self.prompt_table), ("output", self.output_table)):
            if len(table) != 101 or any(b < a for a, b in zip(table, table[1:])):
                raise UserError(f"{self.name}: the {which} table must have 101 non-decreasing points")

    def sample(self, n: int, seed: int) -> list[Lengths]:
        rng = np.random.default_rng(seed)
        # One u per request per marginal, drawn in a fixed order so the i-th request's lengths
        # depend only on (seed, i) and never on how many requests are drawn after it.
        u = rng.uniform(0.0, 100.0, size=(n, 2))
        prompt = np.interp(u[:, 0], _PERCENTILES, self.prompt_table)
        output = np.interp(u[:, 1], _PERCENTILES, self.output_table)
        return [clip_to_context(int(round(p)), int(round(o)), self.max_context) for p, o in zip(prompt, output)]


@dataclass(frozen=True)
class FixedLengths:
    """Every request has the same prompt and output length (micro-benchmarks, tests)."""

    prompt: int
    output: int
    max_context: int = 2048

    def sample(self, n: int, seed: int) -> list[Lengths]:
        del seed  # nothing random; the argument keeps the interface uniform
        one = clip_to_context(self.prompt, self.output, self.max_context)
        return [one] * n


LengthSampler = PercentileLengths | FixedLengths


def length_distribution(name: str, max_context: int = 2048) -> LengthSampler:
    """Resolve a workload name: "sharegpt", "gsm8k", or "fixed:PROMPT:OUTPUT" (e.g. "fixed:32:64")."""
    key = name.strip().lower()
    if key in _TABLES:
        prompt, output = _TABLES[key]
        return PercentileLengths(key, prompt, output, max_context)
    if key.startswith("fixed:"):
        parts = key.split(":")
        try:
            p, o = int(parts[1]), int(parts[2])
            if len(parts) != 3 or p < 1 or o < 1:
                raise ValueError
        except (ValueError, IndexError):
            raise UserError(f"fixed lengths are written fixed:PROMPT:OUTPUT with positive integers, got {name!r}") from None
        return FixedLengths(p, o, max_context)
    raise UserError(f"unknown length distribution {name!r}; valid: sharegpt, gsm8k, fixed:PROMPT:OUTPUT")


def percentile_table(name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The embedded (prompt, output) percentile tables of a named dataset (for tests and reports)."""
    if name not in _TABLES:
        raise UserError(f"no percentile table named {name!r}; valid: {', '.join(sorted(_TABLES))}")
    return _TABLES[name]
