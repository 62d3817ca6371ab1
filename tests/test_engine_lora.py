"""The LoRA half of the engine contract: every engine with the `lora` trait (rl/factory.py ENGINE_TRAITS) serves a LoRA
run's versions the same way.

An engine holds the run's base weights and a version is an adapter payload (rl/lora.py): the torch engine merges it
into the base, vLLM serves it through its LoRA requests or merges it too (rl/vllm_engine.py, rollout.lora_apply). Both are judged by the trainer: the
log-prob the LoRA trainer (peft, unmerged) gives each sampled token against the one the engine recorded, within the
contract's float32 tolerance (tests/test_engine_contract.py TOL; MAX_GAP below), and a load must move the samples (the previous
version explains them worse by MOVED nats a token). The vLLM cases run in the .venv-vllm venv
(tests/test_vllm_engine.py starts them there), the cuda ones under the `gpu` marker.
"""

from __future__ import annotations

import pytest
import torch

from laminar.config import TrainerSection
from laminar.errors import EngineError
from laminar.rl.engine import TorchEngine
from laminar.rl.lora import LoraTrainer, load_base
from laminar.rl.model import build_model
from laminar.rl.trainer import Trainer
from tests.test_engine_contract import (
    EOS,
    HAS_VLLM,
    HF,
    MAX_NEW,
    MAX_PROMPT,
    MOVED,
    PROMPT,
    SLOTS,
    TEMPERATURE,
    TOL,
    A,
    close_engine,
    needs_cuda,
    needs_vllm,
    rid,
    trajectories,
)

pytest.importorskip("peft")

RANK = 8
LORA = {"r": RANK, "alpha": 2.0 * RANK, "target_modules": ["all-linear"]}
# |trainer - engine| log-prob per token, float32: the contract's mean (1e-4), twice its max. The trainer computes
# x W + s (x A^T) B^T (peft, unmerged); a merging engine rounds W + s B A to float32 once per element first, and these
# adapters are as large as the weights (ADAPTER_STD), so the two orders differ by more. Measured: torch merge max
# 6.1e-5, vLLM adapter 6.5e-5, vLLM merge 1.03e-4; means 2.4e-6 to 4.2e-6.
MAX_GAP, MEAN_GAP = 2 * TOL[torch.float32][0], TOL[torch.float32][1]
ADAPTER_STD = 0.2  # lora_A and lora_B drawn at this std: B starts at zero in training, which would move nothing

ENGINES = [
    pytest.param("torch-cpu"),
    pytest.param("torch-cuda", marks=[pytest.mark.gpu, needs_cuda]),
    pytest.param("vllm-cpu", marks=needs_vllm),  # vLLM's LoRA requests
    pytest.param("vllm-cpu-merge", marks=needs_vllm),  # merged into vLLM's weights (rollout.lora_apply)
    pytest.param("vllm-cuda", marks=[pytest.mark.gpu, needs_cuda, needs_vllm]),
    pytest.param("vllm-cuda-merge", marks=[pytest.mark.gpu, needs_cuda, needs_vllm]),
]


def adapter_trainer(adapter_seed: int, base_seed: int = 0) -> LoraTrainer:
    """A LoRA trainer on the base build_model(HF, seed=base_seed) whose adapters are drawn with adapter_seed."""
    trainer = LoraTrainer(build_model(HF, seed=base_seed), TrainerSection(lora=LORA), group_size=2,
                          temperature=TEMPERATURE)
    g = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * ADAPTER_STD)
    return trainer


V1, V2 = adapter_trainer(1), adapter_trainer(2)


class LoraSubject:
    def __init__(self, kind: str):
        self.kind = kind
        self.device = "cuda" if "cuda" in kind else "cpu"
        if kind.startswith("torch"):
            model = build_model(HF, seed=99).to(self.device)  # its own init, overwritten by the base (rl/factory.py)
            self.engine = TorchEngine(model, None, max_inflight_seqs=SLOTS, max_new_tokens=MAX_NEW,
                                      temperature=TEMPERATURE, seed=0, eos_id=EOS, max_prompt_len=MAX_PROMPT,
                                      base_fingerprint=load_base(model, A))
        else:
            from laminar.rl.vllm_engine import VllmEngine

            self.engine = VllmEngine(HF, max_inflight_seqs=SLOTS, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                                     seed=0, eos_id=EOS, max_prompt_len=MAX_PROMPT, device=self.device,
                                     dtype="float32", base=A, lora_rank=RANK, lora_merge=kind.endswith("merge"))
        self.engine.load_weights(V1.policy_state_dict(), 1)

    def run(self, n: int) -> list:
        for i in range(n):
            self.engine.add(rid(i), PROMPT)
        out = []
        for _ in range(4 * MAX_NEW):
            if not self.engine.in_flight():
                break
            out += self.engine.step()
        assert self.engine.in_flight() == 0 and len(out) == n
        return out


def gaps(trainer: Trainer, finished: list, skip: int = 0) -> torch.Tensor:
    """|trainer log-prob - engine log-prob| of each response token from index `skip` on."""
    rows = trainer.response_logprobs(trajectories(finished))
    return torch.tensor([abs(t - e) for f, row in zip(finished, rows, strict=True)
                         for t, e in zip(row[skip:], f.logprobs[skip:], strict=True)])


BASE = Trainer(build_model(HF, seed=0), TrainerSection(), group_size=2, temperature=TEMPERATURE)


@pytest.fixture(scope="module", params=ENGINES)
def subject(request):
    s = LoraSubject(request.param)
    yield s
    close_engine(s.engine)


@pytest.fixture
def e(subject):
    """The module's engine serving adapter V1 (version 1), nothing in flight."""
    subject.engine.abort()
    if subject.engine.policy_version != 1:
        subject.engine.load_weights(V1.policy_state_dict(), 1)
    yield subject
    subject.engine.abort()


def test_an_adapter_version_gives_the_lora_trainer_s_logprobs(e: LoraSubject) -> None:
    finished = e.run(SLOTS)
    under_v1, under_base = gaps(V1, finished), gaps(BASE, finished)
    print(f"{e.kind} LoRA: {len(under_v1)} tokens, max |trainer - engine| {float(under_v1.max()):.2e}, mean "
          f"{float(under_v1.mean()):.2e}; {float(under_base.mean()):.2f} under the base alone")
    assert float(under_v1.max()) <= MAX_GAP and float(under_v1.mean()) <= MEAN_GAP
    assert float(under_base.mean()) > MOVED + float(under_v1.mean())  # the adapter is applied, not the base alone


def test_a_new_version_replaces_the_adapter_rather_than_adding_to_it(e: LoraSubject) -> None:
    e.engine.load_weights(V2.policy_state_dict(), 2)
    assert e.engine.policy_version == 2
    finished = e.run(8)
    under_v2, under_v1 = gaps(V2, finished), gaps(V1, finished)
    assert float(under_v2.max()) <= MAX_GAP
    assert float(under_v1.mean()) > MOVED + float(under_v2.mean())
    # the same version number again with other weights (a trainer restored from a checkpoint publishes it anew)
    e.engine.load_weights(V1.policy_state_dict(), 2)
    assert float(gaps(V1, e.run(4)).max()) <= MAX_GAP


def test_a_version_of_another_base_or_full_weights_is_refused_and_the_old_one_still_serves(e: LoraSubject) -> None:
    other = adapter_trainer(1, base_seed=1)  # the same adapter seed on another base: only the fingerprint differs
    with pytest.raises(EngineError, match="belongs to another base model"):
        e.engine.load_weights(other.policy_state_dict(), 5)
    with pytest.raises(EngineError, match="holds full weights"):
        e.engine.load_weights(A, 5)
    assert e.engine.policy_version == 1
    assert float(gaps(V1, e.run(4)).max()) <= MAX_GAP


def test_interrupted_sequences_continue_under_the_new_adapter(e: LoraSubject) -> None:
    for i in range(4):
        e.engine.add(rid(i), PROMPT)
    early = e.engine.step() + e.engine.step() + e.engine.step()
    held = {r[0]: len(r[2]) for r in e.engine.snapshot_inflight()}
    assert held, "every request ended within 3 steps"
    e.engine.interrupt_and_load(V2.policy_state_dict(), 2)
    assert e.engine.policy_version == 2 and e.engine.in_flight() == len(held)
    later = []
    for _ in range(4 * MAX_NEW):
        if not e.engine.in_flight():
            break
        later += e.engine.step()
    assert {f.request_id for f in later} == set(held) and not set(held) & {f.request_id for f in early}
    for f in later:  # the tokens sampled after the interrupt come from V2
        assert float(gaps(V2, [f], skip=held[f.request_id]).max()) <= MAX_GAP


def test_the_factory_builds_every_lora_engine_and_refuses_a_rank_vllm_cannot_serve() -> None:
    from laminar.config import RunConfig
    from laminar.errors import ConfigError
    from laminar.rl.factory import ENGINE_TRAITS, check_engines

    lora = ['trainer.lora={"r": 8, "alpha": 16, "target_modules": ["q_proj"]}']
    assert sorted(n for n, t in ENGINE_TRAITS.items() if t.lora) == ["torch", "vllm"]
    for engine in ("torch", "vllm"):
        check_engines(RunConfig.load(None, [f"rollout.engine={engine}", *lora]))
    with pytest.raises(ConfigError, match="trainer.lora with rollout.engine='modelled'"):
        check_engines(RunConfig.load(None, ["rollout.engine=modelled", "trainer.engine=modelled", *lora]))
    # rollout.lora_apply: auto merges on CPU (vLLM's CPU LoRA kernels decode 3.7x slower), serves adapters on CUDA
    from laminar.rl.factory import lora_merges

    for apply, device, merges in [("auto", "cpu", True), ("auto", "cuda", False), ("adapter", "cpu", False),
                                  ("merge", "cuda", True)]:
        cfg = RunConfig.load(None, [f"rollout.lora_apply={apply}", *lora])
        assert lora_merges(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"device": device})})) \
            is merges, (apply, device)
    with pytest.raises(ConfigError, match="rollout.lora_apply"):
        RunConfig.load(None, ["rollout.lora_apply=sometimes"])
    with pytest.raises(ConfigError, match="rollout.lora_apply='adapter' with rollout.engine='torch'"):
        check_engines(RunConfig.load(None, ["rollout.lora_apply=adapter", *lora]))
    check_engines(RunConfig.load(None, ["rollout.lora_apply=merge", *lora]))  # what the torch engine does anyway
    if not HAS_VLLM:  # the rank check lives in the vLLM engine (tests/test_vllm_engine.py runs this in .venv-vllm)
        return
    from laminar.rl.vllm_engine import VllmEngine

    with pytest.raises(ConfigError, match=r"trainer.lora.r=600 .* at most 512"):
        VllmEngine(HF, max_inflight_seqs=2, max_new_tokens=4, temperature=1.0, seed=0, eos_id=EOS, base=A,
                   lora_rank=600)
