"""The replica's prompt groups, from lease to report (waiting leases, groups in flight in the engine, complete
groups not yet reported), and what the incarnation counts. A finished sample becomes a trajectory in
`Batch.record` (the place a multi-turn environment loop hooks in: see services/rollout/__init__.py).

Failures (envs/tasks/__init__.py): a reward that raises, overruns task.reward_timeout_s, or returns NaN or a
non-number is not a reward; a prompt that cannot be built or admitted is a generation failure; a finished sample
whose row the trainer could never train (its lengths disagree: laminar/records.py `untrainable`) is "malformed".
Its whole group is generated again from the prompt (its other samples aborted,
their tokens counted as regenerated), with a fresh prompt and reward call context, up to
task.max_group_retries times; then it leaves the batch as a `FailedGroup`, reported with the next
`add_experience` so the workflow closes its lease as failed. A failed group is never written to a segment.

Environment loop (multi-turn tool calls, envs/tools/__init__.py), for a task with `tools` and `max_turns`: a
sample that finishes a model turn (<eos>) ending in `<tag>text</tag>` of one of its tools, with turns left,
is not scored: the tool runs (`Batch.tool_turn`), the turn's <eos> is dropped, the tool's output tokens are
appended (log-prob 0, mask 0 in `Episode.mask`), and the sample re-enters the engine with the whole response
so far as its prefix. So a sample between turns is an ordinary in-flight sequence with a prefix: the pool, the
hand-over, partial rollout and repack carry it, tool outputs included, and a resumed sample continues after
its last tool output: a completed call is never run again. Each call is keyed (group, sample, turn) and counted
in `tool_executions`. Calls run at most once, with a write-ahead record batched per engine step: the step's
calls are first queued (`intents`) and the pool written with each one's intent (its row ends with the call,
extra `tool_intent`; no output), then they run (`run_calls`), then the pool is written with their outputs
(`tool_turns_unsaved`). A resumed sample whose intent has no output was possibly run: it is not run again but
answered `INTERRUPTED` (mask 0, like any output: the model reads it and goes on; log `tool_interrupted`).
A tool that fails fails the group ("sandbox"), retried then dropped like a failed reward."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar import metrics as prom
from laminar.contract import FailedGroup, Lease
from laminar.envs.tasks import Prompt, RewardFailure
from laminar.envs.tasks.scoring import RewardRunner
from laminar.envs.tools import Episode, Tool, ToolCall, call, parse_call, recorded_calls
from laminar.logs import get_logger
from laminar.records import Trajectory, untrainable
from laminar.rl.engine_api import Engine, Finished, InFlight

log = get_logger(__name__)

# the answer to a call whose intent was recorded but whose output was not: it possibly ran, so it is not run again
INTERRUPTED = "error: the call was interrupted"
# a pool row's extra entry: the recorded answers (Batch.recorded) its sample has not reached yet, as JSON
# [[turn, call text, output ids], ...], so an incarnation resuming it still answers those calls from the record
RECORDED = "recorded_calls"


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
    attempts: int = 1  # tries so far, this one included (a failure starts the group again)


class Batch:
    def __init__(self, engine: Engine, task: Any, run_id: str, replica_id: str, group_size: int,
                 clock: Callable[[], float], *, reward_timeout_s: float = 30.0, max_group_retries: int = 2,
                 counters: Counters | None = None) -> None:
        self.engine, self.task, self.run_id, self.replica_id = engine, task, run_id, replica_id
        self.group_size, self.clock = group_size, clock
        self.rewards, self.max_group_retries = RewardRunner(reward_timeout_s), max_group_retries
        self.counters = counters  # where thrown-away tokens of retried groups are counted
        self.failed: list[FailedGroup] = []  # dropped after their last try, not yet reported
        self.reporting_failed: list[FailedGroup] = []  # ... whose report is in flight
        self.groups: dict[str, Group] = {}  # in flight, by group id
        self.completed: list[Group] = []  # complete, not yet reported
        self.reporting: list[Group] = []  # complete groups whose report is in flight
        self.completed_since = 0.0  # when the oldest complete group not yet reported completed
        self.pending: list[Lease] = []  # leased while draining: admitted once the newer version is loaded
        self.tools = list(getattr(task, "tools", None) or [])  # the environment loop runs for these (docstring)
        self.max_turns = int(getattr(task, "max_turns", 1) or 1)
        self.episodes: dict[str, Episode] = {}  # request id -> its turns so far (samples with a tool answer)
        self.tool_executions: dict[tuple[str, int, int], int] = {}  # (group, sample, turn) -> runs
        self.tool_turns_unsaved = 0  # tool calls answered since the last pool write
        # this engine step's calls, queued until their intents are written (group, sample, its turn, episode,
        # tool, call text); `write_ahead` writes the pool (PartialPool sets it; None: no pool, as in unit tests)
        self.intents: list[tuple[Group, int, Finished, Episode, Tool, str]] = []
        self.write_ahead: Callable[[], None] | None = None
        # (group, sample, turn) -> (call text, output tokens) recorded by an earlier incarnation of a group that
        # is generated again from its prompt: the same call there gets the recorded answer, not a second run
        self.recorded: dict[tuple[str, int, int], tuple[str, list[int]]] = {}
        # groups to continue from recorded prefixes (a resumed pool, a migration, a departed replica's group) that
        # did not fit beside those in flight: group id -> (the version they started on, their rows)
        self.deferred: dict[str, tuple[int, list[Trajectory]]] = {}
        # rows of a repack hand-off the workflow has not recorded yet (services/rollout/migration.py): pool rows
        self.handing_off: list[Trajectory] = []

    def admit(self, leases: list[Lease], attempts: int = 1) -> None:
        """Start each group from its prompt. A prompt the task cannot build, or the engine cannot admit (longer
        than its max_prompt_len), fails the group ("generation") instead of the replica, which would otherwise
        be retried on the same lease forever. A group that does not fit beside the ones in flight (no free slot
        for each sample, or its prompts not in the KV cache; e.g. a restart resumed its pool and took a
        migration's groups too) is no failure: its lease waits in `pending` until the engine has room."""
        for lease in leases:
            version = int(self.engine.policy_version or 0)
            group = Group(lease, Prompt(lease.prompt_id, "", []), self.clock(), version, attempts=attempts)
            self.groups[lease.group_id] = group
            try:
                group.prompt = self.task.prompt(lease.prompt_id)
                if self.engine.in_flight() and not self._fits(group.prompt):
                    del self.groups[lease.group_id]
                    self.pending.append(lease)
                    continue
                for i in range(self.group_size):
                    # from the prompt: no turn yet, whatever this batch held for the sample before (a group it
                    # handed off in a migration and got back, say); a stale episode gave the new response its mask
                    self.episodes.pop(f"{lease.group_id}/{i}", None)
                    self.engine.add(f"{lease.group_id}/{i}", group.prompt.token_ids)
            except Exception as e:  # noqa: BLE001 - the group fails with what went wrong; the replica goes on
                self.fail(group, "generation", f"{type(e).__name__}: {e}")

    def _fits(self, prompt: Prompt) -> bool:
        """Every sample of a group gets a slot and its prompt a place in the KV cache, beside what is in flight."""
        used, capacity = self.engine.kv_usage()
        return (self.engine.free_slots() >= self.group_size
                and used + self.group_size * len(prompt.token_ids) <= capacity)

    def record(self, finished: list[Finished]) -> None:
        """Each finished sample, verified, into its group; a group with every sample is complete. A failed
        reward restarts or drops the whole group (module docstring). A turn that calls a tool is queued, and the
        step's calls run once their intents are written (`run_calls`)."""
        now = self.clock()
        restarted: set[str] = set()  # this step's other samples of a restarted group belong to its old try
        for f in finished:
            group_id, index = f.request_id.rsplit("/", 1)
            group = self.groups.get(group_id)
            if group is None or group_id in restarted:
                continue
            if self.tools and self.tool_turn(group, int(index), f):
                continue  # its call runs after this step's intents are written
            if not self._score(group, int(index), f, now):
                restarted.add(group_id)
        self.run_calls(now)

    def _score(self, group: Group, index: int, f: Finished, now: float) -> bool:
        """Score the sample's last turn into its group (False: its reward failed, the group restarted)."""
        try:
            reward = self.rewards.score(self.task, group.prompt, f.response_ids)
        except RewardFailure as e:
            self.fail(group, e.reason, e.detail, thrown_away=len(f.response_ids))
            return False
        t = self.trajectory(group, index, f.response_ids, f.logprobs, reward, f.finish_reason, now)
        if (why := untrainable(t)) is not None:  # a row the trainer would refuse at every retry: never data
            self.fail(group, "malformed", f"sample {index}: {why}", thrown_away=len(f.response_ids))
            return False
        group.done[index] = t
        self.episodes.pop(f.request_id, None)
        if len(group.done) == self.group_size:
            if not self.completed:
                self.completed_since = now
            self.completed.append(self.groups.pop(group.lease.group_id))
        return True

    def tool_turn(self, group: Group, index: int, f: Finished) -> bool:
        """If this finished model turn calls a tool and turns are left: queue the call in `intents` (True).
        False: the turn is the sample's last, to be scored."""
        episode = self.episodes.get(f.request_id) or Episode()
        if f.finish_reason != "stop" or episode.turns >= self.max_turns:
            return False
        found = parse_call(self.task.turn_text(f.response_ids[len(episode.mask):]), self.tools)
        if found is None:
            return False
        self.intents.append((group, index, f, episode, *found))
        return True

    def run_calls(self, now: float) -> None:
        """Write the pool with this step's call intents, then run each call once and put its sample back in the
        engine with the output (a sample with no room left for it is scored on this turn). A tool that fails
        fails its group ("sandbox")."""
        if not self.intents:
            return
        if self.write_ahead is not None:
            self.write_ahead()  # from here on a crash leaves these intents without output: never run again
        intents, self.intents = self.intents, []
        for group, index, f, episode, tool, text in intents:
            if self.groups.get(group.lease.group_id) is not group:
                continue  # its group failed during this step and starts again from its prompt
            try:
                out, latency = self._answer((group.lease.group_id, index, episode.turns - 1), tool, text)
            except RewardFailure as e:
                self.fail(group, e.reason, e.detail, thrown_away=len(f.response_ids))
                continue
            if not self._continue(f, episode, tool.name, out, latency):
                self._score(group, index, f, now)

    def _continue(self, f: Finished, episode: Episode, tool: str, out: list[int], latency: float) -> bool:
        """Put the sample back in the engine: its turn without the <eos> (it ends the turn; it is not context),
        then the tool's output (log-prob 0, mask 0). False: no room left for the answer."""
        body, lps = f.response_ids[:-1], f.logprobs[:-1]
        try:
            self.engine.add(f.request_id, f.prompt_ids, prefix_ids=body + out, prefix_logprobs=lps + [0.0] * len(out))
        except Exception as e:  # noqa: BLE001 - no room left for the answer: the sample ends on this turn
            log.info("tool_turn_ended", request_id=f.request_id, error=str(e)[:200])
            return False
        episode.mask = episode.mask + [1] * (len(body) - len(episode.mask)) + [0] * len(out)
        episode.calls.append(ToolCall(episode.turns - 1, tool, latency))
        self.episodes[f.request_id] = episode
        self.tool_turns_unsaved += 1
        return True

    def _answer(self, key: tuple[str, int, int], tool, text: str) -> tuple[list[int], float]:
        """The output tokens of call `key` and the seconds it took: the recorded answer of the same call
        (`remember_calls`), else one run of the tool, counted in tool_executions."""
        recorded = self.recorded.pop(key, None)
        if recorded is not None and recorded[0] == text:
            log.info("tool_reused", run_id=self.run_id, group_id=key[0], sample=key[1], turn=key[2], tool=tool.name)
            return list(recorded[1]), 0.0
        self.tool_executions[key] = self.tool_executions.get(key, 0) + 1
        result, latency = call(tool, text)
        log.info("tool_executed", run_id=self.run_id, group_id=key[0], sample=key[1], turn=key[2], tool=tool.name, ok=result.ok,
                 latency_s=round(latency, 6), call_sha=hashlib.sha256(text.encode()).hexdigest()[:12])
        if not result.ok:
            raise RewardFailure("sandbox", result.detail)
        return list(self.task.tool_output_ids(result.output)), latency

    def remember_calls(self, rows: list[Trajectory]) -> None:
        """Keep the completed calls of these recorded rows, whose groups are generated again from their prompts
        (a restart under a newer version): a regenerated turn that makes the same call gets its recorded answer."""
        for t in rows:
            self._carry_recorded(t)
            if t.tool_mask and self.tools:
                calls = recorded_calls(t.response_ids, t.tool_mask, self.task.turn_text, self.tools)
                for turn, answer in enumerate(calls):
                    self.recorded[(t.group_id, t.sample_index, turn)] = answer
            if "tool_intent" in t.extra and self.tools:  # possibly run: the same call is answered INTERRUPTED
                found = self._intent_call(t)
                self.recorded[(t.group_id, t.sample_index, int(t.extra["tool_intent"]))] = (
                    found[1] if found else "", list(self.task.tool_output_ids(INTERRUPTED)))

    def _carry_recorded(self, t: Trajectory) -> None:
        """The recorded answers a pool row carries (RECORDED: written by an incarnation that regenerated its group
        and had not reached those calls again when it died) back into `recorded`."""
        if RECORDED in t.extra and self.tools:
            for turn, text, out in json.loads(t.extra[RECORDED]):
                self.recorded.setdefault((t.group_id, t.sample_index, int(turn)), (str(text), [int(x) for x in out]))

    def _recorded_by_sample(self) -> dict[tuple[str, int], str]:
        """The RECORDED entries of pool rows, by (group, sample), for the samples answers are kept for."""
        kept: dict[tuple[str, int], list] = {}
        for (g, i, turn), (text, out) in self.recorded.items():
            kept.setdefault((g, i), []).append([turn, text, out])
        return {k: json.dumps(sorted(v)) for k, v in kept.items()}

    def fail(self, group: Group, reason: str, detail: str, thrown_away: int = 0) -> None:
        """A try of `group` failed (reason: envs/tasks/scoring.py REASONS): start it again from a freshly built
        prompt while retries are left, else drop it into `failed`. Its in-flight samples are aborted and its
        finished ones discarded (their tokens counted as regenerated)."""
        gid = group.lease.group_id
        self.rewards.fresh()  # the retry's reward calls start on a new thread and event loop
        aborted = self.engine.abort([f"{gid}/{i}" for i in range(self.group_size)])
        for i in range(self.group_size):
            self.episodes.pop(f"{gid}/{i}", None)
        thrown_away += sum(len(row[2]) for row in aborted) + sum(len(t.response_ids) for t in group.done.values())
        if self.counters is not None:
            self.counters.tokens_regenerated += thrown_away
        del self.groups[gid]
        fields = {"run_id": self.run_id, "replica_id": self.replica_id, "group_id": gid, "prompt_id": group.lease.prompt_id,
                  "source_id": group.prompt.source_id, "reason": reason, "detail": detail,
                  "attempt": group.attempts}
        if group.attempts > self.max_group_retries:
            log.error("group_failed", attempts=group.attempts, **fields)
            prom.ROLLOUT_GROUPS_FAILED.labels(self.replica_id, reason).inc()
            if not self.completed and not self.failed:
                self.completed_since = self.clock()
            self.failed.append(FailedGroup(group_id=gid, prompt_id=group.lease.prompt_id, reason=reason,
                                           detail=detail[:200], attempts=group.attempts,
                                           source_id=group.prompt.source_id))
            return
        log.warning("group_retried", retries_left=self.max_group_retries - group.attempts, **fields)
        prom.ROLLOUT_GROUP_RETRIES.labels(self.replica_id, reason).inc()
        self.admit([group.lease], attempts=group.attempts + 1)

    def resume(self, groups: dict[str, list[Trajectory]], version: int) -> None:
        """Continue these groups under `version` (the one loaded): partial samples from their prefixes (prefilled
        again), missing samples from the prompt; finished samples are kept as they are. A group whose samples
        do not fit beside those in flight (slots, or its prompts and prefixes in the KV cache) waits in
        `deferred` until they do (`resume_deferred`): a resume never overruns the engine."""
        for group_id, rows in groups.items():
            if self.engine.in_flight() and not self._fits_rows(rows):
                self.deferred[group_id] = (version, rows)
                continue
            self._resume_one(group_id, rows, version)

    def _fits_rows(self, rows: list[Trajectory]) -> bool:
        partial = [t for t in rows if t.finish_reason == "partial"]
        missing = self.group_size - len(rows)
        unfinished = len(partial) + missing
        kv = sum(len(t.prompt_ids) + len(t.response_ids) for t in partial) + missing * len(rows[0].prompt_ids)
        used, capacity = self.engine.kv_usage()
        return self.engine.free_slots() >= unfinished and used + kv <= capacity

    def resume_deferred(self) -> None:
        """The deferred groups of the loaded version that fit now are continued; one whose version is no longer
        loaded is generated again from its prompt (restart_fresh)."""
        version = self.engine.policy_version
        if version is None:
            return
        for group_id, (v, rows) in list(self.deferred.items()):
            if v != version:
                del self.deferred[group_id]
                self.restart_fresh({group_id: rows})
            elif not self.engine.in_flight() or self._fits_rows(rows):
                del self.deferred[group_id]
                self._resume_one(group_id, rows, v)

    def restart_fresh(self, groups: dict[str, list[Trajectory]]) -> None:
        """Generate these groups again from their prompts (their start version is not the one loaded): their
        tokens are counted as regenerated, and a regenerated turn that makes a call they completed gets the
        recorded answer instead of a second run."""
        rows = [t for g in groups.values() for t in g]
        if self.counters is not None:
            self.counters.tokens_regenerated += sum(len(t.response_ids) for t in rows)
        self.remember_calls(rows)
        self.admit([Lease(g, g_rows[0].prompt_id) for g, g_rows in groups.items()])

    def deferred_rows(self) -> list[Trajectory]:
        return [t for _, rows in self.deferred.values() for t in rows]

    def _resume_one(self, group_id: str, rows: list[Trajectory], version: int) -> None:
        first = rows[0]
        group = Group(Lease(group_id, first.prompt_id), self.task.prompt(first.prompt_id), first.started_at, version)
        self.groups[group_id] = group
        bad = next(((t.sample_index, why) for t in rows if t.finish_reason != "partial"
                    and (why := untrainable(t)) is not None), None)
        if bad is not None:  # a finished row the trainer would refuse (written by an older incarnation): never data
            self.fail(group, "malformed", f"sample {bad[0]}: {bad[1]}")
            return
        for t in rows:
            if t.finish_reason != "partial":
                group.done[t.sample_index] = t
                continue
            self._carry_recorded(t)
            if "tool_intent" in t.extra and self.tools:
                self._interrupted(group, t)
            else:
                # its completed tool calls are in its prefix: never run again
                self.episodes[f"{group_id}/{t.sample_index}"] = Episode.from_row(t.tool_mask, t.extra)
                self.engine.add(f"{group_id}/{t.sample_index}", t.prompt_ids,
                                prefix_ids=t.response_ids, prefix_logprobs=t.logprobs)
        for i in sorted(set(range(self.group_size)) - {t.sample_index for t in rows}):
            self.episodes.pop(f"{group_id}/{i}", None)  # from the prompt (admit)
            self.engine.add(f"{group_id}/{i}", first.prompt_ids)
        if self.groups.get(group_id) is group and len(group.done) == self.group_size:
            self.completed.append(self.groups.pop(group_id))

    def _intent_call(self, t: Trajectory) -> tuple[Tool, str] | None:
        """The call that ends the row of a sample whose call intent was written (its last turn)."""
        episode = Episode.from_row(t.tool_mask, t.extra)
        return parse_call(self.task.turn_text(t.response_ids[len(episode.mask):]), self.tools)

    def _interrupted(self, group: Group, t: Trajectory) -> None:
        """A resumed sample whose last call's intent was written and its output not: the call possibly ran, so
        it is not run again; the sample reads INTERRUPTED as that call's output and goes on (docs/decisions/tool-call-intents.md)."""
        rid, now = f"{group.lease.group_id}/{t.sample_index}", self.clock()
        episode = Episode.from_row(t.tool_mask, t.extra)
        found = self._intent_call(t)
        log.warning("tool_interrupted", run_id=self.run_id, group_id=group.lease.group_id, sample=t.sample_index,
                    turn=int(t.extra["tool_intent"]), tool=found[0].name if found else "")
        f = Finished(rid, t.prompt_ids, t.response_ids, t.logprobs, "stop")
        out = list(self.task.tool_output_ids(INTERRUPTED))
        if not self._continue(f, episode, found[0].name if found else "", out, 0.0):
            self._score(group, t.sample_index, f, now)

    def rows(self, groups: dict[str, Group], in_flight: list[InFlight]) -> list[Trajectory]:
        """The finished samples of `groups`, then the in-flight ones as partial trajectories (prefixes)."""
        now = self.clock()
        rows = [t for g in groups.values() for t in g.done.values()]
        partial = []
        for request_id, _prompt, response, logprobs in in_flight:
            group_id, index = request_id.rsplit("/", 1)
            partial.append(self.trajectory(groups[group_id], int(index), response, logprobs, 0.0, "partial", now,
                                           self.episodes.get(request_id)))
        for group, index, f, episode, _tool, _text in self.intents:  # queued calls (run_calls): their intents
            if groups.get(group.lease.group_id) is group:
                t = self.trajectory(group, index, f.response_ids, f.logprobs, 0.0, "partial", now, episode)
                t.extra["tool_intent"] = str(episode.turns - 1)
                partial.append(t)
        if self.recorded:  # answers kept for regenerated groups travel with their rows (RECORDED)
            kept = self._recorded_by_sample()
            for t in partial:
                if (t.group_id, t.sample_index) in kept:
                    t.extra[RECORDED] = kept[(t.group_id, t.sample_index)]
        return rows + partial

    def trajectory(self, group: Group, index: int, response: list[int], logprobs: list[float],
                   reward: float, finish: str, now: float, episode: Episode | None = None) -> Trajectory:
        episode = episode or self.episodes.get(f"{group.lease.group_id}/{index}") or Episode()
        return Trajectory(
            run_id=self.run_id, prompt_id=group.lease.prompt_id, group_id=group.lease.group_id,
            sample_index=index, prompt_ids=list(group.prompt.token_ids), response_ids=list(response),
            logprobs=list(logprobs), reward=reward, policy_version=group.start_version,
            replica_id=self.replica_id, started_at=group.started_at, ended_at=now, finish_reason=finish,
            extra=episode.extra(), tool_mask=episode.full_mask(len(response)),
        )
