"""Each engine's speed, learned term by term from the times to first token the router measures.

The cost model's per-token prefill, attention and step costs are one model on one GPU (the
sim's Llama-3.1-8B on an H100). A cluster of other GPUs, another model, or two GPU
generations mixed would be priced for a machine it is not. So each worker carries its own
coefficients over those constants, fitted online; the constants are only the starting point.

What is measured: a request whose first byte marks its first token (a streamed answer)
took `measured` seconds from its send. Its terms (`Work`, at the constants) are the work the
policy saw queued and running ahead of it, and what the engine's answer says it did: the
tokens it computed and their attention pairs, and the tokens it pulled from a peer (their
transfer), and what is not learned here (host-tier loads). The model is

    measured - fixed = overhead + queue_x * queue + token_x * tokens + pair_x * pairs
                       + transfer_x * moved

Priced as planned instead, a request planned as a pull whose holder had lost the prefix
(recomputed whole) or as a hit on pages evicted since read as a worker 20x slower: under the
cost rule, which plans pulls often, equal workers were fitted at 0.4-7x the constants and
the ones fitted slow starved (the sweep's 10-prefix cell, issue 37).

with `overhead` the seconds every request pays whatever its size (the network, the engine's
scheduling and first step). Fitting it as one ratio, measured over modelled, was biased where
it mattered most: a worker holding a hot prefix serves mostly short suffixes, whose modelled
work is a few ms against a fixed few ms of overhead, so it looked several times slower than
it was and the policy moved hot-prefix requests off it (the sweep's Zipf 1.4 cell, issue 37).

The fit is a weighted least squares with exponential forgetting (the last ~50 requests),
weighted by the inverse square of each request's work at the constants plus 10 ms (relative
errors: a 10 ms request's error weighs as much as a 1 s one's), robust to the few requests an
engine's batching holds behind another's prefill (a Huber weight against the samples'
typical ratio, `_robust`: squared, a short suffix that waited 8x its work outweighed tens of
others, and equal workers were fitted 1.7-3.3x), and held toward a prior: the
constants, with the queue and attention coefficients tied to the per-token one (what is
queued is mostly other prompts' prefill, on the same engine). A term the traffic never
exercises follows the per-token one; the transfer's, another link's, is held to its constant
alone.

Evidence fades with time too: a worker that gets no samples for `STALE_AFTER_S` (one fitted
slow while it was briefly held up gets no traffic, so nothing would correct it) has its sums
halved every `FADE_HALF_LIFE_S`, back toward the constants, until traffic probes it again;
after `FORGET_AFTER_S` (2^-20 of it left) it is dropped (the worker reads as never measured).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from mempool._radix import WorkerState

T_REF = 0.01  # the overhead's unit in the fit (10 ms): every coefficient is of order 1
DECAY = 0.98  # a sample's weight fades by this a request (about the last 50 weigh)
SOLVE_EVERY = 4  # refit after this many samples (each one for the first 2 * this)
MIN_EXPECTED_S = 0.002  # a prediction's floor for the clamp below
RATIO_RANGE = (0.05, 20.0)  # a sample beyond this x its prediction is clamped (a stall)
HUBER = 0.5  # a sample further than this (relative) from the typical ratio weighs less
TYPICAL_STEP = 0.08  # how fast the typical ratio (a running median, in logs) moves a sample
STALE_AFTER_S = 30.0  # a fit without a sample for this long starts fading ...
FADE_HALF_LIFE_S = 30.0  # ... its evidence halving every this many seconds (back in ~5 min)
FORGET_AFTER_S = STALE_AFTER_S + 20 * FADE_HALF_LIFE_S  # then what is left is dropped
COEF_RANGE = (0.05, 50.0)  # each multiplier's bounds after a fit
MAX_OVERHEAD_S = 1.0
# the prior: overhead (in T_REF), queue_x, token_x, pair_x; its weight in samples per term
# (queue_x and pair_x are held by their ties to token_x alone), and those ties' strength
PRIOR = (0.0, 1.0, 1.0, 1.0, 1.0)
PRIOR_WEIGHT = (0.5, 0.0, 0.5, 0.0, 0.5)
TIE_WEIGHT = 2.0
N = 5


class Work(NamedTuple):
    """A request's time to first token at the cost model's constants, by term (seconds).
    A tuple: the cost model builds one per candidate worker on every request."""

    queue_s: float = 0.0  # the work queued and running on the worker ahead of it
    tokens_s: float = 0.0  # its own uncached tokens, the per-token part
    pairs_s: float = 0.0  # their attention pairs
    moved_s: float = 0.0  # a pull's transfer of a peer's prefix (shared with its other pulls)
    fixed_s: float = 0.0  # modelled, not learned: host-tier loads, an adapter's load

    @property
    def total_s(self) -> float:
        return self.queue_s + self.tokens_s + self.pairs_s + self.moved_s + self.fixed_s


def _prior_matrix() -> list[list[float]]:
    """The prior's precision: a weight per coefficient, and ties of queue_x and pair_x to
    token_x (a penalty on their differences)."""
    r = [[0.0] * N for _ in range(N)]
    for i, w in enumerate(PRIOR_WEIGHT):
        r[i][i] = w
    for j in (1, 3):  # queue_x and pair_x, each tied to token_x (index 2)
        r[j][j] += TIE_WEIGHT
        r[2][2] += TIE_WEIGHT
        r[j][2] -= TIE_WEIGHT
        r[2][j] -= TIE_WEIGHT
    return r


_R = _prior_matrix()
_R_PRIOR = [sum(_R[i][j] * PRIOR[j] for j in range(N)) for i in range(N)]


def delegated(holder: str, name: str, doc: str) -> property:
    """An attribute kept in a native WorkerState (`self.<holder>.<name>`), where the native
    decision reads it."""
    return property(
        lambda self: getattr(getattr(self, holder), name),
        lambda self, value: setattr(getattr(self, holder), name, value),
        doc=doc,
    )


@dataclass(slots=True)
class EngineSpeed:
    """One worker's coefficients over the cost model's constants (all 1.0 and no overhead:
    as the constants say). They live in its `WorkerState` (the native decision reads them
    there); this keeps the fit."""

    coefficients: WorkerState = field(default_factory=WorkerState)
    samples: int = 0
    learn: bool = True  # False: stays at the constants (--engine-speed fixed)
    # the forgetting sums of w x x^T and w x y over the samples
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * N for _ in range(N)])
    _xy: list[float] = field(default_factory=lambda: [0.0] * N)
    _typical: float = 0.0  # log of the running median of measured over expected
    _last_sample: float = 0.0  # time.monotonic() of the last sample
    _faded_to: float = 0.0  # the time up to which the sums have been faded

    overhead_s = delegated("coefficients", "overhead_s", "seconds every request pays")
    queue_x = delegated("coefficients", "queue_x", "x the constants' queued work")
    token_x = delegated("coefficients", "token_x", "x the constants' per-token prefill")
    pair_x = delegated("coefficients", "pair_x", "x the constants' attention pairs")
    transfer_x = delegated("coefficients", "transfer_x", "x the constants' pull transfer")

    @property
    def slowness(self) -> float:
        """How many times the constants' per-token prefill time this engine takes (the
        figure `/workers` shows)."""
        return self.coefficients.token_x

    def prefill_s(self, tokens_s: float, pairs_s: float) -> float:
        """A request's own prefill at this engine's speed, with the overhead it pays."""
        c = self.coefficients
        return c.overhead_s + c.token_x * tokens_s + c.pair_x * pairs_s

    def expected_s(self, work: Work) -> float:
        c = self.coefficients
        return (
            c.queue_x * work.queue_s
            + c.transfer_x * work.moved_s
            + self.prefill_s(work.tokens_s, work.pairs_s)
        )

    def observe(self, measured_s: float, work: Work, now: float | None = None) -> None:
        """A request priced at `work` took `measured_s` to its first token (`now`: the
        time.monotonic() it ended)."""
        if not self.learn or not measured_s > 0:
            return
        self._last_sample = time.monotonic() if now is None else now
        low, high = RATIO_RANGE
        expected = max(self.expected_s(work), MIN_EXPECTED_S)
        y = min(max(measured_s - work.fixed_s, expected * low), expected * high)
        # relative to the work at the constants (not at the fit: the weights, and so the
        # prior's pull, stay the same however slow the engine turns out to be)
        scale = work.queue_s + work.tokens_s + work.pairs_s + work.moved_s + T_REF
        weight = 1.0 / (scale * scale) * self._robust(y / expected)
        x = (T_REF, work.queue_s, work.tokens_s, work.pairs_s, work.moved_s)
        xx, xy = self._xx, self._xy
        for i in range(N):
            wi = weight * x[i]
            row = xx[i]
            for j in range(N):
                row[j] = DECAY * row[j] + wi * x[j]
            xy[i] = DECAY * xy[i] + wi * y
        self.samples += 1
        if self.samples <= 2 * SOLVE_EVERY or self.samples % SOLVE_EVERY == 0:
            self._fit()

    def fade(self, now: float) -> None:
        """Fade the evidence of a worker that has had no sample for `STALE_AFTER_S` by the
        time since (halving every `FADE_HALF_LIFE_S`), and refit: its coefficients return
        toward the constants. Called with the load reads, about once a second."""
        if not self.learn or not self.samples:
            return
        start = max(self._last_sample + STALE_AFTER_S, self._faded_to)
        if now <= start:
            return
        if now - self._last_sample > FORGET_AFTER_S:  # nothing left worth a refit each second
            self._forget()
            return
        keep = 0.5 ** ((now - start) / FADE_HALF_LIFE_S)
        self._faded_to = now
        for row in self._xx:
            for j in range(N):
                row[j] *= keep
        for i in range(N):
            self._xy[i] *= keep
        self._typical *= keep
        self._fit()

    def _forget(self) -> None:
        """Back at the constants with no evidence, as a worker never measured."""
        self._xx = [[0.0] * N for _ in range(N)]
        self._xy = [0.0] * N
        self._typical, self.samples = 0.0, 0
        self._fit()

    def _robust(self, ratio: float) -> float:
        """A sample's weight by how far its ratio to the fit's prediction lies from the
        typical ratio now (a Huber weight: the influence of one far sample is bounded).
        The typical ratio is the samples' running median: an engine that is slower than the
        fit in most samples moves it within tens of samples and is learned at full weight;
        the few requests an engine's batching held behind another's prefill do not."""
        log_ratio = math.log(ratio)
        self._typical += TYPICAL_STEP if log_ratio > self._typical else -TYPICAL_STEP
        residual = abs(ratio / math.exp(self._typical) - 1.0)
        return 1.0 if residual <= HUBER else HUBER / residual

    def _fit(self) -> None:
        a = [[self._xx[i][j] + _R[i][j] for j in range(N)] for i in range(N)]
        b = [self._xy[i] + _R_PRIOR[i] for i in range(N)]
        theta = _solve(a, b)
        low, high = COEF_RANGE
        self.overhead_s = min(max(theta[0] * T_REF, 0.0), MAX_OVERHEAD_S)
        c = self.coefficients
        c.queue_x, c.token_x, c.pair_x, c.transfer_x = (min(max(t, low), high) for t in theta[1:])

    def as_json(self) -> dict[str, float | int]:
        return {
            "overhead_s": round(self.overhead_s, 6),
            "queue": round(self.queue_x, 4),
            "per_token": round(self.token_x, 4),
            "per_pair": round(self.pair_x, 4),
            "transfer": round(self.transfer_x, 4),
            "samples": self.samples,
        }


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a symmetric positive definite `a` (the prior makes it so):
    Gaussian elimination without pivoting, which such a matrix does not need."""
    n = len(b)
    for k in range(n):
        pivot = a[k][k]
        for i in range(k + 1, n):
            f = a[i][k] / pivot
            if f:
                row_i, row_k = a[i], a[k]
                for j in range(k, n):
                    row_i[j] -= f * row_k[j]
                b[i] -= f * b[k]
    x = [0.0] * n
    for k in range(n - 1, -1, -1):
        x[k] = (b[k] - sum(a[k][j] * x[j] for j in range(k + 1, n))) / a[k][k]
    return x
