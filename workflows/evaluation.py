"""Held-out evaluation during training, the workflow's side (docs/evaluation.md, docs/decisions/eval-rounds.md 'Eval rounds
wired'): eval rounds (workflows/eval_rounds.py, pure) over `RunState.eval`, fed by the replicas' claims, and each
closed round's record stored by one `record_eval` activity.

Deterministic like workflows/ledger.py: the workflow passes claims in, and Temporal is reached only through the
`Runtime` and `record` (workflows/commands.py `record_eval`), which a test replaces.

- A round opens for each due version (`due_versions`: eval.at_start, every eval.every_steps, eval.at_end) once the
  version is published and the eval set's size is known (a replica's claim says it: `eval_set`).
- A claim reports the replica's eval results (first result kept), the versions it could not load, the eval leases
  it holds (any other leased to it goes back: a lost answer, a dead incarnation, a departure), and is
  answered eval leases up to its `eval_room`: open rounds of versions it has seen, oldest first. The replica scores them on
  its own eval engine with the version's weights (services/rollout/evaluation.py), so eval never takes a training
  slot, and training leases, the ledger and every training counter are untouched.
- A closed round is recorded once (`record_eval`; a retry writes the same record); then its results are dropped
  from the state, its figures kept in `eval_done` (the last RECENT_EVALS) for the status.
- At the run's end the workflow waits (at most EVAL_END_WAIT) for the rounds of versions it published, leasing no
  training prompt meanwhile; an operator's stop does not wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from laminar.config import RunConfig
from laminar.contract import ClaimPromptsInput, EvalLease, EvalRoundStatus, RecordEvalInput, RunStatus
from laminar.evalstats import EvalSummary, due_versions
from laminar.workflows.commands import Runtime
from laminar.workflows.eval_rounds import EvalRounds, rounds_from_json
from laminar.workflows.state import RunState

RECENT_EVALS = 20  # closed rounds kept in the status
EVAL_END_WAIT = timedelta(minutes=5)  # the most a finished run waits for its last eval rounds


class Evaluation:
    def __init__(self, state: RunState, cfg: RunConfig | None, rt: Runtime,
                 record: Callable[[RecordEvalInput], Any]) -> None:
        self.state, self.cfg, self.rt, self.record = state, cfg, rt, record
        # a continued segment's state carries them as JSON (workflows/state.py)
        state.eval = rounds_from_json(state.eval)
        state.eval_done = [done_from_json(d) for d in state.eval_done]
        e = cfg.eval if cfg is not None else None
        self.due = due_versions(cfg.run.steps, e.every_steps, e.at_start, e.at_end) if cfg is not None and e else []
        self.on = False  # set by the run: eval is due and the history has patch `eval-rounds`
        self.writes: dict[int, Any] = {}  # version -> its record_eval task in this segment
        self.ending = False  # the run waits for its last rounds: no training prompt is leased

    def wanted(self) -> bool:
        return bool(self.due)

    # -- claims ---------------------------------------------------------------------------------

    def on_claim(self, inp: ClaimPromptsInput, leasing: bool) -> list[EvalLease]:
        """Results, give-backs and holdings of a claim; then its eval leases (none unless `leasing`)."""
        if not self.on:
            return []
        assert self.cfg is not None
        rounds, replica_id, now = self.state.eval, inp.report.replica_id, self.rt.now()
        if rounds is None:
            if inp.eval_set <= 0:
                return []
            rounds = self.state.eval = EvalRounds(prompts=inp.eval_set, samples=self.cfg.eval.samples,
                                                  threshold=self.cfg.eval.pass_threshold)
        for r in inp.eval_results:
            if rounds.report(r.policy_version, r.index, r.result, now) and rounds.rounds[r.policy_version].complete:
                self._closed(r.policy_version)
        rounds.reconcile(replica_id, {(h.policy_version, h.index) for h in inp.eval_holding})
        self.open_due()
        if not leasing or inp.eval_room <= 0:
            return []
        held = inp.report.policy_version
        # oldest first: the oldest round closes first, while relays still hold its version
        order = sorted(v for v, rnd in rounds.rounds.items() if rnd.closed_at is None)
        skip = set(inp.eval_unloadable)  # no relay served it these versions
        out: list[EvalLease] = []
        for v in order:
            if v in skip or held < v:
                continue  # a version is leased once the replica has seen it published
            out += [EvalLease(v, p) for v, p in rounds.lease(replica_id, inp.eval_room - len(out), v)]
            if len(out) >= inp.eval_room:
                break
        return out

    def open_due(self) -> None:
        """Open the round of every due version published so far (once)."""
        if self.state.eval is None:
            return
        for v in self.due:
            if v <= self.state.policy_version and v not in self.state.eval.rounds:
                self.state.eval.open(v, self.rt.now())

    def release(self, replica_id: str) -> None:
        """A replica left (retired): its eval leases go back to their rounds."""
        if self.state.eval is not None:
            self.state.eval.release(replica_id)

    # -- records ----------------------------------------------------------------------------------

    def _closed(self, version: int) -> None:
        rounds = self.state.eval
        assert rounds is not None
        summary = rounds.summary(version)
        rnd = rounds.rounds[version]
        if summary is not None:
            self.state.eval_done = (self.state.eval_done + [EvalRoundStatus(
                policy_version=version, summary=summary, duplicates=rnd.duplicates, opened_at=rnd.opened_at,
                closed_at=rnd.closed_at or 0.0, releases=rnd.releases)])[-RECENT_EVALS:]
        self.start_records()

    def start_records(self) -> None:
        """One record_eval activity for each closed round not yet recorded (again in a new segment for one whose
        activity the hand-over cut short)."""
        rounds = self.state.eval
        if not self.on or rounds is None:
            return
        for v, rnd in sorted(rounds.rounds.items()):
            if rnd.complete and rnd.prompts > 0 and v not in self.writes:
                self.writes[v] = self.rt.spawn(self._record(v))

    async def _record(self, version: int) -> None:
        rounds = self.state.eval
        assert rounds is not None and self.cfg is not None
        rnd = rounds.rounds[version]
        inp = RecordEvalInput(run_id=self.state.run_id, config=self.cfg.to_json(), policy_version=version,
                              results=[rnd.results[p] for p in range(rnd.prompts)],
                              wall_s=round((rnd.closed_at or rnd.opened_at) - rnd.opened_at, 3),
                              duplicates=rnd.duplicates, releases=rnd.releases)
        if not await self.record(inp):
            return  # logged by the command; the figures stay in the status, the results in the state
        rounds.drop_results(version)
        self.state.eval_done = [s if s.policy_version != version else dataclasses.replace(s, recorded=True)
                                for s in self.state.eval_done]

    async def settle(self) -> None:
        """Wait for the record activities in flight (before a continue-as-new or the end)."""
        if any(not t.done() for t in self.writes.values()):
            await self.rt.wait(lambda: all(t.done() for t in self.writes.values()))

    # -- the end ----------------------------------------------------------------------------------

    def waiting_at_end(self) -> bool:
        """Rounds of published due versions not closed yet (or not opened, the eval set's size unknown)."""
        if not self.on:
            return False
        published = [v for v in self.due if v <= self.state.policy_version]
        rounds = self.state.eval
        if rounds is None:
            return bool(published)
        return any(v not in rounds.rounds or not rounds.rounds[v].complete for v in published)

    async def finish(self) -> None:
        """The run took its last step: wait for its last rounds (bounded), then for their records."""
        if not self.on:
            return
        self.ending = True
        try:
            await self.rt.wait(lambda: not self.waiting_at_end() or self.state.stopping, timeout=EVAL_END_WAIT)
        except TimeoutError:
            self.rt.logger.warning("eval_rounds_unfinished", extra={"pending": self.pending()})
        await self.settle()

    # -- the status -------------------------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        return {} if self.state.eval is None else {str(v): n for v, n in self.state.eval.pending().items()}

    def annotate(self, status: RunStatus) -> RunStatus:
        if not self.due:
            return status
        return dataclasses.replace(status, eval_pending=self.pending(), eval_done=list(self.state.eval_done))


def done_from_json(value: Any) -> EvalRoundStatus:
    """A closed round's figures as a continue-as-new carried them (JSON), or as they are."""
    if isinstance(value, EvalRoundStatus):
        return value
    return EvalRoundStatus(**{**value, "summary": EvalSummary(**value["summary"])})
