"""`trainer.backend = "fsdp"`: the GRPO trainer with FSDP2 (torch.distributed.fsdp.fully_shard) over N ranks.

Launch (torchrun-style ranks): the trainer worker process is rank 0, the only one that talks to Temporal and the
store. It starts ranks 1..N-1 as child processes (`python -m rl.fsdp`, environment RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT as torchrun sets them); every rank loads the same model directory, shards each decoder
layer and then the whole model with `fully_shard`, and builds the same rl.trainer.Trainer on it. Backend: gloo
on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK), with a gloo group for the commands.

Rank 0 drives: each call (`step`, `policy_state_dict`, `state_parts`, `load_state_parts`) broadcasts a command
object to the other ranks and runs the same code itself, so every rank enters the same collectives in the same
order. A step is data parallel: every rank receives the whole batch, computes the proximal log-probs and the
metrics on all of it, and takes rows rank, rank + N, ... of each minibatch for the update (rl/trainer.py); the
gradients are reduce-scattered by FSDP.

Weights leave as full tensors: `policy_state_dict` gathers them in buckets of BUCKET_BYTES (one all-gather per
parameter, at most a bucket held at a time on the device, copied to host memory on rank 0), so the publish path
and the checkpoints (safetensors + manifest in the object store) are the single-process ones.

A helper rank exits when its parent (rank 0) is gone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from laminar.config import TrainerSection
from laminar.errors import ConfigError
from laminar.records import Trajectory
from laminar.rl.model import load_pretrained, placement
from laminar.rl.trainer import Trainer, UpdateMetrics

BUCKET_BYTES = 256 << 20  # full weights gathered for publishing at most this many bytes at a time
START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(model_dir: str, section: TrainerSection, group_size: int, temperature: float, pad_id: int,
           rank: int, world: int) -> Trainer:
    """This rank's trainer on its shard of the model (same code on every rank)."""
    from torch.distributed.fsdp import fully_shard

    device, dtype = placement("trainer", section.device, section.dtype)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    model, _, _ = load_pretrained(model_dir)
    model = model.to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    trainer = Trainer(model, section, group_size=group_size, temperature=temperature, pad_id=pad_id,
                      compute_dtype=dtype)
    trainer.rank, trainer.world = rank, world
    return trainer


def _full_state(trainer: Trainer, bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on the host, Hugging Face names, lm_head omitted when tied; every rank must call
    it, rank 0 gets the tensors (the others an empty dict). Gathered parameter by parameter; the host copies are
    made once a bucket of bucket_bytes is full, so the device holds at most one bucket of gathered weights."""
    out: dict[str, torch.Tensor] = {}
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if trainer.rank == 0:
            out.update((name, t.detach().to("cpu", copy=True)) for name, t in bucket)
        bucket.clear()
        held = 0

    tied = trainer.model.config.tie_word_embeddings
    for name, p in trainer.model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        bucket.append((name, full))
        held += full.numel() * full.element_size()
        if held >= bucket_bytes:
            flush()
    flush()
    return out


def _run(trainer: Trainer, command: dict):
    """One command on this rank (every rank runs the same)."""
    op = command["op"]
    if op == "step":
        return trainer.step(command["trajectories"], command["trainer_version"])
    if op == "policy_state_dict":
        return _full_state(trainer)
    if op == "state_parts":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model = _full_state(trainer)
        osd = get_optimizer_state_dict(trainer.model, trainer.optim,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.rank != 0:  # cpu_offload: the full state is on rank 0 only
            return None
        optim = {f"{name}/{key}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone().contiguous()
                 for name, state in osd["state"].items() for key, v in state.items()}
        return {"model": model, "optim": optim}
    if op == "load_state_parts":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        parts = command["parts"]
        opts = StateDictOptions(full_state_dict=True)
        model_sd = dict(parts["model"])
        if trainer.model.config.tie_word_embeddings:
            model_sd.setdefault("lm_head.weight", model_sd["model.embed_tokens.weight"])
        set_model_state_dict(trainer.model, model_sd, options=opts)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in parts["optim"].items():
            name, _, field_name = key.rpartition("/")
            state.setdefault(name, {})[field_name] = value
        groups = [{**g, "params": list(trainer._named)} for g in trainer.optim.state_dict()["param_groups"]]
        set_optimizer_state_dict(trainer.model, trainer.optim, {"state": state, "param_groups": groups}, options=opts)
        return None
    raise ValueError(f"unknown fsdp command {op!r}")


class FsdpTrainer:
    """Rank 0 of an FSDP2 trainer: the interface of laminar.rl.trainer.Trainer, every call run on all ranks."""

    def __init__(self, model_dir: str | Path, section: TrainerSection, *, group_size: int, temperature: float = 1.0,
                 pad_id: int = 0, procs: int | None = None):
        world = int(procs or section.fsdp_procs)
        if section.device == "cuda" and torch.cuda.is_available() and world > torch.cuda.device_count():
            raise ConfigError(f"trainer.fsdp_procs={world} exceeds the {torch.cuda.device_count()} GPUs of this "
                              f"host; set trainer.fsdp_procs to at most that")
        if dist.is_initialized():
            raise ConfigError("a torch.distributed process group already exists in this process; one FsdpTrainer at "
                              "a time (close() the previous one)")
        self.world = world
        port = _free_port()
        spec = json.dumps({"model_dir": str(model_dir), "section": section.model_dump(), "group_size": group_size,
                           "temperature": temperature, "pad_id": pad_id})
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "LAMINAR_FSDP_PARENT": str(os.getpid())}
        self._procs = [subprocess.Popen([sys.executable, "-m", "laminar.rl.fsdp", spec],
                                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                       for r in range(1, world)]
        backend = "cpu:gloo,cuda:nccl" if section.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=_timeout())
        self._commands = dist.new_group(backend="gloo")
        self.inner = _build(str(model_dir), section, group_size, temperature, pad_id, 0, world)
        self.model, self.cfg = self.inner.model, section

    def _call(self, command: dict):
        dist.broadcast_object_list([command], src=0, group=self._commands)
        return _run(self.inner, command)

    def step(self, trajectories: list[Trajectory], trainer_version: int) -> UpdateMetrics:
        return self._call({"op": "step", "trajectories": trajectories, "trainer_version": trainer_version})

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call({"op": "policy_state_dict"})

    def state_parts(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._call({"op": "state_parts"})

    def load_state_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        self._call({"op": "load_state_parts", "parts": parts})

    def push_stall(self, global_sync: bool) -> float:
        return 0.0  # the relay push is the whole push

    def close(self) -> None:
        """Stop the helper ranks and leave the process group."""
        if dist.is_initialized():
            try:
                dist.broadcast_object_list([{"op": "stop"}], src=0, group=self._commands)
            finally:
                dist.destroy_process_group()
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _timeout():
    from datetime import timedelta

    return timedelta(seconds=START_TIMEOUT_S)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def main() -> None:
    """A helper rank: join the group, build the same trainer, run rank 0's commands until `stop`."""
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threading.Thread(target=_watch_parent, args=(int(os.environ["LAMINAR_FSDP_PARENT"]),), daemon=True).start()
    section = TrainerSection.model_validate(spec["section"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "cpu:gloo,cuda:nccl" if section.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=_timeout())
    commands = dist.new_group(backend="gloo")
    trainer = _build(spec["model_dir"], section, spec["group_size"], spec["temperature"], spec["pad_id"], rank, world)
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=commands)
        except RuntimeError as e:  # rank 0 is gone (its process stopped or was killed): so is this run
            print(f"laminar.rl.fsdp rank {rank}: rank 0 closed the group ({str(e)[:120]}); exiting", file=sys.stderr)
            os._exit(0)
        command = box[0]
        assert isinstance(command, dict)
        if command["op"] == "stop":
            break
        _run(trainer, command)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
