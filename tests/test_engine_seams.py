"""The engine and trainer seams: rl/factory.py is the one place that maps engine names to classes.

(a) no module outside rl/ compares to an engine name, asks isinstance of an engine or trainer class, or
    hasattr/getattr of an engine or trainer (laminar/config.py declares the names as data: Literal types and
    the pairing tables, which are no comparisons);
(b) no function of services/rollout/ is over 40 lines;
(c) every engine and trainer the factories build implements its protocol in full (rl/engine_api.py).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import typing
from pathlib import Path

import pytest

from laminar.config import RolloutEngine, RunConfig
from laminar.policy import policy_for
from rl.engine_api import Engine, PolicyTrainer
from rl.factory import ENGINE_TRAITS, build_engine, build_trainer
from services.model_files import load_run_files, publish_model_files, resolve_model_dir
from storage.objects import open_store

ROOT = Path(__file__).resolve().parent.parent
NAMES = set(typing.get_args(RolloutEngine))  # torch, modelled, vllm (trainer engines are a subset)
CLASSES = {"TorchEngine", "ModelledEngine", "VllmEngine", "Trainer", "FsdpTrainer", "ModelledTrainer"}
SKIP_DIRS = {"rl", "tests", "build", "dist", "node_modules", "__pycache__"}


def _modules() -> list[Path]:
    out = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIP_DIRS or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        out.append(path)
    return out


def _names_in(node: ast.AST) -> bool:
    """An engine name as a string constant, alone or in a tuple/list/set literal."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(isinstance(i, ast.Constant) and i.value in NAMES for i in items)


def _seam_breaks(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(n) for n in [node.left, *node.comparators]):
            found.append((node.lineno, "compares to an engine name"))
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(ast.unparse(c).rsplit(".", 1)[-1] in CLASSES for c in classes):
                found.append((node.lineno, "isinstance on an engine/trainer class"))
        if node.func.id in ("hasattr", "getattr") and any(
                w in ast.unparse(node.args[0]).lower() for w in ("engine", "trainer")):
            found.append((node.lineno, f"{node.func.id} on an engine/trainer"))
    return found


def test_no_module_outside_rl_special_cases_an_engine_or_trainer():
    modules = _modules()
    assert len(modules) > 50  # the walk found the project (services/, workers/, workflows/, ...)
    breaks = [f"{p.relative_to(ROOT)}:{line}: {why}" for p in modules
              for line, why in _seam_breaks(ast.parse(p.read_text(), str(p)))]
    assert breaks == [], "ask rl.factory (build_engine, build_trainer, engine_traits) instead:\n" + "\n".join(breaks)


def test_the_seam_check_catches_each_kind_of_special_case():
    # the check above must be able to fail: each line below is one special case it has to report
    code = ('if cfg.rollout.engine == "vllm": pass\n'
            'if engine not in ("modelled", "torch"): pass\n'
            'isinstance(self.trainer, ModelledTrainer)\n'
            'hasattr(self.engine, "close")\n'
            'getattr(engine, "device", None)\n'
            'if cfg.rollout.device == "cuda": pass\n')  # not an engine name: allowed
    assert [line for line, _ in _seam_breaks(ast.parse(code))] == [1, 2, 3, 4, 5]


def test_no_function_in_the_rollout_package_is_over_40_lines():
    files = sorted((ROOT / "services" / "rollout").glob("*.py"))
    assert len(files) >= 5
    long = [f"{f.name}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines" for f in files
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 40]
    assert long == []


# -- protocol conformance --------------------------------------------------------------------------------


def _members(protocol: type) -> dict[str, inspect.Signature | None]:
    """The protocol's methods (name -> signature) and data members (name -> None)."""
    out: dict[str, inspect.Signature | None] = {}
    for name in [*protocol.__annotations__, *vars(protocol)]:
        value = vars(protocol).get(name)
        if name.startswith("_"):
            continue
        out[name] = inspect.signature(value) if callable(value) else None
    return out


def _assert_implements(obj: object, protocol: type) -> None:
    for name, sig in _members(protocol).items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if sig is None:
            continue
        have = inspect.signature(getattr(obj, name)).parameters
        for p in list(sig.parameters.values())[1:]:  # past self
            assert p.name in have and have[p.name].kind == p.kind, (
                f"{type(obj).__name__}.{name} lacks parameter {p.name!r} ({p.kind.description})")
    assert isinstance(obj, protocol)


def _cfg(engine: str) -> RunConfig:
    trainer = "modelled" if engine == "modelled" else "torch"
    # head_dim 64 (128 / 2): vLLM's CPU attention has a kernel for it (examples/vllm.toml)
    return RunConfig.load(None, ["model.pretrain_steps=0", "model.hidden_size=128", "model.num_heads=2",
                                 "model.num_kv_heads=1", "rollout.group_size=2", "rollout.max_inflight_groups=2",
                                 f"rollout.engine={engine}", f"trainer.engine={trainer}"]).with_run_id("seams")


@pytest.mark.parametrize("engine", sorted(NAMES))
def test_every_engine_the_factory_builds_implements_the_engine_protocol(engine, tmp_path):
    assert set(ENGINE_TRAITS) == NAMES  # every declared engine has its traits
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this venv; tests/test_vllm_engine.py runs the contract in .venv-vllm")
    cfg = _cfg(engine)
    store = open_store((tmp_path / "store").as_uri())
    publish_model_files(store, "seams", resolve_model_dir(_cfg("torch"), tmp_path))  # the modelled one reads none
    built, task = build_engine(cfg, policy=policy_for(cfg), seed=0,
                               run_files=lambda: load_run_files(store, "seams", cfg))
    try:
        _assert_implements(built, Engine)
        assert task.prompt(0).token_ids  # the task the engine came with serves prompts
        built.note_pull(local=False)  # every engine takes the hint, whether or not a pull costs it anything
    finally:
        built.close()


@pytest.mark.parametrize("engine", ["torch", "modelled"])
def test_every_trainer_the_factory_builds_implements_the_trainer_protocol(engine, tmp_path):
    cfg = _cfg(engine)
    built = build_trainer(cfg, policy=policy_for(cfg), max_staleness=-1,
                          model_dir=lambda: resolve_model_dir(cfg, tmp_path))
    try:
        _assert_implements(built, PolicyTrainer)
        assert built.push_stall(global_sync=False) >= 0.0
    finally:
        built.close()


def test_the_fsdp_trainer_class_implements_the_trainer_protocol():
    # building one starts trainer.fsdp_procs rank processes (tests/test_fsdp.py does); the class suffices here
    from rl.fsdp import FsdpTrainer

    for name, sig in _members(PolicyTrainer).items():
        assert callable(getattr(FsdpTrainer, name, None)), f"FsdpTrainer lacks PolicyTrainer.{name}"
        have = inspect.signature(getattr(FsdpTrainer, name)).parameters
        assert sig is not None and all(p.name in have for p in sig.parameters.values())
