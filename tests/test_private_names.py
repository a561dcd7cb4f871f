"""The private names of libraries the script relies on: each declared here, with what the script needs of it, checked
against the pinned libraries installed; the script touches no other, and says beside each use why no public API does.

A pin bump that renames, removes or reshapes one of them fails here, not in a training run."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest

from conftest import SCRIPT, load_script
from test_packaging import PRIVATE_CODE_OVERRIDDEN

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # as the script does: its tables import trl.experimental

HARNESS = "trl.experimental.async_grpo.openenv_harness"
WORKER = "trl.experimental.async_grpo.async_rollout_worker"
TRAINER = "trl.experimental.async_grpo.async_grpo_trainer"


@dataclass(frozen=True)
class Private:
    """`name` of `owner` ("module" or "module:Class.Qualname"), and what the script relies on it being."""

    owner: str
    name: str
    relies_on: str
    # class, function, method, init (an attribute __init__ sets on self), class_attr, number (a class attribute),
    # property
    kind: str
    params: tuple[str, ...] | None = None  # a function's or method's parameter names, in order
    coroutine: bool = False
    generator: bool = False
    # `Qualname: regex` pairs, each a library function (module-qualified like owner) whose source must match: where
    # the library calls an override or reads a hook
    used_by: tuple[str, ...] = ()
    # a name the script sets on its own class for another library class to read (not on a library base of it)
    hook: bool = False

    def __str__(self) -> str:
        return f"{self.owner}.{self.name}"


# Every private name the script touches, what it relies on, and where the library relies on the script's override.
PRIVATE = [
    # TRL: the loop-owning harness loop, run in the rollout child; HarborRolloutLoop subclasses it.
    Private(HARNESS, "_HarnessRolloutLoop", "the loop HarnessRolloutWorker runs in its child, handed the metric "
            "queue and the failure channel as keyword arguments", "class",
            used_by=(f"{HARNESS}:HarnessRolloutWorker: _loop_cls = _HarnessRolloutLoop",
                     f"{WORKER}:_child_main: failed_event=failed_event,\\s+exception_info_queue=exception_info_queue,"
                     "\\s+metrics_queue=metrics_queue")),
    Private(f"{HARNESS}:_HarnessRolloutLoop", "_score_group", "async (self, group) -> samples, awaited per group",
            "method", ("self", "group"), coroutine=True,
            used_by=(f"{WORKER}:_AsyncRolloutLoop: await self._score_group\\(group\\)",)),
    Private(f"{HARNESS}:_HarnessRolloutLoop", "_run_loops", "async (self, stop_event), the child's whole run",
            "method", ("self", "stop_event"), coroutine=True,
            used_by=(f"{WORKER}:_AsyncRolloutLoop.run: self._run_loops\\(stop_event=self._stop_event\\)",)),
    Private(f"{HARNESS}:_HarnessRolloutLoop", "_counters", "metric counters, pushed with TRL's", "init",
            used_by=(f"{WORKER}:_AsyncRolloutLoop: payload.update\\(self._counters\\)",)),
    Private(f"{HARNESS}:_HarnessRolloutLoop", "_rates", "[numerator, denominator] metrics, pushed with TRL's", "init",
            used_by=(f"{WORKER}:_AsyncRolloutLoop: in self._rates.items\\(\\)",)),
    Private(f"{HARNESS}:HarnessRolloutWorker", "_loop_cls", "the loop class start() runs in the child", "class_attr",
            used_by=(f"{WORKER}:AsyncRolloutWorker.start: self._loop_cls,",)),
    Private(f"{HARNESS}:HarnessRolloutWorker", "_loop_kwargs", "the child loop's keyword arguments, sent by start()",
            "init", used_by=(f"{WORKER}:AsyncRolloutWorker.start: self._loop_kwargs,",
                             f"{TRAINER}:AsyncGRPOTrainer._inner_training_loop: "
                             '_loop_kwargs\\["dataset_start_index"\\]')),
    Private(f"{HARNESS}:HarnessRolloutWorker", "_process", "the child process, None once stopped", "init"),
    Private(f"{HARNESS}:HarnessRolloutWorker", "_stop_event_mp", "the multiprocessing Event the child stops on",
            "init"),
    # TRL: the trainer's weight push.
    Private(TRAINER, "_iter_vllm_named_params", "(model) -> (name, param) of every tensor vLLM receives", "function",
            ("model",), generator=True,
            used_by=(f"{TRAINER}:AsyncGRPOTrainer.__init__: in _iter_vllm_named_params\\(model\\)",
                     f"{TRAINER}:AsyncGRPOTrainer._streaming_iter: in _iter_vllm_named_params\\(")),
    Private(f"{TRAINER}:AsyncGRPOTrainer", "_init_lora_sync", "(self, model) -> bool: whether to push adapters only",
            "method", ("self", "model"),
            used_by=(f"{TRAINER}:AsyncGRPOTrainer.__init__: lora_sync = self._init_lora_sync\\(model\\)",)),
    Private(f"{TRAINER}:AsyncGRPOTrainer", "_streaming_iter", "a generator of the (name, tensor) the push sends",
            "method", ("self",), generator=True,
            used_by=(f"{TRAINER}:AsyncGRPOTrainer._sync_weight_merged: send_weights\\(self._streaming_iter\\(\\)\\)",)),
    # transformers' Trainer.
    Private("transformers:Trainer", "_save_checkpoint", "(self, model, trial): writes checkpoint-N, resumable, "
            "followed by on_save, which completes it", "method", ("self", "model", "trial"),
            used_by=("transformers:Trainer._maybe_log_save_evaluate: self._save_checkpoint\\(model, trial\\)\\s+"
                     "self.control = self.callback_handler.on_save",)),
    # torch.
    Private("torch.utils.data:DataLoader", "_get_iterator", "(self): makes each pass's iterator", "method",
            ("self",), used_by=("torch.utils.data:DataLoader.__iter__: self._get_iterator\\(\\)",)),
    # The standard library.
    Private("multiprocessing.queues:Queue", "_writer", "the write end of the queue's pipe (a Connection)", "init"),
]
# Private-looking names the library documents as public.
DOCUMENTED = {"_exit": "os._exit"}


def resolve(path: str) -> Any:
    """"module" or "module:Qualname" -> the object."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else []:
        obj = getattr(obj, part)
    return obj


def owner_or_none(entry: Private) -> Any:
    try:
        return resolve(entry.owner)
    except (ImportError, AttributeError):  # the first test names it
        return None


def source(obj: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):  # built in (pybind, C)
        return ""


def assigned_on_self(function: Any) -> set[str]:
    """The attributes `function`'s code sets on self (`self.x = `, `self.x: T = `, `self.a, self.x = `)."""
    tree = ast.parse(source(function) or "pass")
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    names = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def problems(entry: Private) -> list[str]:
    """What of `entry` the installed library no longer provides; [] when all of it holds."""
    try:
        owner = resolve(entry.owner)
    except (ImportError, AttributeError) as exc:
        return [f"{entry.owner} is gone: {exc}"]
    found = []
    if entry.kind == "init":
        inits = [vars(c)["__init__"] for c in owner.__mro__ if "__init__" in vars(c)]
        if not any(entry.name in assigned_on_self(init) for init in inits):
            found.append(f"no __init__ of {owner.__name__} or its bases sets self.{entry.name}")
    elif not hasattr(owner, entry.name) and not (entry.hook and entry.kind == "class_attr"):
        found.append(f"{entry} is gone")
    else:
        value = None if entry.hook else inspect.getattr_static(owner, entry.name)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if entry.kind == "class" and not isinstance(value, type):
            found.append(f"{entry} is no longer a class: {value!r}")
        elif entry.kind == "property" and not isinstance(value, property):
            found.append(f"{entry} is no longer a property: {value!r}")
        elif entry.kind == "number" and not isinstance(value, (int, float)):
            found.append(f"{entry} is no longer a number: {value!r}")
        elif entry.kind in ("function", "method"):
            if not callable(value):
                found.append(f"{entry} is no longer callable: {value!r}")
            elif entry.params is not None:
                params = tuple(inspect.signature(value).parameters)
                if params != entry.params:
                    found.append(f"{entry} takes {params}, the script relies on {entry.params}")
            function = inspect.unwrap(value) if callable(value) else None
            if entry.coroutine and not inspect.iscoroutinefunction(function):
                found.append(f"{entry} is no longer a coroutine function")
            if entry.generator and not inspect.isgeneratorfunction(function):
                found.append(f"{entry} is no longer a generator function")
    for use in entry.used_by:
        where, _, pattern = use.partition(": ")
        try:
            code = source(resolve(where))
        except AttributeError as exc:
            found.append(f"{where}, which uses {entry.name}, is gone: {exc}")
            continue
        if not re.search(pattern, code):
            found.append(f"{where} no longer matches {pattern!r}: the library stopped using {entry.name} so")
    return found


@pytest.mark.parametrize("entry", PRIVATE, ids=str)
def test_each_private_library_name_the_script_relies_on_is_still_there_in_the_pinned_libraries(entry):
    assert problems(entry) == [], f"{entry} ({entry.relies_on}): the pinned library changed it"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def library_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__ != cls.__module__ and c is not object]


def library_has(bases: list[type], name: str) -> bool:
    """Whether one of `bases` defines `name`, as a class attribute or as an attribute its code sets or reads."""
    return any(name in vars(c) or re.search(rf"\bself\.{name}\b", source(c)) for c in bases)


def touched() -> tuple[dict[str, set[int]], list[str]]:
    """The private library names the script touches (name -> its lines), and the undeclared ones, as messages.

    Library names are those the script imports, reads from a library object, overrides or reads through self in a
    subclass of a library class, or sets for a library to read (a `hook` entry). The script's own private names (set
    or defined in its own classes, none of whose library bases has them) are not."""
    script, tree = load_script(), ast.parse(SCRIPT.read_text())
    declared = {entry.name for entry in PRIVATE}
    uses: dict[str, set[int]] = {}
    undeclared = []

    def declare(name: str, line: int, ok: bool, what: str) -> None:
        uses.setdefault(name, set()).add(line)
        if not ok:
            undeclared.append(f"line {line}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if private(alias.name):
                    ok = any(e.owner == node.module and e.name == alias.name for e in PRIVATE)
                    declare(alias.name, node.lineno, ok, f"imports {node.module}.{alias.name}")
    own, classes = set(), [n for n in tree.body if isinstance(n, ast.ClassDef)]
    in_class: dict[int, ast.ClassDef] = {}  # id of each Attribute node of a class's code -> the class
    for cls_node in classes:
        cls, names = getattr(script, cls_node.name), {}  # name -> the lines of its class that touch it
        for node in cls_node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
                names.setdefault(node.name, set()).add(node.lineno)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name) and private(target.id):
                        names.setdefault(target.id, set()).add(node.lineno)
        for node in ast.walk(cls_node):
            if isinstance(node, ast.Attribute):
                in_class[id(node)] = cls_node
                through_self = isinstance(node.value, ast.Name) and node.value.id == "self"
                through_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
                if (through_self or through_super) and private(node.attr):
                    names.setdefault(node.attr, set()).add(node.lineno)
        bases = library_bases(cls)
        for name, lines in names.items():
            if any(e.name == name and (e.hook or owner_or_none(e) in cls.__mro__) for e in PRIVATE):
                for line in lines:
                    declare(name, line, True, "")
            elif bases and library_has(bases, name):
                base = next(c for c in bases if library_has([c], name))
                declare(name, min(lines), False, f"{cls.__name__} touches {name} of its library base "
                                                 f"{base.__module__}.{base.__qualname__}")
            else:
                own.add(name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id == "self" and id(node) in in_class) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") == "super"):
            continue  # classified with its class above
        if isinstance(value, ast.Name) and value.id in {c.name for c in classes}:
            continue  # a name of one of the script's classes: its class body, above
        if node.attr in declared:
            declare(node.attr, node.lineno, True, "")
        elif node.attr not in own and node.attr not in DOCUMENTED:
            declare(node.attr, node.lineno, False, f"{ast.unparse(node)}")
    return uses, undeclared


def test_the_script_touches_no_private_library_name_the_table_does_not_declare():
    """A new private use is declared in PRIVATE (and so checked against the pins); one the script dropped leaves."""
    uses, undeclared = touched()
    assert undeclared == [], "private library names not in PRIVATE: " + "; ".join(undeclared)
    unused = sorted({e.name for e in PRIVATE} - set(uses))
    assert unused == [], f"PRIVATE declares names the script no longer touches: {unused}"


def test_each_private_library_name_has_a_one_line_reason_beside_its_use():
    """`# private: <why no public API does it>`, one line, on a line that uses the name or on the line just above
    one; a reason that covers several names, beside one of their uses, names the others."""
    lines = SCRIPT.read_text().splitlines()
    reasons = [line.split("# private: ", 1)[1] for line in lines if "# private: " in line]
    uses, _ = touched()

    def reasoned(line: int) -> bool:  # 1-based
        here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
        return "# private: " in here or above.strip().startswith("# private: ")

    missing = sorted(name for name, at in uses.items() if not any(reasoned(line) for line in at)
                     and not any(re.search(rf"(?<!\w){name}\b", reason) for reason in reasons))
    assert missing == [], f"no `# private:` reason beside any use of {missing}"


def test_the_libraries_whose_private_names_the_script_uses_are_pinned_exactly():
    libraries = {entry.owner.split(".")[0].split(":")[0] for entry in PRIVATE} - set(sys.stdlib_module_names)
    assert libraries <= PRIVATE_CODE_OVERRIDDEN, libraries - PRIVATE_CODE_OVERRIDDEN
