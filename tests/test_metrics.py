"""Prometheus metrics (laminar/metrics.py) and the runs' search attributes (laminar/search.py).

Unit tests read the process registry before and after an update (the series are process-wide, so every
check is a difference); the integration test runs a short run on the real stack, whose worker processes
serve /metrics on ports the launcher gave them, scrapes the trainer and the rollout workers and parses
the text with prometheus_client's own parser, and finds the running run by its search attributes.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from laminar import metrics, search
from laminar.client.run_control import start_workflow
from laminar.contract import RunStatus
from laminar.storage.records import step_records
from laminar.workers.launcher import metrics_url
from tests.fixtures.stack import small_config
from tests.fixtures.waiting import async_wait_until


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_train_step_series_worked_by_hand():
    names = ["laminar_trainer_steps_total", "laminar_trainer_tokens_total",
             "laminar_trainer_sample_staleness_versions_count", "laminar_trainer_sample_staleness_versions_sum",
             "laminar_trainer_publish_stall_seconds_count"]
    before = {n: _value(n) for n in names}
    buckets = {le: _value("laminar_trainer_sample_staleness_versions_bucket", le=le) for le in ("0.0", "2.0", "3.0")}
    metrics.observe_train_step(7, 7, tokens=120, reward=0.75, loss=-0.5, clip_fraction=0.125,
                               staleness={"0": 2, "3": 1}, consumed_twice=0, wait_s=1.0, busy_s=0.5, stall_s=0.01,
                               published=True)
    after = {n: _value(n) - before[n] for n in names}
    # one step of 120 tokens; three samples of staleness 0, 0, 3 (sum 3); one publish
    assert after == {"laminar_trainer_steps_total": 1, "laminar_trainer_tokens_total": 120,
                     "laminar_trainer_sample_staleness_versions_count": 3,
                     "laminar_trainer_sample_staleness_versions_sum": 3,
                     "laminar_trainer_publish_stall_seconds_count": 1}
    # cumulative buckets: le=0 holds the two on-policy samples, le=2 still two, le=3 all three
    grown = {le: _value("laminar_trainer_sample_staleness_versions_bucket", le=le) - v for le, v in buckets.items()}
    assert grown == {"0.0": 2, "2.0": 2, "3.0": 3}
    # 120 tokens over 1.0 s waiting + 0.5 s busy = 80 tokens/s
    assert _value("laminar_trainer_tokens_per_second") == 80.0
    assert (_value("laminar_trainer_step"), _value("laminar_trainer_reward"), _value("laminar_trainer_clip_fraction_ratio")) == (7, 0.75, 0.125)


def test_replica_series_and_update_names():
    m = metrics.ReplicaMetrics.of("replica-t")
    claims = _value("laminar_control_update_seconds_count", update="claim_prompts")
    m.state(policy_version=5, in_flight=7, kv_used=30, kv_capacity=120)
    m.tokens.inc(7)
    m.update("claim", 0.03)  # the replica's call kind "claim" is the claim_prompts update
    assert _value("laminar_rollout_kv_utilisation_ratio", replica="replica-t") == 0.25  # 30 / 120
    assert _value("laminar_rollout_in_flight_trajectories", replica="replica-t") == 7
    assert _value("laminar_rollout_policy_version", replica="replica-t") == 5
    assert _value("laminar_rollout_tokens_generated_total", replica="replica-t") == 7
    assert _value("laminar_control_update_seconds_count", update="claim_prompts") == claims + 1


def test_serve_off_at_port_zero_and_survives_a_taken_port():
    assert metrics.serve(0, "127.0.0.1", "p", "trainer", "host-0") is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # a port in use is logged and skipped: the worker still starts
        assert metrics.serve(taken.getsockname()[1], "127.0.0.1", "p", "trainer", "host-0") is None


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample at url, parsed with prometheus_client's parser: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _scrape_when_up(url: str) -> dict[tuple[str, tuple], float]:
    """_scrape once the process serves (the session's workers may still be importing torch)."""

    def attempt():
        try:
            return _scrape(url)
        except OSError:
            return None

    return await async_wait_until(lambda: asyncio.to_thread(attempt), 120, f"metrics at {url}", interval_s=0.5)


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


async def test_live_run_metrics_and_search_attributes(stack):
    procs = stack.launcher.processes
    trainer_url = metrics_url(procs["trainer"])
    rollout_urls = [metrics_url(p) for name, p in procs.items() if name.startswith("rollout-")]
    assert trainer_url and all(rollout_urls), "the test stack gives every process a metrics port"
    await search.register(stack.client, "default")  # what `laminar dev up` does
    before = await _scrape_when_up(trainer_url)
    assert before[("laminar_process_info", (("host", "host-0"), ("process", "trainer"), ("role", "trainer")))] == 1

    # 40 steps: 6 took about half a second on the test stack, a short window for the listing to see it running
    cfg = small_config("run.steps=40")
    steps = cfg.run.steps
    handle = await start_workflow(stack.client, cfg)  # the namespace has the attributes: the run starts with them
    query = f"LaminarPhase = 'running' AND LaminarMode = 'laminar' AND WorkflowId = '{handle.id}'"

    async def listed():
        return [wf.id async for wf in stack.client.list_workflows(query)]

    assert await async_wait_until(listed, 120, f"the run listed by {query!r}") == [handle.id]
    final: RunStatus = await handle.result(rpc_timeout=None)
    assert final.phase == "finished" and final.step == steps

    after = await asyncio.to_thread(_scrape, trainer_url)
    records = step_records(stack.store, cfg.run.run_id)
    # this run's steps on the session's one trainer, and exactly the tokens its step records hold
    assert _total(after, "laminar_trainer_steps_total") - _total(before, "laminar_trainer_steps_total") == steps
    assert (_total(after, "laminar_trainer_tokens_total") - _total(before, "laminar_trainer_tokens_total")
            == sum(r["tokens"] for r in records))
    assert _total(after, "laminar_trainer_groups_consumed_twice_total") == 0
    assert after[("laminar_trainer_reward", ())] == records[-1]["reward_mean"]
    generated = 0.0
    for url in rollout_urls:
        generated += _total(await asyncio.to_thread(_scrape, url), "laminar_rollout_tokens_generated_total")
    assert generated >= sum(r["tokens"] for r in records)  # a trained token was generated first

    # the finished run's attributes, as the workflow left them
    desc = await handle.describe()
    attrs = desc.typed_search_attributes
    assert (attrs.get(search.PHASE), attrs.get(search.STEP), attrs.get(search.POLICY_VERSION)) == (
        "finished", steps, steps)
    assert attrs.get(search.REWARD) == records[-1]["reward_mean"]
    assert attrs.get(search.MODE) == "laminar"
