"""One training step of a pretrained-model run config, piece by piece, against its arithmetic lower bound.

    python -m bench.step_bounds examples/smollm2_math.toml [--section.key=value ...] [--json OUT]

In one process with one torch thread (as each worker process runs: workers/processes.py), with the run's own code:

- the machine's rates: float32 matmul GFLOP/s on the model's own shapes, and memory bandwidth (a large tensor
  copy, bytes read + written per second);
- generation: `groups_per_step` prompts of the task's training stream, `group_size` samples each, on the torch
  engine with the replica's slots (rollout.max_inflight_groups x group_size), until every sample finished;
- scoring: the task's reward on every response (envs/tasks/scoring.py's runner, as a replica scores);
- the trainer's step (rl/trainer.py) on those samples, split into the optimizer (AdamW step, timed by torch's
  optimizer step hooks) and everything else (forward, backward, loss, gradient clipping);
- the weight payload: the published state dict serialised as the trainer does (safetensors, rl/model.py).

Lower bounds: matmul FLOPs at the measured rate (2 x matmul parameters per token forward, 6 x for forward and
backward; attention's own FLOPs are left out, a few percent at these lengths), bytes at the measured bandwidth
(each decode step reads every weight once; AdamW reads parameter, gradient and two moments and writes three; the
payload is written once and read once). A piece's bound is the larger of the two. On CPU the rates and each piece
are measured in CPU seconds of this process (time.process_time), so the ratio holds on a shared machine where wall
seconds do not (both are printed); on a GPU in wall seconds. What the run adds around these
(relay push, control-plane waits, checkpoints) is in the run's own profile (`laminar run` prints it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

MATMUL_S = 2.0  # seconds each rate is measured for
BANDWIDTH_BYTES = 256 * 2**20  # the tensor the bandwidth copy moves (bytes)


def _clock(device: str):
    """CPU seconds of this process on CPU (what a piece costs whatever else shares the cores), wall seconds on a
    GPU (the device works while the host waits)."""
    return time.perf_counter if device.startswith("cuda") else time.process_time


class Timer:
    """Wall and CPU seconds of a block."""

    def __enter__(self) -> Timer:
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(k: int, n: int, m: int = 2048, seconds: float = MATMUL_S, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of [m, k] @ [k, n] in this process."""
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    _sync(device)
    clock = _clock(device)
    reps, t0 = 0, clock()
    while clock() - t0 < seconds:
        torch.mm(a, b)
        reps += 1
        if reps % 16 == 0:
            _sync(device)
    _sync(device)
    return 2.0 * m * k * n * reps / (clock() - t0) / 1e9


def bandwidth(nbytes: int = BANDWIDTH_BYTES, seconds: float = MATMUL_S, device: str = "cpu") -> float:
    """Bytes per second of a tensor copy, counting the bytes read and the bytes written."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    clock = _clock(device)
    reps, t0 = 0, clock()
    while clock() - t0 < seconds:
        dst.copy_(src)
        reps += 1
    _sync(device)
    return 2.0 * nbytes * reps / (clock() - t0)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul per token: every Linear weight, and the output head (the tied
    embedding counted once as the head; the embedding lookup itself is a gather)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads = [m for name, m in model.named_modules() if name.endswith("lm_head") and isinstance(m, torch.nn.Linear)]
    if not heads:  # a tied head that is no Linear module: the embedding's matrix does the head's matmul
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        linear += emb.weight.numel() if emb is not None else 0
    return linear


def profile_step(cfg: Any, threads: int = 1, device: str = "cpu") -> dict[str, Any]:
    from laminar.envs.tasks.scoring import RewardRunner
    from laminar.policy import policy_for, staleness_bound
    from laminar.records import Trajectory
    from laminar.rl.factory import build_local_engine, build_trainer
    from laminar.rl.model import state_dict_to_bytes
    from laminar.services.evaluate import load_policy

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.run.seed)
    model, tokenizer, task, _ = load_policy(None, cfg, cfg.model.path)  # a model directory: no store is read
    model = model.to(device)
    hidden = model.config.hidden_size if hasattr(model, "config") else 576
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    rates = {"matmul_gflops": round(matmul_rate(hidden, inter, device=device), 1),
             "bandwidth_gbs": round(bandwidth(device=device) / 1e9, 2)}
    flops_s, bytes_s = rates["matmul_gflops"] * 1e9, rates["bandwidth_gbs"] * 1e9
    p_mm = matmul_params(model)
    p_all = sum(p.numel() for p in model.parameters())
    weight_bytes = 4 * p_all

    r, t = cfg.rollout, cfg.trainer
    prompts = [task.prompt(i) for i in range(t.groups_per_step)]
    engine = build_local_engine(model, tokenizer, max_inflight_seqs=r.max_inflight_groups * r.group_size,
                                max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=cfg.run.seed,
                                eos_id=task.eos_id, max_prompt_len=r.max_prompt_len)
    engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, 0)
    for g, p in enumerate(prompts):
        for i in range(r.group_size):
            engine.add(f"{g}/{i}", p.token_ids)
    finished, decode_steps = [], 0
    with Timer() as gen, torch.no_grad():
        while engine.in_flight():
            finished += engine.step()
            decode_steps += 1
        _sync(device)
    prompt_tokens = sum(len(f.prompt_ids) for f in finished)
    new_tokens = sum(len(f.response_ids) for f in finished)

    runner = RewardRunner(cfg.task.reward_timeout_s)
    with Timer() as score:
        rewards = [runner.score(task, prompts[int(f.request_id.split("/")[0])], f.response_ids) for f in finished]

    now = time.time()
    trajectories = [Trajectory(run_id="bench", prompt_id=int(f.request_id.split("/")[0]),
                               group_id=f.request_id.split("/")[0], sample_index=int(f.request_id.split("/")[1]),
                               prompt_ids=f.prompt_ids, response_ids=f.response_ids, logprobs=f.logprobs,
                               reward=float(rw), policy_version=0, replica_id="bench", started_at=now, ended_at=now,
                               finish_reason=f.finish_reason) for f, rw in zip(finished, rewards, strict=True)]
    # the trainer a run builds (its own copy of the weights, as a run's trainer process has), on `device`
    on_device = cfg.model_copy(update={"trainer": t.model_copy(update={"device": device})})
    trainer = build_trainer(on_device, policy=policy_for(cfg), max_staleness=staleness_bound(cfg),
                            model_dir=lambda: Path(cfg.model.path))
    opt: dict[str, float] = {"wall": 0.0, "cpu": 0.0, "n": 0}
    marks: list[tuple[float, float]] = []

    def before(*_: object) -> None:
        _sync(device)
        marks.append((time.perf_counter(), time.process_time()))

    def after(*_: object) -> None:
        _sync(device)
        opt["wall"] += time.perf_counter() - marks[-1][0]
        opt["cpu"] += time.process_time() - marks[-1][1]
        opt["n"] += 1

    trainer.optim.register_step_pre_hook(before)  # torch's own optimizer hooks: the AdamW step alone
    trainer.optim.register_step_post_hook(after)
    with Timer() as train:
        trainer.step(trajectories, trainer_version=0)
        _sync(device)
    peak_rss = _peak_rss_mib()  # the process's high-water mark, the trainer step's tensors included
    train_tokens = sum(len(x.prompt_ids) + len(x.response_ids) for x in trajectories)
    trainable = sum(p.numel() for p in trainer._named.values())

    with Timer() as pay:
        payload = state_dict_to_bytes(trainer.policy_state_dict())

    on_gpu = device.startswith("cuda")

    def row(name: str, wall: float, cpu: float, flops: float, nbytes: float, what: str) -> dict[str, Any]:
        bound = max(flops / flops_s, nbytes / bytes_s)
        cost = wall if on_gpu else cpu  # what the bound is compared with (clock above)
        return {"piece": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "bound_s": round(bound, 3),
                "ratio": round(cost / bound, 1) if bound > 0 else None, "work": what}

    rows = [
        row("generation", gen.wall, gen.cpu, 2 * p_mm * (prompt_tokens + new_tokens), weight_bytes * decode_steps,
            f"{len(finished)} samples, {prompt_tokens} prompt + {new_tokens} new tokens, {decode_steps} decode steps"),
        row("scoring", score.wall, score.cpu, 0, 0, f"{len(finished)} rewards"),
        row("trainer forward+backward", train.wall - opt["wall"], train.cpu - opt["cpu"], 6 * p_mm * train_tokens,
            0, f"{train_tokens} tokens x {p_mm / 1e6:.1f}M matmul parameters"),
        row("optimizer (AdamW)", opt["wall"], opt["cpu"], 0, 7 * 4 * trainable * max(1, int(opt["n"])),
            f"{int(opt['n'])} update(s) of {trainable / 1e6:.1f}M parameters"),
        row("weight payload (serialise)", pay.wall, pay.cpu, 0, 2 * len(payload), f"{len(payload) / 2**20:.0f} MiB"),
    ]
    return {"threads": threads, "device": device, "rates": rates, "parameters": p_all, "matmul_parameters": p_mm,
            "reward_mean": round(sum(rewards) / len(rewards), 3), "load_avg": _loadavg(),
            "peak_rss_mib_after_train_step": peak_rss, "rows": rows}


def _peak_rss_mib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # kB on Linux


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "-"


def format_table(result: dict[str, Any]) -> str:
    r = result["rates"]
    lines = [f"{result['device']}, {result['threads']} torch thread(s): float32 matmul {r['matmul_gflops']} GFLOP/s, memory "
             f"{r['bandwidth_gbs']} GB/s; {result['parameters'] / 1e6:.1f}M parameters "
             f"({result['matmul_parameters'] / 1e6:.1f}M in matmuls)",
             f"load average {result['load_avg']}; peak RSS after the trainer step "
             f"{result['peak_rss_mib_after_train_step']} MiB; reward mean {result['reward_mean']}",
             "| piece | wall s | CPU s | lower bound s | measured / bound | work |",
             "| --- | --- | --- | --- | --- | --- |"]
    for x in result["rows"]:
        ratio = "-" if x["ratio"] is None else f"{x['ratio']}"
        lines.append(f"| {x['piece']} | {x['wall_s']} | {x['cpu_s']} | {x['bound_s']} | {ratio} | {x['work']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from laminar.config import RunConfig

    ap = argparse.ArgumentParser(prog="python -m laminar.bench.step_bounds", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker process runs with 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the GPU's rates; the trainer in float32)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args, overrides = ap.parse_known_args(argv)
    cfg = RunConfig.load(args.config, overrides)
    if not cfg.model.path or not Path(cfg.model.path).is_dir():
        raise SystemExit(f"model.path={cfg.model.path!r} is not a model directory; `laminar model import-gguf "
                         "--out <model.path>` (or one `laminar run` of the config) makes it")
    result = profile_step(cfg, args.threads, args.device)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
