"""From `task.name` to a task object: built-ins, `package.module:Class`, `laminar.tasks` entry points; and the
constructor arguments a task class gets from the run's `task` section (envs/tasks/__init__.py describes both)."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from typing import Any

from laminar import SUBPACKAGES
from laminar.errors import ConfigError

ENTRY_POINT_GROUP = "laminar.tasks"
# built-in task name -> "module:Class" (imported only when chosen)
BUILTIN: dict[str, str] = {
    "repeat": "laminar.envs.tasks.repeat:RepeatTask",
    "file": "laminar.envs.tasks.text:FileTask",  # task.prompts, exact-match reward
    "math": "laminar.envs.tasks.math:MathTask",  # task.params.generator: chain_sum | countdown | gsm8k
    "tools": "laminar.envs.tasks.tool_use:ToolsTask",  # chain_sum with a <calc> tool over several turns
}


def _fix() -> str:
    return (f"set task.name to a built-in ({', '.join(sorted(BUILTIN))}), to \"package.module:Class\", or to "
            f"an entry point of the {ENTRY_POINT_GROUP!r} group")


def _import(name: str, spec: str) -> type:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"task.name={name!r} is not \"package.module:Class\"; {_fix()}")
    if module_name.split(".")[0] in SUBPACKAGES:
        # a config stored before the one installed name (`envs.tasks.math`) still loads: laminar.envs.tasks.math
        module_name = "laminar." + module_name
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task.name={name!r}: module {module_name!r} cannot be imported ({e}); install it or "
                          f"put it on PYTHONPATH on every host that runs rollout and trainer workers") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"task.name={name!r}: module {module_name!r} has no {attr!r}; {_fix()}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"task.name={name!r}: {spec!r} is not a class or factory; {_fix()}")
    return obj


def resolve_task_class(name: str) -> type:
    """The class (or factory) task.name names: built-in, then "module:Class", then a `laminar.tasks` entry point."""
    if name in BUILTIN:
        return _import(name, BUILTIN[name])
    if ":" in name:
        return _import(name, name)
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise ConfigError(f"task.name={name!r} is not a known task (known tasks: {', '.join(sorted(BUILTIN))}; "
                          f"no {ENTRY_POINT_GROUP!r} entry point of that name is installed); {_fix()}")
    try:
        return found[0].load()
    except Exception as e:  # noqa: BLE001 - a broken plug-in is a config error naming it
        raise ConfigError(f"task.name={name!r}: entry point {found[0].value!r} failed to load ({e})") from None


def build_task(section: Any, *, seed: int, tokenizer: Any = None, chat_template: str | None = None) -> Any:
    """The task of a run's `task` section (laminar.config.TaskSection): its class called with the keyword
    arguments it accepts of seed, tokenizer, chat_template, max_count, prompts, and every task.params key."""
    from laminar.envs.tasks.prompt_file import FilePrompts

    cls = resolve_task_class(section.name)
    prompts = FilePrompts(section.prompts, seed=seed) if section.prompts else None
    offered = _arguments(section, cls, {"seed": seed, "tokenizer": tokenizer, "chat_template": chat_template,
                                        "max_count": section.max_count}, prompts)
    params = dict(section.params)
    try:
        return cls(**offered, **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task.name={section.name!r} could not be built with task.params={params!r}: {e}") from None


def check_task(section: Any) -> None:
    """Fail fast where a run starts, building nothing: task.name resolves, task.prompts reads, and task.params
    and the prompt file fit the class's constructor (ConfigError naming the field otherwise)."""
    from laminar.envs.tasks.prompt_file import FilePrompts

    cls = resolve_task_class(section.name)
    prompts = FilePrompts(section.prompts) if section.prompts else None
    _arguments(section, cls, {}, prompts)


def _arguments(section: Any, cls: type, offered: dict[str, Any], prompts: Any) -> dict[str, Any]:
    """Of `offered`, those the constructor takes, plus `prompts`; ConfigError for a task.params key or a prompt
    file it does not take."""
    params = dict(section.params)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    takes_any = sig is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    accepts = set() if sig is None else {n for n, p in sig.parameters.items()
                                         if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    if not takes_any:
        unknown = sorted(set(params) - accepts)
        if unknown:
            raise ConfigError(f"task.params has {', '.join(unknown)}, which task {section.name!r} does not take "
                              f"(it takes {', '.join(sorted(accepts)) or 'no arguments'}); remove them")
        if prompts is not None and "prompts" not in accepts:
            raise ConfigError(f"task.prompts={section.prompts!r} is set but task {section.name!r} reads no prompt "
                              f"file (its constructor has no `prompts` argument); clear task.prompts or pick a "
                              f"task that reads one")
        offered = {k: v for k, v in offered.items() if k in accepts}
    if prompts is not None:
        offered = {**offered, "prompts": prompts}
    return offered
