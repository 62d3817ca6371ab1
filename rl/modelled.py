"""The `modelled` engine and trainer: a GPU's timing without a GPU (rollout.engine = trainer.engine = 'modelled').

Only time is modelled. Leases, relays, object stores, the ledger, checkpoints and the workflow are the real
code; what is replaced is the arithmetic of generation and training. Every cost below is a *modelled* second
(the time the [modelled] section's GPU would take) and is slept as modelled / `modelled.speedup` wall seconds
through an injected `sleep`, so schedules can be compared at scale on a 2-core CPU machine.

- `response_length`: the length a request will reach, a deterministic function of (run seed, prompt id,
  sample index), so every mode sees the same workload. `tool_plan`: the `tools` workload's model turns and
  tool-call latencies, deterministic in the same way.
- `ModelledTask`: fake prompts (`modelled.prompt_tokens` copies of one id) and a deterministic pseudo-reward.
  Modelled runs do not learn: the reward does not depend on anything a policy could change.
- `ModelledEngine`: the interface of `rl.engine.TorchEngine` (continuous batching, slots, KV admission,
  resumable prefixes) with modelled prefill, decode and weight-load times.
- `ModelledTrainer`: the interface `services/trainer.py` uses from `rl.trainer.Trainer`; a step sleeps in
  proportion to the batch's tokens and returns the batch's real reward, length and staleness statistics.

Response length cap: in modelled runs the cap is `modelled.max_response_tokens`, not `rollout.max_new_tokens`
(which sizes the tiny torch model's cache). A request whose drawn length exceeds the cap ends with
finish_reason "length" after exactly `max_response_tokens` tokens; every other ends with <eos> ("stop").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from hashlib import blake2b

import numpy as np
import torch

from laminar.config import ModelledSection, RunConfig
from laminar.envs.tasks import Prompt
from laminar.errors import EngineError
from laminar.records import Trajectory
from laminar.rl.costs import TOOL_OUTPUT_TOKENS, CostModel, tool_latency_s
from laminar.rl.engine import Finished, abort_slots, check_resumable, first_free_slot, inflight_state
from laminar.rl.grpo import split_stale
from laminar.rl.trainer import UpdateMetrics

EOS_ID = 2  # the fake <eos> that ends a "stop" response
PROMPT_TOKEN_ID = 5  # every fake prompt token
RESPONSE_TOKEN_ID = 7  # every fake response token but a final <eos>
TOKEN_LOGPROB = -1.0  # behaviour log-prob recorded for every fake token
LONG_TAIL_SIGMA = math.log(10) / 2.326  # lognormal sigma with p99 / p50 = 10 (z_0.99 = 2.326)
PREEMPT_FREE = 0.05  # a full KV cache preempts the newest sequences until this fraction is free (as sim/core.py)
WALL_S_PER_STEP = 0.05  # one `step()` call advances at most this much wall time of decoding (s)
# The `tools` workload (multi-turn tool calling). Turns per trajectory: uniform in 2..6 (1..5 tool calls; our
# assumption, below the paper's "up to 8 tool calls" of section 8.1). Each turn's length: the long_tail lognormal
# with median response_p50_tokens / 4, so the mean trajectory (4 turns) generates as many tokens as a long_tail one.
TOOL_TURNS_MIN, TOOL_TURNS_MAX = 2, 6
TOOL_TURN_P50_DIVISOR = 4


# -- workload ----------------------------------------------------------------------------------------------


def _rng(seed: int, prompt_id: int, sample: int) -> np.random.Generator:
    digest = blake2b(f"{seed}/{prompt_id}/{sample}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


def _tool_draws(cfg: ModelledSection, seed: int, prompt_id: int, sample: int) -> tuple[list[int], list[float]]:
    """The `tools` workload's uncapped turn lengths (tokens, each >= 1) and one latency per tool call (modelled s,
    rl.costs.tool_latency_s: p50 2 s, p99 20 s)."""
    rng = _rng(seed, prompt_id, sample)
    turns = int(rng.integers(TOOL_TURNS_MIN, TOOL_TURNS_MAX + 1))
    p50 = max(1.0, cfg.response_p50_tokens / TOOL_TURN_P50_DIVISOR)
    lengths = [max(1, round(float(x))) for x in rng.lognormal(math.log(p50), LONG_TAIL_SIGMA, turns)]
    return lengths, [tool_latency_s(float(z)) for z in rng.standard_normal(turns - 1)]


def tool_plan(cfg: ModelledSection, seed: int, prompt_id: int, sample: int) -> tuple[list[int], list[float]]:
    """(response lengths at which each tool call starts, each call's latency in modelled s) of a request; empty
    unless modelled.workload = 'tools'. The turns are cut at max_response_tokens: a call at or past the capped
    length is never made. The sum of the turns is `response_length`'s drawn length."""
    if cfg.workload != "tools":
        return [], []
    lengths, latencies = _tool_draws(cfg, seed, prompt_id, sample)
    target = response_length(cfg, seed, prompt_id, sample)
    calls, at = [], 0
    for n in lengths[:-1]:  # every turn but the last ends in a call
        at += n
        if at >= target:
            break
        calls.append(at)
    return calls, latencies[:len(calls)]


def _drawn_length(cfg: ModelledSection, seed: int, prompt_id: int, sample: int) -> int:
    """The uncapped response length (tokens, >= 1) of sample `sample` of prompt `prompt_id`."""
    if cfg.workload == "tools":
        return sum(_tool_draws(cfg, seed, prompt_id, sample)[0])
    rng = _rng(seed, prompt_id, sample)
    p50 = cfg.response_p50_tokens
    if cfg.workload == "long_tail":
        return max(1, round(float(rng.lognormal(mean=math.log(p50), sigma=LONG_TAIL_SIGMA))))
    lo, hi = -(-4 * p50 // 5), 6 * p50 // 5  # integers within +-20 % of p50: ceil(0.8 p50) .. floor(1.2 p50)
    if lo > hi:  # no integer in the band (p50 = 1 or 2 cannot move by 20 %)
        lo = hi = p50
    return max(1, int(rng.integers(lo, hi + 1)))


def response_length(cfg: ModelledSection, seed: int, prompt_id: int, sample: int) -> int:
    """Response length in tokens (<eos> included) that request `g<prompt_id>/<sample>` reaches.

    Deterministic in (seed, prompt_id, sample). `long_tail`: lognormal with median response_p50_tokens and
    sigma = ln(10)/2.326, so p99 = 10 x p50; `uniform`: uniform integer in [ceil(0.8 p50), floor(1.2 p50)];
    `tools`: the sum of 2..6 turns, each long_tail with median p50 / 4 (`tool_plan`). Always in 1..cfg.max_response_tokens (the cap)."""
    return min(_drawn_length(cfg, seed, prompt_id, sample), cfg.max_response_tokens)


def parse_request_id(request_id: str) -> tuple[int, int]:
    """("g00000012/3") -> (prompt id 12, sample 3); EngineError naming the id and the expected form."""
    group, _, sample = request_id.partition("/")
    if not (group.startswith("g") and group[1:].isdigit() and sample.isdigit()):
        raise EngineError(
            f"request_id={request_id!r} is not '<group>/<sample>' with group 'g%08d' % prompt_id (e.g. "
            f"'g00000012/3'); the modelled engine derives the response length from it"
        )
    return int(group[1:]), int(sample)


class ModelledTask:
    """What services/rollout/ needs from a task, with fake tokens and a pseudo-reward.

    Modelled runs do not learn: `reward` is a deterministic hash of (prompt id, response length) in [0, 1],
    so groups have a spread of rewards (non-zero advantages) but nothing a policy could improve."""

    name = "modelled"
    eos_id = EOS_ID

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def prompt(self, prompt_id: int) -> Prompt:
        ids = [PROMPT_TOKEN_ID] * self.cfg.modelled.prompt_tokens
        return Prompt(prompt_id=prompt_id, text=f"modelled prompt {prompt_id}", token_ids=ids)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        digest = blake2b(f"reward/{prompt.prompt_id}/{len(response_ids)}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64


# -- engine ------------------------------------------------------------------------------------------------


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    target: int  # response tokens at which it finishes (<eos> included for "stop")
    capped: bool  # the drawn length exceeded max_response_tokens: finishes with "length"
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefilled: bool = False
    calls: list[int] = field(default_factory=list)  # `tools`: response lengths at which the next tool calls start
    latencies: list[float] = field(default_factory=list)  # ... and their latencies (modelled s)
    tool_until: float | None = None  # waiting for a tool until this engine clock time: KV held, no decode
    context: int = 0  # tool output tokens in the context (KV), not generated: never in response_ids
    pending: int = 0  # tool output tokens not prefilled yet
    order: int = 0  # admission order: a full cache preempts the newest first
    waiting: bool = False  # not resident: queued (no room yet) or preempted; holds no KV, re-prefilled on admission

    def tokens(self) -> int:
        return len(self.prompt_ids) + self.context + len(self.response_ids)

    def next_stop(self) -> int:
        """Response length at which this sequence next stops decoding: its next tool call or its end."""
        return self.calls[0] if self.calls else self.target


class ModelledEngine:
    """Continuous batching with the timing of the [modelled] GPU; the interface of rl.engine.TorchEngine.

    `step()` prefills the requests added since the last step (prompt + resumed prefix tokens x
    prefill_s_per_token, all together), then advances every active sequence by k decode steps at once:
    k = min(tokens until the next sequence finishes, steps that fit in WALL_S_PER_STEP wall seconds), >= 1.
    A decode step costs decode_step_s up to roofline_batch active sequences, decode_step_s x batch /
    roofline_batch above it (memory- then compute-bound). Each step's modelled cost is slept as
    cost / speedup wall seconds in one `sleep` call.

    KV cache, as vLLM's scheduler (and sim/core.py) treats it: `kv_usage()` = (prompt + context + response
    tokens of resident sequences, kv_capacity_tokens). A request whose prompt + prefix can never fit
    (> kv_capacity_tokens) is refused at `add` with a permanent error; one that does not fit now waits, not
    resident, and is admitted (prefilled) when room frees, oldest first. A full cache during decode preempts the
    newest active sequences (recompute: they free their KV, wait, and are prefilled again with their response
    so far) until PREEMPT_FREE of the cache is free and one decode step fits; a lone active sequence is never
    preempted. `free_slots()` is 0 while any sequence waits, or once less than one prompt
    (modelled.prompt_tokens) fits, so a replica stops claiming. The config refuses a longest sequence
    (prompt_tokens + max_response_tokens) the cache cannot hold (laminar/config.py), as vLLM refuses a
    max_model_len its cache cannot hold.

    Weights: `load_weights` ignores the tensors (the modelled trainer publishes a tiny real payload) and
    charges the transfer: with `global_sync` a global NCCL broadcast (weight_bytes / broadcast_gbytes_s);
    otherwise Laminar's relays: one chain hop (weight_bytes / relay_gbytes_s, charged to the puller,
    conservatively) plus the local pull from the host's relay (weight_bytes / pcie_gbytes_s), plus another
    relay_gbytes_s transfer when `local_pull` is False (this host has no live relay: fetched over the network
    from another host's). The replica sets it before each load through `note_pull`.

    Tool calls (modelled.workload = 'tools', `tool_plan`): a sequence that reaches a call's length stops
    decoding until `clock_s` (the engine's modelled clock: everything charged plus tool waits) passes the call's
    latency; it keeps its slot and KV meanwhile (a real engine's environment loop keeps the cache resident). On
    return, TOOL_OUTPUT_TOKENS join its context (prefilled at prefill_s_per_token at the next step, held in the
    KV, never counted as generated tokens) and it decodes on. A step with every sequence waiting sleeps until the
    first return (at most WALL_S_PER_STEP wall seconds), and k stops short of the first return. A resumed prefix
    (abort/repack) brings the output of its finished calls back as context; one that ends exactly at a call
    re-issues it (full latency again).

    Counters (modelled seconds unless a count): `modelled_seconds` (everything charged), `load_seconds`,
    `reprefill_tokens` (prompt + prefix tokens prefilled again after interrupts and preemptions), `interrupts`,
    `preemptions` (sequences preempted by a full cache), `tool_wait_seconds` (steps with every sequence waiting
    for a tool), `tool_calls`.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        max_inflight_seqs: int,
        global_sync: bool,
        sleep: Callable[[float], None] = time.sleep,
        local_pull: bool = True,
    ):
        if max_inflight_seqs < 1:
            raise EngineError(f"modelled engine needs max_inflight_seqs >= 1, got {max_inflight_seqs}")
        self.cfg = cfg
        self.m = cfg.modelled
        self.run_seed = cfg.run.seed  # lengths depend on (run.seed, prompt, sample), never on the replica
        self.global_sync = global_sync
        self.local_pull = local_pull
        self.costs = CostModel.from_modelled(cfg.modelled)  # rl/costs.py: the simulator's cost functions too
        self.eos_id = EOS_ID
        self._sleep = sleep
        self.policy_version: int | None = None
        self._slots: list[_Seq | None] = [None] * max_inflight_seqs
        self.modelled_seconds = 0.0
        self.load_seconds = 0.0
        self.reprefill_tokens = 0
        self.interrupts = 0
        self.clock_s = 0.0  # this engine's modelled clock: everything charged plus tool waits
        self.tool_wait_seconds = 0.0
        self.tool_calls = 0
        self.preemptions = 0
        self._admitted = 0  # admission counter (_Seq.order)

    # -- time ----------------------------------------------------------------------------------------------

    def _charge(self, modelled_s: float) -> None:
        """Account `modelled_s` modelled seconds and sleep them as modelled_s / speedup wall seconds."""
        if modelled_s <= 0:
            return
        self.modelled_seconds += modelled_s
        self.clock_s += modelled_s
        self._sleep(modelled_s / self.m.speedup)

    def _start_tool(self, s: _Seq) -> None:
        """`s` reached its next call: it waits the call's latency from now, holding its slot and KV."""
        s.calls.pop(0)
        s.tool_until = self.clock_s + s.latencies.pop(0)
        self.tool_calls += 1

    def decode_step_s(self, batch: int) -> float:
        """Modelled seconds of one decode step over `batch` active sequences (flat up to the roofline)."""
        return self.costs.decode_step_s(batch)

    def load_cost_s(self) -> float:
        """Modelled seconds one weight load takes on this replica (see the class docstring)."""
        return self.costs.load_s(global_sync=self.global_sync, local_pull=self.local_pull)

    # -- weights -------------------------------------------------------------------------------------------

    def note_pull(self, local: bool) -> None:
        """A pull from another host's relay pays a network hop too (load_cost_s)."""
        self.local_pull = local

    def close(self) -> None:
        """Nothing to free: no device, no process."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> None:
        """Take version `policy_version` (tensors ignored); only with nothing in flight, like TorchEngine."""
        if self.in_flight():
            raise EngineError(
                f"cannot load policy_version={policy_version} while {self.in_flight()} sequences of "
                f"policy_version={self.policy_version} are in flight; load a new policy version only "
                "between batches (or use interrupt_and_load)"
            )
        cost = self.load_cost_s()
        self.load_seconds += cost
        self._charge(cost)
        self.policy_version = policy_version

    def interrupt_and_load(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> int:
        """Partial rollout: stop every in-flight sequence, load the version, continue them under it.

        Each sequence keeps its response so far as a prefix and is prefilled again (prompt + prefix) at the
        next `step`, which charges it. Returns the re-prefilled tokens of sequences that had been prefilled
        (a sequence added but not yet prefilled costs nothing extra)."""
        held = [s for s in self._slots if s is not None]
        self._slots = [None] * len(self._slots)
        try:
            self.load_weights(state_dict, policy_version)
        except BaseException:
            self._slots = held + [None] * (len(self._slots) - len(held))
            raise
        # a preempted (waiting) sequence holds no KV: it is charged when it is admitted again (_admit_waiting)
        tokens = sum(s.tokens() for s in held if s.prefilled and not s.waiting)
        for i, s in enumerate(held):
            if not s.waiting:
                s.prefilled = False
            self._slots[i] = s
        self.reprefill_tokens += tokens
        self.interrupts += 1
        return tokens

    # -- admission -----------------------------------------------------------------------------------------

    def free_slots(self) -> int:
        """Free sequence slots, or 0 while a sequence waits for room or once the KV cache cannot hold one more
        prompt."""
        used, capacity = self.kv_usage()
        if capacity - used < self.m.prompt_tokens or any(s is not None and s.waiting for s in self._slots):
            return 0
        return sum(1 for s in self._slots if s is None)

    def in_flight(self) -> int:
        return sum(1 for s in self._slots if s is not None)

    def kv_usage(self) -> tuple[int, int]:
        """(tokens held by resident in-flight sequences, kv_capacity_tokens)."""
        return sum(s.tokens() for s in self._slots if s is not None and not s.waiting), self.m.kv_capacity_tokens

    def _kv_target(self, active: int) -> int:
        """KV use a preemption brings the cache down to (and re-admission stays under): PREEMPT_FREE of it free,
        and room for one decode step of `active` sequences (sim/core.py's rule)."""
        capacity = self.m.kv_capacity_tokens
        return min(int(capacity * (1 - PREEMPT_FREE)), capacity - active)

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        prefix_ids: list[int] | None = None,
        prefix_logprobs: list[float] | None = None,
    ) -> None:
        """Queue request `g<prompt id, 8 digits>/<sample>`; it joins the running batch at the next `step`.

        A resumed prefix counts toward the request's response length."""
        prefix_ids, prefix_logprobs = list(prefix_ids or []), list(prefix_logprobs or [])
        if self.policy_version is None:
            raise EngineError(f"request {request_id}: no weights loaded; call load_weights first")
        prompt_id, sample = parse_request_id(request_id)
        if not prompt_ids:
            raise EngineError(f"request {request_id}: empty prompt; pass at least one prompt token")
        drawn = _drawn_length(self.m, self.run_seed, prompt_id, sample)
        target = min(drawn, self.m.max_response_tokens)
        check_resumable(request_id, prefix_ids, prefix_logprobs, target,
                        f"the request's modelled length {target} (run.seed={self.run_seed}, [modelled] section); a "
                        f"prefix from another config cannot be resumed", self.eos_id)
        slot = first_free_slot(self._slots, request_id)
        used, capacity = self.kv_usage()
        need = len(prompt_ids) + len(prefix_ids)
        if need > capacity:  # permanent: no amount of waiting makes room for it
            raise EngineError(
                f"request {request_id}: {need} prompt + prefix tokens can never fit in the KV cache "
                f"(modelled.kv_capacity_tokens={capacity}); raise kv_capacity_tokens or lower "
                "modelled.max_response_tokens / modelled.prompt_tokens"
            )
        s = _Seq(request_id, list(prompt_ids), target, drawn > self.m.max_response_tokens, prefix_ids, prefix_logprobs)
        self._admitted += 1
        s.order = self._admitted
        # no room now, or others already wait (first come, first served): it waits, holding no KV
        s.waiting = used + need > capacity or any(q is not None and q.waiting for q in self._slots)
        s.calls, s.latencies = tool_plan(self.m, self.run_seed, prompt_id, sample)
        while s.calls and s.calls[0] < len(prefix_ids):  # finished calls: their output is context again
            s.calls.pop(0)
            s.latencies.pop(0)
            s.context += TOOL_OUTPUT_TOKENS
        if s.calls and s.calls[0] == len(prefix_ids):  # stopped at a call: issue it again
            self._start_tool(s)
        self._slots[slot] = s

    def abort(self, request_ids: Iterable[str] | None = None) -> list[tuple[str, list[int], list[int], list[float]]]:
        """Drop the named in-flight requests (None: all; dynamic repack hands them to another replica); returns
        their state so far (rl.engine_api.Engine.abort). Ids not in flight are ignored."""
        return abort_slots(self._slots, request_ids)

    def snapshot_inflight(self) -> list[tuple[str, list[int], list[int], list[float]]]:
        """(request_id, prompt_ids, response_ids so far, logprobs so far) of every in-flight sequence."""
        return inflight_state(self._slots)

    # -- generation ----------------------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """Prefill new requests, then advance all active sequences by k decode steps (class docstring);
        return the sequences that finished."""
        for s in self._slots:  # tool calls that returned: their output joins the context
            if s is not None and s.tool_until is not None and s.tool_until <= self.clock_s + 1e-9:
                s.tool_until = None
                s.context += TOOL_OUTPUT_TOKENS
                s.pending += TOOL_OUTPUT_TOKENS
        self._admit_waiting()
        new = [s for s in self._slots if s is not None and not s.waiting and not s.prefilled]
        cost = self.costs.prefill_s(sum(s.tokens() for s in new)
                                    + sum(s.pending for s in self._slots if s is not None and s.prefilled))
        for s in self._slots:
            if s is not None and not s.waiting:
                s.prefilled, s.pending = True, 0
        held = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.waiting]
        if not held:
            return []
        active = [(i, s) for i, s in held if s.tool_until is None]
        returns = [s.tool_until for _, s in held if s.tool_until is not None]
        if not active:  # every sequence waits for a tool: sleep until the first returns
            self._charge(cost)
            wait = min(min(returns) - self.clock_s, WALL_S_PER_STEP * self.m.speedup)
            if wait > 0:
                self.clock_s += wait
                self.tool_wait_seconds += wait
                self._sleep(wait / self.m.speedup)
            return []
        active = self._preempt_if_full(active)
        step_s = self.decode_step_s(len(active))
        fit = max(1, int(WALL_S_PER_STEP * self.m.speedup / step_s))
        k = min(min(s.next_stop() - len(s.response_ids) for _, s in active), fit)
        if len(active) > 1:  # stop when the cache is full: the next step preempts
            used, capacity = self.kv_usage()
            k = min(k, max(1, (capacity - used) // len(active)))
        if returns:  # stop at the first tool return so that sequence rejoins the batch
            k = min(k, max(1, math.ceil((min(returns) - self.clock_s - cost) / step_s)))
        self._charge(cost + k * step_s)
        finished = []
        for i, s in active:
            s.response_ids.extend([RESPONSE_TOKEN_ID] * k)
            s.logprobs.extend([TOKEN_LOGPROB] * k)
            if len(s.response_ids) >= s.target:
                reason = "length" if s.capped else "stop"
                if reason == "stop":
                    s.response_ids[-1] = self.eos_id
                finished.append(Finished(s.request_id, s.prompt_ids, s.response_ids, s.logprobs, reason))
                self._slots[i] = None
            elif s.calls and len(s.response_ids) == s.calls[0]:
                self._start_tool(s)
        return finished

    def _admit_waiting(self) -> None:
        """Waiting sequences become resident, oldest first, while they fit under the preemption target (or the
        cache holds nothing); a preempted one is prefilled again with its response so far (recompute)."""
        waiting = sorted((s for s in self._slots if s is not None and s.waiting), key=lambda s: s.order)
        for s in waiting:
            used, _ = self.kv_usage()
            active = sum(1 for q in self._slots if q is not None and not q.waiting and q.tool_until is None)
            if used > 0 and used + s.tokens() > self._kv_target(active + 1):
                return  # first come, first served: nothing younger jumps the queue
            s.waiting = False
            if s.prefilled:  # preempted: its prompt + context + response are prefilled again
                s.prefilled = False
                self.reprefill_tokens += s.tokens()

    def _preempt_if_full(self, active: list[tuple[int, _Seq]]) -> list[tuple[int, _Seq]]:
        """The cache cannot take one more decode step of every active sequence: preempt the newest until it is at
        the target (or one is left); returns the sequences still active."""
        used, capacity = self.kv_usage()
        if used + len(active) <= capacity:
            return active
        keep = sorted(active, key=lambda e: e[1].order)
        while len(keep) > 1 and used > self._kv_target(len(keep)):
            _, s = keep.pop()
            used -= s.tokens()
            s.waiting = True  # keeps prefilled=True: _admit_waiting charges its recompute
            s.pending = 0
            self.preemptions += 1
        return sorted(keep)  # slot order, as without preemption


# -- trainer -----------------------------------------------------------------------------------------------


class ModelledTrainer:
    """The interface services/trainer.py uses from rl.trainer.Trainer, with a modelled step time.

    `step` sleeps (prompt + response tokens of the kept samples) x trainer_s_per_token / speedup wall
    seconds and reports the batch's real reward mean, sample and token counts, response length and staleness;
    loss, grad_norm and the other optimisation statistics are 0. `max_staleness` is the bound the run
    applies (laminar.policy.staleness_bound; rl does not import workflows): samples staler than it are
    dropped and counted, -1 keeps all. The "weights" are one tensor holding the step count.
    """

    def __init__(self, cfg: RunConfig, *, max_staleness: int, sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.m = cfg.modelled
        self.max_staleness = max_staleness
        self._sleep = sleep
        self.steps = 0  # optimizer steps applied (what a checkpoint restores)
        self.modelled_seconds = 0.0

    def step(self, trajectories: list[Trajectory], trainer_version: int) -> UpdateMetrics:
        kept, hist, dropped = split_stale(trajectories, trainer_version, self.max_staleness)
        self.steps += 1
        if not kept:
            return UpdateMetrics(trainer_version, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, dropped, hist, updated=False)
        batch_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in kept)
        cost = CostModel.from_modelled(self.m).train_s(batch_tokens)
        self.modelled_seconds += cost
        self._sleep(cost / self.m.speedup)
        response_tokens = sum(len(t.response_ids) for t in kept)
        return UpdateMetrics(
            trainer_version=trainer_version,
            samples=len(kept),
            tokens=response_tokens,
            reward_mean=sum(t.reward for t in kept) / len(kept),
            loss=0.0,
            grad_norm=0.0,
            clip_fraction=0.0,
            entropy=0.0,
            response_len_mean=response_tokens / len(kept),
            dropped_stale=dropped,
            staleness=hist,
        )

    def publish_stall_s(self, global_sync: bool) -> float:
        """Wall seconds the trainer stalls pushing a version (already divided by speedup): the push to the
        master relay (weight_bytes / relay_gbytes_s) for laminar, a global broadcast (weight_bytes /
        broadcast_gbytes_s) for the global-sync modes."""
        return CostModel.from_modelled(self.m).publish_stall_s(global_sync) / self.m.speedup

    def push_stall(self, global_sync: bool) -> float:
        """The modelled push (publish_stall_s), slept here after the real relay push of the tiny payload."""
        stall = self.publish_stall_s(global_sync)
        self._sleep(stall)
        return stall

    def close(self) -> None:
        """Nothing to free: no weights, no helper processes."""

    # -- weights and checkpoints -----------------------------------------------------------------------------

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """A tiny real payload for the relays: {"version": [steps]} (the modelled engine ignores it)."""
        return {"version": torch.tensor([self.steps], dtype=torch.int64)}

    def state_parts(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"model": self.policy_state_dict(), "optim": {"steps": torch.tensor([self.steps], dtype=torch.int64)}}

    def load_state_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        try:
            self.steps = int(parts["optim"]["steps"][0])
        except (KeyError, IndexError) as e:
            raise ValueError(
                f"checkpoint parts {sorted(parts)} are not a modelled trainer's ({e!r} missing); a torch run's "
                f"checkpoint cannot be restored with trainer.engine='modelled'"
            ) from None
