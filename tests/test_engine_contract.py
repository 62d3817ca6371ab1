"""The engine contract (rl/engine_api.py): every rollout engine passes the same suite.

Engines: the torch engine on CPU (always), on CUDA in bf16 (`gpu` marker), vLLM on CPU (in the .venv-vllm venv,
run by tests/test_vllm_engine.py; skipped here when vllm is not importable) and on CUDA (`gpu`), and the modelled
engine (the parts that do not need real tokens: it has no weights and fakes its log-probs).

The model is a tiny Llama with head_dim 64 (vLLM's CPU attention has no kernel for the default tiny model's 16)
and tied embeddings, as the default (its published weights have no lm_head.weight), initialised with std INIT_STD so that its next-token distributions are far from uniform: log-probs then tell
weights A from weights B, and a temperature error shows.

Log-prob agreement (the trainer's log-prob of each sampled token, recomputed with a full forward pass on the same
weights, against what the engine recorded while sampling), TOL[dtype] = (max, mean) |difference| per token:
- float32: 1e-4 and 1e-4. Measured on CPU: torch engine max 3.4e-5, mean 2.0e-6; vLLM max 1.1e-5, mean 1.9e-6 (the
  engines differ from the trainer only in summation order: a KV cache instead of the full sequence);
- bfloat16: 2.0 and 0.1. The engine holds bf16 weights, activations and KV cache; the trainer keeps float32 weights
  and runs under bf16 autocast (matmuls in bf16, residual stream, norms and softmax in float32), the usual
  training/inference mismatch. Measured on CPU (torch-cpu-bf16, this model's logits are large: INIT_STD 0.25):
  max 1.16, mean 0.061. Not measured on a GPU here (none was lent); scripts/gpu-check.sh runs the cuda cases.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from multiprocessing import shared_memory

import pytest
import torch

from laminar.config import RunConfig
from laminar.errors import EngineError
from laminar.records import Trajectory
from laminar.relay.weights import state_dict_from_buffer
from laminar.rl.engine import TorchEngine
from laminar.rl.engine_api import Engine, Finished
from laminar.rl.model import build_model, model_state_dict, state_dict_to_bytes
from laminar.rl.trainer import Trainer

VOCAB, EOS = 32, 2
INIT_STD = 0.25
HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
    "tie_word_embeddings": True, "initializer_range": INIT_STD, "bos_token_id": 1, "eos_token_id": EOS,
    "pad_token_id": 0, "torch_dtype": "float32",
}
SLOTS, MAX_NEW, MAX_PROMPT, TEMPERATURE = 16, 24, 8, 0.8
PROMPT = [1, 5, 9, 13]
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2.0, 0.1)}  # (max, mean) |trainer - engine| per token
MOVED = 0.5  # mean |log-prob| gap (nats) by which weights A must explain B's samples worse than B does

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed in this venv; tests/test_vllm_engine.py "
                                "runs this suite in .venv-vllm (make vllm-venv)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

ENGINES = [
    pytest.param("torch-cpu"),
    pytest.param("torch-cpu-bf16"),
    pytest.param("torch-cuda", marks=[pytest.mark.gpu, needs_cuda]),
    pytest.param("vllm-cpu", marks=needs_vllm),
    pytest.param("vllm-cuda", marks=[pytest.mark.gpu, needs_cuda, needs_vllm]),
    pytest.param("modelled"),
]


def weights(seed: int) -> dict[str, torch.Tensor]:
    return model_state_dict(build_model(HF, seed=seed))


A, B = weights(0), weights(1)


class Subject:
    """An engine under test, with what the suite needs to judge it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.real = kind != "modelled"  # real tokens and log-probs
        self.device = "cuda" if kind.endswith("cuda") else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" or kind.endswith("bf16") else torch.float32
        self.engine: Engine = self._build()
        try:
            self.engine.add("g00000000/0", PROMPT)
            self.refused_before_load = ""
        except EngineError as e:
            self.refused_before_load = str(e)
        t0 = time.perf_counter()
        self.engine.load_weights(A, 0)
        self.load_s = time.perf_counter() - t0

    def _build(self) -> Engine:
        if self.kind.startswith("torch"):
            model = build_model(HF, seed=0).to(self.device, self.dtype)
            return TorchEngine(model, None, max_inflight_seqs=SLOTS, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                               seed=0, eos_id=EOS, max_prompt_len=MAX_PROMPT)
        if self.kind.startswith("vllm"):
            from laminar.rl.vllm_engine import VllmEngine

            return VllmEngine(HF, max_inflight_seqs=SLOTS, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=0,
                              eos_id=EOS, max_prompt_len=MAX_PROMPT, device=self.device,
                              dtype="bfloat16" if self.dtype == torch.bfloat16 else "float32")
        from laminar.rl.modelled import ModelledEngine

        # one token a step (speedup 1: 0.05 wall s per step fit one 0.05 s decode step), lengths around 8
        cfg = RunConfig.load(None, ["rollout.engine=modelled", "trainer.engine=modelled", "modelled.speedup=1",
                                    "modelled.decode_step_s=0.05", "modelled.response_p50_tokens=8",
                                    f"modelled.max_response_tokens={MAX_NEW}"])
        return ModelledEngine(cfg, max_inflight_seqs=SLOTS, global_sync=False, sleep=lambda s: None)

    def trainer(self, sd: dict[str, torch.Tensor]) -> Trainer:
        """The trainer's view of the same weights: float32 master weights, compute in the engine's dtype."""
        model = build_model(HF, seed=0)
        model.load_state_dict(sd, strict=False)
        return Trainer(model.to(self.device), RunConfig().trainer, group_size=2, temperature=TEMPERATURE,
                       compute_dtype=self.dtype)

    def run(self, n: int, prompt=PROMPT, first: int = 0) -> list[Finished]:
        """Add n requests and step until all finish; each must finish exactly once."""
        for i in range(first, first + n):
            self.engine.add(rid(i), prompt)
        return self.drain()

    def drain(self, limit: int = 4 * MAX_NEW) -> list[Finished]:
        out: list[Finished] = []
        for _ in range(limit):
            if not self.engine.in_flight():
                break
            out += self.engine.step()
        assert self.engine.in_flight() == 0, f"{self.kind}: still {self.engine.in_flight()} in flight after {limit} steps"
        ids = [f.request_id for f in out]
        assert len(ids) == len(set(ids)), f"a request finished twice: {ids}"
        return out


def rid(i: int) -> str:
    return f"g{i:08d}/{i % 4}"  # the modelled engine derives lengths from '<group>/<sample>' ids


def trajectories(finished: list[Finished]) -> list[Trajectory]:
    return [Trajectory(run_id="contract", prompt_id=0, group_id=f.request_id, sample_index=0,
                       prompt_ids=f.prompt_ids, response_ids=f.response_ids, logprobs=f.logprobs, reward=0.0,
                       policy_version=0, replica_id="r", started_at=0.0, ended_at=0.0, finish_reason=f.finish_reason)
            for f in finished]


def gaps(subject: Subject, finished: list[Finished], sd: dict[str, torch.Tensor], skip: int = 0) -> torch.Tensor:
    """|trainer log-prob - engine log-prob| of every response token from index `skip` on, under weights sd."""
    recomputed = subject.trainer(sd).response_logprobs(trajectories(finished))
    out = [abs(t - e) for f, row in zip(finished, recomputed, strict=True)
           for t, e in zip(row[skip:], f.logprobs[skip:], strict=True)]
    assert out, "no response tokens to compare"
    return torch.tensor(out)


def close_engine(engine: Engine) -> None:
    """Hand a module's engine back at the end (vLLM: one engine per process, the next module builds its own)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


@pytest.fixture(scope="module", params=ENGINES)
def subject(request):
    s = Subject(request.param)
    yield s
    close_engine(s.engine)


@pytest.fixture
def e(subject):
    """The module's engine with weights A and nothing in flight, before and after each test."""
    subject.engine.abort()
    if subject.engine.policy_version != 0:
        subject.engine.load_weights(A, 0)
    yield subject
    subject.engine.abort()


# -- the contract ------------------------------------------------------------------------------------------


def test_is_an_engine_and_needs_weights_before_admitting(e: Subject) -> None:
    assert isinstance(e.engine, Engine)
    assert "no weights loaded" in e.refused_before_load
    assert e.engine.policy_version == 0 and e.engine.in_flight() == 0 and e.engine.free_slots() == SLOTS


def test_each_request_ends_at_eos_or_the_cap_with_one_logprob_per_token(e: Subject) -> None:
    finished = e.run(SLOTS)
    assert sorted(f.request_id for f in finished) == sorted(rid(i) for i in range(SLOTS))
    for f in finished:
        assert f.prompt_ids == PROMPT
        assert 1 <= len(f.response_ids) <= MAX_NEW and len(f.logprobs) == len(f.response_ids)
        assert all(lp <= 0.0 for lp in f.logprobs)
        if f.finish_reason == "stop":  # <eos> ends the response and stays in it
            assert f.response_ids[-1] == e.engine.eos_id and e.engine.eos_id not in f.response_ids[:-1]
        else:
            assert f.finish_reason == "length" and len(f.response_ids) == MAX_NEW
            assert e.engine.eos_id not in f.response_ids
    assert e.engine.free_slots() == SLOTS
    if e.real:  # 16 samples of 24 tokens at T=0.8 from this model: both endings occur (p(<eos>) is ~3 % a token)
        assert {f.finish_reason for f in finished} == {"stop", "length"}


def test_slots_bound_admission(e: Subject) -> None:
    for i in range(SLOTS):
        e.engine.add(rid(i), PROMPT)
    assert e.engine.free_slots() == 0 and e.engine.in_flight() == SLOTS
    with pytest.raises(EngineError, match="slots are busy"):
        e.engine.add(rid(SLOTS), PROMPT)
    e.engine.abort([rid(0)])
    if not e.real:
        return  # the modelled engine's prompts are its own, of modelled.prompt_tokens
    with pytest.raises(EngineError, match="max_prompt_len"):
        e.engine.add(rid(0), list(range(3, 3 + MAX_PROMPT + 1)))


def test_kv_usage_comes_from_the_engine(e: Subject) -> None:
    used, capacity = e.engine.kv_usage()
    assert used == 0 and capacity >= SLOTS * (len(PROMPT) + MAX_NEW)
    for i in range(4):
        e.engine.add(rid(i), PROMPT)
    if e.real:  # prefill and the first token (the modelled engine's step would run to the first sequence's end)
        e.engine.step()
        assert e.engine.in_flight() > 0
    used, _ = e.engine.kv_usage()
    # at least one sequence's prompt + 1 token is cached (vLLM's prefix cache may share the prompt's blocks)
    assert len(PROMPT) + 1 <= used <= capacity
    e.engine.abort()
    assert e.engine.kv_usage()[0] == 0


def test_abort_returns_the_state_so_far_and_frees_the_slot(e: Subject) -> None:
    for i in range(3):
        e.engine.add(rid(i), PROMPT)
    done = e.engine.step() + e.engine.step()
    alive = {r[0] for r in e.engine.snapshot_inflight()}
    victim = rid(1)
    if victim not in alive:
        pytest.skip(f"{victim} finished within two steps; nothing to abort")
    before = e.engine.in_flight()
    (row,) = e.engine.abort([victim, "g99999999/0"])  # an id not in flight is ignored
    request_id, prompt, response, logprobs = row
    assert request_id == victim and prompt == PROMPT and len(response) == len(logprobs) >= 1
    assert e.engine.in_flight() == before - 1 and e.engine.free_slots() == SLOTS - before + 1
    rest = e.drain()
    assert victim not in {f.request_id for f in done + rest}
    assert {f.request_id for f in done + rest} == {rid(0), rid(2)}


def test_a_resumed_prefix_is_kept_and_continued(e: Subject) -> None:
    e.engine.add(rid(0), PROMPT)
    for _ in range(3):
        assert not e.engine.step(), "needs a request that runs 3 steps; pick another PROMPT"
    ((_, _, prefix, prefix_lp),) = e.engine.abort()
    assert len(prefix) == len(prefix_lp) >= 3
    e.engine.add(rid(1), PROMPT, prefix_ids=prefix, prefix_logprobs=prefix_lp)
    (f,) = e.drain()
    assert f.response_ids[: len(prefix)] == prefix and f.logprobs[: len(prefix)] == prefix_lp
    assert len(prefix) < len(f.response_ids) <= MAX_NEW
    if e.real:  # the continuation was sampled given the prefix: the trainer agrees on its tokens
        g = gaps(e, [f], A, skip=len(prefix))
        assert float(g.max()) <= TOL[e.dtype][0]
    with pytest.raises(EngineError, match="equal lengths"):
        e.engine.add(rid(2), PROMPT, prefix_ids=prefix, prefix_logprobs=prefix_lp[:-1])


def test_loading_is_refused_while_sequences_are_in_flight(e: Subject) -> None:
    e.engine.add(rid(0), PROMPT)
    e.engine.step()
    if e.engine.in_flight():
        with pytest.raises(EngineError, match="in flight"):
            e.engine.load_weights(B, 1)
    assert e.engine.policy_version == 0


def test_logprobs_match_the_trainer(e: Subject) -> None:
    if not e.real:
        pytest.skip("the modelled engine records a fixed fake log-prob")
    finished = e.run(SLOTS)
    g = gaps(e, finished, A)
    max_tol, mean_tol = TOL[e.dtype]
    print(f"{e.kind}: {len(g)} tokens, max |trainer - engine| {float(g.max()):.2e}, mean {float(g.mean()):.2e}")
    assert float(g.max()) <= max_tol and float(g.mean()) <= mean_tol


def test_a_version_loads_in_place_from_a_shared_memory_segment(e: Subject) -> None:
    payload = state_dict_to_bytes(B)
    shm = shared_memory.SharedMemory(create=True, size=len(payload))
    try:
        shm.buf[: len(payload)] = payload
        tensors = state_dict_from_buffer(shm.buf[: len(payload)])  # views of the segment, no copy
        e.engine.load_weights(tensors, 1)
        del tensors
        gc.collect()
    finally:
        shm.close()
        shm.unlink()
    assert e.engine.policy_version == 1
    if not e.real:
        return
    finished = e.run(8)
    under_b, under_a = gaps(e, finished, B), gaps(e, finished, A)
    assert float(under_b.max()) <= TOL[e.dtype][0]
    print(f"{e.kind}: after loading B, mean |trainer - engine| {float(under_b.mean()):.2e} under B, "
          f"{float(under_a.mean()):.2f} under A")
    assert float(under_a.mean()) > MOVED + float(under_b.mean())  # the load took effect: A explains them badly


def test_interrupt_continues_in_flight_sequences_under_the_new_version(e: Subject) -> None:
    for i in range(4):
        e.engine.add(rid(i), PROMPT)
    early = e.engine.step() + e.engine.step() + e.engine.step()
    held = {r[0]: len(r[2]) for r in e.engine.snapshot_inflight()}
    assert held, "every request ended within 3 steps; pick another PROMPT"
    tokens = e.engine.interrupt_and_load(B, 1)
    assert e.engine.policy_version == 1 and e.engine.in_flight() == len(held)
    if e.kind != "modelled" or tokens:
        assert tokens == sum(len(PROMPT) + n for n in held.values())
    later = e.drain()
    assert {f.request_id for f in later} == set(held) and not set(held) & {f.request_id for f in early}
    if e.real:  # tokens sampled after the interrupt come from B
        for f in later:
            assert float(gaps(e, [f], B, skip=held[f.request_id]).max()) <= TOL[e.dtype][0]


# -- choosing an engine and its device (laminar/config.py, rl.factory.check_engines, rl.model.placement) --------------------------------


def test_engine_and_backend_choices_are_validated_with_the_fix_named() -> None:
    from laminar.errors import ConfigError
    from laminar.rl.factory import check_engines

    cfg = check_engines(RunConfig.load(None, ["rollout.engine=vllm"]))  # vLLM generates, the torch trainer learns
    assert (cfg.rollout.engine, cfg.trainer.engine, cfg.rollout.device, cfg.rollout.dtype) == ("vllm", "torch", "cpu",
                                                                                              "float32")
    with pytest.raises(ConfigError, match="rollout.engine='vllm' and trainer.engine='modelled' must match"):
        check_engines(RunConfig.load(None, ["rollout.engine=vllm", "trainer.engine=modelled"]))
    with pytest.raises(ConfigError, match="trainer.backend='fsdp' needs trainer.engine='torch'"):
        check_engines(RunConfig.load(None, ["rollout.engine=modelled", "trainer.engine=modelled", "trainer.backend=fsdp"]))
    with pytest.raises(ConfigError, match="rollout.device"):
        RunConfig.load(None, ["rollout.device=tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_on_a_host_without_a_gpu_is_a_config_error_naming_the_field() -> None:
    from laminar.errors import ConfigError
    from laminar.rl.model import placement

    assert placement("rollout", "cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match=r"trainer.device='cuda' but .* no CUDA device .* set trainer.device='cpu'"):
        placement("trainer", "cuda", "bfloat16")
