"""Each engine's speed, learned from the times to first token the router measures.

The cost model's per-token prefill, attention and step costs are one model on one GPU (the
sim's Llama-3.1-8B on an H100). A cluster of other GPUs, another model, or two GPU
generations mixed would be priced for a machine it is not. So each worker carries a
`slowness`: measured seconds over the seconds those constants give for the same work. The
cost model multiplies its modelled queue and prefill times by it (router.policies.CostModel);
the constants are only the starting point.

What is measured: a request whose first byte marks its first token (a streamed answer, a PD
prefill's answer) took `measured` seconds from its send; the policy modelled `modelled`
seconds of work ahead of it and in it at slowness 1 (the work queued on the worker, the
requests running there and its own uncached prefill). Their ratio is the worker's slowness
in this request; a running average in log space (slow and fast errors weigh alike) follows
it. The queue model is rough, so the ratio carries the same bias on every worker: what it
gets right is how much slower one worker is than another, which is what routing needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.05  # a new sample's weight once there are 20 (before: the mean of the samples)
MIN_MODELLED_S = 0.002  # shorter work is mostly network and scheduling noise
RATIO_RANGE = (0.05, 50.0)  # a sample outside is clamped (a hiccup, a stalled stream)


@dataclass(slots=True)
class EngineSpeed:
    """One worker's slowness against the cost model's constants (1.0: as they say)."""

    slowness: float = 1.0
    samples: int = 0
    learn: bool = True  # False: stays at 1.0 (--engine-speed fixed)

    def observe(self, measured_s: float, modelled_s: float) -> None:
        """A request took `measured_s` to its first token where the constants modelled
        `modelled_s` (at slowness 1)."""
        if not self.learn or modelled_s < MIN_MODELLED_S or not measured_s > 0:
            return
        low, high = RATIO_RANGE
        ratio = min(max(measured_s / modelled_s, low), high)
        self.samples += 1
        weight = max(ALPHA, 1.0 / self.samples)
        self.slowness = math.exp((1 - weight) * math.log(self.slowness) + weight * math.log(ratio))
