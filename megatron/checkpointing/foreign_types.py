"""Objects of classes a checkpoint names and this process does not import, read as stand-ins.

Megatron-LM pickles its training `args` (an argparse Namespace) into every checkpoint, and with
them objects of megatron-core's classes: `attention_backend` is an `AttnBackend` member,
`model_type` a `ModelType` member, `cuda_graph_scope` a list of `CudaGraphScope` members; a
checkpoint saved for a rerun holds `RerunMode` and `RerunState` members; other releases and
tools add dataclass configs. torch's `weights_only` unpickler refuses every class it is not
given, and giving it the class means importing it: running its module's code, with
megatron-core (whose top-level package is `megatron`, as ours), Transformer Engine or ModelOpt
installed. So a file is scanned first (`torch.serialization.get_unsafe_globals_in_checkpoint`,
which reads the pickle's opcodes and runs nothing), and each class it names beyond what torch
and our allow-list accept gets a stand-in class of that qualified name, created here, which the
`weights_only` unpickler then uses in its place:

- a call of the class (`(AttnBackend, (5,))`, how an enum member pickles; any `__reduce__`
  that names a class) makes a `ForeignObject` holding the call's arguments;
- an instance restored from its state (dataclasses, plain objects: `__new__`, then the
  `__dict__`) holds that state, readable as attributes;
- a bare reference (a function kept in a config) is the stand-in class itself.

The members of the enums Megatron-LM's checkpoints hold are known by name (`ENUM_NAMES`, from
megatron-core's sources), so `<AttnBackend.auto: 5>` reads as it printed; `plain` turns any
enum member, real or stand-in, into what its flag spells.

Refused, in one line: names from Python's standard library, torch or numpy that neither torch
nor our allow-list accept (`os.system`, `builtins.eval`, `subprocess.Popen`,
`functools.partial`, `torch.load`, ...). Those are code, not data: a stand-in would run nothing,
but a file that calls them is not a checkpoint to read.
"""

from __future__ import annotations

import _compat_pickle
import enum
import sys
from typing import Any, ClassVar

import torch

ENUM_NAMES: dict[str, dict[Any, str]] = {
    # megatron/core/transformer/enums.py: AttnBackend the same from core_v0.12 to core_v0.16.1,
    # CudaGraphScope new in core_v0.16.
    "megatron.core.transformer.enums.AttnBackend": {
        1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto",
    },
    "megatron.core.transformer.enums.CudaGraphScope": {
        1: "full_iteration", 2: "attn", 3: "mlp", 4: "moe", 5: "moe_router",
        6: "moe_preprocess", 7: "mamba",
    },
    # megatron/core/enums.py: the one member every release has (the others' values moved).
    "megatron.core.enums.ModelType": {1: "encoder_or_decoder"},
    # megatron/core/rerun_state_machine.py, the same from core_v0.12 to core_v0.16.1
    "megatron.core.rerun_state_machine.RerunMode": {
        "disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS",
        "report_determinism_stats": "REPORT_DETERMINISM_STATS",
    },
    "megatron.core.rerun_state_machine.RerunState": {
        0: "NOT_RUNNING_YET", 1: "INITIAL_RUN", 2: "RERUNNING_IN_PLACE",
        3: "WILL_RERUN_FROM_CHECKPOINT", 4: "RERUNNING_FROM_CHECKPOINT",
        5: "RERUNNING_AGAIN_FROM_CHECKPOINT",
    },
    "megatron.core.rerun_state_machine.RerunDiagnostic": {
        "correct_result": "CORRECT_RESULT", "transient_error": "TRANSIENT_ERROR",
        "persistent_error": "PERSISTENT_ERROR",
    },
}  # fmt: skip
"""Member names by value of the enums Megatron-LM's checkpoints hold (megatron-core's own
weights_only allow-list, megatron/core/safe_globals.py, names the same classes)."""

_CODE_MODULES = frozenset(
    {*sys.stdlib_module_names, "torch", "numpy"}
    | {name.partition(".")[0] for name in _compat_pickle.IMPORT_MAPPING}
    | {module.partition(".")[0] for module, _ in _compat_pickle.NAME_MAPPING}
)
"""Top-level modules whose names in a pickle are code, with the Python 2 names protocol 2 writes
for them (`commands.getoutput` is subprocess.getoutput; pickle's `_compat_pickle` maps them)."""


class ForeignCodeError(ValueError):
    """A pickle refers to code (a function of Python's standard library, torch or numpy)."""


class _ForeignClass(type):
    """The stand-in classes' type: a bare reference prints as the name it stands for."""

    def __repr__(cls) -> str:
        return f"<stand-in for {cls.foreign_name}>"


class ForeignObject(metaclass=_ForeignClass):
    """An object of a class that is not imported here: the class's qualified name
    (`foreign_name`), the arguments it was called with and its state (also as attributes)."""

    foreign_name: ClassVar[str] = ""
    __slots__ = ("foreign_args", "foreign_state", "foreign_member")

    def __new__(cls, *args: Any) -> ForeignObject:
        """An object made by unpickling's NEWOBJ (`cls.__new__(cls, *args)`) or REDUCE
        (`cls(*args)`, an enum member's value among them)."""
        made = super().__new__(cls)
        object.__setattr__(made, "foreign_args", args)
        object.__setattr__(made, "foreign_state", {})
        names = ENUM_NAMES.get(cls.foreign_name, {})
        member = names.get(args[0]) if len(args) == 1 and _hashable(args[0]) else None
        object.__setattr__(made, "foreign_member", member)
        return made

    def __init__(self, *args: Any) -> None:
        """Nothing more: `__new__` kept the arguments."""

    @classmethod
    def member(cls, name: str) -> ForeignObject:
        """The member `name` of this enum (`getattr(SomeEnum, name)`, Python 3.11.2's pickle)."""
        values = {member: value for value, member in ENUM_NAMES.get(cls.foreign_name, {}).items()}
        made = cls(values[name]) if name in values else cls()
        object.__setattr__(made, "foreign_member", name)
        return made

    def __setstate__(self, state: Any) -> None:
        """Keep what the pickle restores: a `__dict__`, (`__dict__`, slots) or anything else."""
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        if all(part is None or isinstance(part, dict) for part in parts):
            for part in parts:
                self.foreign_state.update(part or {})
        else:
            self.foreign_state["__state__"] = state

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "foreign_state")[name]
        except (KeyError, AttributeError):
            raise AttributeError(f"stand-in for {self.foreign_name} has no {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self.foreign_state[name] = value

    def __reduce__(self) -> tuple:
        return type(self), self.foreign_args, dict(self.foreign_state) or None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (
            (self.foreign_args, self.foreign_member, self.foreign_state)
            == (other.foreign_args, other.foreign_member, other.foreign_state)
        )

    def __hash__(self) -> int:
        return hash(self.foreign_name)

    def __repr__(self) -> str:
        short = self.foreign_name.rpartition(".")[2]
        if self.foreign_member is not None:
            value = f": {self.foreign_args[0]!r}" if self.foreign_args else ""
            return f"<{short}.{self.foreign_member}{value}>"
        parts = [repr(arg) for arg in self.foreign_args]
        parts += [f"{key}={value!r}" for key, value in self.foreign_state.items()]
        return f"{self.foreign_name}({', '.join(parts)})"


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


_STAND_INS: dict[str, type[ForeignObject]] = {}


def stand_in(name: str) -> type[ForeignObject]:
    """The stand-in class for the qualified class name `name` (one per name, so that objects
    read from two files compare equal)."""
    if name not in _STAND_INS:
        short = name.rpartition(".")[2] or name
        attributes = {"foreign_name": name, "__slots__": (), "__module__": __name__}
        _STAND_INS[name] = _ForeignClass(short, (ForeignObject,), attributes)
    return _STAND_INS[name]


def foreign_globals(path: str) -> list[tuple[type[ForeignObject], str]]:
    """Stand-ins, as `(class, name)` entries for `torch.serialization.safe_globals`, for every
    global a torch.save file refers to beyond torch's and the current allow-list (call inside
    that allow-list's `safe_globals`). A static scan: nothing in the file runs. Raises
    ForeignCodeError for names that are code (see the module docstring); a file that is not a
    torch.save zip archive, or a damaged one, gets none (the load then says what it finds)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - legacy (pre-zip) format, TorchScript, a damaged file
        return []
    code = sorted(name for name in names if name.partition(".")[0] in _CODE_MODULES)
    if code:
        named = ", ".join(_python3_spelling(name) for name in code)
        raise ForeignCodeError(f"it refers to {named}: code, not data (refused; nothing in it ran)")
    return [(stand_in(name), name) for name in sorted(names)]


def _python3_spelling(name: str) -> str:
    """`name`, followed by what Python 3 calls it where pickle maps a Python 2 name."""
    module, _, attribute = name.rpartition(".")
    if (module, attribute) in _compat_pickle.NAME_MAPPING:
        return f"{name} ({'.'.join(_compat_pickle.NAME_MAPPING[(module, attribute)])})"
    if module in _compat_pickle.IMPORT_MAPPING:
        return f"{name} ({_compat_pickle.IMPORT_MAPPING[module]}.{attribute})"
    return name


def plain(value: Any) -> Any:
    """`value` with enum members, real or stand-in, replaced by what their flags spell (a str
    enum's value, another enum's member name, or the value where the name is unknown), in lists,
    tuples and dicts too; anything else unchanged."""
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, str) else value.name
    if isinstance(value, ForeignObject) and len(value.foreign_args) <= 1:
        if not value.foreign_state and (value.foreign_args or value.foreign_member):
            held = value.foreign_args[0] if value.foreign_args else None
            if isinstance(held, str) or value.foreign_member is None:
                return held
            return value.foreign_member
        return value
    if type(value) in (list, tuple):
        return type(value)(plain(item) for item in value)
    if type(value) is dict:
        return {key: plain(item) for key, item in value.items()}
    return value
