"""The modelled engine and trainer (rl/modelled.py): workload lengths, modelled time charged per step, KV
admission, weight-load costs, partial-rollout interrupts on both engines, and the TrainerService running a
modelled trainer through steps, a checkpoint restore and a real relay push.

Time is checked through an injected sleep that records every call: wall seconds x speedup must equal the
modelled seconds worked out in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laminar.config import RunConfig
from laminar.contract import BatchPart, TrainStepInput
from laminar.envs.tasks import get_task
from laminar.errors import ConfigError, EngineError
from laminar.records import Trajectory
from laminar.relay import client as relay_client
from laminar.relay.server import RelayServer
from laminar.rl.costs import tool_latency_s
from laminar.rl.engine import TorchEngine
from laminar.rl.model import build_model, bytes_to_state_dict, model_state_dict
from laminar.rl.modelled import (
    EOS_ID,
    RESPONSE_TOKEN_ID,
    ModelledEngine,
    ModelledTask,
    ModelledTrainer,
    parse_request_id,
    response_length,
    tool_plan,
)
from laminar.services.trainer import TrainerService
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore
from laminar.storage.trajectories import TrajectoryStore


def cfg(*overrides: str) -> RunConfig:
    return RunConfig.load(None, ["rollout.engine=modelled", "trainer.engine=modelled", *overrides])


class Clock:
    """An injected sleep: records each call's wall seconds instead of sleeping."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)

    @property
    def total(self) -> float:
        return sum(self.calls)


# -- workload ----------------------------------------------------------------------------------------------


def test_long_tail_lengths_have_p99_ten_times_p50_and_respect_the_cap():
    m = cfg().modelled  # p50 1024, cap 16384
    lengths = np.array([response_length(m, 0, p, s) for p in range(2500) for s in range(8)])  # 20k draws
    p50, p99 = np.percentile(lengths, [50, 99])
    # lognormal(ln 1024, ln(10)/2.326): median 1024, p99 = 1024 x 10 = 10240 (below the cap, so uncut)
    assert abs(p50 - 1024) / 1024 < 0.05
    assert 8 <= p99 / p50 <= 12
    assert lengths.min() >= 1 and lengths.max() <= 16384
    capped = cfg("modelled.max_response_tokens=2000").modelled
    cut = np.array([response_length(capped, 0, p, 0) for p in range(4000)])
    # P(length > 2000) = P(z > ln(2000/1024) / 0.990) = P(z > 0.676) ~ 0.25: about a quarter sits at the cap
    assert cut.max() == 2000 and 0.2 < (cut == 2000).mean() < 0.3


def test_lengths_are_deterministic_per_seed_prompt_and_sample():
    m = cfg().modelled
    assert response_length(m, 3, 17, 5) == response_length(m, 3, 17, 5)
    draws = {response_length(m, seed, 17, 5) for seed in range(20)}
    assert len(draws) > 15  # another seed, another length (continuous draw: collisions are rare)
    assert [response_length(m, 0, 1, s) for s in range(8)] != [response_length(m, 0, 2, s) for s in range(8)]


def test_uniform_lengths_stay_within_twenty_percent_of_p50():
    m = cfg("modelled.workload=uniform").modelled
    lengths = [response_length(m, 0, p, s) for p in range(500) for s in range(8)]
    # ceil(0.8 x 1024) = 820 .. floor(1.2 x 1024) = 1228, both ends reached in 4000 draws of 409 values
    assert min(lengths) == 820 and max(lengths) == 1228
    assert abs(np.median(lengths) - 1024) < 15


def test_request_ids_name_prompt_and_sample():
    assert parse_request_id("g00000012/3") == (12, 3)
    with pytest.raises(EngineError, match="request_id='replica-0/3'"):
        parse_request_id("replica-0/3")


# -- engine timing -----------------------------------------------------------------------------------------

# Small numbers to work out by hand: prompts of 4 tokens, 1 ms per prefill token, 25 ms per decode step, and a
# 5-token cap far below the 1000-token median, so every request is cut at exactly 5 tokens ("length").
SMALL = ("modelled.prompt_tokens=4", "modelled.prefill_s_per_token=0.001", "modelled.decode_step_s=0.025",
         "modelled.response_p50_tokens=1000", "modelled.max_response_tokens=5", "modelled.speedup=10")


def engine(*overrides: str, slots: int = 8, global_sync: bool = False) -> tuple[ModelledEngine, Clock]:
    clock = Clock()
    e = ModelledEngine(cfg(*SMALL, *overrides), max_inflight_seqs=slots, global_sync=global_sync,
                       sleep=clock)
    e.load_weights({}, policy_version=1)
    e.modelled_seconds, e.load_seconds, clock.calls = 0.0, 0.0, []  # count generation only
    return e, clock


def test_two_sequences_below_the_roofline_cost_one_prefill_and_five_decode_steps():
    e, clock = engine()
    e.add("g00000000/0", [5] * 4, prefix_ids=[7, 7], prefix_logprobs=[-1.0, -1.0])  # 3 tokens to go
    e.add("g00000001/0", [5] * 4)  # 5 tokens to go
    first = e.step()
    # prefill (4 + 2) + 4 = 10 tokens x 1 ms = 0.010; k = min(3, 5) = 3 steps (20 fit in 0.05 s x speedup 10)
    assert [f.request_id for f in first] == ["g00000000/0"]
    assert first[0].finish_reason == "length" and first[0].response_ids == [7] * 5 and len(first[0].logprobs) == 5
    assert e.kv_usage() == (4 + 3, 1_000_000)  # the other one: 4 prompt + 3 generated tokens held
    second = e.step()  # the other one: 2 more steps, batch 1
    assert [f.request_id for f in second] == ["g00000001/0"] and second[0].finish_reason == "length"
    # 0.010 + 5 decode steps x 0.025 = 0.135 modelled s, slept as 0.0135 wall s in two calls
    assert e.modelled_seconds == pytest.approx(0.135)
    assert clock.calls == pytest.approx([(0.010 + 3 * 0.025) / 10, 2 * 0.025 / 10])
    assert e.in_flight() == 0 and e.step() == [] and clock.total == pytest.approx(0.0135)


def test_above_the_roofline_a_decode_step_costs_batch_over_roofline():
    e, _ = engine("modelled.roofline_batch=2")
    for p in range(2):
        e.add(f"g{p:08d}/0", [5] * 4, prefix_ids=[7] * 4, prefix_logprobs=[-1.0] * 4)  # 1 token to go
    for p in range(2, 4):
        e.add(f"g{p:08d}/0", [5] * 4)  # 5 tokens to go
    assert len(e.step()) == 2  # batch 4 > roofline 2: 1 step x 0.025 x 4/2 = 0.05
    assert len(e.step()) == 2  # batch 2 = roofline: 4 steps x 0.025 = 0.10
    # prefill (4 + 4) x 2 + 4 x 2 = 24 tokens x 1 ms = 0.024; total 0.024 + 0.05 + 0.10 = 0.174
    assert e.modelled_seconds == pytest.approx(0.174)


def test_one_step_call_decodes_at_most_fifty_wall_milliseconds():
    e, clock = engine("modelled.speedup=1")
    e.add("g00000000/0", [5] * 4)
    # speedup 1: floor(0.05 / 0.025) = 2 decode steps per call, so 5 tokens take calls of 2, 2 and 1
    assert (e.step(), e.step()) == ([], [])
    assert len(e.step()) == 1
    assert clock.calls == pytest.approx([0.004 + 0.05, 0.05, 0.025])


def test_a_drawn_length_below_the_cap_ends_with_eos():
    e, _ = engine("modelled.workload=uniform", "modelled.response_p50_tokens=5", "modelled.max_response_tokens=100")
    e.add("g00000042/1", [5] * 4)
    done = []
    while e.in_flight():
        done += e.step()
    want = response_length(e.cfg.modelled, e.cfg.run.seed, 42, 1)  # 4..6 (uniform +-20 % of 5)
    assert 4 <= want <= 6
    assert done[0].finish_reason == "stop"
    assert done[0].response_ids == [RESPONSE_TOKEN_ID] * (want - 1) + [EOS_ID]


def test_lengths_follow_the_run_seed_so_every_replica_sees_the_same_workload():
    a = ModelledEngine(cfg("modelled.workload=uniform"), max_inflight_seqs=1, global_sync=False, sleep=Clock())
    b = ModelledEngine(cfg("modelled.workload=uniform"), max_inflight_seqs=1, global_sync=False, sleep=Clock())
    lengths = []
    for e in (a, b):
        e.load_weights({}, 0)
        e.add("g00000007/2", [5])
        done = []
        while e.in_flight():
            done += e.step()
        lengths.append(len(done[0].response_ids))
    assert lengths == [response_length(a.cfg.modelled, 0, 7, 2)] * 2  # run.seed 0 for both replicas


# -- admission ---------------------------------------------------------------------------------------------


def test_kv_capacity_limits_admission_and_free_slots():
    e, _ = engine("modelled.kv_capacity_tokens=10", slots=4)
    e.add("g00000000/0", [5] * 4)
    assert e.free_slots() == 3  # 4 of 10 tokens used: one more prompt of 4 fits
    e.add("g00000000/1", [5] * 4)
    assert e.kv_usage() == (8, 10) and e.free_slots() == 0  # 2 left: less than a prompt, though 2 slots are free
    e.add("g00000000/2", [5] * 4)  # no room now: it waits, holding no KV (vLLM's waiting queue)
    assert e.kv_usage() == (8, 10) and e.in_flight() == 3 and e.free_slots() == 0
    done = []
    for _ in range(50):
        done += e.step()
        used, capacity = e.kv_usage()
        assert used <= capacity or e.in_flight() - 1 <= 1  # never past the cache with two or more resident
        if len(done) == 3:
            break
    assert sorted(f.request_id for f in done) == ["g00000000/0", "g00000000/1", "g00000000/2"]
    assert all(len(f.response_ids) == 5 for f in done)  # each to the cap of 5
    assert e.kv_usage() == (0, 10) and e.free_slots() == 4


def test_a_request_that_can_never_fit_the_cache_is_refused_at_once():
    e, _ = engine("modelled.kv_capacity_tokens=10", slots=4)
    with pytest.raises(EngineError, match="can never fit in the KV cache .modelled.kv_capacity_tokens=10"):
        e.add("g00000000/0", [5] * 9, prefix_ids=[7] * 2, prefix_logprobs=[-1.0] * 2)  # 11 > 10, even empty
    assert e.in_flight() == 0


def test_a_config_whose_longest_sequence_cannot_fit_the_cache_is_refused():
    with pytest.raises(ConfigError, match=r"prompt_tokens \(256\) \+ max_response_tokens \(8192\) = 8448 exceeds "
                                          r"kv_capacity_tokens=6144.*lower max_response_tokens to at most 5888"):
        cfg("modelled.max_response_tokens=8192", "modelled.kv_capacity_tokens=6144")
    assert cfg("modelled.max_response_tokens=5888", "modelled.kv_capacity_tokens=6144").modelled.kv_capacity_tokens


def test_a_full_cache_preempts_the_newest_and_recomputes_it_later():
    # 4 sequences of prompt 4, cap 5: 4 x 9 = 36 tokens at the end, against a cache of 24. Growth fills it while
    # they decode: the newest are preempted (their KV freed), wait, and are prefilled again with their response
    e, clock = engine("modelled.kv_capacity_tokens=24", "modelled.speedup=1000", slots=4)
    for i in range(4):
        e.add(f"g00000000/{i}", [5] * 4)
    assert e.kv_usage() == (16, 24)
    done = []
    for _ in range(100):
        done += e.step()
        used, capacity = e.kv_usage()
        resident = sum(1 for s in e._slots if s is not None and not s.waiting)
        assert used <= capacity or resident <= 1
        if len(done) == 4:
            break
    assert sorted(f.request_id for f in done) == [f"g00000000/{i}" for i in range(4)]
    assert all(len(f.response_ids) == 5 and len(f.logprobs) == 5 for f in done)
    assert e.preemptions >= 1
    assert e.reprefill_tokens > 0  # the preempted ones were prefilled again: prompt + response so far
    assert e.kv_usage() == (0, 24) and e.free_slots() == 4


def test_slots_and_weights_gate_admission():
    e, _ = engine(slots=1)
    e.add("g00000000/0", [5] * 4)
    with pytest.raises(EngineError, match="all 1 slots are busy"):
        e.add("g00000000/1", [5] * 4)
    fresh = ModelledEngine(cfg(), max_inflight_seqs=1, global_sync=False, sleep=Clock())
    with pytest.raises(EngineError, match="no weights loaded"):
        fresh.add("g00000000/0", [5])
    with pytest.raises(EngineError, match="modelled length 5"):  # the 5-token cap: nothing left to generate
        engine()[0].add("g00000000/0", [5] * 4, prefix_ids=[7] * 5, prefix_logprobs=[-1.0] * 5)


# -- weights -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("global_sync", "local_pull", "modelled_s"), [
    (True, True, 15.2e9 / 31.5e9),  # global NCCL broadcast: 15.2 GB at 31.5 GB/s = 0.4825 s
    (False, True, 15.2e9 / 100e9 + 15.2e9 / 50e9),  # chain hop 0.152 s + PCIe pull 0.304 s = 0.456 s
    (False, False, 2 * 15.2e9 / 100e9 + 15.2e9 / 50e9),  # plus a network fetch from another host: 0.608 s
])
def test_load_weights_charges_broadcast_or_relay_pull(global_sync, local_pull, modelled_s):
    clock = Clock()
    e = ModelledEngine(cfg("modelled.speedup=100"), max_inflight_seqs=2, global_sync=global_sync,
                       sleep=clock, local_pull=local_pull)
    e.load_weights({"version": torch.tensor([1])}, 1)  # 7.6e9 params x 2 B = 15.2 GB, whatever the payload
    assert e.policy_version == 1
    assert e.load_seconds == pytest.approx(modelled_s) and clock.calls == pytest.approx([modelled_s / 100])


def test_load_weights_refuses_while_sequences_are_in_flight():
    e, _ = engine()
    e.add("g00000000/0", [5] * 4)
    with pytest.raises(EngineError, match="1 sequences of policy_version=1 are in flight"):
        e.load_weights({}, 2)


def test_modelled_interrupt_re_prefills_prompt_and_prefix():
    e, clock = engine("modelled.speedup=1", "modelled.max_response_tokens=6")
    e.add("g00000000/0", [5] * 4)
    e.add("g00000001/0", [5] * 4)
    assert e.step() == []  # speedup 1: 2 decode steps per call; each now holds 4 + 2 = 6 tokens
    before = e.modelled_seconds
    assert e.interrupt_and_load({}, 2) == 12  # 2 x (4 prompt + 2 prefix)
    assert (e.policy_version, e.interrupts, e.reprefill_tokens, e.in_flight()) == (2, 1, 12, 2)
    load = 15.2e9 / 100e9 + 15.2e9 / 50e9
    assert e.modelled_seconds - before == pytest.approx(load)
    e.step()  # re-prefill 12 tokens x 1 ms + 2 decode steps x 0.025
    assert e.modelled_seconds - before == pytest.approx(load + 0.012 + 0.05)
    done = e.step()  # 4 + 2 = 6 tokens: the cap, reached under the new version
    assert [len(f.response_ids) for f in done] == [6, 6]
    assert clock.total == pytest.approx(e.modelled_seconds)  # speedup 1


# -- the torch engine's interrupt --------------------------------------------------------------------------

TASK = get_task("repeat", seed=0, max_count=16)
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": TASK.tokenizer.get_vocab_size(),
      "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}


def test_torch_interrupt_continues_each_sequence_under_the_new_weights():
    old, new = build_model(HF, seed=0), build_model(HF, seed=9)
    e = TorchEngine(old, TASK.tokenizer, max_inflight_seqs=4, max_new_tokens=8, temperature=1.0, seed=0, eos_id=-1,
                    max_prompt_len=16)
    e.load_weights(model_state_dict(old), policy_version=3)
    prompts = [[1, 5, 6], [1, 5, 6, 7]]
    e.add("a/0", prompts[0])
    e.add("a/1", prompts[1])
    for _ in range(3):
        assert e.step() == []
    held = {rid: resp for rid, _, resp, _ in e.snapshot_inflight()}
    # (3 prompt + 3 generated) + (4 prompt + 3 generated) = 13 tokens to prefill again under version 4
    assert e.interrupt_and_load(model_state_dict(build_model(HF, seed=9)), policy_version=4) == 13
    assert e.policy_version == 4 and e.in_flight() == 2
    done = []
    while e.in_flight():
        done += e.step()
    for f in done:
        assert f.response_ids[:3] == held[f.request_id] and len(f.response_ids) == 8
        # the 5 tokens after the interrupt carry the NEW model's log-probs: the re-prefilled cache is right
        with torch.no_grad():
            logits = new(torch.tensor([f.prompt_ids + f.response_ids]))[0]
        logp = torch.log_softmax(logits, -1)[len(f.prompt_ids) - 1: -1]
        expect = logp.gather(1, torch.tensor(f.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(f.logprobs[3:]), expect[3:], atol=1e-4)


def test_torch_interrupt_with_bad_weights_keeps_the_sequences():
    model = build_model(HF, seed=0)
    e = TorchEngine(model, TASK.tokenizer, max_inflight_seqs=2, max_new_tokens=8, temperature=1.0, seed=0,
                    eos_id=-1, max_prompt_len=16)
    e.load_weights(model_state_dict(model), policy_version=3)
    e.add("a/0", [1, 5, 6])
    e.step()
    with pytest.raises(ConfigError, match="weights do not match"):
        e.interrupt_and_load({"nonsense": torch.zeros(1)}, 4)
    assert e.in_flight() == 1 and e.policy_version == 3


# -- trainer -----------------------------------------------------------------------------------------------


def trajectory(prompt_id: int, sample: int, response: int, version: int, reward: float) -> Trajectory:
    return Trajectory("r", prompt_id, f"g{prompt_id:08d}", sample, [5] * 4, [7] * (response - 1) + [EOS_ID],
                      [-1.0] * response, reward, version, "replica-0", 0.0, 1.0, "stop")


def test_modelled_trainer_sleeps_in_proportion_to_tokens_and_drops_stale_samples():
    clock = Clock()
    t = ModelledTrainer(cfg("modelled.trainer_s_per_token=0.01", "modelled.speedup=10"), max_staleness=1,
                        sleep=clock)
    batch = [trajectory(0, 0, 6, 3, 0.5), trajectory(0, 1, 10, 2, 1.0), trajectory(1, 0, 8, 0, 0.0)]
    m = t.step(batch, trainer_version=3)
    # kept: staleness 0 and 1; the version-0 sample (staleness 3 > 1) is dropped.
    # (4 + 6) + (4 + 10) = 24 tokens x 0.01 s = 0.24 modelled s -> 0.024 wall s at speedup 10
    assert clock.calls == pytest.approx([0.024])
    # the histogram is of the kept samples (rl.grpo.split_stale); the dropped one is only counted
    assert (m.samples, m.tokens, m.dropped_stale, m.staleness) == (2, 16, 1, {0: 1, 1: 1})
    assert (m.reward_mean, m.response_len_mean, m.loss, m.updated) == (0.75, 8.0, 0.0, True)
    m2 = t.step(batch + batch, trainer_version=3)  # twice the tokens, twice the time
    assert clock.calls[1] == pytest.approx(2 * clock.calls[0]) and m2.samples == 4
    assert t.step([trajectory(1, 0, 8, 0, 0.0)], trainer_version=3).updated is False
    assert clock.calls[2:] == []  # nothing kept: nothing computed
    assert int(t.policy_state_dict()["version"][0]) == 3


def test_modelled_trainer_publish_stall_and_checkpoint_parts():
    t = ModelledTrainer(cfg("modelled.speedup=100"), max_staleness=-1, sleep=Clock())
    assert t.publish_stall_s(global_sync=False) == pytest.approx(15.2e9 / 100e9 / 100)  # 0.152 s modelled
    assert t.publish_stall_s(global_sync=True) == pytest.approx(15.2e9 / 31.5e9 / 100)  # 0.4825 s modelled
    t.step([trajectory(0, 0, 3, 0, 1.0)], 0)
    other = ModelledTrainer(cfg(), max_staleness=-1, sleep=Clock())
    other.load_state_parts(t.state_parts())
    assert other.steps == 1
    with pytest.raises(ValueError, match="not a modelled trainer's"):
        other.load_state_parts({"model": {"embed.weight": torch.zeros(1)}, "optim": {}})


def test_modelled_task_prompts_and_rewards_are_fake_and_deterministic():
    task = ModelledTask(cfg("modelled.prompt_tokens=3"))
    p = task.prompt(12)
    assert (p.prompt_id, p.token_ids, task.eos_id) == (12, [5, 5, 5], EOS_ID)
    rewards = [task.reward(p, [7] * n) for n in range(1, 50)]
    assert all(0.0 <= r <= 1.0 for r in rewards) and len(set(rewards)) > 40
    assert task.reward(p, [7] * 4) == task.reward(task.prompt(12), [7] * 4)


# -- the trainer service with a modelled trainer -----------------------------------------------------------

SERVICE_CFG = cfg("rollout.group_size=2", "trainer.groups_per_step=2", "trainer.checkpoint_every=2", "run.steps=100",
                  "modelled.speedup=10", "modelled.prompt_tokens=4")


def _batch(trajs: TrajectoryStore, first_prompt: int) -> list[BatchPart]:
    task = ModelledTask(SERVICE_CFG)
    rows = []
    for pid in (first_prompt, first_prompt + 1):
        prompt = task.prompt(pid)
        for i in range(2):
            response = [7] * (3 + i) + [EOS_ID]
            rows.append(Trajectory("r", pid, f"g{pid:08d}", i, prompt.token_ids, response, [-1.0] * len(response),
                                   task.reward(prompt, response), 0, "replica-0", 0.0, 1.0, "stop"))
    ref = trajs.write_segment("r", "replica-0", f"s{first_prompt}", rows)
    return [BatchPart(segment=ref, group_ids=list(ref.group_ids))]


def _input(step: int, batch, chain: list[str], checkpoint=None, replay=(), config: RunConfig = SERVICE_CFG
           ) -> TrainStepInput:
    return TrainStepInput(run_id="r", config=config.to_json(), step=step, batch=batch, checkpoint=checkpoint,
                          replay=list(replay), relay_chain=chain)


def test_trainer_service_runs_a_modelled_trainer_through_a_checkpoint_restore(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    trajs, home = TrajectoryStore(store), tmp_path / "home"
    (tmp_path / "shm").mkdir()
    relay = RelayServer("master", shm_dir=str(tmp_path / "shm"))
    addr = relay.start()
    try:
        first = TrainerService(store, home)
        results = [first.train_step(_input(i, _batch(trajs, 10 * i), [addr])) for i in range(2)]
        assert [r.step for r in results] == [1, 2] and results[1].checkpoint is not None
        # laminar mode: the real push plus the modelled 15.2 GB / 100 GB/s = 0.152 s, / speedup 10 = 0.0152 s
        assert all(r.publish_stall_s >= 0.0152 for r in results)
        m = results[0].metrics
        # 4 samples, responses of 4 and 5 tokens (3 or 4 fake tokens + <eos>): 2 x (4 + 5) = 18 response tokens
        assert (m.samples, m.tokens, m.response_len_mean, m.loss) == (4, 18, 4.5, 0.0)
        version, payload = relay_client.fetch_latest(addr, run="r")
        assert version == 2 and int(bytes_to_state_dict(payload)["version"][0]) == 2
        # No model anywhere: nothing built under home, no model files published.
        assert not (home / "models").exists()
        assert not store.exists(keys.model_file("r", "config.json"))
        # A fresh process asked for step 3: restore checkpoint 2, replay batch 2, then step.
        second = TrainerService(store, home)
        batch2 = _batch(trajs, 20)
        res = second.train_step(_input(3, _batch(trajs, 30), [addr], checkpoint=results[1].checkpoint,
                                       replay=[batch2]))
        assert (res.step, res.steps_redone, res.restored, res.metrics.consumed_twice) == (4, 1, True, 0)
        assert second.trainer.steps == 4 and isinstance(second.trainer, ModelledTrainer)
        # consumed groups survive the checkpoint: batch 0 again is counted, not trained on
        again = second.train_step(_input(4, _batch(trajs, 0), [addr]))
        assert again.metrics.consumed_twice == 2 and again.metrics.samples == 0
    finally:
        relay.stop()


def test_global_sync_modes_stall_for_the_broadcast(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    (tmp_path / "shm").mkdir()
    relay = RelayServer("master", shm_dir=str(tmp_path / "shm"))
    addr = relay.start()
    try:
        svc = TrainerService(store, tmp_path / "home")
        sync = SERVICE_CFG.model_copy(update={"run": SERVICE_CFG.run.model_copy(update={"mode": "sync"})})
        inp = _input(0, _batch(TrajectoryStore(store), 0), [addr], config=sync)
        # 15.2 GB / 31.5 GB/s = 0.4825 s modelled, / speedup 10 = 0.04825 s
        assert svc.train_step(inp).publish_stall_s >= 0.04825
    finally:
        relay.stop()


def test_lognormal_sigma_puts_p99_at_ten_times_the_median():
    z99 = 2.326  # standard normal 99th percentile
    assert math.exp(z99 * math.log(10) / 2.326) == pytest.approx(10.0)


def test_republish_pushes_the_current_version_to_the_chain_it_is_given(tmp_path):
    # The workflow asks after a relay joined or left the chain. Only a trainer whose policy is at the step the
    # workflow records pushes (again); a restarted one (nothing in memory) or one at another step skips (-1).
    from laminar.contract import RepublishInput

    store = LocalObjectStore(tmp_path / "store")
    trajs = TrajectoryStore(store)
    (tmp_path / "shm").mkdir()
    old, new = RelayServer("host-0", shm_dir=str(tmp_path / "shm")), RelayServer("host-1", shm_dir=str(tmp_path / "shm"))
    old_addr, new_addr = old.start(), new.start()
    try:
        svc = TrainerService(store, tmp_path / "home")
        for i in range(2):
            svc.train_step(_input(i, _batch(trajs, 10 * i), [old_addr]))
        assert relay_client.fetch_latest(new_addr, run="r") == (None, None)  # joined after the pushes
        assert svc.republish(RepublishInput(run_id="r", step=2, relay_chain=[new_addr])) == 2
        assert relay_client.fetch_latest(new_addr, run="r")[0] == 2
        assert svc.republish(RepublishInput(run_id="r", step=1, relay_chain=[new_addr])) == -1
        assert TrainerService(store, tmp_path / "home").republish(
            RepublishInput(run_id="r", step=2, relay_chain=[new_addr])) == -1
    finally:
        old.stop()
        new.stop()


# -- the tools workload (multi-turn tool calling) ---------------------------------------------------------

# p50 8 tokens: each turn's median is 8 / 4 = 2 tokens, so the worked plans below stay short.
TOOLS = ("modelled.workload=tools", "modelled.response_p50_tokens=8", "modelled.max_response_tokens=100")


def test_tool_plans_have_two_to_six_turns_and_long_tailed_latencies():
    m = cfg("modelled.workload=tools").modelled  # default p50 1024: turns of median 256 tokens
    plans = [(response_length(m, 0, p, s), *tool_plan(m, 0, p, s)) for p in range(500) for s in range(8)]
    assert plans[:3] == [(response_length(m, 0, p, s), *tool_plan(m, 0, p, s)) for p, s in ((0, 0), (0, 1), (0, 2))]
    turns = [len(calls) + 1 for _, calls, _ in plans]
    assert set(turns) == {2, 3, 4, 5, 6}  # 1..5 tool calls
    for target, calls, latencies in plans:
        assert len(latencies) == len(calls) and calls == sorted(set(calls)) and all(0 < c < target for c in calls)
    lat = np.array([x for _, _, ls in plans for x in ls])  # ~4000 calls x 2 = 8000: p50 2 s, p99 20 s
    assert np.percentile(lat, 50) == pytest.approx(2.0, rel=0.1)
    assert np.percentile(lat, 99) == pytest.approx(20.0, rel=0.3)
    # mean length: 4 turns x 256 x exp(sigma^2 / 2) = 4 x 256 x 1.63 = 1670, a long_tail response's mean
    assert np.mean([t for t, _, _ in plans]) == pytest.approx(1670, rel=0.1)
    assert tool_plan(cfg().modelled, 0, 0, 0) == ([], [])  # long_tail and uniform make no calls
    assert tool_plan(cfg("modelled.workload=uniform").modelled, 0, 0, 0) == ([], [])
    assert tool_latency_s(0.0) == 2.0 and tool_latency_s(2.326) == pytest.approx(20.0)


def test_a_sequence_waiting_for_a_tool_holds_its_kv_and_decodes_nothing():
    e, clock = engine(*TOOLS)
    t0 = e.clock_s  # the weight load's modelled time: the engine's clock runs from there
    # g00000004/0: 3 tokens, one tool call after the first, latency L = 3.3546 modelled s
    calls, (latency,) = tool_plan(e.m, 0, 4, 0)
    assert (response_length(e.m, 0, 4, 0), calls, round(latency, 4)) == (3, [1], 3.3546)
    e.add("g00000004/0", [5] * 4)
    assert e.step() == []  # prefill 4 tokens (0.004) + 1 decode step (0.025); then the call starts
    assert e.tool_calls == 1 and e.kv_usage() == (4 + 1, 1_000_000) and e.free_slots() == 7
    idle = 0
    while (done := e.step()) == []:  # every sequence waits: sleep up to 0.05 wall s x speedup 10 = 0.5 each
        idle += 1
    assert idle == 7  # 6 x 0.5 + 0.3546 = L
    assert e.tool_wait_seconds == pytest.approx(latency)
    # the return: 128 tool output tokens prefilled (0.128) + 2 decode steps (0.05); the tool tokens are context,
    # not response: 3 generated tokens, the last <eos>
    assert done[0].response_ids == [RESPONSE_TOKEN_ID] * 2 + [EOS_ID] and done[0].finish_reason == "stop"
    assert e.modelled_seconds == pytest.approx(0.029 + 0.178)
    assert e.clock_s - t0 == pytest.approx(0.207 + latency) and clock.total == pytest.approx((e.clock_s - t0) / 10)
    # resumed exactly at the call (repack): the call is issued again, full latency
    e.add("g00000004/0", [5] * 4, prefix_ids=[RESPONSE_TOKEN_ID], prefix_logprobs=[-1.0])
    assert e.tool_calls == 2 and e.step() == [] and e.tool_wait_seconds == pytest.approx(latency + 0.5)


def test_decoding_stops_at_a_tool_return_so_the_sequence_rejoins_the_batch():
    # decode_step_s 1 and speedup 1000: 50 steps fit a call, so only the tool return bounds k
    e, _ = engine(*TOOLS, "modelled.decode_step_s=1", "modelled.speedup=1000")
    e.clock_s = 0.0  # time from here (the weight load's modelled time is on the clock)
    assert tool_plan(e.m, 0, 3, 0)[0] == [1, 17, 21, 22, 35] and response_length(e.m, 0, 3, 0) == 40
    e.add("g00000004/0", [5] * 4)  # call at 1, latency 3.35463
    e.add("g00000003/0", [5] * 4, prefix_ids=[RESPONSE_TOKEN_ID] * 2, prefix_logprobs=[-1.0] * 2)  # past call 1
    # prefill 4 + (4 prompt + 128 tool output of the finished call + 2 prefix) = 138 tokens = 0.138, k = 1
    assert e.step() == [] and e.clock_s == pytest.approx(1.138)
    assert e.kv_usage()[0] == (4 + 1) + (4 + 128 + 3)
    # g4 waits until 1.138 + 3.35463 = 4.49263; g3 could decode 14 tokens to its call at 17, but stops after
    # ceil(3.35463 / 1) = 4 steps
    assert e.step() == [] and e.clock_s == pytest.approx(5.138)
    assert [len(r) for _, _, r, _ in e.snapshot_inflight()] == [1, 7]
    # g4 returned: 128 tokens prefilled (0.128), both decode 2 steps; g4 ends at 3 tokens
    done = e.step()
    assert [f.request_id for f in done] == ["g00000004/0"] and e.modelled_seconds == pytest.approx(7.266)
    assert e.tool_calls == 1  # g3's first call was made before its prefix was cut: not made here
