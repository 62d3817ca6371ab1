"""Prometheus metrics of every worker process, served on `LAMINAR_METRICS_PORT` (0: off).

One registry per process (prometheus_client's default, which also carries the process_* and python_*
collectors); each process serves only what it measures, so a name appears on the endpoint of the
process that owns it: `laminar_trainer_*` on the trainer, `laminar_rollout_*` and `laminar_control_*`
on rollout workers, `laminar_eval_*` on the control worker, `laminar_relay_*` on relays. Every endpoint has `laminar_process_info` (process,
role, host). A relay counts the bytes it received and the bytes it forwarded down the chain (relay/forwarder.py,
where a forward completes). Names follow the Prometheus conventions: counters end in `_total`, times are `_seconds`,
sizes `_bytes`, shares `_ratio`. Values are updated where the code already computes them; nothing here
reads a clock or the store.

| metric | type | labels | what |
| --- | --- | --- | --- |
| laminar_trainer_steps_total | counter | | train steps completed by this process (replays not counted) |
| laminar_trainer_step | gauge | | the policy's step after the last train step |
| laminar_trainer_policy_version | gauge | | policy version of the trainer's weights |
| laminar_trainer_step_seconds | histogram | | wall time of one train_step (read, compute, checkpoint, publish) |
| laminar_trainer_wait_seconds | histogram | | trainer idle before a step (waiting for groups and the control plane) |
| laminar_trainer_tokens_total | counter | | response tokens trained on |
| laminar_trainer_tokens_per_second | gauge | | the last step's tokens / (its wait + its wall time) |
| laminar_trainer_reward | gauge | | mean reward of the last step's batch |
| laminar_trainer_loss | gauge | | the last step's loss |
| laminar_trainer_clip_fraction_ratio | gauge | | share of the last step's tokens whose PPO clip was active |
| laminar_trainer_sample_staleness_versions | histogram | | trainer version minus sample version, one observation per trained sample |
| laminar_trainer_publish_stall_seconds | histogram | | trainer stall pushing a version to the master relay |
| laminar_trainer_groups_consumed_twice_total | counter | | groups that reached the trainer twice (must stay 0) |
| laminar_rollout_tokens_generated_total | counter | replica | tokens generated (one per sequence per engine step) |
| laminar_rollout_kv_utilisation_ratio | gauge | replica | KV-cache tokens used / capacity |
| laminar_rollout_in_flight_trajectories | gauge | replica | sequences in the engine's batch |
| laminar_rollout_policy_version | gauge | replica | policy version of the replica's weights (-1: none yet) |
| laminar_rollout_weight_load_seconds | histogram | replica, via | time to load a version (shared_memory or tcp) |
| laminar_rollout_group_retries_total | counter | replica, reason | groups generated again after a failed reward or generation (reason: envs/tasks/scoring.py) |
| laminar_rollout_groups_failed_total | counter | replica, reason | groups dropped after task.max_group_retries retries (never trained on; groups_failed in the run status) |
| laminar_rollout_eval_prompts_scored_total | counter | replica | held-out eval prompts the replica scored during training (all their samples) |
| laminar_control_update_seconds | histogram | update | round trip of a claim_prompts or add_experience update, as the replica measured it (a report includes writing its segment) |
| laminar_control_update_retries_total | counter | update | update attempts that failed (server or control worker unreachable) and were sent again |
| laminar_control_workflow_resets_total | counter | run | wedged run workflows this control worker's repairer reset (services/repair.py) |
| laminar_eval_accuracy_ratio | gauge | run | held-out accuracy (pass@1) of the run's last recorded eval round (control worker: it stores the records) |
| laminar_eval_accuracy_stderr_ratio | gauge | run | that accuracy's standard error over the eval prompts |
| laminar_eval_policy_version | gauge | run | policy version of the last recorded eval round |
| laminar_eval_rounds_recorded_total | counter | run | eval rounds whose record this control worker stored |
| laminar_eval_failed_samples_total | counter | run | eval samples whose generation or reward failed (scored 0 and counted) |
| laminar_relay_received_bytes_total | counter | relay | version bytes received (from the trainer or the previous relay) |
| laminar_relay_forwarded_bytes_total | counter | relay | version bytes forwarded to the next relay of the chain |
| laminar_relay_versions_held | gauge | relay | versions the relay holds in shared memory |

Off loopback the endpoint needs its secret (laminar.listeners): with `LAMINAR_METRICS_TOKEN` set, every
request must carry `Authorization: Bearer <token>` (Prometheus: `authorization: {credentials: ...}` in the
scrape config) or gets 401; bound off loopback without it, `serve` refuses to start unless
`LAMINAR_INSECURE=1` accepts the risk (logged). The token keeps strangers from reading the run's numbers;
it travels in clear over HTTP, so on an untrusted network scrape through TLS in front of the endpoint.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

from laminar import contract
from laminar.listeners import check_bind
from laminar.logs import get_logger

log = get_logger(__name__)

# Time buckets from 1 ms to 2 min: a control-plane update takes tens of ms, a CPU train step ~0.1 s,
# a modelled or GPU step seconds, a weight push of a large model tens of seconds.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STALENESS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32)  # versions; le="0" counts the on-policy samples

PROCESS = Info("laminar_process", "This worker process: its name, role and host id.")

TRAINER_STEPS = Counter("laminar_trainer_steps", "Train steps completed by this trainer process.")
TRAINER_STEP = Gauge("laminar_trainer_step", "The policy's step after the last train step.")
TRAINER_VERSION = Gauge("laminar_trainer_policy_version", "Policy version of the trainer's weights.")
TRAINER_STEP_SECONDS = Histogram("laminar_trainer_step_seconds", "Wall time of one train_step.", buckets=SECONDS)
TRAINER_WAIT_SECONDS = Histogram("laminar_trainer_wait_seconds",
                                 "Trainer idle before a step (groups, control plane).", buckets=SECONDS)
TRAINER_TOKENS = Counter("laminar_trainer_tokens", "Response tokens trained on.")
TRAINER_TOKENS_PER_S = Gauge("laminar_trainer_tokens_per_second",
                             "The last step's tokens / (its wait + its wall time).")
TRAINER_REWARD = Gauge("laminar_trainer_reward", "Mean reward of the last step's batch.")
TRAINER_LOSS = Gauge("laminar_trainer_loss", "Loss of the last step.")
TRAINER_CLIP = Gauge("laminar_trainer_clip_fraction_ratio", "Share of the last step's tokens whose PPO clip was active.")
TRAINER_STALENESS = Histogram("laminar_trainer_sample_staleness_versions",
                              "Trainer version minus sample version, per trained sample.", buckets=STALENESS)
TRAINER_STALL = Histogram("laminar_trainer_publish_stall_seconds",
                          "Trainer stall pushing a version to the master relay.", buckets=SECONDS)
TRAINER_TWICE = Counter("laminar_trainer_groups_consumed_twice", "Groups that reached the trainer twice (must stay 0).")

ROLLOUT_TOKENS = Counter("laminar_rollout_tokens_generated", "Tokens generated.", ["replica"])
ROLLOUT_KV = Gauge("laminar_rollout_kv_utilisation_ratio", "KV-cache tokens used / capacity.", ["replica"])
ROLLOUT_IN_FLIGHT = Gauge("laminar_rollout_in_flight_trajectories", "Sequences in the engine's batch.", ["replica"])
ROLLOUT_VERSION = Gauge("laminar_rollout_policy_version", "Policy version of the replica's weights (-1: none).",
                        ["replica"])
ROLLOUT_LOAD_SECONDS = Histogram("laminar_rollout_weight_load_seconds", "Time to load a policy version.",
                                 ["replica", "via"], buckets=SECONDS)
ROLLOUT_GROUP_RETRIES = Counter("laminar_rollout_group_retries", "Groups generated again after a failure.",
                                ["replica", "reason"])
ROLLOUT_GROUPS_FAILED = Counter("laminar_rollout_groups_failed", "Groups dropped after their last retry failed.",
                                ["replica", "reason"])
CONTROL_UPDATE_SECONDS = Histogram("laminar_control_update_seconds", "Round trip of a claim or report update.",
                                   ["update"], buckets=SECONDS)
CONTROL_UPDATE_RETRIES = Counter("laminar_control_update_retries",
                                 "Update attempts that failed and were sent again.", ["update"])

CONTROL_WORKFLOW_RESETS = Counter("laminar_control_workflow_resets", "Wedged run workflows reset by the repairer.",
                                  ["run"])

# held-out eval rounds during training: set by the control worker's record_eval (activities/evaluation.py), the one
# writer of eval records; the replicas count the eval prompts they score
EVAL_ACCURACY = Gauge("laminar_eval_accuracy_ratio", "Held-out accuracy (pass@1) of the last recorded eval round.",
                      ["run"])
EVAL_STDERR = Gauge("laminar_eval_accuracy_stderr_ratio", "Standard error of that accuracy over the eval prompts.",
                    ["run"])
EVAL_VERSION = Gauge("laminar_eval_policy_version", "Policy version of the last recorded eval round.", ["run"])
EVAL_ROUNDS = Counter("laminar_eval_rounds_recorded", "Eval rounds whose record this process stored.", ["run"])
EVAL_FAILED_SAMPLES = Counter("laminar_eval_failed_samples",
                              "Eval samples whose generation or reward failed (scored 0, counted).", ["run"])
ROLLOUT_EVAL_PROMPTS = Counter("laminar_rollout_eval_prompts_scored", "Eval prompts scored (all their samples).",
                               ["replica"])


def observe_eval(run_id: str, policy_version: int, accuracy: float, stderr: float, failures: int) -> None:
    EVAL_ACCURACY.labels(run_id).set(accuracy)
    EVAL_STDERR.labels(run_id).set(stderr)
    EVAL_VERSION.labels(run_id).set(policy_version)
    EVAL_ROUNDS.labels(run_id).inc()
    EVAL_FAILED_SAMPLES.labels(run_id).inc(failures)


UPDATES = {"claim": contract.CLAIM_PROMPTS, "report": contract.ADD_EXPERIENCE}  # the replica's call kinds -> update names

RELAY_RECEIVED = Counter("laminar_relay_received_bytes", "Version bytes received.", ["relay"])
RELAY_FORWARDED = Counter("laminar_relay_forwarded_bytes", "Version bytes forwarded down the chain.", ["relay"])
RELAY_VERSIONS = Gauge("laminar_relay_versions_held", "Versions held in shared memory.", ["relay"])


METRICS_RISK = "anyone who can reach the port reads the run's metrics (steps, rewards, hosts, process names)"


def serve(port: int, bind: str, process: str, role: str, host_id: str, *, token: str | None = None,
          insecure: bool = False) -> str | None:
    """Serve this process's metrics at http://<bind>:<port>/metrics (port 0: off); returns the URL or None.

    token: required as `Authorization: Bearer <token>` on every request (None: no check). Off loopback
    without a token: ConfigError (laminar.listeners) unless insecure, which logs the risk.
    A taken port is logged and skipped: metrics never stop a worker from starting."""
    PROCESS.info({"process": process, "role": role, "host": host_id})
    if port == 0:
        return None
    check_bind("the metrics endpoint", bind, secret=token, variable="LAMINAR_METRICS_TOKEN", insecure=insecure,
               risk=METRICS_RISK)
    try:
        if token:
            _serve_with_token(port, bind, token)
        else:
            start_http_server(port, addr=bind)
    except OSError as e:
        log.error("metrics_port_unavailable", port=port, bind=bind, error=str(e),
                  fix="set LAMINAR_METRICS_PORT to a free port, or 0 to turn metrics off")
        return None
    url = f"http://{bind}:{port}/metrics"
    log.info("metrics_serving", url=url, process=process, auth=bool(token))
    return url


def bearer_app(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    """`app` behind `Authorization: Bearer <token>` (compared in constant time); anything else gets 401."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="laminar-metrics"')])
            return [b"metrics need Authorization: Bearer <LAMINAR_METRICS_TOKEN>\n"]
        return app(environ, start_response)

    return guarded


def _serve_with_token(port: int, bind: str, token: str) -> None:
    """prometheus_client's WSGI server (its address family and quiet handler) around bearer_app."""

    class _Server(ThreadingWSGIServer):
        pass

    _Server.address_family, addr = _get_best_family(bind, port)
    httpd = make_server(addr, port, bearer_app(make_wsgi_app(REGISTRY), token), _Server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()


def observe_train_step(step: int, version: int, *, tokens: int, reward: float, loss: float, clip_fraction: float,
                       staleness: dict[str, int], consumed_twice: int, wait_s: float, busy_s: float,
                       stall_s: float, published: bool) -> None:
    """The trainer after one train_step (services/trainer.py); staleness: gap -> trained samples."""
    TRAINER_STEPS.inc()
    TRAINER_STEP.set(step)
    TRAINER_VERSION.set(version)
    TRAINER_STEP_SECONDS.observe(busy_s)
    TRAINER_WAIT_SECONDS.observe(wait_s)
    TRAINER_TOKENS.inc(tokens)
    if wait_s + busy_s > 0:
        TRAINER_TOKENS_PER_S.set(tokens / (wait_s + busy_s))
    TRAINER_REWARD.set(reward)
    TRAINER_LOSS.set(loss)
    TRAINER_CLIP.set(clip_fraction)
    for gap, n in staleness.items():
        for _ in range(n):
            TRAINER_STALENESS.observe(int(gap))
    if consumed_twice:
        TRAINER_TWICE.inc(consumed_twice)
    if published:
        TRAINER_STALL.observe(stall_s)


@dataclass(frozen=True)
class ReplicaMetrics:
    """One rollout replica's series, bound once (the engine loop updates them every step)."""

    tokens: Counter
    kv: Gauge
    in_flight: Gauge
    version: Gauge
    replica_id: str

    @classmethod
    def of(cls, replica_id: str) -> ReplicaMetrics:
        return cls(ROLLOUT_TOKENS.labels(replica_id), ROLLOUT_KV.labels(replica_id),
                   ROLLOUT_IN_FLIGHT.labels(replica_id), ROLLOUT_VERSION.labels(replica_id), replica_id)

    def state(self, policy_version: int, in_flight: int, kv_used: int, kv_capacity: int) -> None:
        self.version.set(policy_version)
        self.in_flight.set(in_flight)
        self.kv.set(kv_used / kv_capacity if kv_capacity > 0 else 0.0)

    def loaded(self, via: str, seconds: float) -> None:
        ROLLOUT_LOAD_SECONDS.labels(self.replica_id, via).observe(seconds)

    def update(self, kind: str, seconds: float) -> None:
        """A control call's round trip: kind claim or report (a report includes writing its segment)."""
        CONTROL_UPDATE_SECONDS.labels(UPDATES.get(kind, kind)).observe(seconds)
