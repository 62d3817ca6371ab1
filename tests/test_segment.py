"""workflows/segment.py: the segment's input (validated, or a ConfigError that fails the run), when it is full, and
when it hands over (a stand-in for workflow.info())."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from laminar.config import RunConfig
from laminar.errors import ConfigError
from laminar.workflows.segment import Segment, parse_input, pool_of
from laminar.workflows.state import RunState


@dataclass
class Info:
    length: int = 0
    suggested: bool = False

    def get_current_history_length(self) -> int:
        return self.length

    def is_continue_as_new_suggested(self) -> bool:
        return self.suggested


CFG = RunConfig.load(None, ["run.steps=10", "run.history_events_per_segment=500", "run.updates_per_segment=100"])
EVERY = RunConfig.load(None, ["run.steps=10", "run.continue_as_new_every=3"])


@pytest.mark.parametrize(
    ("case", "cfg", "step", "stopping", "first_step", "updates", "info", "hands_over"),
    [
        ("a fresh segment", CFG, 4, False, 0, 0, Info(10), False),
        ("history events at the bound", CFG, 4, False, 0, 0, Info(500), True),
        ("updates at the bound", CFG, 4, False, 0, 100, Info(10), True),
        ("the server suggests it", CFG, 4, False, 0, 0, Info(10, True), True),
        ("full, but the run's last step is taken", CFG, 10, False, 0, 0, Info(500), False),
        ("full, but the run stops", CFG, 4, True, 0, 0, Info(500), False),
        ("every 3 steps: step 3", EVERY, 3, False, 0, 0, Info(10), True),
        ("every 3 steps: the segment started at step 3", EVERY, 3, False, 3, 0, Info(10), False),
        ("every 3 steps: step 4", EVERY, 4, False, 3, 0, Info(10), False),
        ("every 3 steps: step 6", EVERY, 6, False, 3, 0, Info(10), True),
    ],
)
def test_when_a_segment_hands_over(case, cfg, step, stopping, first_step, updates, info, hands_over):
    seg = Segment(first_step=first_step, updates=updates)
    state = RunState(run_id="r", step=step, stopping=stopping)
    assert seg.should_continue_as_new(state, cfg, info) is hands_over, case


def test_new_replicas_start_only_while_the_segment_runs_on():
    state = RunState(run_id="r")
    assert Segment().may_start(state)
    assert not Segment(handover=True).may_start(state)
    assert not Segment(closing=True).may_start(state)
    state.stopping = True
    assert not Segment().may_start(state)


def test_a_new_run_and_a_continued_one_parse():
    cfg = RunConfig.load(None, ["run.steps=7"])
    got, state = parse_input({"config": cfg.to_json(), "pool": "pool/p"})
    assert got == cfg and state is None and pool_of({"config": {}, "pool": "pool/p"}) == "pool/p"
    carried = RunState(run_id="r", step=3, relay_ids=["host-0"])
    from laminar.client.converter import (
        DATA_CONVERTER,  # the state travels as JSON, as continue-as-new sends it
    )

    conv = DATA_CONVERTER.payload_converter
    as_json = conv.from_payloads(conv.to_payloads([{"state": carried}]), None)[0]["state"]
    got, state = parse_input({"config": cfg.to_json(), "state": as_json})
    assert state == carried
    assert pool_of("not a dict") == "" and pool_of({"config": {}}) == ""


@pytest.mark.parametrize(
    ("inp", "message"),
    [
        ("a string", "workflow input must be a JSON object"),
        ({"cfg": {}}, "workflow input must be a JSON object"),
        ({"config": {"run": {"steps": 0}}}, "steps"),
        ({"config": {}, "state": {"step": "many"}}, "workflow input state does not match RunState"),
    ],
)
def test_a_bad_input_is_a_config_error(inp, message):
    with pytest.raises(ConfigError, match=message):
        parse_input(inp)


DEFAULT = RunConfig.load(None, ["run.steps=10"])


@pytest.mark.parametrize(("senders", "updates", "hands_over"), [
    (4, 1499, False), (4, 1500, True),  # few replicas: run.updates_per_segment (1,500)
    (300, 1349, False), (300, 1350, True),  # 300 replicas and relays: 2,000 - 2 x 300 - 50
])
def test_a_run_with_many_replicas_hands_over_before_it_can_reach_the_server_s_update_limit(senders, updates,
                                                                                           hands_over):
    seg = Segment(updates=updates)
    assert seg.should_continue_as_new(RunState(run_id="r", step=4), DEFAULT, Info(10), senders) is hands_over


def test_the_budget_leaves_every_sender_two_updates_below_the_server_s_limit_up_to_the_most_a_run_may_have():
    from laminar.config import MAX_UPDATE_SENDERS, SERVER_MAX_TOTAL_UPDATES, UPDATES_RESERVE
    from laminar.workflows.timeouts import HANDOVER_UPDATES_CAP, updates_budget

    for senders in range(1, MAX_UPDATE_SENDERS + 1):
        cap = min(HANDOVER_UPDATES_CAP, updates_budget(senders))
        # the task that crosses the cap accepts at most one update per sender, the hand-over's answers one more each
        assert cap + 2 * senders + UPDATES_RESERVE <= SERVER_MAX_TOTAL_UPDATES, senders
        assert cap >= 100, senders
    with pytest.raises(ConfigError, match="at most 925 replicas and relays"):
        RunConfig.load(None, ["rollout.replicas=924", "relay.relays=2"])
    RunConfig.load(None, ["rollout.replicas=923", "relay.relays=2"])
    # the `scale` update's validator names its own arguments
    from laminar.config import check_update_senders

    with pytest.raises(ValueError, match=r"^scale: replicas=920 \+ relays=8 = 928: .*at most 925"):
        check_update_senders(920, 8, scale=True)
