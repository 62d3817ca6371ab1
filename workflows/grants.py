"""Slot-pool grants, the run's side: a run on a shared worker set (`laminar start`, workflows/pool.py) asks its slot
pool for replicas and runs min(ask, grant) of them.

Deterministic like workflows/ledger.py: it changes `RunState` (replicas_asked, grant, grant_note, pool_error) and
reaches Temporal only through what it is given: a `Runtime` (workflows/commands.py), `signal(pool, name, arg)` for
the signals to the pool, and `scale_to(target)`, the run's own `laminar scale` path that starts replicas or asks
them to leave; tests/test_grants.py drives it with fakes.

- The ask is rollout.replicas, or the run's last `laminar scale` target; the pool hears it at the start of each
  history segment and after each scale (`tell`), and again every POOL_RETRY_S while the pool does not take it.
- A grant (the pool's `replica_grant` signal) is kept; once the run has started its replicas (`may_apply`), the
  run starts or retires replicas so that min(ask, grant) run. Retired ones leave gracefully.
- A finished or stopped run leaves the pool at once (`leave`), so its slots go to the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio.exceptions import FailureError

from laminar import contract
from laminar.config import RunConfig
from laminar.contract import PoolAsk, ReplicaGrant, ScaleResult
from laminar.workflows import timeouts
from laminar.workflows.commands import Runtime
from laminar.workflows.state import RunState


class SlotGrants:
    def __init__(self, state: RunState, cfg: RunConfig | None, rt: Runtime, workflow_id: str, *,
                 signal: Callable[[str, str, Any], Awaitable[None]], scale_to: Callable[[int], ScaleResult],
                 may_apply: Callable[[], bool], closing: Callable[[], bool]) -> None:
        self.state, self.cfg, self.rt, self.workflow_id = state, cfg, rt, workflow_id
        self.signal = signal  # (pool workflow id, signal name, argument) -> the signal sent
        self.scale_to = scale_to  # start or retire replicas to this many (the `laminar scale` path)
        self.may_apply = may_apply  # the run has started its replicas and is neither failed nor finished
        self.closing = closing  # the segment drains: stop telling the pool
        self.ask_unsent = True  # the slot pool has not heard this segment's ask yet

    def ask(self) -> int:
        """The replicas the run asks for: rollout.replicas, or its last `laminar scale` target."""
        assert self.cfg is not None
        return self.state.replicas_asked or self.cfg.rollout.replicas

    def scale_ask(self, replicas: int) -> ScaleResult:
        """`laminar scale` on a pooled run changes its ask: the pool hears it, and the run runs min(ask, grant)."""
        self.state.replicas_asked = replicas
        self.ask_unsent = True
        res = self.apply()
        return ScaleResult(replicas_target=replicas, started=res.started if res else [],
                           removed=res.removed if res else [])

    def granted(self, grant: ReplicaGrant) -> None:
        """The pool's grant (a signal): kept, and applied once the run runs its replicas."""
        if not self.state.pool:
            return  # not a pooled run: a stray signal changes nothing
        self.state.grant, self.state.grant_note = max(0, grant.granted), grant.note
        self.apply()

    def apply(self) -> ScaleResult | None:
        """Start or retire replicas so that min(ask, grant) run. Before the run has started its replicas, or while it
        stops, only the grant is kept. None when nothing changes."""
        if not self.state.pool or self.cfg is None or not self.may_apply() or self.state.stopping:
            return None
        target = min(self.ask(), max(0, self.state.grant))
        if target == len([r for r in self.state.replica_ids if r not in self.state.leaving]):
            return None
        return self.scale_to(target)

    async def tell(self) -> None:
        """State the run's ask to its slot pool at the start of the segment and after each scale; a pool that does not
        take the signal (it is not running) is asked again every POOL_RETRY_S."""
        assert self.cfg is not None
        while not self.closing():
            await self.rt.wait(lambda: self.ask_unsent or self.closing())
            if self.closing():
                return
            self.ask_unsent = False
            r = self.cfg.rollout
            ask = PoolAsk(run_id=self.state.run_id, workflow_id=self.workflow_id, replicas=self.ask(),
                          quota=min(r.quota, self.ask()), engine=r.engine)
            try:
                await self.signal(self.state.pool, contract.POOL_ASK, ask)
                self.state.pool_error = ""
            except FailureError as e:
                self.state.pool_error = f"slot pool {self.state.pool} did not take the run's ask ({e}); asking again"
                self.ask_unsent = True
                await self.rt.sleep(timeouts.POOL_RETRY_S)

    async def leave(self) -> None:
        """A finished or stopped run gives its slots back at once (a failed one: the pool finds it gone)."""
        try:
            await self.signal(self.state.pool, contract.POOL_LEAVE, self.state.run_id)
        except FailureError as e:
            self.rt.logger.warning("pool_leave_failed", extra={"pool": self.state.pool, "error": str(e)})

    def note(self) -> str:
        """Why the run runs fewer replicas than it asks ("" when it does not, or is not pooled)."""
        if not self.state.pool:
            return ""
        if self.state.pool_error:
            return self.state.pool_error
        if self.state.grant < 0:
            return f"waiting for a grant from slot pool {self.state.pool}"
        return self.state.grant_note

    def facts(self) -> dict[str, Any]:
        """The grant's part of the watchdog's facts (laminar/watchdog.py)."""
        if not self.state.pool:
            return {}
        return {"replicas_granted": self.state.grant, "grant_note": self.note(), "replicas_wanted": self.ask()}
