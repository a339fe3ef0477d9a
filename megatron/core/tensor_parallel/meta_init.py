"""Meta-device builds: a model's parameters made without memory, their initializers run later,
one tensor at a time, on each rank's shard.

Under torch FSDP2 sharding the engine builds the model inside `meta_device_build()`: every
parameter is made on the meta device (`new_parameter`, or `device=parameter_device()` for
torch's own layers) and every initializer a layer runs on its parameters (`initialize(tensors,
fill)`, the only way they are filled) is recorded in the order the layers ran them instead of
run. Buffers (rotary tables, router counters) are small and computed for real, on the default
device, as in a whole build.

`run_initializers(build, keep)` replays the records in that order, from the random generator
states the build started with: each record's fill runs on full-size temporaries of its
tensors, on the device a whole build would have drawn them on, `keep` takes this rank's part
of each, and the temporaries are freed before the next record. The generators advance exactly
as in a whole build, so every rank's part is a whole build's, bit for bit, however the tensors
are sharded; at most one record's tensors are whole at a time (one parameter, or one MoE
layer's two stacked expert weights, plus a fill's own scratch: the master weight of
`--use-cpu-initialization`, one expert's pair).

Outside `meta_device_build()` (DDP, DeepSpeed, a model built to load weights into:
`whole_build()`) `initialize` runs each fill at once, on the parameter itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

Fill = Callable[..., object]
"""fill(*tensors): writes the initial values of `tensors` in place (its return is ignored)."""


@dataclass(frozen=True)
class RngStates:
    """The generator states a build draws from: torch's CPU generator, the current CUDA
    device's (where there is one), and the model-parallel tracker's streams."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def now(cls) -> RngStates:
        """This process's states now."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        """Make these the process's states."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_cuda_rng_tracker().set_states(self.tracker)

    def same_as(self, other: RngStates) -> bool:
        """Whether both draw the same numbers from every generator."""

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            return (a is None and b is None) or (
                a is not None and b is not None and torch.equal(a, b)
            )

        return (
            same(self.cpu, other.cpu)
            and same(self.cuda, other.cuda)
            and self.tracker.keys() == other.tracker.keys()
            and all(same(state, other.tracker[name]) for name, state in self.tracker.items())
        )


@dataclass
class _Record:
    tensors: tuple[torch.Tensor, ...]
    fill: Fill


@dataclass
class MetaBuild:
    """One meta-device build: where and from which generator states a whole build would have
    drawn, and its initializers in the order they ran."""

    device: torch.device
    """The default device outside the build: where a whole build fills its parameters."""
    rng: RngStates
    """The generator states at the build's start."""
    records: list[_Record] = field(default_factory=list)


_ACTIVE: MetaBuild | None = None
_BUILD_ATTRIBUTE = "_meta_build"  # on each recorded meta tensor: the build holding its fill


@contextlib.contextmanager
def meta_device_build() -> Iterator[MetaBuild]:
    """Within: parameters are made on the meta device and their initializers recorded."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a meta-device build is already under way")
    _ACTIVE = MetaBuild(torch.get_default_device(), RngStates.now())
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = None


@contextlib.contextmanager
def whole_build() -> Iterator[None]:
    """Within: parameters are made and initialized for real, even inside a meta-device build
    (a model provider that writes weights into the model it builds)."""
    global _ACTIVE
    suspended, _ACTIVE = _ACTIVE, None
    try:
        yield
    finally:
        _ACTIVE = suspended


def parameter_device() -> torch.device | None:
    """Where new parameters go: the meta device during a meta-device build, else None (the
    default device); pass it as `device=` to torch's own layers."""
    return torch.device("meta") if _ACTIVE is not None else None


def new_parameter(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized parameter on `parameter_device()`; fill it with `initialize`."""
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=parameter_device()))


def initialize(tensors: torch.Tensor | Sequence[torch.Tensor], fill: Fill) -> None:
    """`fill(*tensors)` in place without autograd: now, or, for parameters made during a
    meta-device build, when `run_initializers` replays the build."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if _ACTIVE is None or not any(tensor.is_meta for tensor in tensors):
        with torch.no_grad():
            fill(*tensors)
        return
    if not all(tensor.is_meta for tensor in tensors):
        raise ValueError("initialize: fill meta-device and real tensors separately")
    _ACTIVE.records.append(_Record(tensors, fill))
    for tensor in tensors:
        setattr(tensor, _BUILD_ATTRIBUTE, _ACTIVE)


def meta_build_of(model: nn.Module) -> MetaBuild | None:
    """The meta-device build whose initializers `model`'s parameters await, or None for a model
    built whole; a RuntimeError names a parameter made outside `new_parameter` / `initialize`
    in a meta-device build (its values would be lost, or drawn out of order)."""
    builds: dict[int, MetaBuild] = {}
    real = None
    for name, param in model.named_parameters():
        build = getattr(param, _BUILD_ATTRIBUTE, None)
        if build is not None:
            builds[id(build)] = build
        elif param.is_meta:
            raise RuntimeError(
                f"parameter {name} was made on the meta device without an initializer "
                "(megatron.core.tensor_parallel.meta_init.initialize)"
            )
        else:
            real = real or name
    if not builds:
        return None
    if real is not None or len(builds) > 1:
        raise RuntimeError(
            f"parameter {real or name} was made outside this model's meta-device build (make "
            "parameters with megatron.core.tensor_parallel.meta_init.new_parameter)"
        )
    return next(iter(builds.values()))


def run_initializers(
    build: MetaBuild,
    keep: Callable[[torch.Tensor, torch.Tensor], None],
    start: RngStates | None = None,
) -> None:
    """Replay `build`'s fills in order from the generator states `start` (default: the
    build's own), calling `keep(meta_tensor, full_value)` for each of their tensors; then
    leave the generators where this rank's own whole build would have left them.

    `start` other than the build's own (another rank's: `engines/fsdp.py` gives every rank its
    group's first rank's) draws that rank's values; the fills then run once more from this
    rank's own states, their values discarded, to advance this rank's streams (its dropout
    continues from there, as after a whole build). The replay starts by setting the
    generators: anything drawn between the build and it would be drawn again (the engines draw
    nothing there)."""
    own = build.rng
    start = own if start is None else start
    _replay(build, keep, start)
    if not start.same_as(own):
        _replay(build, lambda tensor, value: None, own)


def _replay(
    build: MetaBuild, keep: Callable[[torch.Tensor, torch.Tensor], None], start: RngStates
) -> None:
    start.restore()
    with torch.no_grad(), torch.device(build.device):
        for record in build.records:
            values = [torch.empty(t.shape, dtype=t.dtype) for t in record.tensors]
            record.fill(*values)
            for tensor, value in zip(record.tensors, values):
                keep(tensor, value)
            del values  # one record's tensors whole at a time
