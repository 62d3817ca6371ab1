"""What a rollout replica needs of a generation engine (services/rollout.py is the only caller).

Three engines implement it: `rl.engine.TorchEngine` (plain torch, CPU or CUDA), `rl.modelled.ModelledEngine`
(a GPU's timing without a GPU) and `rl.vllm_engine.VllmEngine` (vLLM; imported only when
rollout.engine = 'vllm'). tests/test_engine_contract.py is the contract every engine must pass.

The contract, in the words the replica relies on:
- one policy version at a time: `load_weights` replaces it between batches (EngineError while anything is
  in flight); `interrupt_and_load` replaces it under in-flight sequences, which continue under the new
  weights with their response so far kept as a prefix (partial rollout). The tensors may be zero-copy views
  of the relay's shared-memory segment (relay.weights.state_dict_from_buffer): the engine copies them into
  its own parameters and keeps no reference;
- `add` admits a request from its prompt, or from a resumed prefix (its tokens and their log-probs, recorded
  by an earlier incarnation); it joins the running batch at the next `step`;
- `step` advances every active sequence and returns those that finished (<eos>: "stop", the length cap:
  "length"), each with one behaviour log-prob per response token: log softmax(logits / temperature) at the
  sampled token, the distribution the token was drawn from;
- `abort` drops in-flight requests and returns their state so far (resumable with `add(prefix_ids=...)`);
- `kv_usage` is (token positions in use, token positions of capacity) as the engine itself counts them;
- `free_slots`, `in_flight`, `snapshot_inflight` and `policy_version` describe the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Finished:
    """A sequence that ended this step; response_ids include the final <eos> when finish_reason is stop."""

    request_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


# (request_id, prompt_ids, response_ids so far, logprobs so far): an in-flight sequence, resumable
InFlight = tuple[str, list[int], list[int], list[float]]


@runtime_checkable
class Engine(Protocol):
    """A continuous-batching generator for one policy version at a time (see the module docstring)."""

    policy_version: int | None

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None: ...

    def interrupt_and_load(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> int:
        """Returns the tokens prefilled again (prompt + prefix of the sequences that had been prefilled)."""
        ...

    def add(self, request_id: str, prompt_ids: list[int], *, prefix_ids: list[int] | None = None,
            prefix_logprobs: list[float] | None = None) -> None: ...

    def step(self) -> list[Finished]: ...

    def abort(self, request_ids: list[str] | None = None) -> list[InFlight]:
        """Drop the named in-flight requests (None: all); their state so far, in slot order."""
        ...

    def free_slots(self) -> int: ...

    def in_flight(self) -> int: ...

    def kv_usage(self) -> tuple[int, int]: ...

    def snapshot_inflight(self) -> list[InFlight]: ...
