"""The discrete-event core: one trainer, R rollout replicas, their relays and the control plane, in modelled time.

Every scheduling decision is the project's own code, passed in as `PolicyFns` (the real functions by default,
a test's double otherwise): the run mode's rules (laminar/policy.py: fresh_lease_room, trainer_batch,
may_start, load_action, min_version, version_of, publishes), the repack planner (workflows/repack.py
plan_repack) and the exactly-once ledger (workflows/ledger.py: lease, add_segment, commit_step). Time is
charged through rl/costs.py's CostModel, the modelled engine's cost functions. What the simulator adds is
only the clock and the queue of events.

How a replica is advanced. All active sequences of a replica decode in lockstep (one token each per decode
step), so a replica keeps a step counter `tau`; a sequence that starts at step s with n tokens to go finishes
at step s + n. A replica's next event is its earliest finishing sequence; the time to get there is the closed
form of CostModel.decode_steps_s (n sequences, a KV cache growing by n tokens a step). An outside event (a
new version, a lease, a repack move) first brings the replica up to that moment with CostModel.steps_within.
No per-token event is ever simulated.

What happens where (mirrors services/rollout/ and workflows/training_run.py with its parts, workflows/trainer.py and
workflows/ledger.py):
- a replica with free group slots (slots and KV for the prompts) claims; the control plane answers at once
  with ledger.lease(min(want, max_ready_groups - ready), fresh_lease_room(...)); a replica that got less than
  it asked for claims again when the ledger changes (a group reported, a step committed);
- leases start when may_start(min_version(...), engine version, newer version waiting) allows and the KV
  cache holds their prompts (prefill charged before the next decode step);
- load_action decides "load" (nothing in flight) or "interrupt" (partial rollout: stop, load, re-prefill);
- a complete group is reported to the ledger at once (add_segment); the trainer asks trainer_batch after
  every report and every step; a step costs CostModel.train_s of the batch's tokens, then the trainer
  publishes (publish stall) when `publishes`; the version reaches the relays after the chain broadcast;
- repack (laminar): plan_repack over the replicas behind the newest version, every PLAN_EVERY_S and after
  each step; a move hands the source's trajectories to the destination, which re-prefills their tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar import policy as policy_mod
from laminar.config import RunConfig
from laminar.contract import BatchPart, StepMetrics, TrainStepInput, TrainStepResult
from laminar.policy import Policy, policy_for, staleness_bound
from laminar.refs import SegmentRef
from laminar.rl.costs import CostModel
from laminar.sim.control import ControlPlaneCost, ControlServer
from laminar.workflows import repack as repack_mod
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState

LONG_TAIL_SIGMA = math.log(10) / 2.326  # rl/modelled.py's: lognormal sigma with p99 / p50 = 10
PREEMPT_FREE = 0.05  # a full KV cache preempts the newest sequences until this fraction is free (no thrashing)


@dataclass(frozen=True)
class PolicyFns:
    """The scheduling functions the simulator asks. Defaults: the project's own (laminar/policy.py,
    workflows/repack.py); a test swaps one for a double to show that the schedule follows it."""

    fresh_lease_room: Callable[..., int | None] = policy_mod.fresh_lease_room
    trainer_batch: Callable[..., list[str] | None] = policy_mod.trainer_batch
    may_start: Callable[..., bool] = policy_mod.may_start
    load_action: Callable[..., str] = policy_mod.load_action
    min_version: Callable[..., int] = policy_mod.min_version
    version_of: Callable[..., int] = policy_mod.version_of
    publishes: Callable[..., bool] = policy_mod.publishes
    plan_repack: Callable[..., list[repack_mod.Move]] = repack_mod.plan_repack


REAL_POLICY = PolicyFns()


@dataclass(frozen=True)
class Lengths:
    """Response lengths and tool turns of each (prompt, sample): deterministic in (seed, prompt), drawn in
    blocks of `block` prompts from one generator, so every mode and placement sees the same workload."""

    p50: int
    cap: int
    long_tail: bool = True
    turns_max: int = 1
    env_p50_s: float = 0.0
    env_tail_ratio: float = 10.0
    seed: int = 0
    exact: Callable[[int, int], int] | None = None  # (prompt, sample) -> length: the real stack's function


@dataclass(frozen=True)
class ControlTiming:
    """The replica loop's control-plane intervals (services/rollout/timing.py ReplicaTiming), in modelled seconds.
    None in SimConfig: an instant control plane (a replica sees a version, gets leases and reports at once)."""

    version_poll_s: float  # a busy replica asks its relay for the newest version this often
    version_wait_poll_s: float  # ... an idle one (nothing in flight) this often
    claim_poll_s: float  # an empty claim is retried after this, doubling ...
    idle_claim_max_s: float  # ... up to this
    claim_min_groups: int  # a replica with groups in flight claims once this many group slots are free
    report_min_groups: int  # complete groups are reported once this many wait ...
    report_max_wait_s: float  # ... or the oldest waited this long (at once while the trainer waits)
    contact_s: float  # a busy replica with no free slot contacts the workflow this often (repack orders)

    def scaled(self, factor: float) -> ControlTiming:
        return ControlTiming(self.version_poll_s * factor, self.version_wait_poll_s * factor,
                             self.claim_poll_s * factor, self.idle_claim_max_s * factor, self.claim_min_groups,
                             self.report_min_groups, self.report_max_wait_s * factor, self.contact_s * factor)


@dataclass
class SimConfig:
    """One simulated run: a mode, a placement and a workload."""

    mode: str
    replicas: int
    costs: CostModel  # one replica's costs; trainer_s_per_token is the whole trainer's
    kv_capacity: int  # tokens per replica
    max_inflight_seqs: int  # sequences per replica
    groups_per_step: int
    group_size: int
    prompt_tokens: int
    lengths: Lengths
    iterations: int = 8  # global batches (versions) to run
    warmup: int = 3  # global batches excluded from the time-based metrics
    repack: bool = True
    stream_minibatches: int = 4
    max_ready_groups: int | None = None  # default: 2 batches
    max_staleness: int = -1  # trainer.max_staleness (partial_rollout's -1 is laminar/policy.py's bound)
    relay_delay_s: float = 0.0  # publish -> the version at every relay (laminar: the chain broadcast)
    load_s: float | None = None  # one weight load on a replica (default: costs.load_s for the mode)
    publish_stall_s: float | None = None  # the trainer's stall per publish (default: costs.publish_stall_s)
    tool_output_tokens: int = 0
    replicas_per_machine: int = 1  # replicas that die together in a `preempt` failure
    failures: tuple[tuple[str, float], ...] = ()  # (kind, modelled time): rollout, relay, trainer, preempt
    failure_costs: dict[str, float] = field(default_factory=dict)
    max_time_s: float = 1e7  # a run that has not finished by then stops (reported as incomplete)
    # A replica's event waits this many decode steps past its first finishing sequence and retires every one
    # that finished by then (each finishes at most this late: 16 steps against ~3,000-token trajectories, ~0.5 %).
    # Fewer events: at 1,024 sequences a replica finishes one about every 3 steps. 0: exact.
    finish_quantum_steps: int = 16
    control: ControlTiming | None = None
    # The run's workflow as a server of updates (sim/control.py); None: it answers at once, for free.
    control_plane: ControlPlaneCost | None = None
    # KV full during decode: preempt the newest sequences (vLLM's recompute preemption, as rl/modelled.py does) and
    # re-prefill them when room frees. False: growth past capacity is not preempted (a cache without a limit).
    preempt: bool = True

    def run_config(self) -> RunConfig:
        """The project's RunConfig of this run, for policy_for and staleness_bound (the real code)."""
        return RunConfig.from_json({
            "run": {"mode": self.mode, "steps": self.iterations * self.steps_per_batch()},
            "rollout": {"replicas": min(self.replicas, 1024), "group_size": self.group_size,
                        "max_inflight_groups": max(1, min(4096, self.max_inflight_seqs // self.group_size)),
                        "repack": self.repack and self.mode == "laminar", "engine": "modelled",
                        "max_ready_groups": self.ready_limit()},
            "trainer": {"groups_per_step": self.groups_per_step, "engine": "modelled",
                        "minibatches": self.steps_per_batch(), "max_staleness": self.max_staleness},
        })

    def steps_per_batch(self) -> int:
        return self.stream_minibatches if self.mode == "stream" else 1

    def ready_limit(self) -> int:
        return self.max_ready_groups if self.max_ready_groups is not None else 2 * self.groups_per_step


class _Seq:
    __slots__ = ("group", "sample", "prompt", "prefix", "start_tau", "end_tau", "segments", "env", "kv_held")

    def __init__(self, group: _Group, sample: int, prompt: int, segments: list[int], env: list[float]):
        self.group, self.sample, self.prompt = group, sample, prompt
        self.prefix = 0  # response tokens generated before the current segment (resumed, moved, tool turns)
        self.start_tau = 0.0
        self.end_tau = 0.0
        self.segments = segments  # remaining segment lengths; the current one first
        self.env = env  # environment latencies after each segment but the last
        self.kv_held = 0  # tokens held while paused (tool call in flight)


class _Group:
    __slots__ = ("group_id", "prompt_id", "version", "remaining", "tokens", "seqs", "replica", "started_at")

    def __init__(self, group_id: str, prompt_id: int, version: int, replica: int, at: float):
        self.group_id, self.prompt_id, self.version = group_id, prompt_id, version
        self.remaining = 0
        self.tokens = 0  # prompt + response tokens of its finished samples
        self.seqs: list[_Seq] = []
        self.replica = replica
        self.started_at = at


class _Replica:
    def __init__(self, rid: int, host: int):
        self.rid = rid
        self.name = f"rollout-{rid:04d}"
        self.host = host
        self.version: int | None = None
        self.tau = 0.0
        self.t = 0.0  # the time tau refers to
        self.busy_until = 0.0  # prefill / weight load in progress: no decoding before this
        self.heap: list[tuple[float, int, _Seq]] = []  # (end_tau, tiebreak, seq) of active sequences
        self.active = 0
        self.kv_base = 0.0  # sum over active sequences of (prompt + prefix - start_tau): kv = kv_base + active*tau
        self.kv_paused = 0  # tokens of paused sequences (tool calls in flight)
        self.paused = 0
        self.preempted: list[_Seq] = []  # KV ran out: waiting to be re-prefilled, oldest first
        self.pending: list[Any] = []  # leases not started yet
        self.epoch = 0  # invalidates this replica's scheduled events
        self.kv_area = 0.0  # integral of kv used over time (token seconds)
        self.kv_prev = 0  # kv at the previous repack plan (the report's kv_prev)
        self.hold = -1  # repack: keep this version loaded until the moved trajectories arrive (instant here)
        self.dead_until = -1.0  # failed: no work until then
        self.starved = False
        self.groups: set[_Group] = set()
        self.newest: int | None = None  # the newest version this replica knows is at its relay
        self.claim_every = 0.0  # control plane: back-off after empty claims
        self.wake_after: int | None = None  # ... the run's version at the last empty claim (Contacts.wake_after)
        self.woke_for = -1  # ... the relay version the last claim it woke went out for
        self.claim_epoch = 0
        self.unreported: list[_Group] = []
        self.report_epoch = 0
        self.epoch_alive = 0  # control_plane: bumped when the replica dies (answers to the dead are dropped)
        self.claim_sent = False  # control_plane: a claim is on its way (one at a time, as services/rollout/)
        self.sent: list[_Group] = []  # control_plane: complete groups whose report is on its way

    def kv(self) -> float:
        return self.kv_base + self.active * self.tau + self.kv_paused

    def in_flight(self) -> int:
        return self.active + self.paused + len(self.preempted)


@dataclass
class SimResult:
    mode: str
    replicas: int
    tokens_per_s: float
    generation_tokens_per_s: float
    iteration_s: float
    staleness_histogram: dict[int, int]
    staleness_max: int
    kv_utilisation: float
    trainer_idle_fraction: float
    batches: int
    complete: bool
    repacks: int
    reprefill_tokens: int
    dropped_stale: int
    step_times: list[float]
    step_tokens: list[int]
    events: int
    peak_in_flight: int = 0  # most sequences in flight on one replica at once
    preemptions: int = 0  # sequences preempted by a full KV cache (re-prefilled later)
    sim_s: float = 0.0
    control_plane: dict[str, float] = field(default_factory=dict)  # ControlServer.stats; {} without one

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("step_times", "step_tokens")}


class Simulator:
    def __init__(self, cfg: SimConfig, fns: PolicyFns = REAL_POLICY):
        self.cfg = cfg
        self.fns = fns
        self.run_cfg = cfg.run_config()
        self.policy: Policy = policy_for(self.run_cfg)
        self.bound = staleness_bound(self.run_cfg)
        self.costs = cfg.costs
        self.ledger = Ledger(RunState(run_id="sim"))
        self.ledger.state.trainer_ready = True
        self.load_s = cfg.load_s if cfg.load_s is not None else self.costs.load_s(global_sync=self.policy.global_sync)
        self.stall_s = (cfg.publish_stall_s if cfg.publish_stall_s is not None
                        else self.costs.publish_stall_s(self.policy.global_sync))
        self.replicas = [_Replica(i, i // max(1, cfg.replicas_per_machine)) for i in range(cfg.replicas)]
        self.queue: list[tuple[float, int, str, Any]] = []
        self.seq_no = 0
        self.now = 0.0
        self.groups: dict[str, _Group] = {}
        self.newest_at_relay: int | None = None
        self.relay_versions: list[tuple[float, int]] = []
        self.trainer_busy = False
        self.trainer_down_until = -1.0
        self.trainer_busy_s = 0.0
        self.trainer_wait_since = 0.0
        self.trainer_wait_s = 0.0
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.stale: dict[int, int] = {}
        self.dropped = 0
        self.repacks = 0
        self.reprefill = 0
        self.generated_tokens: list[tuple[float, int]] = []
        self.events = 0
        self.batch_size = cfg.groups_per_step
        self.done = False
        self._len_cache: dict[int, tuple[np.ndarray, ...]] = {}
        self.window: tuple[float, float, float, float, float] | None = None  # t0, kv_area0, busy0, wait0, gen0
        self.window_end: tuple[float, float, float, float, float] | None = None
        self.gen_tokens = 0
        self.peak_in_flight = 0
        self.preemptions = 0
        self._finished: dict[str, _Group] = {}  # reported groups not yet trained
        self.relay_outage_until = -1.0
        self.relay_down_host = -1
        self._lost_step = False
        self._window_step = 0
        self.migrating: set[int] = set()  # replicas in a repack migration (control plane: not planned again)
        self.plan_every = repack_mod.PLAN_EVERY_S
        self.roofline = min(self.costs.roofline_batch(), cfg.max_inflight_seqs)
        self.cp = ControlServer(cfg.control_plane) if cfg.control_plane is not None else None
        self.handovers = 0

    # -- events ------------------------------------------------------------------------------------------

    def _at(self, t: float, kind: str, data: Any = None) -> None:
        self.seq_no += 1
        heapq.heappush(self.queue, (t, self.seq_no, kind, data))

    def run(self) -> SimResult:
        self._at(0.0, "publish_initial")
        if self.policy.repacks:
            self._at(self.plan_every, "repack_tick")
        for kind, at in self.cfg.failures:
            self._at(at, "fail_" + kind)
        while self.queue and not self.done:
            t, _, kind, data = heapq.heappop(self.queue)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            self.events += 1
            getattr(self, "_on_" + kind)(data)
        return self._result()

    def _on_publish_initial(self, _: Any) -> None:
        self._version_at_relays(0)

    def _on_relay_version(self, version: int) -> None:
        self._version_at_relays(version)

    def _version_at_relays(self, version: int) -> None:
        if self.newest_at_relay is not None and version <= self.newest_at_relay:
            return
        self.newest_at_relay = version
        c = self.cfg.control
        for r in self.replicas:
            if c is None:
                self._see(r, version)
                continue
            every = c.version_wait_poll_s if r.in_flight() == 0 else c.version_poll_s
            phase = (r.rid * 0.6180339887 % 1.0) * every  # each replica polls on its own phase
            t_see = phase + math.ceil((self.now - phase) / every - 1e-9) * every
            self._at(max(self.now, t_see), "see_version", (r.rid, version))

    def _on_see_version(self, data: tuple[int, int]) -> None:
        self._see(self.replicas[data[0]], data[1])

    def _see(self, r: _Replica, version: int) -> None:
        if r.newest is None or version > r.newest:
            r.newest = version
            if r.wake_after is not None and version > max(r.wake_after, r.woke_for):
                # services/rollout/control.py Contacts.woken: a version newer than the one its empty claim saw
                # is at its relay: it claims again now, whatever its back-off
                r.woke_for, r.claim_every, r.claim_epoch = version, 0.0, r.claim_epoch + 1
            self._act(r)

    # -- lengths -----------------------------------------------------------------------------------------

    def _draws(self, prompt_id: int) -> tuple[list, list, list]:
        """(segment lengths [G, turns], turns [G], env latencies [G, turns]) of one prompt."""
        got = self._len_cache.get(prompt_id)
        if got is not None:
            return got
        L, g, block = self.cfg.lengths, self.cfg.group_size, 512
        first = prompt_id - prompt_id % block
        rng = np.random.default_rng([L.seed, first])
        tm = max(1, L.turns_max)
        if tm == 1:  # single turn: the capped lengths, nothing else
            if L.long_tail:
                one = np.rint(rng.lognormal(math.log(L.p50), LONG_TAIL_SIGMA, (block, g)))
            else:
                lo, hi = -(-4 * L.p50 // 5), 6 * L.p50 // 5
                one = rng.integers(lo, max(lo, hi) + 1, (block, g))
            rows = np.clip(one, 1, L.cap).astype(np.int64).tolist()
            for i in range(block):
                self._len_cache[first + i] = (rows[i], None, None)
            return self._len_cache[prompt_id]
        if L.long_tail:
            seg = np.maximum(1, np.rint(rng.lognormal(math.log(L.p50), LONG_TAIL_SIGMA, (block, g, tm))))
        else:
            lo, hi = -(-4 * L.p50 // 5), 6 * L.p50 // 5
            seg = rng.integers(lo, max(lo, hi) + 1, (block, g, tm)).astype(float)
        turns = rng.integers(1, tm + 1, (block, g)) if tm > 1 else np.ones((block, g), dtype=int)
        env = rng.lognormal(math.log(max(L.env_p50_s, 1e-9)), math.log(L.env_tail_ratio) / 2.326, (block, g, tm))
        seg_l, turns_l, env_l = seg.tolist(), turns.tolist(), env.tolist()
        for i in range(block):
            self._len_cache[first + i] = (seg_l[i], turns_l[i], env_l[i])
        return self._len_cache[prompt_id]

    def _segments(self, prompt_id: int, sample: int) -> tuple[list[int], list[float]]:
        L = self.cfg.lengths
        if L.exact is not None:
            return [L.exact(prompt_id, sample)], []
        seg, turns, env = self._draws(prompt_id)
        if turns is None:
            return [seg[sample]], []
        k = turns[sample]
        if k == 1:
            return [int(min(seg[sample][0], L.cap))], []
        out, total = [], 0
        for n in seg[sample][:k]:
            n = int(min(n, L.cap - total))
            if n <= 0:
                break
            out.append(n)
            total += n
        return out, env[sample][:len(out) - 1]

    # -- replicas ----------------------------------------------------------------------------------------

    def _sync(self, r: _Replica) -> None:
        """Bring replica r up to now: decode steps done since r.t (none while busy or dead)."""
        now = self.now
        start = max(r.t, r.busy_until)
        if r.active and now > start:
            steps = self.costs.steps_within(r.active, r.kv(), now - start)
            if r.heap:
                steps = min(steps, max(0, int(r.heap[0][0] + self.cfg.finish_quantum_steps - r.tau)))
            kv0 = r.kv()
            r.tau += steps
            r.kv_area += (kv0 + r.kv()) / 2 * (now - r.t)
            self.gen_tokens += steps * r.active
        else:
            r.kv_area += r.kv() * max(0.0, now - r.t)
        r.t = now

    def _schedule(self, r: _Replica) -> None:
        r.epoch += 1
        if not r.heap or r.dead_until > self.now:
            return
        end_tau = r.heap[0][0] + self.cfg.finish_quantum_steps
        steps = max(0, int(math.ceil(end_tau - r.tau - 1e-9)))
        kind = "replica"
        if self.cfg.preempt:
            room = self.cfg.kv_capacity - r.kv()
            full = max(0, int(room // r.active))  # steps until the cache is full
            if full < steps and r.active > 1:  # a lone sequence is never preempted (it could not come back)
                steps, end_tau, kind = full, r.tau + full, "kv_full"
        start = max(self.now, r.busy_until)
        t = start + self.costs.decode_steps_s(r.active, r.kv(), steps)
        self._at(t, kind, (r.rid, r.epoch, end_tau))

    def _on_kv_full(self, data: tuple[int, int, float]) -> None:
        """The cache is full: preempt the newest sequences until PREEMPT_FREE of it is free again."""
        rid, epoch, end_tau = data
        r = self.replicas[rid]
        if epoch != r.epoch:
            return
        kv0 = r.kv()
        self.gen_tokens += int(end_tau - r.tau) * r.active
        r.tau = end_tau
        r.kv_area += (kv0 + r.kv()) / 2 * (self.now - r.t)
        r.t = self.now
        newest_first = sorted(r.heap, key=lambda e: -e[2].start_tau)
        drop = set()
        for e in newest_first:
            if r.kv() <= self._kv_target(r.active) or r.active <= 1:
                break
            s = e[2]
            done = int(r.tau - s.start_tau)
            r.kv_base -= self.cfg.prompt_tokens + s.prefix - s.start_tau
            r.active -= 1
            s.segments[0] -= done
            s.prefix += done
            drop.add(id(s))
            r.preempted.append(s)
        if drop:
            r.heap = [e for e in r.heap if id(e[2]) not in drop]
            heapq.heapify(r.heap)
            self.preemptions += len(drop)
        self._act(r)

    def _on_replica(self, data: tuple[int, int, float]) -> None:
        rid, epoch, end_tau = data
        r = self.replicas[rid]
        if epoch != r.epoch:
            return
        # bring r to end_tau exactly: the event's time was computed for these steps
        steps = end_tau - r.tau
        kv0 = r.kv()
        r.tau = end_tau
        r.kv_area += (kv0 + r.kv()) / 2 * (self.now - r.t)
        self.gen_tokens += int(steps) * r.active
        r.t = self.now
        finished_groups: list[_Group] = []
        while r.heap and r.heap[0][0] <= r.tau + 1e-9:
            _, _, s = heapq.heappop(r.heap)
            r.active -= 1
            seg = s.segments.pop(0)
            tokens = self.cfg.prompt_tokens + s.prefix + seg
            r.kv_base -= self.cfg.prompt_tokens + s.prefix - s.start_tau
            s.prefix += seg
            if s.segments:  # a tool call: hold the KV, come back after the environment answers
                s.kv_held = tokens
                r.kv_paused += tokens
                r.paused += 1
                self._at(self.now + s.env.pop(0), "tool_return", (rid, s))
                continue
            g = s.group
            g.tokens += tokens
            g.remaining -= 1
            if g.remaining == 0:
                finished_groups.append(g)
        c = self.cfg.control
        if c is not None and finished_groups:
            r.unreported.extend(finished_groups)
            for g in finished_groups:
                r.groups.discard(g)
            trainer_waits = not self.trainer_busy
            if len(r.unreported) >= c.report_min_groups or trainer_waits or not r.groups:
                finished_groups, r.unreported = r.unreported, []
                r.report_epoch += 1
            else:
                if len(r.unreported) == len(finished_groups):  # the oldest waits at most report_max_wait_s
                    r.report_epoch += 1
                    self._at(self.now + c.report_max_wait_s, "report", (r.rid, r.report_epoch))
                finished_groups = []
        reported = self._report(r, finished_groups)
        self._act(r)
        if reported:
            self._after_ledger_change()

    def _on_report(self, data: tuple[int, int]) -> None:
        r = self.replicas[data[0]]
        if data[1] != r.report_epoch or not r.unreported:
            return
        groups, r.unreported = r.unreported, []
        if self._report(r, groups):
            self._after_ledger_change()

    def _report(self, r: _Replica, groups: list[_Group]) -> bool:
        """Report complete groups: at once without a control plane (True: the ledger changed), else as an update
        answered later (report_answer)."""
        if not groups:
            return False
        if self.cp is None:
            for g in groups:
                self._complete(g, r)
            return True
        for g in groups:
            r.groups.discard(g)
        r.sent.extend(groups)
        at, handover = self.cp.send(self.now)
        self._at(at, "report_answer", (r.rid, [g.group_id for g in groups]))
        if handover:
            self._handover()
        return False

    def _on_report_answer(self, data: tuple[int, list[str]]) -> None:
        r = self.replicas[data[0]]
        ids = set(data[1])
        mine = [g for g in r.sent if g.group_id in ids]  # none if the replica died meanwhile (_lose delivered them)
        if not mine:
            return
        r.sent = [g for g in r.sent if g.group_id not in ids]
        for g in mine:
            self._complete(g, r)
        self._after_ledger_change()

    def _on_tool_return(self, data: tuple[int, _Seq]) -> None:
        rid, s = data
        r = self.replicas[rid]
        if s.group.replica != rid or s.kv_held == 0:
            return  # moved or lost meanwhile
        self._sync(r)
        r.kv_paused -= s.kv_held
        r.paused -= 1
        s.kv_held = 0
        extra = self.cfg.tool_output_tokens
        r.busy_until = max(r.busy_until, self.now) + self.costs.prefill_s(extra)
        self._start_seq(r, s, extra_tokens=extra)
        self._schedule(r)

    def _start_seq(self, r: _Replica, s: _Seq, extra_tokens: int = 0) -> None:
        """Put s into r's decode batch at r.tau with its current segment to go."""
        if extra_tokens:
            s.prefix += extra_tokens  # tool output joins the context (counted as context, not response)
        s.start_tau = r.tau
        s.end_tau = r.tau + s.segments[0]
        r.kv_base += self.cfg.prompt_tokens + s.prefix - s.start_tau
        r.active += 1
        self.seq_no += 1
        heapq.heappush(r.heap, (s.end_tau, self.seq_no, s))

    def _complete(self, g: _Group, r: _Replica) -> None:
        r.groups.discard(g)
        del self.groups[g.group_id]
        seg = SegmentRef(key=f"seg/{g.group_id}", sha256="", size=0, rows=self.cfg.group_size,
                         group_ids=[g.group_id], policy_version=g.version, tokens=g.tokens)
        self.ledger.add_segment(seg, r.name, self.now)
        self._finished[g.group_id] = g

    def _free_groups(self, r: _Replica) -> int:
        """Group slots r could admit now (engine.free_slots // group_size), less the leases it holds."""
        if r.version is None or r.dead_until > self.now:
            return 0
        kv_left = self.cfg.kv_capacity - r.kv()
        if kv_left < self.cfg.prompt_tokens:
            return 0
        slots = self.cfg.max_inflight_seqs - r.in_flight()
        return slots // self.cfg.group_size - len(r.pending)

    def _act(self, r: _Replica) -> None:
        """What services/rollout/'s loop does at this moment: load, admit, claim."""
        if r.dead_until > self.now:
            return
        self._sync(r)
        action = self.fns.load_action(self.policy, r.version, r.newest, r.in_flight())
        if action == "load" and r.hold == r.version:
            action = ""
        if action:
            self._load(r, interrupt=action == "interrupt")
        self._admit(r)
        want = self._free_groups(r)
        c = self.cfg.control
        enough = 1 if c is None or not r.groups else c.claim_min_groups
        # a starved replica waits for its back-off (control timing) or, with a control plane and no timing, for
        # the ledger to change (_after_ledger_change) before it asks again
        if want >= enough and not (c is not None and r.claim_every > 0 and r.starved) and not (
                c is None and self.cp is not None and r.starved):
            self._claim(r, want)
        elif want <= 0:
            r.starved = False
        self._schedule(r)

    def _load(self, r: _Replica, interrupt: bool) -> None:
        start = max(self.now, r.busy_until)
        cost = self.load_s
        if r.host == self.relay_down_host and self.now < self.relay_outage_until:
            cost += self.costs.weight_bytes / (self.costs.relay_gbytes_s * 1e9)  # from another host's relay
        if interrupt:
            tokens = int(r.kv())
            cost += self.costs.prefill_s(tokens)
            self.reprefill += tokens
        r.busy_until = start + cost
        r.version = r.newest

    def _kv_target(self, active: int) -> float:
        """KV use a preemption brings the cache down to: PREEMPT_FREE of it free, and at least one decode step's
        growth (so the next full cache is at least a step away)."""
        return min(self.cfg.kv_capacity * (1 - PREEMPT_FREE), self.cfg.kv_capacity - active)

    def _admit(self, r: _Replica) -> None:
        if r.preempted:  # preempted sequences come back first, when their prompt + prefix fit again
            tokens = 0
            while r.preempted:
                s = r.preempted[0]
                need = self.cfg.prompt_tokens + s.prefix
                if r.kv() + need > self._kv_target(r.active + 1) and r.active > 0:
                    break
                r.preempted.pop(0)
                if s.segments[0] <= 0:
                    s.segments[0] = 1
                self._start_seq(r, s)
                tokens += need
            if tokens:
                self.reprefill += tokens
                r.busy_until = max(r.busy_until, self.now) + self.costs.prefill_s(tokens)
            if r.preempted:
                return  # nothing new starts while preempted sequences wait (vLLM's waiting queue order)
        if not r.pending or r.version is None:
            return
        newer = r.newest is not None and r.newest > r.version
        started: list[Any] = []
        prefill = 0
        G, P = self.cfg.group_size, self.cfg.prompt_tokens
        for lease in r.pending:
            if not self.fns.may_start(self.policy, self.fns.min_version(self.policy, lease.prompt_id), r.version, newer):
                continue
            if r.kv() + G * P > self.cfg.kv_capacity or r.in_flight() + G > self.cfg.max_inflight_seqs:
                break
            g = _Group(lease.group_id, lease.prompt_id, r.version, r.rid, self.now)
            self.groups[g.group_id] = g
            r.groups.add(g)
            rows = None if self.cfg.lengths.exact is not None else self._draws(lease.prompt_id)
            if rows is not None and rows[1] is None:  # single turn: the group's lengths in one go
                tau, heap = r.tau, r.heap
                for i, n in enumerate(rows[0]):
                    s = _Seq(g, i, lease.prompt_id, [n], [])
                    s.start_tau, s.end_tau = tau, tau + n
                    g.seqs.append(s)
                    self.seq_no += 1
                    heapq.heappush(heap, (tau + n, self.seq_no, s))
                g.remaining += G
                r.active += G
                r.kv_base += G * (P - tau)
            else:
                for i in range(G):
                    segs, env = self._segments(lease.prompt_id, i)
                    s = _Seq(g, i, lease.prompt_id, segs, env)
                    g.seqs.append(s)
                    g.remaining += 1
                    self._start_seq(r, s)
            prefill += G * P
            started.append(lease)
        if started:
            self.peak_in_flight = max(self.peak_in_flight, r.in_flight())
            ids = {id(x) for x in started}
            r.pending = [x for x in r.pending if id(x) not in ids]
            r.busy_until = max(r.busy_until, self.now) + self.costs.prefill_s(prefill)

    def _claim(self, r: _Replica, want: int) -> None:
        if self.cp is None:
            self._lease(r, want)
            return
        if r.claim_sent:
            return
        r.claim_sent = True
        at, handover = self.cp.send(self.now)
        self._at(at, "claim_answer", (r.rid, want, r.epoch_alive))
        if handover:
            self._handover()

    def _on_claim_answer(self, data: tuple[int, int, int]) -> None:
        rid, want, alive = data
        r = self.replicas[rid]
        if alive != r.epoch_alive:  # the replica died since it asked: the answer reached no one
            return
        r.claim_sent = False
        self._sync(r)
        self._lease(r, want)
        self._act(r)

    def _handover(self) -> None:
        """A continue-as-new: every live replica's generation stops for handover_s (parked, then adopted by the new
        run's activity); with writes_out it wrote its in-flight groups to its pool and prefills them again."""
        assert self.cp is not None
        self.handovers += 1
        for r in self.replicas:
            if r.dead_until > self.now:
                continue
            self._sync(r)
            tokens = int(r.kv()) if self.cp.cost.writes_out else 0
            self.reprefill += tokens
            r.busy_until = max(r.busy_until, self.now) + self.cp.cost.handover_s + self.costs.prefill_s(tokens)
            self._schedule(r)

    def _lease(self, r: _Replica, want: int) -> None:
        st = self.ledger.state
        room = self.cfg.ready_limit() - len(st.ready)
        fresh = self.fns.fresh_lease_room(self.policy, st.prompt_cursor, st.policy_version, st.groups_generated)
        if (room <= 0 or fresh == 0) and not st.returned:  # the ledger would hand out nothing
            leases = []
        else:
            leases = self.ledger.lease(r.name, max(0, min(want, room)), fresh)
        r.pending.extend(leases)
        r.starved = len(leases) < want
        c = self.cfg.control
        if c is not None:  # services/rollout/timing.py next_claim_interval: back off while claims come back empty
            r.claim_every = 0.0 if leases else min(c.idle_claim_max_s, max(c.claim_poll_s, 2 * r.claim_every))
            if leases:
                r.wake_after = None
            elif want > 0:
                r.wake_after = st.policy_version
            if not leases:
                r.claim_epoch += 1
                self._at(self.now + r.claim_every, "claim_retry", (r.rid, r.claim_epoch))
        if leases:
            self._admit(r)

    def _on_claim_retry(self, data: tuple[int, int]) -> None:
        r = self.replicas[data[0]]
        if data[1] != r.claim_epoch or r.dead_until > self.now:
            return
        self._sync(r)
        want = self._free_groups(r)
        if want > 0:
            self._claim(r, want)
        else:
            r.starved = False
            r.claim_every = 0.0
        self._schedule(r)

    def _after_ledger_change(self) -> None:
        """A group was reported or a step committed: the trainer may step, starved replicas may get leases."""
        self._try_train()
        st = self.ledger.state
        room = self.cfg.ready_limit() - len(st.ready)
        fresh = self.fns.fresh_lease_room(self.policy, st.prompt_cursor, st.policy_version, st.groups_generated)
        if room <= 0 or (fresh is not None and fresh <= 0 and not st.returned):
            return
        if self.cfg.control is not None:
            return  # starved replicas retry on their own back-off (claim_retry)
        for r in self.replicas:
            if r.starved and r.dead_until <= self.now:
                if self.cp is not None:
                    r.starved = False  # it learns of the change and asks again (one update)
                self._act(r)

    # -- trainer -----------------------------------------------------------------------------------------

    def _try_train(self) -> None:
        if self.trainer_busy or self.trainer_down_until > self.now or self.done:
            return
        st = self.ledger.state
        ids = self.fns.trainer_batch(self.policy, [(g.group_id, g.prompt_id) for g in st.ready], st.step)
        if ids is None:
            return
        version = self.fns.version_of(self.policy, st.step)
        tokens, hist, dropped = 0, {}, 0
        for gid in ids:
            g = self._finished[gid]
            gap = version - g.version
            if self.bound >= 0 and gap > self.bound:
                dropped += self.cfg.group_size
                continue
            hist[gap] = hist.get(gap, 0) + self.cfg.group_size
            tokens += g.tokens
        cost = self.costs.train_s(tokens)
        # the trainer waited for this batch: its activity is scheduled by the report's workflow task and then
        # dispatched; a batch ready as the last step ended was scheduled ahead (workflows/trainer.py)
        start = self.now + (self.cp.cost.dispatch_s if self.cp is not None and self.now > self.trainer_wait_since
                            else 0.0)
        self.trainer_busy = True
        self.trainer_wait_s += start - self.trainer_wait_since
        self._at(start + cost, "step_done", (ids, tokens, hist, dropped, cost))

    def _on_step_done(self, data: tuple[list[str], int, dict[int, int], int, float]) -> None:
        ids, tokens, hist, dropped, cost = data
        if self._lost_step:
            self._lost_step = False
            self._at(max(self.now, self.trainer_down_until) + cost, "step_done", data)
            return
        st = self.ledger.state
        step = st.step + 1
        publishes = self.fns.publishes(self.policy, step)
        version = self.fns.version_of(self.policy, step)
        inp = TrainStepInput(run_id="sim", config={}, step=st.step,
                             batch=[BatchPart(segment=st.segments[f"seg/{g}"], group_ids=[g]) for g in ids],
                             checkpoint=None, replay=[], relay_chain=[])
        metrics = StepMetrics(reward_mean=0.0, loss=0.0, grad_norm=0.0, samples=len(ids) * self.cfg.group_size,
                              tokens=tokens, response_len_mean=0.0, staleness={str(k): v for k, v in hist.items()},
                              dropped_stale=dropped, clip_fraction=0.0, consumed_twice=0)
        stall = self.stall_s if publishes else 0.0
        res = TrainStepResult(step=step, policy_version=version, metrics=metrics, checkpoint=None, steps_redone=0,
                              publish_stall_s=stall)
        self.ledger.commit_step(inp, res, keep_last=3, at=self.now)
        if self.cp is not None:  # the step's result is a workflow task too (nobody waits for it)
            self.cp.task(self.now)
        st.uncommitted = []  # no checkpoints in the simulator: nothing to replay
        for gid in ids:
            self._finished.pop(gid, None)
        for k, v in hist.items():
            self.stale[k] = self.stale.get(k, 0) + v
        self.dropped += dropped
        self.trainer_busy_s += cost + stall
        self.step_times.append(self.now)
        self.step_tokens.append(tokens)
        batches = step // self.policy.steps_per_version
        if publishes:
            if batches == self.cfg.warmup:
                self._mark_window()
            if batches >= self.cfg.iterations:
                self._mark_window(end=True)
                self.done = True
                return
        self.trainer_busy = True
        self._at(self.now + stall, "trainer_free", version if publishes else None)

    def _on_trainer_free(self, version: int | None) -> None:
        self.trainer_busy = False
        self.trainer_wait_since = self.now
        if version is not None:
            if self.cfg.relay_delay_s > 0:
                self._at(self.now + self.cfg.relay_delay_s, "relay_version", version)
            else:
                self._version_at_relays(version)
            if self.policy.repacks:
                self._repack()
        self._after_ledger_change()

    # -- repack ------------------------------------------------------------------------------------------

    def _on_repack_tick(self, _: Any) -> None:
        self._repack()
        self._at(self.now + self.plan_every, "repack_tick")

    def _repack(self) -> None:
        """Plan over the replicas behind the newest version and not in a migration (workflows/migrations.py)."""
        newest = self.ledger.state.policy_version
        loads = []
        for r in self.replicas:
            if r.version is None or r.version >= newest or r.dead_until > self.now or r.rid in self.migrating:
                continue
            self._sync(r)
            kv = int(r.kv())
            loads.append(repack_mod.ReplicaLoad(r.name, r.version, kv, r.kv_prev, self.cfg.kv_capacity,
                                                r.in_flight(), len(r.pending)))
        for r in self.replicas:
            r.kv_prev = int(r.kv())
        if not loads:
            return
        moves = self.fns.plan_repack(loads, c_max=repack_mod.C_MAX, roofline_batch=self.roofline)
        by_name = {r.name: r for r in self.replicas}
        c = self.cfg.control
        for m in moves:
            src, dst = by_name[m.source], by_name[m.destination]
            if c is None:
                self._give(dst, self._hand_off(src))
                continue
            # the order reaches the source at its next contact; the destination keeps the version meanwhile
            self.migrating.update((src.rid, dst.rid))
            dst.hold = m.policy_version
            self._at(self._next_contact(src), "handoff", (src.rid, dst.rid, m.policy_version))
        for m in moves:
            if c is None:
                self._act(by_name[m.source])

    def _next_contact(self, r: _Replica) -> float:
        every = self.cfg.control.contact_s
        phase = (r.rid * 0.6180339887 % 1.0) * every
        return max(self.now, phase + math.ceil((self.now - phase) / every - 1e-9) * every)

    def _on_handoff(self, data: tuple[int, int, int]) -> None:
        src, dst = self.replicas[data[0]], self.replicas[data[1]]
        if src.version != data[2] or src.dead_until > self.now or dst.dead_until > self.now or not src.groups:
            self.migrating.difference_update((src.rid, dst.rid))
            dst.hold = -1
            self._act(dst)
            return
        moved = self._hand_off(src, dst)
        self._act(src)
        self._at(self._next_contact(dst), "take", (dst.rid, moved))

    def _on_take(self, data: tuple[int, Any]) -> None:
        dst = self.replicas[data[0]]
        self.migrating.discard(dst.rid)
        for g in data[1][1]:
            self.migrating.discard(g.replica)
        self._give(dst, data[1])
        dst.hold = -1
        self._act(dst)

    def _hand_off(self, src: _Replica, dst: _Replica | None = None) -> tuple[list[_Seq], list[_Group]]:
        """Take every unfinished trajectory off src (its groups' leases go to dst when known)."""
        self._sync(src)
        seqs = []
        while src.heap:
            _, _, s = heapq.heappop(src.heap)
            done = int(src.tau - s.start_tau)
            s.segments[0] -= done
            s.prefix += done
            seqs.append(s)
        groups = list(src.groups)
        for g in groups:
            for s in g.seqs:
                if s.kv_held:  # paused on a tool call: it comes along and resumes on the destination
                    src.kv_paused -= s.kv_held
                    src.paused -= 1
                    s.kv_held = 0
                    s.prefix += self.cfg.tool_output_tokens  # its call's latency was already drawn (popped)
                    seqs.append(s)
            g.replica = src.rid if dst is None else dst.rid
        src.groups.clear()
        seqs.extend(src.preempted)
        src.preempted = []
        src.active, src.kv_base = 0, 0.0
        src.epoch += 1
        self.migrating.discard(src.rid)
        return seqs, groups

    def _give(self, dst: _Replica, moved: tuple[list[_Seq], list[_Group]]) -> None:
        """dst continues the trajectories under the same version, re-prefilling prompt + prefix."""
        seqs, groups = moved
        self._sync(dst)
        for g in groups:
            g.replica = dst.rid
            dst.groups.add(g)
            self.ledger.state.open_leases[g.group_id].replica_id = dst.name
        tokens = 0
        for s in seqs:
            if s.segments[0] <= 0:  # finished exactly now: give it one step
                s.segments[0] = 1
            self._start_seq(dst, s)
            tokens += self.cfg.prompt_tokens + s.prefix
        dst.busy_until = max(dst.busy_until, self.now) + self.costs.prefill_s(tokens)
        self.reprefill += tokens
        self.repacks += 1
        self._schedule(dst)

    # -- failures ----------------------------------------------------------------------------------------

    def _lose(self, r: _Replica) -> None:
        """r dies: its in-flight groups go back to the ledger (release_leases_of), their progress is lost. Reports
        already sent reach the workflow before it notices the death (detection takes seconds)."""
        self._sync(r)
        sent, r.sent = r.sent, []
        for g in sent:
            self._complete(g, r)
        r.epoch_alive += 1
        r.claim_sent = False
        for g in list(r.groups):
            for s in g.seqs:
                s.kv_held = 0
            del self.groups[g.group_id]
        for g in r.unreported:  # complete but not reported: lost with the process, leased again
            del self.groups[g.group_id]
        r.unreported = []
        r.groups.clear()
        r.heap.clear()
        r.preempted = []
        r.active = r.paused = r.kv_paused = 0
        r.kv_base = 0.0
        r.pending = []
        self.ledger.release_leases_of(r.name, keep=set())
        r.version = None
        r.epoch += 1

    def _revive_at(self, r: _Replica, at: float) -> None:
        r.dead_until = at
        self._at(at, "revive", r.rid)

    def _on_revive(self, rid: int) -> None:
        r = self.replicas[rid]
        if r.dead_until > self.now:
            return
        r.busy_until = self.now
        r.t = self.now
        self._act(r)
        self._after_ledger_change()

    def _on_fail_rollout(self, _: Any) -> None:
        r = self.replicas[0]
        self._lose(r)
        c = self.cfg.failure_costs
        self._revive_at(r, self.now + c.get("rollout_detect_s", 0.0) + c.get("rollout_restart_s", 0.0))
        self._after_ledger_change()

    def _on_fail_preempt(self, _: Any) -> None:
        c = self.cfg.failure_costs
        host = self.replicas[0].host
        for r in self.replicas:
            if r.host == host:
                self._lose(r)
                self._revive_at(r, self.now + c.get("machine_replace_s", 0.0))
        self._after_ledger_change()

    def _on_fail_relay(self, _: Any) -> None:
        # the host's replicas keep generating; a version published meanwhile reaches them over a second hop
        # once the chain is rebuilt: they pay that on their next load (modelled as a delay of the detection)
        c = self.cfg.failure_costs
        self.relay_down_host = self.replicas[0].host
        self.relay_outage_until = self.now + c.get("relay_detect_s", 0.0) + c.get("relay_rebuild_s", 0.0)

    def _on_fail_trainer(self, _: Any) -> None:
        c = self.cfg.failure_costs
        st = self.ledger.state
        redo = st.step % int(c.get("checkpoint_every", 10))
        per_step = (sum(self.step_tokens[-redo:]) if redo else 0) * self.costs.trainer_s_per_token
        down = c.get("trainer_detect_s", 0.0) + c.get("trainer_restart_s", 0.0) + c.get("checkpoint_load_s", 0.0)
        self.trainer_down_until = self.now + down + per_step
        self._at(self.trainer_down_until, "trainer_back")
        self._lost_step = self.trainer_busy  # a step in flight dies with the process: redone after the restore

    def _on_trainer_back(self, _: Any) -> None:
        self._after_ledger_change()

    # -- metrics -----------------------------------------------------------------------------------------

    def _mark_window(self, end: bool = False) -> None:
        for r in self.replicas:
            self._sync(r)
        snap = (self.now, sum(r.kv_area for r in self.replicas), self.trainer_busy_s,
                self.trainer_wait_s, float(self.gen_tokens))
        if end:
            self.window_end = snap
        else:
            self.window = snap
            self._window_step = len(self.step_times)

    def _result(self) -> SimResult:
        complete = self.window is not None and self.window_end is not None
        if complete:
            t0, a0, b0, w0, g0 = self.window
            t1, a1, b1, w1, g1 = self.window_end
            span = max(t1 - t0, 1e-9)
            tokens = sum(self.step_tokens[self._window_step:])
            batches = self.cfg.iterations - self.cfg.warmup
            tps = tokens / span
            kv = (a1 - a0) / span / (self.cfg.kv_capacity * max(1, len(self.replicas)))
            busy, wait = b1 - b0, w1 - w0
            idle = wait / (busy + wait) if busy + wait > 0 else 0.0
            gen = (g1 - g0) / span
            it = span / max(1, batches)
        else:
            tps = kv = idle = gen = 0.0
            it = math.inf
            batches = 0
        hist = dict(sorted(self.stale.items()))
        return SimResult(self.cfg.mode, self.cfg.replicas, tps, gen, it, hist, max(hist, default=0), kv, idle,
                         batches, complete, self.repacks, self.reprefill, self.dropped, list(self.step_times),
                         list(self.step_tokens), self.events, self.peak_in_flight, self.preemptions,
                         control_plane=self._control_stats())

    def _control_stats(self) -> dict[str, float]:
        if self.cp is None:
            return {}
        return {**self.cp.stats(self.now), "handovers": self.handovers}


def simulate(cfg: SimConfig, fns: PolicyFns = REAL_POLICY) -> SimResult:
    return Simulator(cfg, fns).run()
