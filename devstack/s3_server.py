"""The dev stack's S3 server: moto's in-memory S3, saved to a snapshot directory when it stops and loaded
from it before it listens, so S3 state survives `laminar dev down`/`up` and the store drill's restarts.

    python -m devstack.s3_server -H 127.0.0.1 -p PORT --snapshot DIR

Start: the snapshot's buckets and objects are put into moto's backend before the socket is bound, so no
client ever finds an object missing that was there when the server last stopped.

Stop (SIGTERM or SIGINT): the server stops accepting connections, lets the requests it already admitted
finish, and holds any later request on an open connection unanswered (its client retries it against the
restarted server); only then does it save the snapshot and exit. So every write acknowledged to a client
is in the snapshot.

The snapshot holds the live objects only, so it is as big as the buckets however often their keys were
overwritten. `DIR/manifest.json` names each object's file under `DIR/objects/`; a save writes (and
fsyncs) the files of new or changed objects, then replaces the manifest atomically, then deletes the
files no manifest names any more. A save cut short leaves the previous manifest and all its files.
A SIGKILL (or a crash) loses the writes since the last graceful stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import typer
from moto.s3.models import FakeKey, s3_backends
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class _Gate:
    """WSGI middleware that admits requests until `close`, which waits for the admitted ones to finish."""

    def __init__(self, app):
        self._app = app
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    def __call__(self, environ, start_response):
        with self._cond:
            while self._closed:  # never answered: the process exits and the client retries
                self._cond.wait()
            self._active += 1
        try:
            return self._app(environ, start_response)  # moto changes its state before it returns
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._active:
                self._cond.wait()


class _Handler(MotoRequestHandler):
    # A client that stalls for this long mid-request (or an idle keep-alive connection) is dropped, so a
    # stop never waits on it for long; the request was not answered, so its client retries it.
    timeout = 30


def load(snapshot: Path) -> int:
    """Put the snapshot's buckets and objects into moto's backend; returns the number of objects."""
    _collect_garbage(snapshot)
    manifest = _read_manifest(snapshot)
    count = 0
    for name, bucket in manifest["buckets"].items():
        backend = s3_backends[bucket["account"]][bucket["partition"]]
        backend.create_bucket(name, bucket["region"])
        for key, entry in bucket["objects"].items():
            value = (snapshot / "objects" / entry["file"]).read_bytes()
            etag = entry["etag"].strip('"')  # kept as it was (a multipart upload's is not the bytes' MD5)
            backend.put_object(name, key, value, etag=etag, disable_notification=True)
            count += 1
    return count


def save(snapshot: Path) -> int:
    """Write moto's buckets and objects to the snapshot (no request may run meanwhile); returns the
    number of object files written (unchanged objects keep their files)."""
    objects = snapshot / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    previous = _read_manifest(snapshot)["buckets"]
    buckets: dict[str, dict] = {}
    written = 0
    for name, (partition, account) in sorted(s3_backends.bucket_accounts.items()):
        bucket = s3_backends[account][partition].buckets[name]
        entries: dict[str, dict] = {}
        before = previous.get(name, {}).get("objects", {})
        for key, obj in bucket.keys.items():
            if not isinstance(obj, FakeKey):
                continue  # a delete marker (versioned buckets)
            old = before.get(key)
            if old is not None and old["etag"] == obj.etag and old["size"] == obj.size:
                entries[key] = old
                continue
            file = uuid.uuid4().hex
            with open(objects / file, "wb") as f:
                f.write(obj.value)
                f.flush()
                os.fsync(f.fileno())
            entries[key] = {"file": file, "etag": obj.etag, "size": obj.size}
            written += 1
        buckets[name] = {"account": account, "partition": partition, "region": bucket.region_name,
                         "objects": entries}
    _fsync_dir(objects)
    tmp = snapshot / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "buckets": buckets}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(snapshot / MANIFEST)  # the commit point
    _fsync_dir(snapshot)
    _collect_garbage(snapshot)
    return written


def _read_manifest(snapshot: Path) -> dict:
    path = snapshot / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return {"version": MANIFEST_VERSION, "buckets": {}}
    except ValueError as e:
        raise SystemExit(f"S3 snapshot manifest {path} is not valid JSON ({e}); move {snapshot} aside to "
                         f"start with empty S3") from e
    if manifest.get("version") != MANIFEST_VERSION:
        raise SystemExit(f"S3 snapshot manifest {path} has version {manifest.get('version')!r}, this server "
                         f"reads version {MANIFEST_VERSION}; move {snapshot} aside to start with empty S3")
    return manifest


def _collect_garbage(snapshot: Path) -> None:
    """Delete the object files the manifest does not name: left by a save cut short, or replaced."""
    objects = snapshot / "objects"
    if not objects.is_dir():
        return
    named = {e["file"] for b in _read_manifest(snapshot)["buckets"].values() for e in b["objects"].values()}
    for path in objects.iterdir():
        if path.name not in named:
            path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(
    host: str = typer.Option("127.0.0.1", "-H", "--host"),
    port: int = typer.Option(..., "-p", "--port"),
    snapshot: Path = typer.Option(..., help="directory the S3 state is kept in"),
) -> None:
    """Serve moto's S3 from a snapshot directory until SIGTERM/SIGINT, then save the snapshot."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request: the log stays small
    log = logging.getLogger("s3_dev_server")

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # delivered to sigwait below, in any thread
    started = time.monotonic()
    snapshot.mkdir(parents=True, exist_ok=True)
    loaded = load(snapshot)
    gate = _Gate(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, port, gate, threaded=True, request_handler=_Handler)
    serving = threading.Thread(target=server.serve_forever, args=(0.05,), name="serve", daemon=True)
    serving.start()
    log.info("serving S3 at http://%s:%d with %d objects from %s (%.2fs)", host, port, loaded,
             snapshot, time.monotonic() - started)

    sig = signal.sigwait(stop_signals)
    started = time.monotonic()
    server.shutdown()  # no new connections
    server.socket.close()
    gate.close()  # the admitted requests have finished; later ones wait unanswered
    written = save(snapshot)
    log.info("stopped by signal %d; saved %d changed objects to %s (%.2fs)", sig, written, snapshot,
             time.monotonic() - started)
    # Returning ends the process: the request threads (daemons) held by the gate are not waited for.


if __name__ == "__main__":
    typer.run(main)
