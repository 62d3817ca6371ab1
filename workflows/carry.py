"""What a continue-as-new carries: `RunState`, with its leases as compact columns, decoded cheaply (docs/decisions/one-run-load.md,
2026-12-02 "A smaller carried state").

The open leases were one JSON object per lease (`OpenLease`: its group id, prompt id, replica id and three resume
fields at their defaults), 79-93 % of a segment's input at 40-80 replicas (465 KB with 2,551 leases, 788 KB with
5,091: over the server's 256 KB warning, near its 2 MB refusal at 160 replicas). Here they are columns: the prompt
ids, an index into the list of replica ids, and only what differs from the common case (a group id other than
`g{prompt_id:08d}`, the resume fields) by position; the `returned` leases and each replica's last claim likewise.

Decoding went through `temporalio.converter.value_to_type`, which resolves type hints once per nested value (every
lease), through the workflow sandbox's proxies: 0.2-0.3 s of CPU for 2,551 leases, 0.6-0.9 s in the sandbox, past the
SDK's 2 s deadlock detector on a loaded machine. Here the state goes through one pydantic validator built once per
process (as client/converter.py decodes every payload), and the leases are built from their columns in a loop.

Pure and deterministic; `decode_state` also reads the old format (every recorded history's continue-as-new input).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from laminar.contract import Lease
from laminar.refs import SegmentRef
from laminar.workflows.state import LastClaim, OpenLease, RunState

COMPACT = "leases"  # the key of the compact columns in an encoded state (its absence: the old format)
_BIG = ("open_leases", "returned", "last_claims")


def _gid(prompt_id: int) -> str:
    return f"g{prompt_id:08d}"  # workflows/ledger.py names a fresh lease so


@functools.cache
def _adapter() -> Any:
    from pydantic import TypeAdapter  # built once per process: its validators are compiled

    return TypeAdapter(RunState)


def _columns(leases: Iterable[OpenLease | Lease], replicas: dict[str, int] | None) -> dict[str, Any]:
    """prompt: prompt ids; replica: index into the replica ids (OpenLease only); odd: position -> what differs from
    a fresh lease (its group id, resume, resume_version, returned_at)."""
    prompts: list[int] = []
    owners: list[int] = []
    odd: dict[str, dict[str, Any]] = {}
    for i, lease in enumerate(leases):
        prompts.append(lease.prompt_id)
        extra: dict[str, Any] = {}
        if lease.group_id != _gid(lease.prompt_id):
            extra["group_id"] = lease.group_id
        if lease.resume is not None:
            extra["resume"] = dataclasses.asdict(lease.resume)
        if lease.resume_version != -1:
            extra["resume_version"] = lease.resume_version
        if isinstance(lease, OpenLease):
            assert replicas is not None
            owners.append(replicas.setdefault(lease.replica_id, len(replicas)))
            if lease.returned_at:
                extra["returned_at"] = lease.returned_at
        if extra:
            odd[str(i)] = extra
    out: dict[str, Any] = {"prompt": prompts, "odd": odd}
    if replicas is not None:
        out["replica"] = owners
    return out


def encode_state(state: RunState) -> dict[str, Any]:
    """The state as a continue-as-new sends it: every field as it is but the leases, which go as columns."""
    out = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in _BIG}
    replicas: dict[str, int] = {}
    leases = {"open": _columns(state.open_leases.values(), replicas),
              "returned": _columns(state.returned, replicas),
              "last_claims": {r: {"request_id": c.request_id, **_columns(c.leases, None)}
                              for r, c in state.last_claims.items()}}
    leases["replicas"] = list(replicas)
    out[COMPACT] = leases
    return out


def _rows(cols: dict[str, Any], replicas: list[str] | None) -> list[OpenLease] | list[Lease]:
    prompts, owners, odd = cols["prompt"], cols.get("replica"), cols.get("odd") or {}
    out: list[Any] = []
    for i, prompt_id in enumerate(prompts):
        extra = odd.get(str(i))
        group_id = _gid(prompt_id) if extra is None or "group_id" not in extra else str(extra["group_id"])
        resume = None if extra is None or extra.get("resume") is None else SegmentRef(**extra["resume"])
        version = -1 if extra is None else int(extra.get("resume_version", -1))
        if replicas is None:
            out.append(Lease(group_id=group_id, prompt_id=int(prompt_id), resume=resume, resume_version=version))
        else:
            assert owners is not None
            out.append(OpenLease(group_id=group_id, prompt_id=int(prompt_id), replica_id=replicas[owners[i]],
                                 resume=resume, resume_version=version,
                                 returned_at=0.0 if extra is None else float(extra.get("returned_at", 0.0))))
    return out


def decode_state(value: Any) -> RunState:
    """A carried state (compact, or the old format: one object per lease) as RunState; raises on one that does not
    match (parse_input makes that a ConfigError)."""
    if not isinstance(value, dict):
        raise TypeError(f"state must be a JSON object, got {type(value).__name__}")
    if COMPACT not in value:
        return _adapter().validate_python(value)
    rest = {k: v for k, v in value.items() if k != COMPACT}
    state = _adapter().validate_python(rest)
    cols = value[COMPACT]
    replicas = [str(r) for r in cols["replicas"]]
    state.open_leases = {lease.group_id: lease for lease in _rows(cols["open"], replicas)}
    state.returned = list(_rows(cols["returned"], replicas))
    state.last_claims = {r: LastClaim(request_id=str(c["request_id"]), leases=list(_rows(c, None)))
                         for r, c in cols["last_claims"].items()}
    return state
