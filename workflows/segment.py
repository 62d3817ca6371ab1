"""One history segment of a training run: its input (the run config, and the state a continue-as-new carried over),
its own flags and counters, and when it is full and hands over to the next (docs/architecture/handover.md,
'Continue-as-new: the hand-over').

Pure: the workflow passes `workflow.info()` in (tests/test_segment.py passes a stand-in). What a segment carries to
the next is `RunState` alone; everything here starts afresh in each segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from laminar.config import RunConfig
from laminar.errors import ConfigError
from laminar.rl.factory import check_engines
from laminar.workflows.carry import decode_state
from laminar.workflows.state import RunState
from laminar.workflows.timeouts import updates_budget


class HistoryInfo(Protocol):
    """What a segment reads of `workflow.info()`."""

    def get_current_history_length(self) -> int: ...

    def is_continue_as_new_suggested(self) -> bool: ...


@dataclass
class Segment:
    first_step: int = 0  # the run's step when this segment started
    updates: int = 0  # updates handled in this segment (the server caps them per run)
    error: str | None = None  # the input failed validation: the run fails, every update is refused
    replicas_started: bool = False  # run() started the replicas: a grant (slot pool) is applied from then on
    handover: bool = False  # handing over to the next segment: replicas are told, none is started
    keep: bool = False  # ... and told to keep their groups in flight and re-attach (run.handover_keep)
    closing: bool = False  # draining for continue-as-new or finish: relay watchers and the watchdog stop
    finished: bool = False  # the run returned its final status

    def full(self, cfg: RunConfig, info: HistoryInfo, senders: int = 0) -> bool:
        """The segment is near a server limit (events, updates: run.updates_per_segment, or fewer for a run whose
        `senders` of updates, replicas and relays, would otherwise take it past the server's limit while it hands
        over: timeouts.updates_budget) or the server suggests a new one."""
        return (info.get_current_history_length() >= cfg.run.history_events_per_segment
                or self.updates >= min(cfg.run.updates_per_segment, updates_budget(senders))
                or info.is_continue_as_new_suggested())

    def should_continue_as_new(self, state: RunState, cfg: RunConfig, info: HistoryInfo, senders: int = 0) -> bool:
        """Hand over now: the segment is full, or run.continue_as_new_every steps were taken in it (never at the
        run's end, nor while it stops)."""
        if state.step >= cfg.run.steps or state.stopping:
            return False
        every = cfg.run.continue_as_new_every
        forced = every > 0 and state.step > self.first_step and state.step % every == 0
        return forced or self.full(cfg, info, senders)

    def may_start(self, state: RunState) -> bool:
        """New replicas and relays are started now (else the next segment starts them, from the state)."""
        return not self.handover and not self.closing and not state.stopping


def pool_of(inp: Any) -> str:
    """The slot pool a new run joins (`laminar start` sets it; "" for a run that owns its workers)."""
    return str(inp.get("pool") or "") if isinstance(inp, dict) else ""


def parse_input(inp: Any) -> tuple[RunConfig, RunState | None]:
    """Validate the workflow input; ConfigError ends the run FAILED (never an endless task retry)."""
    if not isinstance(inp, dict) or "config" not in inp:
        raise ConfigError(
            'workflow input must be a JSON object {"config": {...run config...}}, '
            f"got {type(inp).__name__}: {str(inp)[:80]}"
        )
    cfg = check_engines(RunConfig.from_json(inp["config"]))  # the engines fit (rl.factory)
    state = inp.get("state")
    if state is None:
        return cfg, None
    try:
        return cfg, decode_state(state)  # compact leases, one compiled validator (workflows/carry.py)
    except Exception as e:  # a hand-written state that does not match RunState
        raise ConfigError(f"workflow input state does not match RunState: {e}") from None
