"""Experience segments and partial-response pools as Parquet, one row per trajectory
(docs/architecture/storage.md, 'Storage layout').

A segment is one atomic put: it is committed once it exists, and its SegmentRef (with sha256) is the
commit record reported to the workflow. A replica's partial pool is rewritten each flush into the one of its
two Parquet slots that its manifest does not name, then a small JSON manifest (slot, sha256, size, rows) is put
over the old one; readers trust the pool only through that manifest. Each put is atomic, so a flush cut short
(the process killed, the store down) leaves the previous commit readable: the pool is never "missing".
"""

from __future__ import annotations

import dataclasses
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from laminar.errors import CorruptDataError, ObjectNotFoundError
from laminar.records import Trajectory
from laminar.refs import SegmentRef
from laminar.storage import keys
from laminar.storage.objects import ObjectStore, sha256_hex

TRAJECTORY_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.int64(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("replica_id", pa.string(), nullable=False),
    pa.field("started_at", pa.float64(), nullable=False),  # unix seconds
    pa.field("ended_at", pa.float64(), nullable=False),  # unix seconds
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("extra", pa.map_(pa.string(), pa.string()), nullable=False),
    pa.field("tool_mask", pa.list_(pa.int8()), nullable=False),  # [] = all model tokens (records.Trajectory)
])
# columns a file written before they existed may lack: read as their default
OPTIONAL = {"tool_mask": list}

_FIELDS = [f.name for f in dataclasses.fields(Trajectory)]
if _FIELDS != TRAJECTORY_SCHEMA.names:  # a new Trajectory field must get a column here, and vice versa
    raise AssertionError(f"TRAJECTORY_SCHEMA columns {TRAJECTORY_SCHEMA.names} != Trajectory fields {_FIELDS}")


def trajectories_to_table(trajectories: list[Trajectory]) -> pa.Table:
    """An Arrow table with TRAJECTORY_SCHEMA, one row per trajectory."""
    # a shallow row per trajectory: dataclasses.asdict deep-copies every token list (1.3 s for 32 x 5,000 tokens)
    columns = {name: [getattr(t, name) for t in trajectories] for name in _FIELDS}
    columns["extra"] = [sorted(t.extra.items()) for t in trajectories]
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    """Trajectories from a table with TRAJECTORY_SCHEMA (see check_schema)."""
    out = []
    names = [n for n in TRAJECTORY_SCHEMA.names if n in table.schema.names]
    for row in table.select(names).to_pylist():
        row["extra"] = dict(row["extra"])
        for name, default in OPTIONAL.items():
            row.setdefault(name, default())
        out.append(Trajectory(**row))
    return out


def check_schema(schema: pa.Schema, where: str) -> None:
    """Raise CorruptDataError naming missing, mismatched and unexpected columns of `schema`."""
    missing = [n for n in TRAJECTORY_SCHEMA.names if n not in schema.names and n not in OPTIONAL]
    mismatched = [f"{f.name} is {schema.field(f.name).type}, expected {f.type}"
                  for f in TRAJECTORY_SCHEMA if f.name in schema.names and schema.field(f.name).type != f.type]
    extra = [n for n in schema.names if n not in TRAJECTORY_SCHEMA.names]
    if missing or mismatched or extra:
        details = "; ".join(filter(None, [
            f"missing columns {missing}" if missing else "",
            f"mismatched columns: {', '.join(mismatched)}" if mismatched else "",
            f"unexpected columns {extra}" if extra else "",
        ]))
        raise CorruptDataError(f"{where} does not match the trajectory schema: {details}; it was written by "
                               f"another version or another tool; rewrite it with laminar.storage.trajectories")


def _to_parquet(trajectories: list[Trajectory]) -> bytes:
    """A segment is written once and read whole by one trainer step, on the path from a group's end to the step
    that trains it: no column statistics (nothing filters on them) and no dictionary pages (zstd takes the
    repetition), which makes the write of a default run's segment 1.7x faster and the file a quarter smaller."""
    buf = io.BytesIO()
    pq.write_table(trajectories_to_table(trajectories), buf, compression="zstd", write_statistics=False,
                   use_dictionary=False)
    return buf.getvalue()


def _from_parquet(data: bytes, where: str) -> list[Trajectory]:
    try:  # one file read whole: ParquetFile.read takes half the time of read_table's dataset layer on a small segment
        table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptDataError(f"{where} is not readable Parquet ({exc}); the store holds a corrupt object") from exc
    check_schema(table.schema, where)
    return table_to_trajectories(table)


def _verify(data: bytes, key: str, size: int, sha256: str) -> None:
    if len(data) != size:
        raise CorruptDataError(f"{key}: size mismatch (expected {size} bytes, got {len(data)}); the store holds "
                               f"a truncated or replaced object")
    actual = sha256_hex(data)
    if actual != sha256:
        raise CorruptDataError(f"{key}: sha256 mismatch (expected {sha256[:8]}.., got {actual[:8]}..); the store "
                               f"holds a corrupt object")


class TrajectoryStore:
    """Writes and reads experience segments and partial-response pools of a run in an ObjectStore."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._committed_slot: dict[tuple[str, str, keys.Fence], int] = {}  # the slot each fence's manifest names

    def write_segment(self, run_id: str, replica_id: str, seq: str, trajectories: list[Trajectory]) -> SegmentRef:
        """Write one segment (complete groups) in a single atomic put and return its commit record."""
        if not trajectories:
            raise ValueError(f"segment {seq} of replica {replica_id} (run {run_id}) has no trajectories; "
                             f"write a segment only when at least one group is complete")
        return self._write(keys.experience_segment(run_id, replica_id, seq), trajectories)

    def write_migration(self, run_id: str, migration_id: str, trajectories: list[Trajectory]) -> SegmentRef:
        """Write the groups a repack source hands over (partial rows included); read with read_segment."""
        if not trajectories:
            raise ValueError(f"migration {migration_id} (run {run_id}) has no trajectories; a source with "
                             "nothing in flight declines instead")
        return self._write(keys.migration(run_id, migration_id), trajectories)

    def _write(self, key: str, trajectories: list[Trajectory]) -> SegmentRef:
        data = _to_parquet(trajectories)
        self.store.put(key, data)
        return SegmentRef(
            key=key, sha256=sha256_hex(data), size=len(data), rows=len(trajectories),
            group_ids=sorted({t.group_id for t in trajectories}),
            policy_version=max(t.policy_version for t in trajectories),
            tokens=sum(len(t.response_ids) for t in trajectories),
        )

    def read_segment(self, ref: SegmentRef) -> list[Trajectory]:
        """The trajectories of a committed segment, after checking size, sha256, schema and row count."""
        data = self.store.get(ref.key)
        _verify(data, ref.key, ref.size, ref.sha256)
        trajectories = _from_parquet(data, f"segment {ref.key}")
        if len(trajectories) != ref.rows:
            raise CorruptDataError(f"segment {ref.key} has {len(trajectories)} rows but its ref says {ref.rows}; "
                                   f"the ref was built for another object")
        return trajectories

    # -- partial-response pool -----------------------------------------------------------------------

    def write_partial(self, run_id: str, replica_id: str, fence: keys.Fence, trajectories: list[Trajectory]) -> None:
        """Replace this incarnation's partial pool: Parquet into the slot the manifest does not name, then the
        manifest (the commit) over the old one. Until the manifest's put lands, readers get the previous pool
        whole: a replica killed mid-flush, or blocked by a store outage while its retry starts, loses only this
        flush, never the pool (which held its tool calls' intents and outputs: without it the retry generated
        its groups again from their prompts and ran their calls a second time; docs/guides/tools.md).

        Pools are fenced by (history segment, attempt): each incarnation of a replica writes under its own
        keys and readers take the newest fence, so a zombie attempt that flushes after its retry started can
        never overwrite the retry's pool."""
        data = _to_parquet(trajectories)
        manifest_key = keys.partial_manifest(run_id, replica_id, fence)
        at = (run_id, replica_id, fence)
        if at not in self._committed_slot:  # first write of this fence here: which slot is committed, if any
            try:
                committed = self._manifest(manifest_key)
            except CorruptDataError:  # an unreadable commit is no commit: either slot may be overwritten
                committed = None
            self._committed_slot[at] = -1 if committed is None else int(committed.get("slot", 0))
        slot = 1 if self._committed_slot[at] == 0 else 0
        self.store.put(keys.partial_pool(run_id, replica_id, fence, slot), data)
        manifest = {"sha256": sha256_hex(data), "size": len(data), "rows": len(trajectories), "fence": list(fence),
                    "slot": slot}
        self.store.put(manifest_key, json.dumps(manifest, sort_keys=True).encode())
        self._committed_slot[at] = slot

    def _manifest(self, manifest_key: str) -> dict | None:
        """A pool manifest as a dict, or None when there is none; CorruptDataError when it cannot be read."""
        try:
            manifest_bytes = self.store.get(manifest_key)
        except ObjectNotFoundError:
            return None
        try:
            manifest = json.loads(manifest_bytes)
            if not isinstance(manifest, dict) or int(manifest.get("slot", 0)) not in (0, 1):
                raise ValueError(f"not a pool manifest: {manifest_bytes[:80]!r}")
            return manifest
        except (ValueError, TypeError) as exc:
            raise CorruptDataError(f"partial pool manifest {manifest_key} is unreadable ({exc!r}); the store "
                                   f"holds a corrupt object; clear_partial() discards the pool") from exc

    def newest_partial_fence(self, run_id: str, replica_id: str) -> keys.Fence | None:
        """The newest fence with a committed pool manifest, or None if the replica has none."""
        fences = [keys.parse_partial_fence(run_id, replica_id, k) for k in
                  self.store.list(keys.partial_prefix(run_id, replica_id)) if k.endswith(".json")]
        return max((f for f in fences if f is not None), default=None)

    def read_partial(self, run_id: str, replica_id: str) -> list[Trajectory]:
        """The replica's newest committed partial pool, verified; [] if none was committed. Its writer may
        still flush (a zombie attempt): a slot rewritten between the manifest's get and the slot's is read
        again through the new manifest, a few times, before it counts as corrupt."""
        fence = self.newest_partial_fence(run_id, replica_id)
        if fence is None:
            return []
        manifest_key = keys.partial_manifest(run_id, replica_id, fence)
        for tries_left in reversed(range(3)):
            manifest = self._manifest(manifest_key)
            if manifest is None:
                return []
            try:
                size, sha256, rows = int(manifest["size"]), str(manifest["sha256"]), int(manifest["rows"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptDataError(f"partial pool manifest {manifest_key} is unreadable ({exc!r}); the store "
                                       f"holds a corrupt object; clear_partial() discards the pool") from exc
            pool_key = keys.partial_pool(run_id, replica_id, fence, int(manifest.get("slot", 0)))
            try:
                data = self.store.get(pool_key)
                _verify(data, pool_key, size, sha256)
                break
            except ObjectNotFoundError as exc:
                if tries_left and self._manifest(manifest_key) != manifest:
                    continue
                raise CorruptDataError(f"partial pool {pool_key} is missing but its manifest {manifest_key} "
                                       f"exists; clear_partial() discards the pool") from exc
            except CorruptDataError:
                if tries_left and self._manifest(manifest_key) != manifest:
                    continue
                raise
        trajectories = _from_parquet(data, f"partial pool {pool_key}")
        if len(trajectories) != rows:
            raise CorruptDataError(f"partial pool {pool_key} has {len(trajectories)} rows, manifest says {rows}")
        return trajectories

    def clear_partial(self, run_id: str, replica_id: str, older_than: keys.Fence | None = None) -> None:
        """Discard the replica's partial pools (those fenced before `older_than`, or all), each manifest
        first, so a pool is uncommitted before it vanishes."""
        found = [(keys.parse_partial_fence(run_id, replica_id, k), k)
                 for k in self.store.list(keys.partial_prefix(run_id, replica_id))]
        doomed = [(f, k) for f, k in found if f is not None and (older_than is None or f < older_than)]
        for _, key in sorted(doomed, key=lambda fk: (fk[0], not fk[1].endswith(".json"))):
            self.store.delete(key)
