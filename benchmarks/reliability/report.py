"""One row per fault, bad input and attack, a verdict each, written to results.json/.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report.page import write_results
from benchmarks.report.table import table_section

BOUND_S = 30.0  # no request may take longer: past it, it hung
RSS_SLACK_MIB = 16.0  # an attack may grow the router's RSS this much (allocator noise)
MAX_PAYLOAD = 1 << 20  # the attacked router's --max-payload-size
HEADER_TIMEOUT_S = 3.0  # and its --header-read-timeout-secs


def verdict(ok: bool, error: str | None = None) -> str:
    return "pass" if ok else "FAIL" + (f": {error}" if error else "")


@dataclass
class FaultResult:
    """What one fault scenario did and what came of it."""

    scenario: str
    injected: str
    client_saw: str = ""
    requests: int = 0
    answered: int = 0  # 200 with the whole answer (first try or the router's retry)
    clear_errors: int = 0
    unclear: int = 0  # hung, or a 5xx without a JSON message, or a stream cut off silently
    bound_s: float = BOUND_S
    slowest_s: float = 0.0
    leaked_blocks: int = 0  # summed over the surviving workers (-1 if one could not be read)
    healed: bool = False
    healed_how: str = ""
    expected: str = ""  # what a client should see
    expectation_met: bool = True
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # the scenario itself broke (a process would not start)
    measured: dict[str, float] = field(default_factory=dict)  # what the servers counted

    @property
    def bound_met(self) -> bool:
        return self.requests > 0 and self.unclear == 0 and self.slowest_s <= self.bound_s

    @property
    def passed(self) -> bool:
        healthy = self.bound_met and self.leaked_blocks == 0 and self.healed
        return self.error is None and healthy and self.expectation_met

    def row(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "injected": self.injected,
            "client saw": self.client_saw,
            "bound met": f"{'yes' if self.bound_met else 'NO'} "
            f"(slowest {self.slowest_s:.1f} s, bound {self.bound_s:.0f} s)",
            "leaked blocks": self.leaked_blocks,
            "healed": f"{'yes' if self.healed else 'NO'}: {self.healed_how}",
            "verdict": verdict(self.passed, self.error),
        }

    def figures(self) -> dict[str, Any]:
        return {**asdict(self), "bound_met": self.bound_met, "passed": self.passed}


@dataclass
class InputResult:
    """One bad input sent to one server."""

    case: str
    target: str  # router or worker
    route: str
    status: int | None
    message: str
    expected: str
    passed: bool
    still_serving: bool

    def row(self) -> dict[str, Any]:
        return {
            "input": self.case,
            "to": self.target,
            "route": self.route,
            "status": self.status,
            "message": self.message[:70],
            "expected": self.expected,
            "verdict": verdict(self.passed and self.still_serving),
        }


@dataclass
class LimitResult:
    """One attack on the router's HTTP server and what came of it."""

    attack: str
    sent: str
    answer: str
    expected: str
    passed: bool
    rss_before_mib: float
    rss_after_mib: float
    still_serving: bool
    seconds: float

    @property
    def rss_kept(self) -> bool:
        return self.rss_after_mib - self.rss_before_mib <= RSS_SLACK_MIB

    @property
    def verdict(self) -> bool:
        return self.passed and self.still_serving and self.rss_kept

    def row(self) -> dict[str, Any]:
        rss = f"{self.rss_before_mib:.0f} -> {self.rss_after_mib:.0f}"
        return {
            "attack": self.attack,
            "sent": self.sent,
            "answer": self.answer,
            "expected": self.expected,
            "router RSS MiB before -> after": rss,
            "verdict": verdict(self.verdict),
        }

    def figures(self) -> dict[str, Any]:
        return {**vars(self), "rss_kept": self.rss_kept, "verdict": self.verdict}


def counts(
    faults: list[FaultResult], inputs: list[InputResult], limits: list[LimitResult]
) -> dict[str, int]:
    return {
        "faults_tried": len(faults),
        "faults_passed": sum(f.passed for f in faults),
        "inputs_tried": len(inputs),
        "inputs_passed": sum(i.passed and i.still_serving for i in inputs),
        "attacks_tried": len(limits),
        "attacks_passed": sum(a.verdict for a in limits),
    }


NOTES = [
    "Real processes on loopback: sim workers (`--backend sim`, modelled time scaled down) "
    "and routers started as `python -m ...`; faults are signals to their pids (SIGKILL for "
    "a crash, SIGSTOP/SIGCONT for a process that accepts and never answers).",
    "Leaked blocks: on every surviving worker, once its in-flight work ended, MemPool blocks "
    "allocated but not held by the cache index, plus pages still pinned (/get_server_info "
    "`mempool`); 0 means nothing a request, transfer or pull held was left behind.",
    "Bound: every request has a hard client-side limit; a request still open then is hung.",
    "Healed: the router marked the broken worker unhealthy (or its requests went elsewhere), "
    "saw it healthy again after a restart or SIGCONT, and requests after the fault succeeded.",
    "Pressure rows (KV exhausted, overloaded cluster, retracted PD decode) kill nothing: they "
    "pass only if the servers counted the pressure (retractions in the workers' "
    "/get_server_info `internal_states`, 429s in the router's "
    "`memserve_router_admission_refusals_total`), every answer is whole (never an abort) "
    "and, for the retraction rows, token for token a roomy worker's; healed there means "
    "every worker idle again, all healthy, later requests answered.",
    "Attacks on the HTTP server: raw sockets against a router started with "
    f"`--max-payload-size {MAX_PAYLOAD}` and `--header-read-timeout-secs "
    f"{HEADER_TIMEOUT_S:g}`; a row passes when the answer is the expected one (or the "
    "connection closed in time), the router still answers /health after it, and its RSS "
    f"grew at most {RSS_SLACK_MIB:g} MiB. 'sent': what got into the socket before the "
    "router refused, closed or stopped reading (the kernel's buffers take some MiB).",
    "Regenerate: `python -m benchmarks.reliability --out benchmarks/results/reliability`.",
]


def publish(
    out: Path,
    mode: str,
    faults: list[FaultResult],
    inputs: list[InputResult],
    limits: list[LimitResult],
    wall_s: float,
) -> dict[str, int]:
    """results.json and results.md in `out`; the counts."""
    total = counts(faults, inputs, limits)
    figures = {
        "mode": mode,
        "counts": total,
        "wall_s": round(wall_s, 1),
        "faults": [f.figures() for f in faults],
        "inputs": [vars(i) for i in inputs],
        "http_limits": [a.figures() for a in limits],
    }
    headline = [
        {"what": what, "tried": total[f"{key}_tried"], "passed": total[f"{key}_passed"]}
        for what, key in (
            ("faults injected", "faults"),
            ("bad inputs sent", "inputs"),
            ("attacks on the HTTP server", "attacks"),
        )
    ]
    details = [
        f"- **{f.scenario}**: expected {f.expected}; {f.requests} requests, {f.answered} "
        f"answered, {f.clear_errors} clear errors, {f.unclear} unclear. "
        + " ".join([*f.notes, *(f"{k}: {v:g}." for k, v in f.measured.items())])
        for f in faults
    ]
    body = [
        *table_section("Faults", [f.row() for f in faults]),
        "### What each scenario expected and saw",
        "",
        *details,
        "",
        *table_section("Bad inputs", [i.row() for i in inputs]),
        *table_section("Attacks on the HTTP server", [a.row() for a in limits]),
    ]
    title = "Reliability: faults injected into real processes, and bad inputs"
    write_results(out, "results", figures, headline, title, NOTES, body=body)
    return total
