"""The `torch` rollout engine: continuous batching over a preallocated per-slot KV cache (CPU default).

Each request owns one slot of a `KVCache` ([layers, slots, kv_heads, max_len, head_dim]) and a length.
`add` only claims a slot; the next `step` prefills every newly added request (prompt and any resumed
prefix, except its last token) in one batched forward, then runs one batched decode over all active
slots, so every active sequence gains exactly one token per step and new requests join the running
batch at the next step. A sequence that samples <eos> or reaches `max_new_tokens` is returned by that
`step` and its slot is free immediately.

Behaviour log-probs: for each sampled token the engine records log softmax(logits / temperature) at
that token, i.e. the log-probability under the distribution it actually sampled from (at the default
temperature 1 this is the policy's own log-prob). The trainer evaluates its policy at the same
temperature, so the importance ratio compares like with like.

Device: the engine runs where the model's parameters are (CPU, or CUDA with bf16 weights), with the KV cache
on that device in the parameters' dtype. Each sequence's last token and position live in device tensors, so a
decode step sends nothing to the device (but the active slots' indices when the batch changed) and reads back
one small tensor, the sampled ids and their log-probs together: the only host round trip per token is
sampling's.

The engine runs under torch.no_grad; the number of torch threads is the caller's business. It implements
rl.engine_api.Engine (the contract in tests/test_engine_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from laminar.errors import EngineError
from laminar.rl.engine_api import Finished, InFlight
from laminar.rl.model import CausalLM, KVCache, load_model_state
from laminar.rl.precision import check_cpu_dtype, cpu_bf16_flags

__all__ = ["Finished", "TorchEngine", "check_resumable", "first_free_slot"]


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0  # token positions written to the KV cache
    prefilled: bool = False

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def check_resumable(request_id: str, prefix_ids: list[int], prefix_logprobs: list[float], limit: int,
                    limit_text: str, eos_id: int) -> None:
    """A resumed prefix must carry one log-prob per token, stay below the request's length `limit` (described
    by `limit_text` in the error) and not be finished already. Shared by every engine's `add`."""
    if len(prefix_ids) != len(prefix_logprobs) or len(prefix_ids) >= limit:
        raise EngineError(
            f"request {request_id}: prefix of {len(prefix_ids)} tokens with {len(prefix_logprobs)} "
            f"log-probs must have equal lengths below {limit_text}"
        )
    if eos_id in prefix_ids:
        raise EngineError(f"request {request_id}: prefix already contains <eos>; it is finished, not partial")


def check_admission(request_id: str, prompt_ids: list[int], policy_version: int | None, max_prompt_len: int) -> None:
    """Weights are loaded and the prompt fits: the checks of every engine's `add` before its own."""
    if policy_version is None:
        raise EngineError(f"request {request_id}: no weights loaded; call load_weights first")
    if not prompt_ids or len(prompt_ids) > max_prompt_len:
        raise EngineError(
            f"request {request_id}: prompt of {len(prompt_ids)} tokens is outside 1..{max_prompt_len} "
            "(max_prompt_len); shorten the prompt or build the engine with a larger max_prompt_len"
        )


def inflight_state(slots: list) -> list[InFlight]:
    """(request_id, prompt_ids, response_ids so far, logprobs so far) of every occupied slot (a slot holds any
    record with those four fields); shared by every engine's snapshot_inflight and abort."""
    return [(s.request_id, list(s.prompt_ids), list(s.response_ids), list(s.logprobs)) for s in slots if s is not None]


def abort_slots(slots: list, request_ids: Iterable[str] | None) -> list[InFlight]:
    """Free the slots of the named requests (None: all) in place; returns their state so far. Unknown ids are
    ignored."""
    wanted = None if request_ids is None else set(request_ids)
    gone = [i for i, s in enumerate(slots) if s is not None and (wanted is None or s.request_id in wanted)]
    out = inflight_state([slots[i] for i in gone])
    for i in gone:
        slots[i] = None
    return out


def first_free_slot(slots: list, request_id: str) -> int:
    """Index of the first free (None) slot; EngineError when every slot is busy."""
    try:
        return slots.index(None)
    except ValueError:
        raise EngineError(
            f"request {request_id}: all {len(slots)} slots are busy; wait for free_slots() > 0"
        ) from None


class TorchEngine:
    """Continuous-batching generator for one policy version at a time."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        *,
        max_inflight_seqs: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_id: int,
        max_prompt_len: int = 64,
        on_close: Callable[[], None] | None = None,
        base_fingerprint: str | None = None,
    ):
        """on_close: runs once at `close` (rl.factory: gives the replica's CUDA device slot back). base_fingerprint:
        the model holds a LoRA run's base weights (rl/lora.py): versions are adapters, merged into them on load."""
        if max_inflight_seqs < 1 or max_new_tokens < 1 or temperature < 0:
            raise EngineError(
                f"engine needs max_inflight_seqs >= 1, max_new_tokens >= 1 and temperature >= 0 (0: greedy); got "
                f"{max_inflight_seqs}, {max_new_tokens}, {temperature}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_prompt_len = max_prompt_len
        self.temperature = temperature
        self.eos_id = eos_id
        self.policy_version: int | None = None
        first = next(model.parameters())
        self.device = first.device
        check_cpu_dtype("rollout.dtype", self.device, first.dtype, cpu_bf16_flags())
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._cache = KVCache(model.config, max_inflight_seqs, max_prompt_len + max_new_tokens, first.dtype,
                              self.device)
        self._slots: list[_Seq | None] = [None] * max_inflight_seqs
        # per slot, on the device: the token the next decode step feeds, and its position
        self._last = torch.zeros(max_inflight_seqs, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(max_inflight_seqs, 1, dtype=torch.long, device=self.device)
        self._active: tuple[list[int], torch.Tensor] | None = None  # the last step's active slots, on the device
        self._on_close = on_close
        self._lora = None
        if base_fingerprint is not None:
            from laminar.rl.lora import AdapterMerge

            self._lora = AdapterMerge(self.model, base_fingerprint)

    def note_pull(self, local: bool) -> None:
        """A real load costs what it costs, wherever the weights come from."""

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> None:
        """Replace the weights in place; only between batches (nothing in flight)."""
        if self.in_flight():
            raise EngineError(
                f"cannot load policy_version={policy_version} while {self.in_flight()} sequences of "
                f"policy_version={self.policy_version} are in flight; load a new policy version only "
                "between batches"
            )
        from laminar.rl.lora import version_is_adapter

        with torch.no_grad():
            if version_is_adapter(state_dict, policy_version, lora_engine=self._lora is not None,
                                  build_fix="base_fingerprint"):
                self._lora.apply(state_dict)  # merged into the base weights it holds (rl/lora.py AdapterMerge)
            else:
                load_model_state(self.model, state_dict)
        self.policy_version = policy_version

    def interrupt_and_load(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> int:
        """Partial rollout: stop every in-flight sequence, load the weights, continue each under them.

        Each sequence keeps its slot, its response so far (now a prefix generated by older versions) and
        its log-probs; the next `step` prefills prompt + prefix again with the new weights. Returns the
        tokens to re-prefill (prompt + prefix) of the sequences that had been prefilled; one added but
        not yet prefilled is prefilled anyway. If loading fails, the sequences are put back as they were
        and the error propagates (the weights may then be partly replaced, as with load_weights)."""
        held = list(self._slots)
        self._slots = [None] * len(held)
        try:
            self.load_weights(state_dict, policy_version)
        except BaseException:
            self._slots = held
            raise
        tokens = 0
        for slot, s in enumerate(held):
            if s is None:
                continue
            if s.prefilled:
                tokens += len(s.tokens())
            s.prefilled, s.cached = False, 0
            self._slots[slot] = s
        return tokens

    # -- admission -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(1 for s in self._slots if s is None)

    def in_flight(self) -> int:
        return len(self._slots) - self.free_slots()

    def kv_usage(self) -> tuple[int, int]:
        """(token positions in use, token positions of capacity) of the KV cache."""
        used = sum(len(s.tokens()) for s in self._slots if s is not None)
        return used, self._cache.slots * self._cache.max_len

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        prefix_ids: list[int] | None = None,
        prefix_logprobs: list[float] | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next `step`.

        prefix_ids/prefix_logprobs resume a partially generated response (fault recovery): generation
        continues after the prefix, which stays part of the returned response.
        """
        prefix_ids, prefix_logprobs = list(prefix_ids or []), list(prefix_logprobs or [])
        check_admission(request_id, prompt_ids, self.policy_version, self.max_prompt_len)
        check_resumable(request_id, prefix_ids, prefix_logprobs, self.max_new_tokens,
                        f"max_new_tokens={self.max_new_tokens}", self.eos_id)
        slot = first_free_slot(self._slots, request_id)
        self._slots[slot] = _Seq(request_id, list(prompt_ids), prefix_ids, prefix_logprobs)

    def snapshot_inflight(self) -> list[InFlight]:
        """(request_id, prompt_ids, response_ids so far, logprobs so far) of every in-flight sequence."""
        return inflight_state(self._slots)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[InFlight]:
        """Drop the named in-flight requests (None: all) and free their slots (dynamic repack hands them to
        another replica); returns their state so far. Ids not in flight are ignored."""
        return abort_slots(self._slots, request_ids)

    # -- generation ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Advance every active sequence by one token; return those that finished this step."""
        self._prefill_new()
        active = [i for i, s in enumerate(self._slots) if s is not None]
        if not active:
            return []
        seqs = [self._slots[i] for i in active]
        if self._active is None or self._active[0] != active:  # the batch changed: one small host-to-device copy
            self._active = (active, torch.tensor(active, device=self.device))
        slots = self._active[1]
        kv_len = max(s.cached for s in seqs) + 1
        logits = self.model.forward_cached(self._last[slots], self._pos[slots], self._cache, slots, kv_len)
        if self.temperature == 0:  # greedy (evaluation): the most likely token, its log-prob at temperature 1
            logp = torch.log_softmax(logits[:, -1], dim=-1)
            sampled = logp.argmax(dim=-1, keepdim=True)
        else:
            logp = torch.log_softmax(logits[:, -1] / self.temperature, dim=-1)
            sampled = torch.multinomial(logp.exp(), 1, generator=self._gen)
        self._last[slots] = sampled
        self._pos[slots] += 1
        # the one read-back per step: sampled ids and their log-probs in one transfer
        both = torch.cat((sampled.to(logp.dtype), logp.gather(1, sampled)), dim=1).tolist()
        sampled = [int(tok) for tok, _ in both]
        chosen = [lp for _, lp in both]
        finished = []
        for slot, s, tok, lp in zip(active, seqs, sampled, chosen, strict=True):
            s.cached += 1
            s.response_ids.append(tok)
            s.logprobs.append(lp)
            reason = (
                "stop"
                if tok == self.eos_id
                else "length"
                if len(s.response_ids) >= self.max_new_tokens
                else ""
            )
            if reason:
                finished.append(Finished(s.request_id, s.prompt_ids, s.response_ids, s.logprobs, reason))
                self._slots[slot] = None
        return finished

    def _prefill_new(self) -> None:
        """Write k/v of all tokens but the last of each new request, in one right-padded forward."""
        new = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.prefilled]
        if not new:
            return
        for _, s in new:
            s.prefilled = True
            s.cached = len(s.tokens()) - 1
        idx = torch.tensor([i for i, _ in new], device=self.device)
        self._last[idx] = torch.tensor([[s.tokens()[-1]] for _, s in new], device=self.device)
        self._pos[idx] = torch.tensor([[s.cached] for _, s in new], device=self.device)
        new = [(i, s) for i, s in new if s.cached > 0]
        if not new:
            return
        width = max(s.cached for _, s in new)
        ids = torch.zeros(len(new), width, dtype=torch.long)
        for row, (_, s) in enumerate(new):
            ids[row, : s.cached] = torch.tensor(s.tokens()[: s.cached])
        # Padding positions write garbage k/v beyond each slot's length; it is overwritten before
        # any query can see it (queries only attend to positions <= their own).
        positions = torch.arange(width, device=self.device).expand(len(new), width)
        slots = torch.tensor([i for i, _ in new], device=self.device)
        self.model.forward_cached(ids.to(self.device), positions, self._cache, slots, width)
