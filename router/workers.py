"""The router's view of its workers: health, circuit breakers and load.

Load is what the router itself has in flight to each worker (requests and prompt tokens),
refreshed with what the worker reports on /get_load, so a router that just started, or
one of several replicas, still sees work it did not send (less its own requests in the
report that were answered since it was asked for: a report is up to a load interval old);
replicas sharing state through Redis (router.replicas) also add each other's in-flight
counts.

The queue a new request joins is measured, not only modelled: requests whose first byte
tells when the worker began them (streamed answers, prefill sides) count as waiting until
it comes, the worker's own report of its waiting requests is read every
`load_interval_s`, and the rate at which it finishes requests is kept; waiting requests
over that rate is how long the next one is expected to wait (Little's law). It sees what a
model of prefill work cannot: requests waiting for KV memory or a batch slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

import aiohttp

from mempool._radix import WorkerState
from router.adapters import WorkerAdapters
from router.speed import EngineSpeed, delegated

log = logging.getLogger(__name__)


class WorkerType(Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class BreakerState(Enum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(slots=True)
class BreakerConfig:
    """sglang-router's defaults: 10 failures open it for 60 s; 3 successes close it."""

    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_s: float = 60.0
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class Agent:
    """A worker's MemPool transfer agent: where peers pull its cached prefixes from."""

    instance_id: int
    host: str
    port: int
    pulls: bool = True  # the worker pulls too (a PD decode only serves its cache)

    @classmethod
    def from_server_info(cls, info: object) -> Agent | None:
        """`memserve.agent` of a worker's /get_server_info, when it serves pulls (and
        whether it pulls: `kv_pull`)."""
        memserve = info.get("memserve") if isinstance(info, dict) else None
        if not isinstance(memserve, dict):
            return None
        pulls = bool(memserve.get("kv_pull"))
        if not (pulls or memserve.get("serves_pulls")):
            return None
        agent = memserve.get("agent")
        if not isinstance(agent, dict):
            return None
        iid, host, port = agent.get("instance_id"), agent.get("host"), agent.get("port")
        if not (isinstance(iid, int) and isinstance(host, str) and isinstance(port, int)):
            return None
        return cls(iid, host, port, pulls)

    def hint(self) -> dict[str, object]:
        return {"instance_id": self.instance_id, "host": self.host, "port": self.port}


@dataclass(eq=False, slots=True)
class Worker:
    """One engine instance behind the router. Its load figures, learned speed and abilities
    live in `state` (a native WorkerState), which the routing decision reads in one call."""

    url: str
    type: WorkerType = WorkerType.COLOCATED
    bootstrap_port: int | None = None
    healthy: bool = True
    model_id: str | None = None
    health_failures: int = 0
    health_successes: int = 0
    breaker: BreakerState = BreakerState.CLOSED
    breaker_failures: int = 0
    breaker_successes: int = 0
    breaker_opened_at: float = 0.0
    processed: int = 0
    learned: bool = False  # its /get_server_info was read (model, agent, KV-event source)
    kv_capacity: int | None = None  # device KV in tokens (its server info's max_total_num_tokens)
    adapters: WorkerAdapters = field(default_factory=WorkerAdapters)  # its LoRA adapters loaded
    # the deadlines of the exchanges in flight to it (router.forward.relay.Bound): a worker that
    # stops answering its health checks has them ended at once instead of at the timeout
    exchanges: set[asyncio.Timeout] = field(default_factory=set)
    # called whenever its load figures change (the registry's load_changed: requests held
    # for an expected wait re-evaluate then, instead of polling)
    changed: Callable[[], None] = field(default=lambda: None, repr=False)
    state: WorkerState = field(init=False, repr=False)
    # how much slower than the cost model's constants it computes (router.speed)
    speed: EngineSpeed = field(init=False, repr=False)
    _agent: Agent | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.state = WorkerState(self.url, self.type is WorkerType.PREFILL)
        self.speed = EngineSpeed(self.state)

    in_flight = delegated("state", "in_flight", "this router's requests in flight to it")
    in_flight_tokens = delegated(
        "state", "in_flight_tokens", "their prompt tokens not prefilled yet"
    )
    in_flight_fixed_s = delegated(
        "state", "in_flight_fixed_s", "the adapter loads those not begun wait for, seconds"
    )
    reported_reqs = delegated("state", "reported_reqs", "requests it reported running")
    reported_waiting = delegated("state", "reported_waiting", "requests it reported waiting")
    reported_pending_tokens = delegated(
        "state", "reported_pending_tokens", "tokens it reported queued"
    )
    peer_in_flight = delegated(
        "state",
        "peer_in_flight",
        "other router replicas' requests in flight to it, as last published",
    )
    peer_in_flight_tokens = delegated("state", "peer_in_flight_tokens", "their prompt tokens")
    pulls_served = delegated("state", "pulls_served", "requests in flight pulling a prefix from it")
    free_tokens = delegated(
        "state", "free_tokens", "device KV it has free, as its KV events tell (-1: not known)"
    )
    unstarted = delegated(
        "state",
        "unstarted",
        "this router's requests not begun yet, as their first byte tells (InFlight)",
    )

    @property
    def agent(self) -> Agent | None:
        """Its MemPool agent, when it pulls and serves prefixes."""
        return self._agent

    @agent.setter
    def agent(self, agent: Agent | None) -> None:
        self._agent = agent
        self.state.has_agent = agent is not None
        self.state.can_pull = agent is not None and agent.pulls

    @property
    def load(self) -> int:
        """Requests in flight: the routers' count (this one's plus its replicas') or the
        worker's report (less this router's requests in it answered since), whichever is
        larger."""
        return self.state.load

    @property
    def queued_tokens(self) -> int:
        return self.state.queued_tokens

    @property
    def waiting(self) -> int:
        """Requests waiting to begin on it: this router's not begun, or the worker's own
        count of waiting requests (less one per request of this router's in its report
        answered since), whichever is larger."""
        return self.state.waiting

    def service_rate(self, now: float | None = None) -> float | None:
        """Requests it finished per second over its last 32 (None: under 4); a worker that
        stopped finishing any is slower than its last ones say."""
        return self.state.service_rate(now)

    def measured_wait_s(self, now: float | None = None) -> float:
        """Seconds a request sent now is expected to wait before it begins: the requests
        waiting ahead of it over the rate it serves them (0 when none wait). Of this router's
        requests not begun, the oldest is taken as being prefilled (the cost model's queued
        work prices its rest): counted, one request in prefill read as a whole service time
        of wait (1/rate, 0.2-0.4 s on the sweep's workers against 5-175 ms of prefill)."""
        return self.state.measured_wait_s(now)

    @property
    def can_pull(self) -> bool:
        """It pulls a longer prefix from a peer when a request names one (our workers with
        --enable-mempool-pull; a real SGLang server does not)."""
        return self.state.can_pull

    @contextlib.contextmanager
    def serving_pull(self) -> Iterator[None]:
        """Count a request that pulls a prefix from this worker while it runs."""
        state = self.state
        state.pulls_served += 1
        try:
            yield
        finally:
            state.pulls_served -= 1

    def abandon_exchanges(self) -> int:
        """Stop waiting for it: every exchange in flight ends now with a TimeoutError (a
        request not yet answered is retried elsewhere, a stream ends with an error event);
        returns how many."""
        now = asyncio.get_running_loop().time()
        pending = [cm for cm in self.exchanges if not cm.expired()]
        self.exchanges.clear()
        for cm in pending:
            cm.reschedule(now)
        return len(pending)

    def request(
        self, prefill_tokens: int, begins_at_first_byte: bool = False, fixed_s: float = 0.0
    ) -> InFlight:
        """Count one request against this worker while it runs (`with worker.request(n):`);
        `begins_at_first_byte`: its first byte comes when the worker begins it (a streamed
        answer, a prefill), so until then it is counted as waiting; `fixed_s`: a load it
        waits for before its prefill (an adapter's), queued work until its first byte."""
        return InFlight(self, prefill_tokens, begins_at_first_byte, fixed_s)

    def ask_load(self) -> None:
        """A report is being asked for: of the requests in flight now, those answered from
        here on leave it (InFlight)."""
        state = self.state
        state.report_asks += 1
        state.reported_ended = 0

    def apply_load(self, loads: object) -> None:
        """The worker's own report (SGLang's /v1/loads or /get_load body), asked for by
        `ask_load` just before (without it, no answer of this router's is taken out of it)."""
        if isinstance(loads, dict):
            loads = loads.get("loads", [loads])
        if not isinstance(loads, list):
            return
        entries = [x for x in loads if isinstance(x, dict)]
        self.reported_reqs = sum(int(x.get("num_reqs", 0) or 0) for x in entries)
        self.reported_waiting = sum(int(x.get("num_waiting_reqs", 0) or 0) for x in entries)
        self.reported_pending_tokens = sum(
            int(x.get("num_pending_tokens", 0) or 0) for x in entries
        )
        self.changed()


class InFlight:
    """One request in flight on a worker: counted until it ends, its prompt tokens still to
    compute (and a load it waits for) counted as queued prefill work until its first byte
    (`prefill_done`), and, when its first byte marks its beginning, counted as waiting until
    then."""

    __slots__ = ("_asks", "_fixed", "_state", "_tokens", "_waiting", "worker")

    def __init__(
        self, worker: Worker, prefill_tokens: int, waiting: bool = False, fixed_s: float = 0.0
    ) -> None:
        self.worker = worker
        self._state = worker.state
        self._tokens = max(prefill_tokens, 0)
        self._fixed = max(fixed_s, 0.0)
        self._waiting = waiting
        self._asks = self._state.report_asks  # a report asked for later may count it

    def __enter__(self) -> InFlight:
        state = self._state
        state.in_flight += 1
        state.in_flight_tokens += self._tokens
        state.in_flight_fixed_s += self._fixed
        state.unstarted += self._waiting
        self.worker.changed()
        return self

    def _begun(self) -> None:
        """Its prompt and load are no longer queued work, nor is it waiting."""
        state = self._state
        state.in_flight_tokens -= self._tokens
        if self._fixed:  # (a sum of floats: none left is exactly none)
            left = state.in_flight_fixed_s - self._fixed
            state.in_flight_fixed_s = left if left > 1e-9 else 0.0
        state.unstarted -= self._waiting
        self._tokens, self._fixed, self._waiting = 0, 0.0, False

    def prefill_done(self) -> None:
        """The worker has begun answering: its prompt is no longer queued work."""
        if self._tokens or self._fixed or self._waiting:
            self._begun()
            self.worker.changed()

    def __exit__(self, *exc: object) -> None:
        state = self._state
        self._begun()
        state.in_flight -= 1
        self.worker.processed += 1
        if not exc or exc[0] is None:  # a failure is not service (it may be instant)
            state.finish()
            if self._asks != state.report_asks:  # in flight when the report was asked for
                state.reported_ended += 1
        self.worker.changed()


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; ValueError if not a URL."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL {url!r} must look like http://host:port")
    return url


class WorkerRegistry:
    """Workers by URL, their breakers, and the health-check loop."""

    def __init__(
        self,
        breaker: BreakerConfig,
        health_interval_s: float = 60.0,
        health_failure_threshold: int = 3,
        health_success_threshold: int = 2,
        health_timeout_s: float = 5.0,
        load_interval_s: float = 1.0,
        learn_speed: bool = True,
    ) -> None:
        self.breaker = breaker
        self.learn_speed = learn_speed  # workers learn their slowness (router.speed)
        self.health_interval_s = health_interval_s
        self.load_interval_s = load_interval_s  # 0: loads are read with health checks only
        self.failure_threshold = health_failure_threshold
        self.success_threshold = health_success_threshold
        self.health_timeout_s = health_timeout_s
        self.workers: dict[str, Worker] = {}
        self._on_gone: list[Callable[[Worker], None]] = []
        self._on_back: list[Callable[[Worker], None]] = []
        self._on_load: list[Callable[[], None]] = []
        self._on_report: list[Callable[[Worker, object], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # whether requests wait in the router's queue for a concurrency slot (the server's
        # Admission.short_of_slots): a worker with nothing to do then is idle for good
        self.backlogged: Callable[[], bool] = lambda: False

    def idle_first(self, workers: list[Worker]) -> tuple[list[Worker], bool]:
        """The workers a request may be placed on, and whether they were narrowed: while
        requests wait for a slot in the router's queue, those of `workers` with nothing in
        flight when some have (work-conserving: a request alone starts sooner where its
        prefix is cached, but an idle worker's time at saturation is lost to every request
        queued); else `workers`."""
        if len(workers) < 2 or not self.backlogged():
            return workers, False
        idle = [w for w in workers if w.state.load == 0]
        if not idle or len(idle) == len(workers):
            return workers, False
        return idle, True

    def add(
        self, url: str, type: WorkerType = WorkerType.COLOCATED, bootstrap_port: int | None = None
    ) -> Worker:
        url = normalize_url(url)
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        worker = Worker(url, type, bootstrap_port, changed=self.load_changed)
        worker.speed.learn = self.learn_speed
        self.workers[url] = worker
        self.load_changed()
        return worker

    def remove(self, url: str) -> Worker:
        url = normalize_url(url)
        try:
            worker = self.workers.pop(url)
        except KeyError:
            raise KeyError(f"no worker {url}") from None
        for callback in self._on_gone:
            callback(worker)
        self.load_changed()
        return worker

    def when_gone(self, callback: Callable[[Worker], None]) -> None:
        """Call `callback(worker)` when a worker is removed or marked unhealthy (the trees
        forget what it held)."""
        self._on_gone.append(callback)

    def when_back(self, callback: Callable[[Worker], None]) -> None:
        """Call `callback(worker)` when an unhealthy worker passes its health checks again,
        or a worker not learned yet (down when it was added) passes one."""
        self._on_back.append(callback)

    def when_load_changes(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever a worker's load figures or the set of available
        workers may have changed (admission's held requests; sibling processes)."""
        self._on_load.append(callback)

    def when_reported(self, callback: Callable[[Worker, object], None]) -> None:
        """Call `callback(worker, report)` with each load report read from a worker (the
        process that reads them passes them on to its siblings)."""
        self._on_report.append(callback)

    def load_changed(self) -> None:
        for callback in self._on_load:
            callback()

    def available(self, type: WorkerType | None = None, model: str | None = None) -> list[Worker]:
        """Workers a request may go to: healthy, breaker not open, of the wanted type and,
        when one is named, serving `model` (router.models)."""
        now = time.monotonic()
        out = []
        for w in self.workers.values():
            if type is not None and w.type is not type:
                continue
            if model is not None and w.model_id != model:
                continue
            if not w.healthy:
                continue
            if w.breaker is BreakerState.OPEN:
                if now - w.breaker_opened_at < self.breaker.timeout_s:
                    continue
                w.breaker = BreakerState.HALF_OPEN
                w.breaker_successes = 0
            out.append(w)
        return out

    # ----------------------------------------------------------------- breaker

    def record_success(self, worker: Worker) -> None:
        worker.breaker_failures = 0
        if worker.breaker is BreakerState.HALF_OPEN:
            worker.breaker_successes += 1
            if worker.breaker_successes >= self.breaker.success_threshold:
                worker.breaker = BreakerState.CLOSED

    def record_failure(self, worker: Worker) -> None:
        if not self.breaker.enabled:
            return
        worker.breaker_failures += 1
        if worker.breaker is BreakerState.HALF_OPEN or (
            worker.breaker_failures >= self.breaker.failure_threshold
        ):
            worker.breaker = BreakerState.OPEN
            worker.breaker_opened_at = time.monotonic()
            self.load_changed()
            log.warning("circuit breaker opened for %s", worker.url)

    # ----------------------------------------------------------------- health

    def start(self, session: aiohttp.ClientSession, checks: bool = True) -> None:
        """`checks`: run the health and load loops (False: another process runs them)."""
        self._session = session
        if not checks:
            return
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._health_loop())
        if self.load_interval_s > 0:
            self._load_task = loop.create_task(self._load_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._load_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def check(self, worker: Worker) -> None:
        """One probe: /health, then /get_load for the worker's own view of its queue."""
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        session = self._session
        if session is None:
            raise RuntimeError("WorkerRegistry.check before start(session)")
        try:
            async with session.get(worker.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:  # the load report is best effort: a healthy worker without it stays healthy
            await self.read_load(worker)
        self._apply_health(worker, ok)
        # A hung worker (it accepts connections, answers nothing) would otherwise hold its
        # requests until --request-timeout-secs: let them go elsewhere now.
        if (
            not ok
            and worker.health_failures >= self.failure_threshold
            and (abandoned := worker.abandon_exchanges())
        ):
            log.warning("gave up on %d requests waiting on %s", abandoned, worker.url)

    async def read_load(self, worker: Worker) -> None:
        """The worker's own view of its queue (SGLang's /v1/loads, or the older /get_load);
        best effort: a worker without it keeps the router's own counts."""
        session = self._session
        if session is None:
            return
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            for path in ("/v1/loads", "/get_load"):  # SGLang's current name, then the old
                worker.ask_load()
                async with session.get(worker.url + path, timeout=timeout) as resp:
                    if resp.status == 200:
                        report = await resp.json(content_type=None)
                        worker.apply_load(report)
                        for callback in self._on_report:
                            callback(worker, report)
                        return

    async def _load_loop(self) -> None:
        """Loads more often than health: the queues the policies and admission weigh
        change within a second (a request waiting for KV memory shows only there)."""
        while True:
            await asyncio.sleep(self.load_interval_s)
            workers = [w for w in self.workers.values() if w.healthy]
            try:
                await asyncio.gather(*(self.read_load(w) for w in workers))
            except Exception:  # never let the loop die
                log.exception("load check round failed")
            self.fade_speeds()

    def fade_speeds(self) -> None:
        """Each worker's learned speed fades toward the constants while no answer of its
        measures it (router.speed)."""
        now = time.monotonic()
        for worker in self.workers.values():
            worker.speed.fade(now)

    def _apply_health(self, worker: Worker, ok: bool) -> None:
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            back = not worker.healthy and worker.health_successes >= self.success_threshold
            if back:
                worker.healthy = True
                log.warning("worker %s is healthy again", worker.url)
                self.load_changed()
            if back or (worker.healthy and not worker.learned):
                for callback in self._on_back:
                    callback(worker)
            return
        worker.health_successes = 0
        worker.health_failures += 1
        if worker.healthy and worker.health_failures >= self.failure_threshold:
            worker.healthy = False
            log.warning("worker %s marked unhealthy", worker.url)
            for callback in self._on_gone:
                callback(worker)
            self.load_changed()

    def set_health(self, worker: Worker, healthy: bool) -> None:
        """Another process's verdict on the worker (it checks; this one follows): the same
        callbacks, and exchanges abandoned, as when this process's own checks decide."""
        if healthy == worker.healthy:
            if healthy and not worker.learned:
                for callback in self._on_back:
                    callback(worker)
            return
        worker.healthy = healthy
        worker.health_failures = 0 if healthy else self.failure_threshold
        worker.health_successes = self.success_threshold if healthy else 0
        for callback in self._on_back if healthy else self._on_gone:
            callback(worker)
        if not healthy:
            worker.abandon_exchanges()
        self.load_changed()

    def mark_dead(self, worker: Worker) -> None:
        """A connection to it failed outright: count it as a failed health probe now."""
        worker.health_failures = max(worker.health_failures, self.failure_threshold - 1)
        self._apply_health(worker, False)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health check round failed")
            if self.load_interval_s <= 0:  # (else the load loop fades them)
                self.fade_speeds()
