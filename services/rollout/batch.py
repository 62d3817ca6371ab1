"""The replica's prompt groups, from lease to report (waiting leases, groups in flight in the engine, complete
groups not yet reported), and what the incarnation counts. A finished sample becomes a trajectory in
`Batch.record` (the place a multi-turn environment loop hooks in: see services/rollout/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.messages import Lease
from laminar.records import Trajectory
from rl.engine_api import Engine, Finished, InFlight
from rl.tasks import Prompt


@dataclass
class Counters:
    groups_completed: int = 0  # by this incarnation, reported
    tokens_generated: int = 0  # ... reported
    tokens_regenerated: int = 0  # since the last report
    reprefill_tokens: int = 0  # prefix tokens prefilled again (partial-rollout interrupts, repack takes)
    reprefill_unreported: int = 0  # ... since the last report
    unsaved_tokens: int = 0  # generated since the last pool write: a retry would generate them again
    kv_reported: int = 0  # kv_used at the previous report (kv_prev)

    def reprefilled(self, tokens: int) -> None:
        self.reprefill_tokens += tokens
        self.reprefill_unreported += tokens


@dataclass
class Group:
    lease: Lease
    prompt: Prompt  # derived once per group; the verifier needs it for every finished sample
    started_at: float
    start_version: int  # the policy version it started on (partial rollout may finish it under newer ones)
    done: dict[int, Trajectory] = field(default_factory=dict)  # sample index -> finished trajectory


class Batch:
    def __init__(self, engine: Engine, task: Any, run_id: str, replica_id: str, group_size: int,
                 clock: Callable[[], float]) -> None:
        self.engine, self.task, self.run_id, self.replica_id = engine, task, run_id, replica_id
        self.group_size, self.clock = group_size, clock
        self.groups: dict[str, Group] = {}  # in flight, by group id
        self.completed: list[Group] = []  # complete, not yet reported
        self.reporting: list[Group] = []  # complete groups whose report is in flight
        self.completed_since = 0.0  # when the oldest complete group not yet reported completed
        self.pending: list[Lease] = []  # leased while draining: admitted once the newer version is loaded

    def admit(self, leases: list[Lease]) -> None:
        for lease in leases:
            prompt = self.task.prompt(lease.prompt_id)
            self.groups[lease.group_id] = Group(lease, prompt, self.clock(), int(self.engine.policy_version or 0))
            for i in range(self.group_size):
                self.engine.add(f"{lease.group_id}/{i}", prompt.token_ids)

    def record(self, finished: list[Finished]) -> None:
        """Each finished sample, verified, into its group; a group with every sample is complete."""
        now = self.clock()
        for f in finished:
            group_id, index = f.request_id.rsplit("/", 1)
            group = self.groups[group_id]
            reward = self.task.reward(group.prompt, f.response_ids)
            group.done[int(index)] = self.trajectory(group, int(index), f.response_ids, f.logprobs, reward,
                                                     f.finish_reason, now)
            if len(group.done) == self.group_size:
                if not self.completed:
                    self.completed_since = now
                self.completed.append(self.groups.pop(group_id))

    def resume(self, groups: dict[str, list[Trajectory]], version: int) -> None:
        """Continue these groups under `version` (the one loaded): partial samples from their prefixes (prefilled
        again), missing samples from the prompt; finished samples are kept as they are."""
        for group_id, rows in groups.items():
            first = rows[0]
            group = Group(Lease(group_id, first.prompt_id), self.task.prompt(first.prompt_id), first.started_at,
                          version)
            self.groups[group_id] = group
            for t in rows:
                if t.finish_reason == "partial":
                    self.engine.add(f"{group_id}/{t.sample_index}", t.prompt_ids,
                                    prefix_ids=t.response_ids, prefix_logprobs=t.logprobs)
                else:
                    group.done[t.sample_index] = t
            for i in sorted(set(range(self.group_size)) - {t.sample_index for t in rows}):
                self.engine.add(f"{group_id}/{i}", first.prompt_ids)
            if len(group.done) == self.group_size:
                self.completed.append(self.groups.pop(group_id))

    def rows(self, groups: dict[str, Group], in_flight: list[InFlight]) -> list[Trajectory]:
        """The finished samples of `groups`, then the in-flight ones as partial trajectories (prefixes)."""
        now = self.clock()
        rows = [t for g in groups.values() for t in g.done.values()]
        for request_id, _prompt, response, logprobs in in_flight:
            group_id, index = request_id.rsplit("/", 1)
            rows.append(self.trajectory(groups[group_id], int(index), response, logprobs, 0.0, "partial", now))
        return rows

    def trajectory(self, group: Group, index: int, response: list[int], logprobs: list[float],
                   reward: float, finish: str, now: float) -> Trajectory:
        return Trajectory(
            run_id=self.run_id, prompt_id=group.lease.prompt_id, group_id=group.lease.group_id,
            sample_index=index, prompt_ids=list(group.prompt.token_ids), response_ids=list(response),
            logprobs=list(logprobs), reward=reward, policy_version=group.start_version,
            replica_id=self.replica_id, started_at=group.started_at, ended_at=now, finish_reason=finish,
        )
