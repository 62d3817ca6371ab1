"""A Llama / Qwen2 / Qwen3-style causal LM in plain torch, configured from a Hugging Face config.json.

Parameter names equal the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...), so a
real checkpoint directory (config.json + *.safetensors + tokenizer.json) loads through the same code
as the tiny CPU default. Weights are stored and shipped as safetensors only, never pickle.

Two forward paths:
- `forward(input_ids, attention_mask)`: full sequences (training, log-prob recomputation).
- `forward_cached(input_ids, positions, cache, slots, kv_len)`: writes keys/values into a `KVCache`
  at (slot, position) and attends over the slot's cached prefix (engine prefill and decode).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load, load_file, save, save_file
from torch import nn

from laminar.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face Llama/Qwen2/Qwen3 config.json this model understands. qk_norm: Qwen3's
    RMSNorm over each head's queries and keys before the rotation; rope_llama3: Llama 3.x's rope scaling
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), None without it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    raw: dict[str, Any]
    qk_norm: bool = False
    rope_llama3: tuple[float, float, float, int] | None = None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in BUILTIN_TYPES:
            raise ConfigError(f"config.json model_type={model_type!r} is not supported; use llama, qwen2 or qwen3")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "llama3"):
            raise ConfigError(f"config.json rope type {rope_type!r} is not supported by the built-in model (default "
                              "or llama3 are); this model needs a rope_scaling the fast path does not implement")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            attention_bias = bool(d.get("attention_bias", False))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                # transformers 5 writes it inside rope_parameters (SmolLM2: 100000), 4.x at the top level
                rope_theta=float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and none on o_proj; Llama's and Qwen3's attention_bias covers all four.
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                raw=dict(d),
                qk_norm=model_type == "qwen3",
                rope_llama3=(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                             int(rope["original_max_position_embeddings"])) if rope_type == "llama3" else None,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from None


BUILTIN_TYPES = ("llama", "qwen2", "qwen3")


def inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Rope inverse frequencies theta^(-2i/d), float32; with Llama 3.x scaling (transformers' `llama3` rope
    type): wavelengths 2 pi / f above original_max / low_freq_factor are divided by factor, those below
    original_max / high_freq_factor kept, and those between interpolated with s = (original_max / wavelength -
    low) / (high - low): f' = (1 - s) f / factor + s f."""
    d = cfg.head_dim
    f = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / d))
    if cfg.rope_llama3 is None:
        return f
    factor, low, high, old_len = cfg.rope_llama3
    wavelen = 2 * math.pi / f
    scaled = torch.where(wavelen > old_len / low, f / factor, f)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class KVCache:
    """Preallocated per-slot keys and values: k, v are [layers, slots, kv_heads, max_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.max_len = max_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face `rotate_half` convention. x: [B, H, T, D]; cos/sin: [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of queries and keys, before the rotation
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, mask, cache_kv=None, slots=None, positions=None, kv_len=0):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d)
        k = self.k_proj(x).view(b, t, self.kvh, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kvh, self.d).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache_kv is not None:
            ck, cv = cache_kv  # [slots, kvh, max_len, d]
            idx = (slots[:, None], slice(None), positions)  # advanced dims first: [B, T, kvh, d]
            ck[idx] = k.transpose(1, 2).to(ck.dtype)
            cv[idx] = v.transpose(1, 2).to(cv.dtype)
            k, v = ck[slots, :, :kv_len].to(q.dtype), cv[slots, :, :kv_len].to(q.dtype)
        if self.kvh != self.h:
            k = k.repeat_interleave(self.h // self.kvh, dim=1)
            v = v.repeat_interleave(self.h // self.kvh, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, **cache_args):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, **cache_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama/Qwen2/Qwen3 decoder-only LM; `state_dict()` keys match Hugging Face checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        freq = self.inv_freq
        if freq.dtype != torch.float32:  # model.to(bfloat16) cast the buffer; rounded, it shifts the angles
            freq = inv_freq(self.config, positions.device)
        freqs = positions[..., None].float() * freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, input_ids, positions, mask, cache=None, slots=None, kv_len=0):
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope_tables(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            extra = {}
            if cache is not None:
                extra = dict(
                    cache_kv=(cache.k[i], cache.v[i]), slots=slots, positions=positions, kv_len=kv_len
                )
            x = layer(x, cos, sin, mask, **extra)
        return self.lm_head(self.model.norm(x)).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence logits [B, T, V] (float32). attention_mask [B, T]: 1 real token, 0 padding."""
        b, t = input_ids.shape
        dev = input_ids.device
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        if attention_mask is None:
            positions = torch.arange(t, device=dev).expand(b, t)
            mask = causal[None, None]
        else:
            am = attention_mask.bool()
            positions = (am.long().cumsum(-1) - 1).clamp(min=0)
            # A query always sees itself, so fully padded rows never produce NaN.
            mask = (causal[None] & am[:, None, :]) | torch.eye(t, dtype=torch.bool, device=dev)[None]
            mask = mask[:, None]
        return self._run(input_ids, positions, mask)

    def forward_cached(self, input_ids, positions, cache: KVCache, slots, kv_len: int) -> torch.Tensor:
        """Write k/v of `input_ids` [B, T] at (slots[b], positions[b, t]); attend over cached [0, kv_len).

        A query at position p sees cached keys at positions <= p of its own slot. Returns [B, T, V].
        """
        key_pos = torch.arange(kv_len, device=input_ids.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, kv_len]
        return self._run(input_ids, positions, mask, cache=cache, slots=slots, kv_len=kv_len)


def is_builtin(hf_config: dict[str, Any]) -> bool:
    """Whether the built-in model covers this config.json (else transformers does)."""
    return hf_config.get("model_type", "llama") in BUILTIN_TYPES


def build_model(hf_config: dict[str, Any], seed: int | None = None) -> CausalLM:
    """A freshly initialised model (normal(0, 0.02) linear/embedding weights, as Hugging Face does). An
    architecture other than Llama/Qwen2/Qwen3 is built by transformers (rl/hf_model.py)."""
    if not is_builtin(hf_config):
        from laminar.rl.hf_model import build_hf_model

        return build_hf_model(hf_config, seed)  # type: ignore[return-value]
    cfg = ModelConfig.from_hf(hf_config)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    model = CausalLM(cfg)
    std = float(hf_config.get("initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm: layernorms, the final norm, Qwen3's q/k norms
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.mul_(1.0 / math.sqrt(2 * cfg.num_hidden_layers))
    dtype = _DTYPES.get(str(hf_config.get("torch_dtype", "float32")), torch.float32)
    return model.to(dtype)


def model_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors; `lm_head.weight` omitted when tied (as Hugging Face saves it)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def load_model_state(model: CausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Copy tensors in place; every parameter must be present (lm_head.weight may be absent if tied)."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if model.config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    unexpected = [u for u in unexpected if not u.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ConfigError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "check that config.json belongs to these safetensors"
        )


def state_dict_to_bytes(sd: dict[str, torch.Tensor]) -> bytes:
    """Serialise a tensor dict with safetensors (how weights travel through relays)."""
    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        t = v.detach().cpu().contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
            t = t.clone()
        seen.add(t.data_ptr())
        out[k] = t
    return save(out)


def bytes_to_state_dict(b: bytes) -> dict[str, torch.Tensor]:
    return load(b)


def save_pretrained(model: CausalLM, tokenizer, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and tokenizer.json (a standard Hugging Face directory)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model_state_dict(model).items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(model.config.raw)
    raw["torch_dtype"] = {v: k for k, v in _DTYPES.items()}[next(model.parameters()).dtype]
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def load_pretrained(model_dir: str | Path, dtype: torch.dtype | None = torch.float32):
    """Load a Hugging Face model directory -> (model, tokenizer, hf_config dict).

    dtype: the compute dtype (float32 on CPU by default); None keeps config.json's torch_dtype.
    Sharded checkpoints (model.safetensors.index.json) are supported.
    """
    from tokenizers import Tokenizer

    d = Path(model_dir)
    if not (d / "config.json").exists():
        raise ConfigError(f"model directory {d} has no config.json; pass a Hugging Face model directory")
    hf = json.loads((d / "config.json").read_text())
    if not is_builtin(hf):  # any other Hugging Face causal LM: through transformers (rl/hf_model.py)
        from laminar.rl.hf_model import load_hf_pretrained

        hf_model = load_hf_pretrained(d, hf, dtype)
        if not (d / "tokenizer.json").exists():
            raise ConfigError(f"model directory {d} has no tokenizer.json")
        return hf_model, Tokenizer.from_file(str(d / "tokenizer.json")), hf
    model = CausalLM(ModelConfig.from_hf(hf))
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(d / f)))
    target = dtype or _DTYPES.get(str(hf.get("torch_dtype", "float32")), torch.float32)
    model = model.to(target)
    load_model_state(model, sd)
    tok_path = d / "tokenizer.json"
    if not tok_path.exists():
        raise ConfigError(f"model directory {d} has no tokenizer.json")
    return model.eval(), Tokenizer.from_file(str(tok_path)), hf


def placement(field: str, device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """(torch device, torch dtype) for `<field>.device` and `<field>.dtype` of the run config; ConfigError when
    the device is not there (e.g. cuda on a machine without a GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{field}.device='cuda' but torch {torch.__version__} sees no CUDA device on this host; set "
            f"{field}.device='cpu' (and {field}.dtype='float32'), or run this worker on a GPU host"
        )
    if dtype not in _DTYPES:
        raise ConfigError(f"{field}.dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    return torch.device(device), _DTYPES[dtype]


class DeviceSlots:
    """Which of a process's CUDA devices each of its replicas uses: one each while there are enough (a rollout
    worker placed by Ray sees exactly the GPUs it reserved, one per replica, through CUDA_VISIBLE_DEVICES), the
    least used one once there are more replicas than devices. Thread-safe: replicas start in their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[int, int] = {}  # device index -> replicas on it

    def acquire(self, devices: int) -> int:
        if devices < 1:
            raise ValueError(f"devices={devices}: a replica needs at least one CUDA device")
        with self._lock:
            index = min(range(devices), key=lambda i: (self._users.get(i, 0), i))
            self._users[index] = self._users.get(index, 0) + 1
            return index

    def release(self, index: int) -> None:
        with self._lock:
            left = self._users.get(index, 0) - 1
            if left > 0:
                self._users[index] = left
            else:
                self._users.pop(index, None)


ROLLOUT_DEVICES = DeviceSlots()  # this process's rollout replicas (taken by rl/factory.py, given back at close)

