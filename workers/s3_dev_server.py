"""The dev stack's S3 server: moto's server, with its request recorder made safe under concurrency.

moto writes each recorded request with two writes (the JSON, then a newline) from whichever server
thread handles it, so concurrent requests interleave and corrupt the recording. Serialising the
recorder keeps one request per line, which the dev stack replays on start to restore S3 state.

    python -m workers.s3_dev_server -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import threading

from moto.moto_api._internal.recorder.models import Recorder
from moto.server import main

_lock = threading.Lock()
_record_request = Recorder._record_request


def _serialised_record_request(self, request, body=None):
    with _lock:
        return _record_request(self, request, body)


Recorder._record_request = _serialised_record_request

if __name__ == "__main__":
    main()
