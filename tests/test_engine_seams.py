"""The engine and trainer seams: rl/factory.py is the one place that maps engine names to classes and traits.

(a) no module outside rl/ (tests/ and scripts/ excepted: they exercise the engines themselves) special-cases an
    engine, a trainer or a trainer backend:
    - no comparison to one of their names (`== "fsdp"`, `in ("modelled", "torch")`);
    - no table of their names (a tuple, list or set holding one, a dict keyed by two or more: a trait belongs in
      rl/factory.py; one key that names the [modelled] section is no table); the config's vocabulary,
      `Literal[...]` types in laminar/config.py, is no table;
    - no identifier, attribute or import built from a name that means only an engine or backend (`vllm`,
      `fsdp`: `cfg.trainer.fsdp_procs`, `FsdpTrainer`), nor naming an engine or trainer class (`Trainer`, also
      the workflow's own class in workflows/trainer.py, only when imported from rl/); a config field's
      own declaration in laminar/config.py is the vocabulary (`modelled` also names the modelled hardware's
      config section, which sim/ shares: it is not checked as an identifier);
    - no isinstance of an engine or trainer class, no hasattr/getattr of an engine or trainer.
    Choosing one by name (a default, an argument: `Field("torch")`, `engine="modelled"`) is allowed.
(b) no function of services/rollout/ is over 40 lines;
(c) every engine and trainer the factories build implements its protocol in full (rl/engine_api.py).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import typing
from pathlib import Path

import pytest

from laminar.config import RolloutEngine, RunConfig, TrainerSection
from laminar.policy import policy_for
from laminar.rl.engine_api import Engine, PolicyTrainer
from laminar.rl.factory import BACKEND_TRAITS, ENGINE_TRAITS, build_engine, build_trainer
from laminar.services.model_files import load_run_files, publish_model_files, resolve_model_dir
from laminar.storage.objects import open_store

ROOT = Path(__file__).resolve().parent.parent
ENGINES = set(typing.get_args(RolloutEngine))  # torch, modelled, vllm (trainer engines are a subset)
BACKENDS = set(typing.get_args(TrainerSection.model_fields["backend"].annotation))  # single, fsdp
NAMES = ENGINES | BACKENDS
WORDS = {"vllm", "fsdp"}  # name parts that mean an engine or a backend and nothing else
CLASSES = {"TorchEngine", "ModelledEngine", "VllmEngine", "Trainer", "FsdpTrainer", "ModelledTrainer"}
GENERIC = {"Trainer"}  # also a name of the workflow's own (workflows/trainer.py): an identifier only when from rl/
SKIP_DIRS = {"rl", "tests", "scripts", "build", "dist", "node_modules", "__pycache__"}


def _modules() -> list[Path]:
    out = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIP_DIRS or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        out.append(path)
    return out


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_in(node: ast.AST) -> bool:
    """An engine name as a string constant, alone or in a tuple/list/set literal."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(_is_name(i) for i in items)


def _words(identifier: str) -> set[str]:
    """`fsdp_procs` -> {fsdp, procs}; `FsdpTrainer` -> {fsdp, trainer}; `VLLM_HOME` -> {vllm, home}."""
    return {w.lower() for part in identifier.split("_") for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", part)}


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [*node.name.split("."), *([node.asname] if node.asname else [])]
    if isinstance(node, ast.ImportFrom) and node.module:
        return node.module.split(".")
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    return []


def _vocabulary(tree: ast.AST) -> set[int]:
    """ids of the nodes that declare the config's vocabulary: `Literal[...]` subscripts and, in a class body,
    a field's declared name (`fsdp_procs: int = Field(...)`)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).rsplit(".", 1)[-1] == "Literal":
            out |= {id(n) for n in ast.walk(node.slice)}
        if isinstance(node, ast.ClassDef):
            out |= {id(s.target) for s in node.body if isinstance(s, ast.AnnAssign)}
    return out


def _seam_breaks(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    vocabulary = _vocabulary(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(n) for n in [node.left, *node.comparators]):
            found.append((node.lineno, "compares to an engine name"))
        elif (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in vocabulary
              and any(_is_name(e) for e in node.elts)) or (
                isinstance(node, ast.Dict) and sum(k is not None and _is_name(k) for k in node.keys) >= 2):
            found.append((node.lineno, "a table of engine names (a trait: rl/factory.py)"))
        bad = [i for i in _identifiers(node) if i in CLASSES - GENERIC or _words(i) & WORDS]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("laminar.rl."):
            bad += [a.name for a in node.names if a.name in CLASSES]
        if bad and id(node) not in vocabulary:
            found.append((getattr(node, "lineno", 0), f"names an engine, trainer or backend: {bad[0]}"))
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
    assert breaks == [], "ask laminar.rl.factory (build_engine, build_trainer, engine_traits) instead:\n" + "\n".join(breaks)


def test_the_seam_check_catches_each_kind_of_special_case():
    # the check above must be able to fail: each numbered line below is one special case it has to report
    code = ('if cfg.rollout.engine == "vllm": pass\n'  # 1
            'if engine not in ("modelled", "torch"): pass\n'  # 2
            'isinstance(self.trainer, ModelledTrainer)\n'  # 3
            'hasattr(self.engine, "close")\n'  # 4
            'getattr(engine, "device", None)\n'  # 5
            'gpus = cfg.trainer.fsdp_procs if cfg.trainer.backend == "fsdp" else 1\n'  # 6 (twice: name, compare)
            'TIME_MODELLED = ("modelled",)\n'  # 7
            'PAIRS = {"torch": ("torch",), "vllm": ("torch",)}\n'  # 8 (dict, tuples)
            'from laminar.rl.vllm_engine import VllmEngine\n'  # 9
            'def start_vllm_worker(): pass\n'  # 10
            'served = sorted({"modelled", "torch", cfg.rollout.engine})\n'  # 11
            'from laminar.rl.trainer import Trainer\n'  # 12
            'from laminar.workflows.trainer import Trainer\n'  # the workflow's own Trainer: allowed
            'if cfg.rollout.device == "cuda": pass\n'  # not an engine name: allowed
            'engine: Literal["torch", "modelled", "vllm"] = Field("torch")\n'  # the vocabulary, a choice: allowed
            'class TrainerSection:\n    fsdp_procs: int = 2\n'  # a config field's declaration: allowed
            'run(engine="modelled", backend="single")\n'  # choosing one by name: allowed
            'speedup = cfg.modelled.speedup\n')  # the modelled hardware's section: allowed
    assert sorted({line for line, _ in _seam_breaks(ast.parse(code))}) == list(range(1, 13))
    assert [why for line, why in _seam_breaks(ast.parse(code)) if line == 6] == [
        "compares to an engine name", "names an engine, trainer or backend: fsdp_procs"]


def test_the_factory_has_the_traits_of_every_engine_and_backend_of_the_config():
    assert set(ENGINE_TRAITS) == ENGINES and set(BACKEND_TRAITS) == BACKENDS
    trainers = set(typing.get_args(typing.get_type_hints(TrainerSection)["engine"]))
    assert {t for e in ENGINE_TRAITS.values() for t in e.trainers} <= trainers
    assert {t for b in BACKEND_TRAITS.values() for t in b.trainers} <= trainers


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


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_engine_the_factory_builds_implements_the_engine_protocol(engine, tmp_path):
    assert set(ENGINE_TRAITS) == ENGINES  # every declared engine has its traits
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
    from laminar.rl.fsdp import FsdpTrainer

    for name, sig in _members(PolicyTrainer).items():
        assert callable(getattr(FsdpTrainer, name, None)), f"FsdpTrainer lacks PolicyTrainer.{name}"
        have = inspect.signature(getattr(FsdpTrainer, name)).parameters
        assert sig is not None and all(p.name in have for p in sig.parameters.values())
