"""Checkpoint files naming classes this process does not import (Megatron-LM's `args` hold
megatron-core's enums; other tools' files hold their dataclasses) are read with stand-ins, and
never import those modules; a file that calls code is refused in one line, running nothing.

The files are written by torch.save from classes of packages that exist only while saving (as
megatron-core's and megatron.training's do in the process that wrote a Megatron-LM checkpoint),
so the pickles are byte for byte what those packages' objects make. megatron-core 0.14/0.15's
DCP `.metadata`, pickled as its subclasses of torch's classes, reads as torch's.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.abc
import os
import subprocess
import sys
import types

import pytest
import torch

from megatron.checkpointing.file_format import args_dict, load_file
from megatron.checkpointing.foreign_types import ForeignObject


class _Backend(enum.Enum):
    flash = 1
    auto = 5


class _Mode(str, enum.Enum):
    VALIDATE_RESULTS = "validate_results"


@dataclasses.dataclass
class _TrainingConfig:
    lr: float = 0.1
    name: str = "run"


def _activation(x):  # noqa: ANN001, ANN202 - only referenced
    return x


class _Gone(importlib.abc.MetaPathFinder):
    """Fails any import of the made-up packages: a test sees any attempt to import them."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name.partition(".")[0] in ("lost_package", "megatron_lm_gone"):
            raise AssertionError(f"the reader imported {name}")
        return None


def test_classes_of_a_module_that_does_not_exist_are_read_as_stand_ins(tmp_path, monkeypatch):
    module = "lost_package.configs"
    saved = argparse.Namespace(
        backend=_Backend.auto, mode=_Mode.VALIDATE_RESULTS, config=_TrainingConfig(lr=0.5),
        activation=_activation, num_layers=2,
    )  # fmt: skip
    path = str(tmp_path / "common.pt")
    with monkeypatch.context() as saving:
        for name in ("lost_package", module):
            saving.setitem(sys.modules, name, types.ModuleType(name))
        for obj in (_Backend, _Mode, _TrainingConfig, _activation):
            saving.setattr(obj, "__module__", module)
            setattr(sys.modules[module], obj.__name__, obj)
        torch.save({"args": saved, "iteration": 3}, path)
    finder = _Gone()
    sys.meta_path.insert(0, finder)
    try:
        first, second = load_file(path), load_file(path, mmap=True)
    finally:
        sys.meta_path.remove(finder)
    assert "lost_package" not in sys.modules
    args = first["args"]
    assert isinstance(args.backend, ForeignObject)
    assert type(args.backend).foreign_name == "lost_package.configs._Backend"
    assert args.backend.foreign_args == (5,)  # the value: the pickle has no name
    assert args.mode.foreign_args == ("validate_results",)
    assert args.config.lr == 0.5 and args.config.foreign_state == {"lr": 0.5, "name": "run"}
    assert repr(args.config) == "lost_package.configs._TrainingConfig(lr=0.5, name='run')"
    assert repr(args.activation) == "<stand-in for lost_package.configs._activation>"
    assert second["args"].config == args.config and second["args"].backend == args.backend
    plain = args_dict(args)
    assert (plain["backend"], plain["mode"], plain["num_layers"]) == (5, "validate_results", 2)
    assert plain["config"] is args.config  # an object keeps its stand-in


def test_megatron_cores_enums_read_with_their_member_names(tmp_path, monkeypatch):
    # megatron.core here is this project's; megatron-core's module is made for the save only.
    module = "megatron.core.transformer.enums"
    path = str(tmp_path / "common.pt")

    class AttnBackend(enum.Enum):
        flash = 1
        auto = 5

    class CudaGraphScope(enum.Enum):
        attn = 2

    with monkeypatch.context() as saving:
        for name in ("megatron.core.transformer", module):
            saving.setitem(sys.modules, name, types.ModuleType(name))
        for cls in (AttnBackend, CudaGraphScope):  # as megatron-core defines them
            cls.__module__, cls.__qualname__ = module, cls.__name__
            setattr(sys.modules[module], cls.__name__, cls)
        args = argparse.Namespace(attention_backend=AttnBackend.auto,
                                  cuda_graph_scope=[CudaGraphScope.attn])  # fmt: skip
        torch.save({"args": args}, path)
    read = load_file(path)["args"]
    assert module not in sys.modules
    assert repr(read.attention_backend) == "<AttnBackend.auto: 5>"
    assert args_dict(read)["attention_backend"] == "auto"
    assert args_dict(read)["cuda_graph_scope"] == ["attn"]


def test_python_3_11_2s_enum_pickle_names_the_member(tmp_path, monkeypatch):
    # Python 3.11's first releases pickled a member as getattr(EnumClass, "name").
    module = "megatron_lm_gone.enums"

    class Backend:
        pass

    class Member:
        def __reduce__(self):  # noqa: ANN204
            return getattr, (Backend, "flash")

    Backend.__module__, Backend.__qualname__ = module, "Backend"
    path = str(tmp_path / "args.pt")
    with monkeypatch.context() as saving:
        for name in ("megatron_lm_gone", module):
            saving.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules[module].Backend = Backend
        torch.save({"args": argparse.Namespace(backend=Member())}, path)
    read = load_file(path)["args"].backend
    assert isinstance(read, ForeignObject) and read.foreign_member == "flash"
    assert args_dict({"backend": read})["backend"] == "flash"


class _Runs:
    """Unpickling calls `call` with `argument`."""

    def __init__(self, call, argument):  # noqa: ANN001
        self.call, self.argument = call, argument

    def __reduce__(self):  # noqa: ANN204
        return self.call, (self.argument,)


@pytest.mark.parametrize(
    "call, named",
    [
        (os.system, "posix.system"),
        (eval, "builtins.eval"),
        (subprocess.getoutput, "subprocess.getoutput"),
        (torch.load, "torch.serialization.load"),
    ],
    ids=["os.system", "eval", "subprocess", "torch.load"],
)
def test_a_file_that_calls_code_is_refused_in_one_line_and_nothing_runs(tmp_path, call, named):
    marker = tmp_path / "ran"
    argument = {
        os.system: f"touch {marker}",
        eval: f"open({str(marker)!r}, 'w')",
        subprocess.getoutput: f"touch {marker}",
        torch.load: str(marker),
    }[call]
    path = str(tmp_path / "common.pt")
    torch.save({"args": argparse.Namespace(lr=_Runs(call, argument))}, path)
    with pytest.raises(RuntimeError) as refused:
        load_file(path)
    message = str(refused.value)
    assert "\n" not in message and path in message and named in message, message
    assert not marker.exists()


def test_megatron_core_0_15s_dcp_metadata_reads_as_torchs(tmp_path, monkeypatch):
    """megatron-core core_v0.14/v0.15 pickled `.metadata` as its dataclass subclasses of DCP's
    Metadata and SavePlan (`MCoreMetadata(mcore_data=..., **vars(metadata))`, its save plans in
    `all_local_plans`); they read as torch's classes and the weights come back."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    from megatron.checkpointing.megatron_core import read_dist_dense, write_megatron_core
    from tests.tools.test_hf_conversion import random_checkpoint

    original = random_checkpoint("gelu_new")
    directory = write_megatron_core(original.state_dict, original.args, str(tmp_path), 12)
    metadata_file = os.path.join(directory, ".metadata")
    with open(metadata_file, "rb") as handle:
        metadata = pickle.load(handle)
    module = "megatron.core.dist_checkpointing.strategies.torch"

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    @dataclasses.dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):
        mcore_data: dict | None = None

    with monkeypatch.context() as saving:
        parts = module.split(".")
        for end in range(3, len(parts) + 1):  # megatron.core exists: this project's
            name = ".".join(parts[:end])
            saving.setitem(sys.modules, name, types.ModuleType(name))
        for cls in (MCoreMetadata, MCoreSavePlan):
            cls.__module__, cls.__qualname__ = module, cls.__name__
            setattr(sys.modules[module], cls.__name__, cls)
        mcore_data = {key: {} for key in metadata.state_dict_metadata}
        written = MCoreMetadata(mcore_data=mcore_data, **vars(metadata))
        written.all_local_plans = [MCoreSavePlan(items=[], mcore_data=mcore_data)]
        with open(metadata_file, "wb") as handle:
            pickle.dump(written, handle)
    args, state = read_dist_dense(directory)
    assert args["num_layers"] == original.args["num_layers"]
    assert sorted(state) == sorted(original.state_dict)
    for name, tensor in original.state_dict.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
