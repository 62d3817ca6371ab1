"""The dev stack's S3 server: moto's in-memory S3, saved to a snapshot directory when it stops and loaded
from it before it listens, so S3 state survives `laminar dev down`/`up` and the store drill's restarts.

    python -m devstack.s3_server -H 127.0.0.1 -p PORT --snapshot DIR

Start: the snapshot's buckets and objects are put into moto's backend before the socket is bound, so no
client ever finds an object missing that was there when the server last stopped.

Stop (SIGTERM or SIGINT): the server stops accepting connections, lets the requests it already admitted
finish, and holds any later request on an open connection unanswered (its client retries it against the
restarted server); only then does it save the snapshot and exit. So every write acknowledged to a client
is in the snapshot.

Read-only mode (the chaos nemesis's `readonly` fault, devstack/stack.py `DevStack.readonly_s3`): while it is on,
every write (PUT, POST, DELETE) is refused with 403 AccessDenied, as a bucket policy that denies writes would
(botocore does not retry a 403; the store raises StoreError "was denied"); reads are served. It is switched by
`PUT /_laminar/mode/read-only` and `PUT /_laminar/mode/read-write` on the server's own port (no bucket name
starts with `_`, so the path is never an S3 request), which answer `{"mode": ..., "refused": N}`: N writes
refused since the mode last went read-only. A restart starts read-write.

The snapshot (`DIR/buckets.pickle`, moto's bucket objects pickled with their live objects) is as big as
the buckets however often their keys were overwritten. A save writes a new file, fsyncs it and replaces
the old one atomically, so a save cut short leaves the previous snapshot. It is read only by the same
moto version (pinned in pyproject.toml). A SIGKILL (or a crash) loses the writes since the last graceful
stop.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import moto
import typer
from moto.s3.models import s3_backends
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

SNAPSHOT = "buckets.pickle"
MODE_PATH = "/_laminar/mode/"  # + read-only | read-write: the read-only fault's switch
WRITE_METHODS = frozenset({"PUT", "POST", "DELETE"})
ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied: the S3 dev server is read-only (a chaos fault)</Message></Error>")


class _Gate:
    """WSGI middleware that admits requests until `close`, which waits for the admitted ones to finish."""

    def __init__(self, app):
        self._app = app
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self.read_only = False
        self.refused = 0  # writes refused since read-only mode was last switched on

    def __call__(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        if path.startswith(MODE_PATH):
            return self._switch(path.removeprefix(MODE_PATH), method, start_response)
        if self.read_only and method in WRITE_METHODS:
            with self._cond:
                self.refused += 1
            _drain(environ)  # the body unread would be parsed as the connection's next request
            start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(ACCESS_DENIED)))])
            return [ACCESS_DENIED]
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

    def _switch(self, mode: str, method: str, start_response):
        """`PUT /_laminar/mode/read-only|read-write` (GET: the mode as it is)."""
        if mode not in ("read-only", "read-write") or method not in ("PUT", "GET"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"PUT /_laminar/mode/read-only or /_laminar/mode/read-write\n"]
        with self._cond:
            if method == "PUT":
                if mode == "read-only" and not self.read_only:
                    self.refused = 0
                self.read_only = mode == "read-only"
                logging.getLogger("s3_dev_server").warning("mode %s (refused %d)", mode, self.refused)
            body = json.dumps({"mode": "read-only" if self.read_only else "read-write",
                               "refused": self.refused}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._active:
                self._cond.wait()


def _drain(environ) -> None:
    """Read and discard a request's body."""
    stream = environ["wsgi.input"]
    if environ.get("wsgi.input_terminated"):  # chunked: the stream ends with the body
        while stream.read(1 << 16):
            pass
        return
    left = int(environ.get("CONTENT_LENGTH") or 0)
    while left > 0 and (chunk := stream.read(min(left, 1 << 16))):
        left -= len(chunk)


class _Handler(MotoRequestHandler):
    # A client that stalls for this long mid-request (or an idle keep-alive connection) is dropped, so a
    # stop never waits on it for long; the request was not answered, so its client retries it.
    timeout = 30


def load(snapshot: Path) -> int:
    """Put the snapshot's buckets into moto's backend; returns the number of objects."""
    path = snapshot / SNAPSHOT
    if not path.exists():
        return 0
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except Exception as e:
        raise SystemExit(f"S3 snapshot {path} cannot be read ({e}); move {snapshot} aside to start with empty S3") from e
    if saved.get("moto") != moto.__version__:
        raise SystemExit(f"S3 snapshot {path} was written by moto {saved.get('moto')}, this server runs moto "
                         f"{moto.__version__}; move {snapshot} aside to start with empty S3")
    for name, (partition, account, bucket) in saved["buckets"].items():
        s3_backends[account][partition].buckets[name] = bucket
        s3_backends.bucket_accounts[name] = (partition, account)
    return sum(len(bucket.keys) for _, _, bucket in saved["buckets"].values())


def save(snapshot: Path) -> int:
    """Write moto's buckets (their live objects: FakeKey pickles its bytes) to the snapshot file, replaced
    atomically (no request may run meanwhile); returns the number of objects."""
    buckets = {name: (partition, account, s3_backends[account][partition].buckets[name])
               for name, (partition, account) in s3_backends.bucket_accounts.items()}
    tmp = snapshot / (SNAPSHOT + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"moto": moto.__version__, "buckets": buckets}, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(snapshot / SNAPSHOT)  # the commit point
    fd = os.open(snapshot, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sum(len(bucket.keys) for _, _, bucket in buckets.values())


def main(
    host: str = typer.Option("127.0.0.1", "-H", "--host"),
    port: int = typer.Option(..., "-p", "--port"),
    snapshot: Path = typer.Option(..., help="directory the S3 state is kept in"),
    insecure: bool = typer.Option(False, "--insecure", help="Accept a non-loopback --host (same as LAMINAR_INSECURE=1)."),
) -> None:
    """Serve moto's S3 from a snapshot directory until SIGTERM/SIGINT, then save the snapshot."""
    from laminar.errors import ConfigError
    from laminar.listeners import check_bind, insecure_from_env

    try:  # moto takes any credentials: off loopback only when asked for by name (laminar/listeners.py)
        check_bind("the S3 dev server", host, secret=None, variable=None, insecure=insecure or insecure_from_env(),
                   risk="it accepts any credentials, so anyone who can reach the port reads and writes every bucket")
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
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
    log.info("stopped by signal %d; saved %d objects to %s (%.2fs)", sig, written, snapshot,
             time.monotonic() - started)
    # Returning ends the process: the request threads (daemons) held by the gate are not waited for.


if __name__ == "__main__":
    typer.run(main)
