"""Presets that compare systems at a measured share of what the cluster sustains, over
paired seeds: `--hot-prefix` and `--pd`.

A `Config` is one comparison: a workload on one cluster shape. It has one or more `Member`
clusters of that shape and KV (PD: one per caching mode, since the mode is a worker flag),
each with the systems that run on it. The first member is started first and calibrated:
its reference system finds the rate the cluster sustains (`sustained`), and then every
member runs every seed's workload at `load` x that rate. So every system of a config gets
the same requests, at the same times, on workers of the same shape and KV; ratios between
systems are taken within a seed and summarized over the seeds (`paired_report`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import step as advance
from benchmarks.multiturn.cluster import RouterSpec
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.plan import Plan, Step
from benchmarks.multiturn.runner import Context, execute, run_one
from benchmarks.multiturn.sustained import Calibration, Search, at_rate, calibrate
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.working_set import Sizing, estimate, hot_set_tokens
from benchmarks.multiturn.workloads import Workload
from benchmarks.peers import OURS
from localrun.cluster import Cluster, ClusterSpec

if TYPE_CHECKING:
    from benchmarks.multiturn.capacity import Features

# MemServe's names for the caching modes, as the reports show them
MODE_LABELS = {
    None: "",
    "basic": "PD-Basic",
    "caching-1": "PD-Caching-1",
    "caching-2": "PD-Caching-2",
    "caching-3": "PD-Caching-3",
}


def system_label(system: str, pd_caching: str | None) -> str:
    """A system as the reports name it: with its workers' caching mode on a PD cluster."""
    mode = MODE_LABELS.get(pd_caching, pd_caching or "")
    return f"{system} [{mode}]" if mode else system


def selected(systems: set[str] | None, system: str, pd_caching: str | None) -> bool:
    """Whether `--systems` asks for this system on this caching mode's cluster: by its name
    (every mode) or by its label ('ours prompt_tree [PD-Caching-3]': that mode only)."""
    return systems is None or system in systems or system_label(system, pd_caching) in systems


@dataclass(frozen=True)
class Prebuilt:
    """A workload built (and measured) while planning, handed to the runner as a builder."""

    workload: Workload
    rate: float

    def build(self, vocab: Vocab) -> Workload:
        return self.workload


@dataclass(frozen=True)
class Member:
    """One cluster of a config and the systems compared on it."""

    spec: ClusterSpec
    systems: tuple[RouterSpec, ...]


@dataclass(frozen=True)
class Config:
    """One comparison: `workload` (seed -> builder at a nominal rate) on `members`, offered at
    `load` x the rate `reference` sustains on the first member with the `calibration`
    builder (a seed no measured run uses); without one (None), each seed's `Prebuilt`
    workload at its own rate."""

    key: str
    workload: str
    seeds: dict[int, Any]
    calibration: Any
    members: tuple[Member, ...]
    reference: RouterSpec
    load: float
    api: str
    labels: dict[str, Any] = field(default_factory=dict)  # into every record of the config
    # Configs with the same rate_key (the same workload on the same cluster, another load)
    # share one sustained rate, measured on the first of them to run; "": the config's own.
    rate_key: str = ""

    def cluster_key(self, member: Member) -> str:
        mode = MODE_LABELS.get(member.spec.caching, "")
        return f"{self.key}" + (f" [{mode}]" if mode else "")


@dataclass
class PairedPlan:
    """A preset made concrete: its configs, the search for the sustained rate, what was
    left out, the sizing per config (for results.json), and sustained rates taken from an
    earlier run instead of measured (`--calibration-from`)."""

    preset: str
    configs: list[Config]
    search: Search
    notes: list[str] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    known: dict[str, float] = field(default_factory=dict)

    def plan(self) -> Plan:
        """The runner's plan: every member cluster in config order, one step per seed with
        a placeholder rate (`Rater` sets it once the config's rate is known)."""
        clusters: dict[str, ClusterSpec] = {}
        steps: list[Step] = []
        for config in self.configs:
            for member in config.members:
                key = config.cluster_key(member)
                clusters[key] = member.spec
                for seed, builder in config.seeds.items():
                    labels = {**config.labels, "config": config.key, "seed": seed}
                    steps.append(
                        Step(key, builder, member.systems, self.preset, 0.0, labels, samples=True)
                    )
        return Plan(self.preset, clusters, steps, None, list(self.notes))


@dataclass
class Rater:
    """The runner's per-cluster hook: measures a config's sustained rate on its first member
    (or takes a known one), then hands every member's steps the seeds' workloads built at
    `load` x that rate, the same objects for every member."""

    ctx: Context
    paired: PairedPlan
    calibrations: dict[str, dict[str, Any]] = field(default_factory=dict)
    sustained: dict[str, float | None] = field(default_factory=dict)  # by rate key
    measured_by: dict[str, str] = field(default_factory=dict)  # rate key -> config key
    built: dict[tuple[str, int], Prebuilt] = field(default_factory=dict)

    def config_of(self, cluster: Cluster) -> Config:
        for config in self.paired.configs:
            if any(m.spec.name == cluster.spec.name for m in config.members):
                return config
        raise KeyError(cluster.spec.name)

    def __call__(self, cluster: Cluster, steps: list[Step], model: str, floor: Floor) -> list[Step]:
        config = self.config_of(cluster)
        if config.calibration is None:  # a fixed rate: each seed's own
            return [replace(step, rate=step.workload.rate) for step in steps]
        shared = config.rate_key or config.key
        if shared not in self.sustained:
            self.sustained[shared] = self.measure(config, cluster, model, floor)
            self.measured_by[shared] = config.key
        elif config.key not in self.calibrations:  # the rate of a config measured before
            first = self.calibrations.get(self.measured_by[shared]) or {}
            self.calibrations[config.key] = {
                **first,
                "config": config.key,
                "load": config.load,
                "shared_with": self.measured_by[shared],
            }
        sustained = self.sustained[shared]
        if sustained is None:  # no rate to offer: the config's runs are left out (said)
            return []
        rate = config.load * sustained
        out = []
        for step in steps:
            seed = int(step.labels["seed"])
            labels = {**step.labels, "sustained_rps": sustained, "load": config.load}
            workload = self.workload(config, seed, rate)
            out.append(replace(step, workload=workload, rate=rate, labels=labels))
        return out

    def workload(self, config: Config, seed: int, rate: float) -> Prebuilt:
        if (config.key, seed) not in self.built:
            workload = self.build(at_rate(config.seeds[seed], rate), config, seed)
            self.built[(config.key, seed)] = Prebuilt(workload, rate)
        return self.built[(config.key, seed)]

    def build(self, builder: Any, config: Config, seed: int | None) -> Workload:
        workload: Workload = builder.build(self.ctx.vocab)
        workload.api = config.api
        workload.params = {**workload.params, "seed": seed}
        return workload

    def measure(self, config: Config, cluster: Cluster, model: str, floor: Floor) -> float | None:
        """The config's sustained rate: known, or searched for on `cluster`; None when the
        search found none (its calibration entry says why)."""
        if config.key in self.paired.known:
            known = self.paired.known[config.key]
            self.calibrations[config.key] = {"sustained_rps": known, "stopped": "known"}
            return known
        reference = self.reference(config)
        label = f"calibrate {config.key}: {reference.name}"
        task = self.ctx.progress.add_task(label, total=self.paired.search.max_steps)
        runs: list[dict[str, Any]] = []

        def run_at(rate: float) -> dict[str, Any]:
            workload = self.build(at_rate(config.calibration, rate), config, None)
            step = Step(
                cluster.spec.name, Prebuilt(workload, rate), (reference,), "calibration", rate
            )
            record = run_one(self.ctx, cluster, step, reference, workload, model, floor)
            runs.append(record)
            advance(self.ctx.progress, task)
            return record

        planned = estimate(
            self.build(config.calibration, config, None), self.ctx.vocab, self.ctx.encoder
        )
        result: Calibration = calibrate(
            cluster, reference, run_at, floor, planned, self.paired.search
        )
        self.ctx.progress.remove_task(task)
        entry = result.to_dict()
        entry["config"] = config.key
        entry["load"] = config.load
        entry["calibration_workload"] = runs[0].get("workload_params") if runs else None
        self.calibrations[config.key] = entry
        return result.sustained_rps

    def reference(self, config: Config) -> RouterSpec:
        """The config's reference system, or ours when that peer cannot run here."""
        ref = config.reference
        status = self.ctx.peers.get(ref.router)
        if ref.router == OURS or (status is not None and status.importable):
            return ref
        return next(s for s in config.members[0].systems if s.router == OURS)


def run_paired(ctx: Context, paired: PairedPlan) -> tuple[list[dict[str, Any]], Rater]:
    """Every config: calibrate, then every member's systems on every seed."""
    rater = Rater(ctx, paired)
    return execute(ctx, rater), rater


def earlier_sizing(
    known: dict[str, dict[str, Any]] | None, workload: str, field: str
) -> int | None:
    """`field` of the earlier run's configs of `workload` (keys '<workload>, ...'), if any."""
    for key, setup in (known or {}).items():
        value = setup.get(field)
        if key.split(", ")[0] == workload and isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class HotSetKV:
    """Each worker's device KV as a share of the seeds' hot set (prompt pages two or more
    requests share): how the hot-prefix and LoRA presets size their workers."""

    name: str  # the workload's
    per_seed: dict[int, int]  # each seed's hot set, tokens
    hot_set: int  # the median of those, or an earlier run's
    earlier: bool  # sized as the run the rates came from sized it
    largest: int  # the largest request's prompt and answer, tokens
    kv: int  # a worker's device KV, tokens

    @classmethod
    def of(
        cls,
        built: dict[int, Workload],
        known: dict[str, dict[str, Any]] | None,
        share: float,
        instances: int,
    ) -> HotSetKV:
        """`share` of the hot set a worker; ValueError when a request does not fit one."""
        name = next(iter(built.values())).name
        per_seed = {seed: hot_set_tokens(w) for seed, w in built.items()}
        earlier = earlier_sizing(known, name, "hot_set_tokens")
        hot_set = earlier or int(statistics.median(per_seed.values()))
        # Sizing's instance KV is working set / (multiple x instances): this multiple gives
        # a worker `share` of the hot set.
        sizing = Sizing(hot_set, 1 / (share * instances), instances)
        largest = max(
            len(r.prompt_ids or []) + r.max_tokens for w in built.values() for r in w.requests
        )
        sizing.check_fits(largest)
        return cls(name, per_seed, hot_set, earlier is not None, largest, sizing.instance_tokens)

    @classmethod
    def of_builders(
        cls,
        builders: dict[int, Any],
        vocab: Vocab,
        known: dict[str, dict[str, Any]] | None,
        share: float,
        instances: int,
        on_seed: Callable[[], None],
    ) -> HotSetKV:
        """Every seed's workload built (`on_seed` after each), then sized as `of` does."""
        built: dict[int, Workload] = {}
        for seed, builder in builders.items():
            built[seed] = builder.build(vocab)
            on_seed()
        return cls.of(built, known, share, instances)

    def setup(self, time_scale: float) -> dict[str, Any]:
        """The sizing as a config's entry of results.json's `setup` gives it."""
        return {
            "hot_set_tokens_per_seed": {str(s): v for s, v in self.per_seed.items()},
            "hot_set_tokens": self.hot_set,
            "instance_kv_tokens": self.kv,
            "largest_request_tokens": self.largest,
            "time_scale": time_scale,
        }

    def seeds_text(self) -> str:
        return ", ".join(f"{s}: {v:,}" for s, v in self.per_seed.items())

    def kv_text(self, share: float) -> str:
        """The sizing in a config's setup text (`share`: of the hot set, a worker)."""
        earlier = "as the run the rates came from sized it; " if self.earlier else ""
        return (
            f"device KV {self.kv:,} tokens a worker = {share:g} x the hot set of "
            f"{self.hot_set:,} tokens ({earlier}median of seeds {self.seeds_text()})"
        )

    def cluster(
        self, name: str, label: str, time_scale: float, features: Features, **shape: Any
    ) -> ClusterSpec:
        """Sim workers of this KV (`shape`: ClusterSpec's counts, caching, worker_args), with
        MemPool pulls and KV events where this tree's worker offers them."""
        return ClusterSpec(
            name,
            label=label,
            time_scale=time_scale,
            max_total_tokens=self.kv,
            mempool_pull=features.pulls,
            kv_events=features.kv_events,
            **shape,
        )


def known_from(source: Path) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """An earlier run's sustained rates per config (`calibration`) and each config's setup
    (its KV sizing), from its results.json: a run of some of its seeds (`--calibration-from`,
    to split the seeds over several invocations) is offered those rates and sizes the KV as
    that run did, not by the median of its own seeds. ValueError without measured rates."""
    figures = json.loads((source / "results.json").read_text())
    rates = {}
    for key, entry in (figures.get("calibration") or {}).items():
        if entry.get("sustained_rps"):
            rates[key] = float(entry["sustained_rps"])
    if not rates:
        raise ValueError(f"{source / 'results.json'} has no measured sustained rates")
    setup = figures.get("setup") or {}
    return rates, {k: v for k, v in setup.items() if isinstance(v, dict)}
