"""The object-store contract, run against both backends (local directory and S3 on a real moto server)."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest

from laminar.errors import BucketNotFoundError, ObjectNotFoundError, StoreError, StoreUnavailableError
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore, MiB, S3ObjectStore, open_store
from tests.fixtures.s3 import free_port

# -- the contract, both backends ---------------------------------------------------------------------


def test_put_get_exists_size_overwrite_delete(object_store):
    key = "runs/r1/config.json"
    assert not object_store.exists(key)
    object_store.put(key, b"first")
    assert object_store.exists(key)
    assert object_store.get(key) == b"first"
    assert object_store.size(key) == 5  # len(b"first")
    object_store.put(key, b"second, longer")
    assert object_store.get(key) == b"second, longer"
    assert object_store.size(key) == 14  # len(b"second, longer")
    object_store.delete(key)
    assert not object_store.exists(key)
    object_store.delete(key)  # deleting an absent key is a no-op, as on S3


def test_empty_object_round_trips(object_store):
    object_store.put("runs/r1/empty", b"")
    assert object_store.get("runs/r1/empty") == b""
    assert object_store.size("runs/r1/empty") == 0


def test_missing_key_raises_object_not_found_naming_the_key(object_store):
    for op in (object_store.get, object_store.size):
        with pytest.raises(ObjectNotFoundError, match="runs/r1/nope.json"):
            op("runs/r1/nope.json")


def test_list_is_sorted_and_uses_a_plain_string_prefix(object_store):
    for key in ["runs/b/z", "runs/a/x/2", "runs/ab/y", "runs/a/x/1", "top"]:
        object_store.put(key, key.encode())
    assert object_store.list("") == ["runs/a/x/1", "runs/a/x/2", "runs/ab/y", "runs/b/z", "top"]
    assert object_store.list("runs/a") == ["runs/a/x/1", "runs/a/x/2", "runs/ab/y"]  # "runs/ab" matches too
    assert object_store.list("runs/a/") == ["runs/a/x/1", "runs/a/x/2"]
    assert object_store.list("runs/c/") == []


def test_bad_keys_are_rejected(object_store):
    for key in ["", "/abs", "runs/../etc", "runs//x", "dir/"]:
        with pytest.raises(ValueError, match="key"):
            object_store.put(key, b"x")


def test_describe_says_where_the_store_points(object_store):
    text = object_store.describe()
    if isinstance(object_store, S3ObjectStore):
        assert text.startswith(f"s3://{object_store.bucket}/") and object_store.endpoint_url in text
    else:
        assert text.startswith("file:///")


# -- local backend -----------------------------------------------------------------------------------


def test_local_put_leaves_no_temp_files_and_list_ignores_crashed_writes(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put("runs/r1/summary.json", b"{}")
    assert sorted(os.listdir(tmp_path / "runs" / "r1")) == ["summary.json"]
    # A writer that crashed before os.replace leaves only its temp file; it is not an object.
    (tmp_path / "runs" / "r1" / ".tmp-summary.json.abc").write_bytes(b"half")
    assert store.list("runs/") == ["runs/r1/summary.json"]


# -- S3 backend --------------------------------------------------------------------------------------


def test_s3_large_object_uses_multipart(moto_server, s3_bucket):
    store = S3ObjectStore(s3_bucket, endpoint_url=moto_server, multipart_threshold_bytes=5 * MiB)
    data = os.urandom(9 * MiB)
    store.put("runs/r1/big.bin", data)
    assert store.get("runs/r1/big.bin") == data
    assert store.size("runs/r1/big.bin") == 9 * MiB
    # A multipart object's ETag ends in "-<parts>": 9 MiB in 5 MiB parts -> ceil(9 / 5) = 2 parts.
    head = boto3.client("s3", endpoint_url=moto_server).head_object(Bucket=s3_bucket, Key="runs/r1/big.bin")
    assert head["ETag"].strip('"').endswith("-2")


def test_s3_prefix_isolates_stores_in_one_bucket(moto_server, s3_bucket):
    a = S3ObjectStore(s3_bucket, prefix="/team-a/", endpoint_url=moto_server)
    b = S3ObjectStore(s3_bucket, prefix="team-b", endpoint_url=moto_server)
    a.put("runs/r1/config.json", b"a")
    b.put("runs/r1/config.json", b"b")
    assert a.list("runs/") == ["runs/r1/config.json"] and a.get("runs/r1/config.json") == b"a"
    assert b.get("runs/r1/config.json") == b"b"
    raw = boto3.client("s3", endpoint_url=moto_server).list_objects_v2(Bucket=s3_bucket)
    assert sorted(o["Key"] for o in raw["Contents"]) == ["team-a/runs/r1/config.json", "team-b/runs/r1/config.json"]


def test_s3_missing_bucket_names_bucket_and_endpoint(moto_server):
    store = S3ObjectStore("laminar-no-such-bucket", endpoint_url=moto_server)
    for op in (lambda: store.put("k", b"x"), lambda: store.get("k"), lambda: store.exists("k"),
               lambda: store.list("")):
        with pytest.raises(BucketNotFoundError) as info:
            op()
        assert "laminar-no-such-bucket" in str(info.value) and moto_server in str(info.value)


def test_s3_unreachable_endpoint_names_endpoint_bucket_and_fix(aws_test_env):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = S3ObjectStore("laminar-bucket", endpoint_url=endpoint, max_attempts=2, connect_timeout_s=1)
    with pytest.raises(StoreUnavailableError) as info:
        store.put("runs/r1/config.json", b"{}")
    message = str(info.value)
    assert endpoint in message and "laminar-bucket" in message
    assert "LAMINAR_S3_ENDPOINT" in message and "2 attempt(s)" in message


class _FlakyS3(BaseHTTPRequestHandler):
    """A real HTTP server that answers 503 SlowDown `fail_first` times, then 404 NoSuchKey."""

    protocol_version = "HTTP/1.1"
    fail_first = 2
    requests = 0
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 (http.server's naming)
        with self.lock:
            type(self).requests += 1
            n = type(self).requests
        status, code = (503, "SlowDown") if n <= self.fail_first else (404, "NoSuchKey")
        body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_s3(aws_test_env):
    handler = type("Handler", (_FlakyS3,), {"requests": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_s3_transient_errors_are_retried_then_translated(flaky_s3):
    endpoint, handler = flaky_s3
    store = S3ObjectStore("laminar-bucket", endpoint_url=endpoint, max_attempts=5)
    with pytest.raises(ObjectNotFoundError, match="runs/r1/config.json"):
        store.get("runs/r1/config.json")
    assert handler.requests == 3  # two 503s retried (by botocore), the third answer (404) is permanent


def test_s3_throttling_past_max_attempts_is_unavailable(flaky_s3):
    endpoint, handler = flaky_s3
    store = S3ObjectStore("laminar-bucket", endpoint_url=endpoint, max_attempts=2)
    with pytest.raises(StoreUnavailableError, match=r"after 2 attempt\(s\): SlowDown \(HTTP 503\)"):
        store.get("runs/r1/config.json")
    assert handler.requests == 2  # max_attempts in all


# -- open_store and keys -----------------------------------------------------------------------------


def test_open_store_parses_urls(tmp_path, aws_test_env):
    assert isinstance(open_store(tmp_path.as_uri()), LocalObjectStore)
    assert open_store(tmp_path.as_uri()).root == tmp_path
    assert open_store(str(tmp_path / "plain")).root == tmp_path / "plain"
    s3 = open_store("s3://laminar/exp/one", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s3, S3ObjectStore)
    assert (s3.bucket, s3.prefix, s3.endpoint_url) == ("laminar", "exp/one/", "http://127.0.0.1:9")
    with pytest.raises(StoreError, match=r"unsupported scheme 'gs'.*s3://bucket/prefix"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreError, match="three slashes"):
        open_store("file://relative/path")
    with pytest.raises(StoreError, match="no bucket"):
        open_store("s3:///prefix")


def test_key_layout():
    assert keys.config("r1") == "runs/r1/config.json"
    assert keys.checkpoint_part("r1", 40, "model") == "runs/r1/checkpoints/step-00000040/model-00001.safetensors"
    assert keys.checkpoint_part("r1", 40, "optim") == "runs/r1/checkpoints/step-00000040/optim-00001.safetensors"
    assert keys.checkpoint_trainer("r1", 40) == "runs/r1/checkpoints/step-00000040/trainer.json"
    assert keys.checkpoint_manifest("r1", 40) == "runs/r1/checkpoints/step-00000040/manifest.json"
    assert keys.experience_segment("r1", "rep-0", "000007") == "runs/r1/experience/rep-0/000007.parquet"
    assert keys.partial_pool("r1", "rep-0", (3, 2)) == "runs/r1/partial/rep-0/g000003-a0002.parquet"
    assert keys.partial_manifest("r1", "rep-0", (3, 2)) == "runs/r1/partial/rep-0/g000003-a0002.json"
    assert keys.parse_partial_fence("r1", "rep-0", keys.partial_manifest("r1", "rep-0", (3, 2))) == (3, 2)
    assert keys.parse_partial_fence("r1", "rep-0", "runs/r1/partial/rep-0/junk.json") is None
    assert keys.drill_report("r1", "kill-trainer") == "runs/r1/drills/kill-trainer.json"
    assert keys.step_metrics("r1", 3) == "runs/r1/metrics/step-00000003.json"
    assert keys.summary("r1") == "runs/r1/summary.json"
    assert keys.parse_checkpoint_step("r1", keys.checkpoint_manifest("r1", 40)) == 40
    assert keys.parse_checkpoint_step("r1", "runs/r1/checkpoints/junk/manifest.json") is None


@pytest.mark.parametrize("bad", ["", "a/b", "..", "."])
def test_key_ids_are_validated(bad):
    with pytest.raises(ValueError, match="run_id"):
        keys.config(bad)
    with pytest.raises(ValueError, match="replica_id"):
        keys.partial_pool("r1", bad, (0, 1))


def test_reserved_part_names_are_rejected():
    with pytest.raises(ValueError, match="reserved"):
        keys.checkpoint_part_file("manifest")
