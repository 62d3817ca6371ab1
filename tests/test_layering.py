"""Import layering: no module imports upward. Every module of the repository (tests excepted) is parsed with `ast`,
so imports inside functions, under `if TYPE_CHECKING:` and `importlib.import_module("...")` calls count too.

- `laminar/` imports only itself; `storage/`, `envs/`, `relay/` and `workflows/` import only `laminar/` and
  themselves, except that `workflows/` may ask `rl.factory` (the engines' traits: deterministic, import-light;
  the one place engine names mean something); `rl/` only `laminar/` and `envs/` (engines serve a task's prompts;
  environments know no engine);
  `reporting/` only `laminar/` and `storage/`; `client/watch.py` (the run-watching helper every
  caller shares) only `laminar/`.
- `client/` imports `laminar/`, `storage/` and `devstack/`, never `workflows/`: it starts, signals and queries
  workflows through the Temporal contract (`laminar/contract.py`) alone.
- `chaos/` (the `laminar chaos` room) imports `laminar/`, `storage/`, `reporting/`, `client/` and `devstack/`; its
  schedule only `laminar/`, its nemesis only `laminar/` and the schedule, its checker only `laminar/`,
  `storage/` and `reporting/`. Only `cli/` imports it.
- `drills/` (the `laminar drill` room) imports `laminar/`, `storage/`, `reporting/`, `client/` and `devstack/`; its
  workflow only `laminar/` and `workflows/timeouts.py` (deterministic: no I/O, no torch), its rules and the fault
  activity only `laminar/`, its observer only `laminar/`, `storage/` and the rules. Only `cli/` imports it, except
  that `workers/` registers the workflow and the fault activity, and `bench/` counts groups lost by its rules.
- Nothing imports the top, `cli/` (every command) and `workers/` (launchers, worker processes), except that `cli/`
  imports `workers/`; `bench/` gets the launcher passed in.

Third-party imports are not checked; first-party packages are the repository's top-level folders. Each is
imported as a subpackage of the one installed name (`laminar.workflows`, never `workflows`), and the rules below
name them by folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import laminar

ROOT = Path(__file__).resolve().parents[1]
TOP = {"cli", "workers"}  # nothing imports them ...
TOP_MAY_IMPORT = {"cli": {"workers"}}  # ... except the command line, which starts the workers
# Module or package -> the first-party packages or modules it may import besides itself (the longest matching
# name rules; an allowed name allows the modules under it).
ONLY = {
    "laminar": set(),
    "storage": {"laminar"},
    "envs": {"laminar"},
    "rl": {"laminar", "envs"},
    "relay": {"laminar"},
    "workflows": {"laminar", "rl.factory"},
    "reporting": {"laminar", "storage"},
    "client": {"laminar", "storage", "devstack"},
    "client.watch": {"laminar"},
    "chaos": {"laminar", "storage", "reporting", "client", "devstack"},
    "chaos.schedule": {"laminar"},
    "chaos.nemesis": {"laminar", "chaos.schedule"},
    "chaos.checker": {"laminar", "storage", "reporting"},
    "drills": {"laminar", "storage", "reporting", "client", "devstack"},
    "drills.workflow": {"laminar", "workflows.timeouts"},
    "drills.rules": {"laminar"},
    "drills.faults": {"laminar"},
    "drills.observer": {"laminar", "storage", "drills.rules"},
}
# A command's room -> the packages that may import it (besides itself; the longest matching name rules).
IMPORTED_ONLY_BY = {
    "chaos": {"cli"},
    "drills": {"cli"},
    "drills.workflow": {"cli", "workers"},  # the control worker registers it
    "drills.faults": {"cli", "workers"},  # every worker started with --allow-faults serves it
    "drills.rules": {"cli", "bench"},  # the control benchmark counts groups lost
}


def first_party() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "tests"
            and not p.name.endswith(".egg-info") and not (p / "pyvenv.cfg").exists() and any(p.rglob("*.py"))}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py file in a first-party folder (examples/ counts as `examples`)."""
    out = {}
    for package in sorted(first_party()):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the source, relative ones resolved against `module`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            # each imported name counts (`from laminar.drills import rules` is laminar.drills.rules): a name
            # that is no module is still under its module's rule
            found += [(node.lineno, f"{name}.{a.name}" if name and a.name != "*" else name) for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


SUBPACKAGES = set(laminar.SUBPACKAGES)


def folder_name(name: str) -> str:
    """`laminar.workflows.ledger` -> `workflows.ledger` (the folder the rules name); `laminar.config` is unchanged."""
    parts = name.split(".")
    return ".".join(parts[1:]) if len(parts) > 1 and parts[0] == "laminar" and parts[1] in SUBPACKAGES else name


def violations(module: str, source: str, packages: set[str], is_package: bool = False) -> list[str]:
    """Each upward import of the module, as 'module:line imports name: rule and fix'."""
    module = folder_name(module)
    own = module.split(".")[0]
    rule = max((k for k in ONLY if module == k or module.startswith(k + ".")), key=len, default=None)
    out = []
    for line, name in imported("laminar." + module if own in SUBPACKAGES else module, source, is_package):
        if name.split(".")[0] in SUBPACKAGES:
            out.append(f"{module}:{line} imports {name}: import it as laminar.{name} (the one installed name)")
            continue
        name = folder_name(name)
        target = name.split(".")[0]
        if target not in packages:  # the standard library or a third-party package
            continue
        if target in TOP:
            if own != target and target not in TOP_MAY_IMPORT.get(own, set()):
                out.append(f"{module}:{line} imports {name}: nothing may import {target}/ (the top: cli/ the "
                           "commands, workers/ the launchers; only cli/ imports workers/); move the piece it needs "
                           "to a lower package (client/) or have the caller pass it in")
        elif rule is not None and not any(_under(name, p) for p in [rule, *ONLY[rule]]):
            allowed = " and ".join(_shown(p) for p in sorted(ONLY[rule])) or "nothing else"
            out.append(f"{module}:{line} imports {name}: {rule} may import only itself and {allowed}")
        elif (room := max((k for k in IMPORTED_ONLY_BY if _under(name, k)), key=len, default=None)) is not None \
                and own != target and own not in IMPORTED_ONLY_BY[room]:
            who = " and ".join(f"{p}/" for p in sorted(IMPORTED_ONLY_BY[room]))
            out.append(f"{module}:{line} imports {name}: only {who} import {_shown(room)} (a command's room)")
    return out


def _under(name: str, allowed: str) -> bool:
    return name == allowed or name.startswith(allowed + ".")


def _shown(allowed: str) -> str:
    return f"{allowed}/" if "." not in allowed else allowed.replace(".", "/") + ".py"


def test_no_module_imports_upward() -> None:
    packages = first_party()
    found = [v for module, path in modules().items()
             for v in violations(module, path.read_text(), packages, path.name == "__init__.py")]
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_scan_covers_every_ruled_package() -> None:
    names = modules()
    for package in [*ONLY, *TOP, "bench", "examples.start_and_watch"]:
        assert package in names, f"{package} not found under {ROOT}: the layering test would check nothing there"
    assert len(names) > 50  # every module of the repository (107 on 2026-12-01), not a handful


def test_the_checker_reports_each_kind_of_upward_import() -> None:
    packages = {"laminar", "storage", "rl", "workers", "bench", "client", "cli"}
    text = """
from typing import TYPE_CHECKING
import torch
from laminar.config import RunConfig
from . import sibling
if TYPE_CHECKING:
    from laminar.workers.settings import Settings
def f():
    import laminar.rl.engine
    importlib.import_module("laminar.storage.keys")
"""
    # laminar: typing and torch are not first-party, laminar.config and `.sibling` are itself; 7, 9, 10 go upward
    found = violations("laminar.fake", text, packages)
    assert sorted(int(v.split(":")[1].split(" ")[0]) for v in found) == [7, 9, 10]
    assert any("imports workers.settings.Settings: nothing may import workers/" in v for v in found)
    # storage may import laminar, not rl
    assert violations("storage.fake", "from laminar.refs import Ref\nfrom laminar.storage import keys\n", packages) == []
    # a subpackage is imported under the installed name, never bare
    assert "import it as laminar.storage" in violations("rl.fake", "from storage import keys\n", packages)[0]
    assert "storage may import only itself and laminar/" in violations("storage.fake", "import laminar.rl.engine", packages)[0]
    # workflows may ask rl.factory and nothing else of rl
    assert violations("workflows.fake", "from laminar.rl.factory import time_scale\n", packages) == []
    assert violations("workflows.fake", "from laminar.rl.engine import TorchEngine\n", packages)
    # rl may import the environments; the environments import no engine
    assert violations("rl.fake", "from laminar.envs.tasks import Prompt\n", packages | {"envs"}) == []
    assert "envs may import only itself and laminar/" in violations("laminar.envs.tasks.fake", "from laminar.rl.engine import E",
                                                                    packages | {"envs"})[0]
    # bench may import the launcher from nowhere, even lazily; workers may import workers; cli may import workers,
    # but not the other way round, and nothing else imports cli
    assert violations("bench.fake", "def g():\n    from laminar.workers.launcher import LocalLauncher\n", packages)
    assert violations("laminar.workers.launcher_ray", "from laminar.workers.launcher import LocalLauncher\n", packages) == []
    assert violations("laminar.cli.main", "from laminar.workers.launcher import LocalLauncher\n", packages) == []
    assert violations("laminar.cli.main", "from laminar.cli.run import run_local\n", packages) == []
    assert "nothing may import cli/" in violations("laminar.chaos.command", "from laminar.cli.run import x\n", packages)[0]
    assert "nothing may import cli/" in violations("bench.fake", "import laminar.cli.main\n", packages)[0]
    # the watching helper: laminar only, not even the rest of client/
    assert violations("client.watch", "from laminar.contract import RunStatus\nimport temporalio\n", packages) == []
    assert violations("client.watch", "from laminar.client.settings import Settings\n", packages)
    assert violations("laminar.client.run_control", "from laminar.client.settings import Settings\n", packages) == []
    # a relative import resolves against the module: `from .. import x` in storage.a.b is storage
    assert violations("storage.a.b", "from .. import keys\nfrom ..c import d\n", packages) == []


def test_the_contract_and_chaos_rules() -> None:
    packages = {"laminar", "storage", "workers", "client", "devstack", "workflows", "reporting", "services", "chaos",
                "cli"}
    # client/ starts and queries runs through laminar/contract.py, never through workflows/
    assert violations("laminar.client.run_control", "from laminar.contract import TrainingRunInput\n", packages) == []
    found = violations("laminar.client.run_control", "from laminar.workflows.state import TrainingRunInput\n", packages)
    assert found and "client may import only itself and devstack/ and laminar/ and storage/" in found[0]
    # chaos/: the schedule is pure, the nemesis carries out a schedule, the command ties the room together
    assert violations("chaos.schedule", "from laminar.chaos.nemesis import Nemesis\n", packages)
    assert violations("chaos.nemesis", "from laminar.chaos.schedule import Fault\nfrom laminar.logs import get_logger\n",
                      packages) == []
    assert "chaos/schedule.py" in violations("chaos.nemesis", "from laminar.client.settings import Settings\n", packages)[0]
    assert violations("chaos.checker", "from laminar.reporting.summary import reward_rise\n", packages) == []
    assert violations("laminar.chaos.command", "from laminar.chaos.checker import judge\nfrom laminar.client.exit import stop_like_ctrl_c\n"
                      "from laminar.devstack.stack import DevStack\n", packages) == []
    assert violations("laminar.chaos.command", "from laminar.workflows.pool import PoolInput\n", packages)
    assert violations("laminar.chaos.command", "from laminar.workers.launcher import process_table_path\n", packages)
    # only the command line imports chaos/
    assert violations("laminar.cli.chaos", "from laminar.chaos.command import run_chaos\n", packages) == []
    assert violations("laminar.workers.launcher", "from laminar.chaos.command import run_chaos\n", packages)
    assert "only cli/ import chaos/" in violations("services.fake", "from laminar.chaos.nemesis import Nemesis\n",
                                                    packages)[0]


def test_the_drills_rules() -> None:
    packages = {"laminar", "storage", "workers", "client", "devstack", "workflows", "reporting", "services", "drills",
                "cli", "bench", "activities"}
    # the workflow is deterministic: the contract and the shared timeouts, nothing that does I/O
    assert violations("drills.workflow", "from laminar.contract import DrillInput\n"
                      "from laminar.workflows import timeouts\n", packages) == []
    assert "drills.workflow may import only itself and laminar/ and workflows/timeouts.py" in violations(
        "drills.workflow", "from laminar.storage.objects import ObjectStore\n", packages)[0]
    assert violations("drills.workflow", "from laminar.drills.observer import DrillActivities\n", packages)
    assert violations("drills.rules", "from laminar.client.settings import Settings\n", packages)
    assert violations("drills.faults", "from laminar.storage import keys\n", packages)
    assert violations("drills.observer", "from laminar.drills import rules\nfrom laminar.storage import keys\n",
                      packages) == []
    assert violations("drills.command", "from laminar.drills.observer import DrillActivities\n"
                      "from laminar.client.connect import connect\nfrom laminar.devstack.stack import DevStack\n"
                      "from laminar.reporting.tool_calls import count_tool_calls\n", packages) == []
    assert violations("drills.command", "from laminar.workers.launcher import LocalLauncher\n", packages)
    # who may import the room: the CLI; the workers register the workflow and the fault activity; bench the rules
    assert violations("laminar.cli.main", "from laminar.drills.command import run_drill\n", packages) == []
    assert violations("laminar.workers.processes", "from laminar.drills.workflow import RecoveryDrillWorkflow\n"
                      "from laminar.drills.faults import FaultActivities\n", packages) == []
    assert "only cli/ import drills/" in violations("laminar.workers.processes",
                                                    "from laminar.drills.command import run_drill\n", packages)[0]
    assert violations("bench.control", "from laminar.drills.rules import groups_lost\n", packages) == []
    assert violations("bench.control", "from laminar.drills.command import run_drill\n", packages)
    assert violations("services.fake", "from laminar.drills.rules import groups_lost\n", packages)
    assert violations("activities.fake", "from laminar.drills.faults import FaultActivities\n", packages)


def test_tests_import_the_installed_name_too() -> None:
    """A test that imports `services.trainer` bare gets a second copy of the module beside `laminar.services.trainer`
    (the checkout's root is on sys.path), so a monkeypatch on it changes nothing the product runs."""
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sorted((ROOT / "tests").rglob("*.py"))
             for line, name in imported("tests.x", path.read_text()) if name.split(".")[0] in SUBPACKAGES]
    assert not found, "import these as laminar.<name>:\n" + "\n".join(found)
