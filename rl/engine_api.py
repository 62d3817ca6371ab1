"""What a rollout replica needs of a generation engine, and the trainer service of a trainer.

Three engines implement `Engine`: `rl.engine.TorchEngine` (plain torch, CPU or CUDA), `rl.modelled.ModelledEngine`
(a GPU's timing without a GPU) and `rl.vllm_engine.VllmEngine` (vLLM; imported only when
rollout.engine = 'vllm'). Three trainers implement `PolicyTrainer`: `rl.trainer.Trainer`, `rl.fsdp.FsdpTrainer`
and `rl.modelled.ModelledTrainer`. `rl.factory` builds both from the run config; no caller names an engine or
asks which one it has (tests/test_engine_seams.py). tests/test_engine_contract.py is the contract every engine
must pass.

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
- `free_slots`, `in_flight`, `snapshot_inflight` and `policy_version` describe the batch;
- `note_pull(local)` says where the next load's weights come from (this host's relay, or another host's over
  the network) before it is loaded; `close` frees what the engine holds (its GPU slot, a pooled vLLM engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from laminar.records import Trajectory
    from laminar.rl.trainer import UpdateMetrics


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

    def note_pull(self, local: bool) -> None:
        """The next load's weights come from this host's relay (True) or over the network from another's."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PolicyTrainer(Protocol):
    """One policy and its optimizer in memory, as services/trainer.py drives it."""

    def step(self, trajectories: list[Trajectory], trainer_version: int) -> UpdateMetrics: ...

    def policy_state_dict(self) -> dict[str, torch.Tensor]: ...

    def state_parts(self) -> dict[str, dict[str, torch.Tensor]]: ...

    def load_state_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None: ...

    def push_stall(self, global_sync: bool) -> float:
        """Seconds a version push stalls beyond the relay push itself, spent here (a modelled trainer's GPU
        push); 0 for a real trainer, whose push is the relay push."""
        ...

    def close(self) -> None: ...
