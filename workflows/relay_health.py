"""Which relays the chain leaves out for failing their data-plane checks: a pure, clock-free decision.

A relay's `run_relay` activity heartbeats from its worker process, so a relay whose data plane is unreachable
(its port's packets dropped, a wedged server, a gray failure) still looks alive to Temporal. The trainer sees it:
each step reports, from its circuit breakers (relay.breaker), the relays it could not reach (`relays_failed`) and,
of those out of the chain, the ones whose background probe passed since (`relays_passed`). This module turns those
reports into the chain:

- A joined relay that a report names as failing is taken out, unless that would leave no relay in the chain (a
  report in which every relay fails says more about the reporter than about the relays).
- A relay out of the chain that a report names as passing is taken back.
- A relay that leaves (heartbeat timeout, notice) or joins again with a new address starts afresh: `forget`.

The workflow keeps one `RelayHealth` per history segment (a new segment starts with every relay in the chain; a
relay still failing is taken out again at the trainer's first step). Times are the workflow's, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RelayHealth:
    out: dict[str, float] = field(default_factory=dict)  # address -> workflow time it was taken out

    def chain(self, joined: list[str]) -> list[str]:
        """The chain: the joined relays (in order) less those taken out; all of them if that leaves none."""
        kept = [a for a in joined if a not in self.out]
        return kept or list(joined)

    def report(self, joined: list[str], failed: list[str], passed: list[str], now: float) -> tuple[list[str], list[str]]:
        """Apply one report; returns (taken out, taken back), each in the chain's order."""
        back = [a for a in joined if a in self.out and a in passed and a not in failed]
        for a in back:
            del self.out[a]
        taken: list[str] = []
        for a in joined:
            if a in failed and a not in self.out and len(self.chain(joined)) > 1:
                self.out[a] = now
                taken.append(a)
        return taken, back

    def forget(self, address: str) -> None:
        """The relay at address left the chain or came back as a new incarnation: no verdict carries over."""
        self.out.pop(address, None)

    def relays_out(self, joined: list[str]) -> list[str]:
        """Joined relays currently out of the chain (the trainer probes them)."""
        return [a for a in joined if a in self.out]
