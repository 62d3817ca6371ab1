"""LoRA through peft: the trainer trains adapters only, and a published version is the adapter plus the base
model's fingerprint (`[trainer] lora = {r, alpha, target_modules, dropout}`, laminar/config.py LoraSection).

Interfaces
- `base_fingerprint(state) -> str`: sha256 (hex) over the base weights, name by name in sorted order (name, shape,
  float32 bytes), so a float32 trainer and a bfloat16 engine that were given the same base agree. The trainer
  computes it once, before the adapters exist; an engine computes it over the base it reads from the store.
- `attach(model, spec) -> (target, fingerprint)`: checks `spec.target_modules` against the model's linear modules
  (ConfigError naming the field, the value, and the modules the model has), freezes every base weight and injects
  peft LoRA layers in place (`peft.inject_adapter_in_model`): the model keeps its class, `forward` and
  `forward_cached`, and HfCausalLM (rl/hf_model.py) gets them on its transformers model.
- `LoraTrainer(Trainer)`: AdamW over the adapter parameters only (rl/trainer.py optimises what requires grad);
  `policy_state_dict()` is the adapter payload below; `state_parts()` = {"model": payload, "optim": the adapter
  parameters' AdamW state}; `load_state_parts` refuses a payload trained on another base.
- The payload (a flat tensor dict, so the publish path, relay chain, safetensors and checksums are unchanged):
  `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r] (peft's names without the adapter name;
  module paths are the Hugging Face ones), `lora.base_fingerprint` uint8 [64] (the fingerprint's hex digits) and
  `lora.scaling` float32 [1] (alpha / r). `is_adapter(sd)` tells a payload from full weights.
- `AdapterMerge(model, fingerprint)`: what a torch engine holds (rl/engine.py `base_fingerprint=`): a copy of the base
  weight of every module an adapter targets, taken at the first adapter; `apply(payload)` writes
  W = W_base + scaling * B @ A into the model's own parameters in place (computed in float32, stored in the model's
  dtype), so generation runs at full speed with no adapter in the forward pass. EngineError on another base.
- `merged_state_dict(base, payload)`: the full Hugging Face state dict (eval of an adapter checkpoint, merged export);
  `write_peft_adapter(out, payload, spec)`: a peft adapter directory (adapter_config.json, adapter_model.safetensors).
- The base reaches rollout replicas once per run: the trainer publishes the model's safetensors beside config.json
  (services/model_files.py `publish_base_weights`, only with LoRA on, sha256 per file); replicas read them when their
  engine is built (`load_run_base`, checked), and so do `laminar eval` and `laminar model export` of an adapter
  checkpoint (services/evaluate.py `load_checkpoint_weights`, services/export.py: a peft directory, or `--merge`).
- Engines: the torch engine merges (above); the vLLM engine (rl/vllm_engine.py) holds the base (fingerprinted by
  `files_fingerprint`) and, by rollout.lora_apply, serves each version through its LoRA request API
  (`write_peft_adapter` writes the directory it loads) or merges it (`merged_state_dict`) and reloads; both check
  the fingerprint first (`check_base`); the modelled engine ignores tensors.

Invariants (tests/test_lora.py)
1. Only adapter parameters require grad; a trainer step changes no base weight.
2. A version is applied only to the base it was trained on: fingerprints equal, else refused with the two values.
3. The engine after `apply(payload)` gives the trainer's logits (peft's unmerged forward) within float rounding.
4. A checkpoint holds the adapter and its optimizer state; a trainer restored from it on the same base continues
   exactly as the one that wrote it.

peft is imported only by `attach` and `write_peft_adapter` (the `lora` extra, and `dev`); engines need no peft.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from laminar.errors import ConfigError, EngineError
from laminar.rl.trainer import Trainer

if TYPE_CHECKING:
    from laminar.config import LoraSection, TrainerSection

FINGERPRINT_KEY = "lora.base_fingerprint"
SCALING_KEY = "lora.scaling"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def base_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) of the base weights: name, shape and float32 bytes of each tensor, names sorted."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{list(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def is_adapter(sd: Any) -> bool:
    return FINGERPRINT_KEY in sd


def fingerprint_of(sd: Any) -> str:
    return bytes(sd[FINGERPRINT_KEY].to(torch.uint8).tolist()).decode("ascii")


def adapter_pairs(sd: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A, B)} of a payload."""
    out = {}
    for key in sd:
        if key.endswith(_A):
            module = key[: -len(_A)]
            if module + _B not in sd:
                raise EngineError(f"adapter payload has {key} but no {module + _B}; the version is malformed")
            out[module] = (sd[key], sd[module + _B])
    return out


def _inner(model: nn.Module) -> nn.Module:
    """The module tree peft injects into: HfCausalLM's transformers model, else the model itself."""
    return getattr(model, "hf", model)


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear modules (what target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in _inner(model).named_modules() if isinstance(m, nn.Linear)})


def _matches(module_name: str, target: str) -> bool:
    return module_name == target or module_name.endswith("." + target)


def all_linear(model: nn.Module) -> list[str]:
    """What `["all-linear"]` adapts: the last names of every linear module but the output head (as peft's own
    "all-linear" does for a transformers model; peft cannot find the head of the built-in model, so it is named here:
    the module `get_output_embeddings()` returns, else `lm_head`)."""
    inner = _inner(model)
    head = getattr(inner, "get_output_embeddings", lambda: None)()
    names = {name.rsplit(".", 1)[-1] for name, m in inner.named_modules()
             if isinstance(m, nn.Linear) and m is not head and not _matches(name, "lm_head")}
    return sorted(names)


def check_targets(model: nn.Module, spec: LoraSection) -> None:
    """ConfigError when a target matches no linear module, or names the output head of tied embeddings."""
    if spec.target_modules == ["all-linear"]:
        return
    names = [n for n, m in _inner(model).named_modules() if isinstance(m, nn.Linear)]
    missing = [t for t in spec.target_modules if not any(_matches(n, t) for n in names)]
    if missing:
        raise ConfigError(
            f"trainer.lora.target_modules={spec.target_modules}: {missing} match no linear module of the model; its "
            f"linear modules are {linear_names(model)}; set target_modules to some of them, or ['all-linear']")
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and any(_matches("lm_head", t) for t in spec.target_modules):
        raise ConfigError(
            f"trainer.lora.target_modules={spec.target_modules}: lm_head shares its weight with the embeddings "
            "(tie_word_embeddings), so merging its adapter would change the embeddings too; leave lm_head out")


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("trainer.lora is set, but peft, which trains the adapters, is not installed where the trainer "
                          "runs: pip install 'laminar[lora]' (peft==0.21.2), or remove trainer.lora") from None
    return peft


def attach(model: nn.Module, spec: LoraSection) -> str:
    """Check the targets, fingerprint the base, freeze it and inject the adapters in place; returns the fingerprint."""
    peft = _peft()
    LoraConfig, inject_adapter_in_model = peft.LoraConfig, peft.inject_adapter_in_model

    from laminar.rl.model import model_state_dict

    check_targets(model, spec)
    fp = base_fingerprint(model_state_dict(model))
    targets = all_linear(model) if spec.target_modules == ["all-linear"] else list(spec.target_modules)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=spec.dropout,
                        bias="none")
    inject_adapter_in_model(config, _inner(model))
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return fp


def adapter_payload(model: nn.Module, fingerprint: str, scaling: float) -> dict[str, torch.Tensor]:
    """The version: adapter weights (peft's names), the base fingerprint and the scaling (detached)."""
    from peft import get_peft_model_state_dict

    sd = {k: v.detach() for k, v in get_peft_model_state_dict(_inner(model)).items()}
    sd[FINGERPRINT_KEY] = torch.tensor(list(fingerprint.encode("ascii")), dtype=torch.uint8)
    sd[SCALING_KEY] = torch.tensor([scaling], dtype=torch.float32)
    return sd


class LoraTrainer(Trainer):
    """laminar.rl.trainer.Trainer over a model with peft adapters: only they train, only they are published and saved."""

    def __init__(self, model: nn.Module, cfg: TrainerSection, **kwargs: Any):
        assert cfg.lora is not None
        self.spec = cfg.lora
        self.fingerprint = attach(model, cfg.lora)
        self.scaling = cfg.lora.alpha / cfg.lora.r
        super().__init__(model, cfg, **kwargs)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return adapter_payload(self.model, self.fingerprint, self.scaling)

    def _load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        if not is_adapter(sd):
            raise ConfigError(
                "this checkpoint holds full weights, but trainer.lora is set (an adapter checkpoint was expected); "
                "resume it without trainer.lora, or start the LoRA run afresh")
        if (got := fingerprint_of(sd)) != self.fingerprint:
            raise ConfigError(
                f"the adapter checkpoint was trained on base weights {got[:16]}.., this trainer's base is "
                f"{self.fingerprint[:16]}.. (model.path or the tiny model's settings changed); restore it on its own "
                "base model")
        adapter = {k: v for k, v in sd.items() if k not in (FINGERPRINT_KEY, SCALING_KEY)}
        result = set_peft_model_state_dict(_inner(self.model), adapter)
        if result.unexpected_keys:
            raise ConfigError(f"adapter checkpoint names modules this model's adapters lack: "
                              f"{result.unexpected_keys[:5]}; check trainer.lora.target_modules")


def version_is_adapter(sd: Any, policy_version: int, *, lora_engine: bool, build_fix: str) -> bool:
    """Whether a version an engine is given is an adapter, refusing the two mismatches: an adapter on an engine built
    without the run's base weights (build_fix: how to build it with them), full weights on a LoRA engine."""
    adapter = is_adapter(sd)
    if adapter and not lora_engine:
        raise EngineError(
            f"policy_version={policy_version} is a LoRA adapter, but this engine was built without its base "
            f"weights (trainer.lora unset where the engine was built?); build it with {build_fix}")
    if lora_engine and not adapter:
        raise EngineError(
            f"policy_version={policy_version} holds full weights, but this engine applies LoRA adapters to "
            "its base weights; a LoRA run publishes adapters only")
    return adapter


def check_base(sd: Any, fingerprint: str) -> None:
    """EngineError when an adapter payload was trained on another base than the engine's (fingerprint)."""
    got = fingerprint_of(sd)
    if got != fingerprint:
        raise EngineError(
            f"policy version was trained on base weights {got[:16]}.. but this engine holds base "
            f"{fingerprint[:16]}..; the version belongs to another base model (another run, or model.path "
            "changed): restart the replica so it reads its run's base weights")


class AdapterMerge:
    """An engine's LoRA state: the base fingerprint and the base weights of the modules adapters target."""

    def __init__(self, model: nn.Module, fingerprint: str):
        self.model, self.fingerprint = model, fingerprint
        self.params = dict(model.named_parameters())
        self.base: dict[str, torch.Tensor] = {}  # module path -> its base weight (a copy, the model's dtype)

    @torch.no_grad()
    def apply(self, sd: Any) -> None:
        check_base(sd, self.fingerprint)
        pairs = adapter_pairs(sd)
        scaling = float(sd[SCALING_KEY].reshape(-1)[0])
        if not self.base:  # the first adapter: keep the base of every module it targets
            for module in pairs:
                self.base[module] = self._weight(module).detach().clone()
        elif set(pairs) != set(self.base):
            raise EngineError(f"adapter targets {sorted(set(pairs) ^ set(self.base))[:4]} differ from the first "
                              "adapter's; a run's adapters target one set of modules")
        for module, (a, b) in pairs.items():
            w = self._weight(module)
            delta = (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)) * scaling
            w.copy_((self.base[module].float() + delta).to(w.dtype))

    def _weight(self, module: str) -> torch.Tensor:
        p = self.params.get(module + ".weight")
        if p is None:
            raise ConfigError(f"adapter targets {module}, which this engine's model has no weight of its own for (a "
                              "weight tied to another, or another architecture): every version of this run would be "
                              "refused, so the replica fails for good; leave that module out of "
                              "trainer.lora.target_modules")
        return p


def merged_state_dict(base: dict[str, torch.Tensor], payload: Any) -> dict[str, torch.Tensor]:
    """Full weights: base with every adapted matrix replaced by W + scaling * B @ A (float32 math, base dtype)."""
    out = dict(base)
    scaling = float(payload[SCALING_KEY].reshape(-1)[0])
    for module, (a, b) in adapter_pairs(payload).items():
        w = base[module + ".weight"]
        out[module + ".weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def write_peft_adapter(out: Path, payload: Any, base_model: str = "") -> Path:
    """A peft adapter directory (`PeftModel.from_pretrained(base, out)` loads it): adapter_config.json and
    adapter_model.safetensors with peft's `base_model.model.` prefix; the fingerprint goes into the metadata."""
    from safetensors.torch import save_file

    pairs = adapter_pairs(payload)
    r = next(iter(pairs.values()))[0].shape[0]
    scaling = float(payload[SCALING_KEY].reshape(-1)[0])
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{k}": v.contiguous() for k, v in payload.items()
               if k not in (FINGERPRINT_KEY, SCALING_KEY)}
    save_file(tensors, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt", "base_fingerprint": fingerprint_of(payload)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": scaling * r,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": base_model, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def load_base(model: nn.Module, base: dict[str, torch.Tensor]) -> str:
    """Copy a run's base weights (as its model directory's safetensors hold them) into `model`; returns their
    fingerprint, over the tensors the model has, at the file's precision (as the trainer computed it)."""
    from laminar.rl.model import load_model_state

    with torch.no_grad():
        load_model_state(model, base)  # the file's tensors are the model's (bar the two below): else a ConfigError
    return files_fingerprint(base, tied=bool(model.config.tie_word_embeddings))


def files_fingerprint(base: Any, *, tied: bool) -> str:
    """The fingerprint of a model directory's base weights without a model to load them into (the vLLM engine):
    over the tensors `model_state_dict` names, i.e. the files' less a tied `lm_head.weight` and rotary buffers."""
    return base_fingerprint({k: v for k, v in base.items()
                             if not k.endswith("rotary_emb.inv_freq") and not (tied and k == "lm_head.weight")})
