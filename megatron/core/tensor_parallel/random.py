"""Named RNG streams and activation checkpointing that replays them.

Dropout inside a tensor-parallel region (attention probabilities split by head, or any
activation split along the sequence) must differ across tensor-parallel ranks, while dropout
on replicated activations must agree. The tracker keeps a separate generator state per name;
`fork()` swaps it in for a block. The names say "cuda" for Megatron compatibility, but the
state is that of the device the model runs on: the CUDA generator when a GPU is present, the
CPU generator otherwise.

`checkpoint` recomputes a block in the backward pass with exactly the RNG states of the
forward pass, so recomputed dropout masks equal the original ones. With
`--deepspeed-activation-checkpointing`, `use_deepspeed_checkpointing` routes both the tracker
and `checkpoint` to DeepSpeed's implementation (partitioned / CPU-offloaded activations).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _device_rng_state() -> torch.Tensor:
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Generator states by name; `fork(name)` runs a block on that state and advances it."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every stream."""
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of all stream states (saved in checkpoints)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore stream states saved by `get_states`."""
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`, leaving the current generator untouched."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        original = _device_rng_state()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with stream `name` as the device generator, then switch back."""
        if name not in self.states:
            raise KeyError(
                f"RNG stream {name!r} is not set up; call model_parallel_cuda_manual_seed first"
            )
        original = _device_rng_state()
        _set_device_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_rng_state()
            _set_device_rng_state(original)


_TRACKER = RNGStatesTracker()
_DEEPSPEED_CHECKPOINTING: Any = None


def get_cuda_rng_tracker() -> Any:
    """The active tracker: ours, or DeepSpeed's once `use_deepspeed_checkpointing` ran."""
    if _DEEPSPEED_CHECKPOINTING is not None:
        return _DEEPSPEED_CHECKPOINTING.get_cuda_rng_tracker()
    return _TRACKER


def _model_parallel_seed(seed: int) -> int:
    """`seed + 2718 + tp_rank` as Megatron, and under a sequence split (DeepSpeed-Ulysses or
    context parallelism) `+ tp x split_rank`: its ranks hold other tokens (and, in Ulysses'
    attention, other heads), so they drop out apart."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    split = parallel_state.get_tensor_model_parallel_rank()
    split += tp * parallel_state.get_sequence_split_rank()
    return seed + 2718 + split


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` and the model-parallel stream per split rank.

    As Megatron: the default generator (same on every TP and Ulysses rank, so replicated
    weights initialize alike) gets `seed`; the model-parallel stream gets `seed + 2718 + tp_rank`
    (plus `tp x split_rank` under a sequence split), so activations split over ranks drop out
    independently on each.
    """
    if _DEEPSPEED_CHECKPOINTING is not None:
        _DEEPSPEED_CHECKPOINTING.model_parallel_cuda_manual_seed(seed)
        if parallel_state.get_sequence_split_world_size() > 1:
            tracker = _DEEPSPEED_CHECKPOINTING.get_cuda_rng_tracker()
            tracker.reset()
            tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, _model_parallel_seed(seed))
        return
    tensor_parallel_seed = _model_parallel_seed(seed)
    _TRACKER.reset()
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)


def use_deepspeed_checkpointing(
    mpu: Any,
    num_checkpoints: int,
    partition_activations: bool = False,
    contiguous_checkpointing: bool = False,
    checkpoint_in_cpu: bool = False,
    synchronize: bool = False,
    profile: bool = False,
) -> None:
    """Route `checkpoint` and the RNG tracker to `deepspeed.checkpointing`, configured."""
    global _DEEPSPEED_CHECKPOINTING
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    ds_checkpointing.configure(
        mpu,
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )
    _DEEPSPEED_CHECKPOINTING = ds_checkpointing


def use_builtin_checkpointing() -> None:
    """Undo `use_deepspeed_checkpointing` (tests, or a second model in one process)."""
    global _DEEPSPEED_CHECKPOINTING
    _DEEPSPEED_CHECKPOINTING = None


def _autocast_device_types() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _autocast_states() -> dict[str, tuple[bool, torch.dtype]]:
    """Whether autocast is on, and in which dtype, for each device type, now."""
    return {
        device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _autocast_device_types()
    }


def _autocast(states: dict[str, tuple[bool, torch.dtype]]) -> contextlib.ExitStack:
    """Re-enter the autocast `states` recorded by `_autocast_states`."""
    stack = contextlib.ExitStack()
    for device, (enabled, dtype) in states.items():
        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
    return stack


@dataclass(frozen=True)
class RandomState:
    """Every random stream a recomputation must replay, and the autocast it ran under."""

    cpu: torch.Tensor
    device: torch.Tensor
    tracker: dict[str, torch.Tensor]
    autocast: dict[str, tuple[bool, torch.dtype]]


def capture_random_state() -> RandomState:
    """The CPU, device and tracker RNG states and the autocast states, now."""
    return RandomState(
        torch.get_rng_state(), _device_rng_state(), _TRACKER.get_states(), _autocast_states()
    )


@contextlib.contextmanager
def replaying(state: RandomState) -> Iterator[None]:
    """Run the block with `state`'s random streams and autocast (gradients on), then put the
    streams back as they were: a recomputation draws the forward's dropout masks."""
    current = capture_random_state()
    torch.set_rng_state(state.cpu)
    _set_device_rng_state(state.device)
    _TRACKER.set_states(state.tracker)
    try:
        with torch.enable_grad(), _autocast(state.autocast):
            yield
    finally:
        torch.set_rng_state(current.cpu)
        _set_device_rng_state(current.device)
        _TRACKER.set_states(current.tracker)


class _CheckpointFunction(torch.autograd.Function):
    """Run forward without saving activations; recompute under the same RNG in backward."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *inputs):
        ctx.run_function = run_function
        ctx.distribute = distribute_saved_activations
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.device_rng_state = _device_rng_state()
        ctx.tracker_states = _TRACKER.get_states()
        ctx.autocast_states = _autocast_states()
        with torch.no_grad():
            outputs = run_function(*inputs)
        # save_for_backward takes tensors (or None); anything else rides on ctx.
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in inputs]
        ctx.non_tensors = [None if is_t else t for t, is_t in zip(inputs, ctx.is_tensor)]
        tensors = [t if is_t else None for t, is_t in zip(inputs, ctx.is_tensor)]
        if distribute_saved_activations and ctx.is_tensor[0]:
            # Each TP rank keeps 1/tp of the (replicated) input; backward gathers it back.
            ctx.first_shape = tensors[0].shape
            tensors[0] = split_tensor_into_1d_equal_chunks(tensors[0].detach())
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        if ctx.distribute and ctx.is_tensor[0]:
            saved[0] = gather_split_1d_tensor(saved[0]).view(ctx.first_shape)
        needs_grad = ctx.needs_input_grad[2:]
        detached = [
            t.detach().requires_grad_(grad) if is_t else other
            for t, is_t, other, grad in zip(saved, ctx.is_tensor, ctx.non_tensors, needs_grad)
        ]
        current = (torch.get_rng_state(), _device_rng_state(), _TRACKER.get_states())
        torch.set_rng_state(ctx.cpu_rng_state)
        _set_device_rng_state(ctx.device_rng_state)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            # Backward runs outside the caller's autocast region: the recomputation must run
            # in the forward's precision, or its activations (and gradients) differ.
            with torch.enable_grad(), _autocast(ctx.autocast_states):
                outputs = ctx.run_function(*detached)
        finally:
            torch.set_rng_state(current[0])
            _set_device_rng_state(current[1])
            _TRACKER.set_states(current[2])
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = (t.grad if grad else None for t, grad in zip(detached, needs_grad))
        return (None, None, *input_grads)


def checkpoint(
    function: Callable[..., Any], distribute_saved_activations: bool, *inputs: torch.Tensor
) -> Any:
    """Activation-checkpoint `function(*inputs)`: recompute it in backward with the same RNG.

    `distribute_saved_activations` keeps only this rank's 1/tp share of the first input.
    """
    if _DEEPSPEED_CHECKPOINTING is not None:
        return _deepspeed_checkpoint(function, *inputs)
    return _CheckpointFunction.apply(function, distribute_saved_activations, *inputs)


def _deepspeed_checkpoint(function: Callable[..., Any], *inputs: Any) -> Any:
    """`deepspeed.checkpointing.checkpoint` given the tensor inputs only.

    With partitioned activations DeepSpeed 0.19 saves a size slot after every input and, for a
    non-tensor input (a causal layer's `attention_mask` of None), counts that slot as one more
    argument: the recompute gets too many. The non-tensors are passed from here instead.
    """
    is_tensor = [isinstance(value, torch.Tensor) for value in inputs]
    tensors = [value for value, tensor in zip(inputs, is_tensor) if tensor]
    others = [None if tensor else value for value, tensor in zip(inputs, is_tensor)]

    def run(*recomputed: torch.Tensor) -> Any:
        given = iter(recomputed)
        return function(*(next(given) if tensor else o for o, tensor in zip(others, is_tensor)))

    return _DEEPSPEED_CHECKPOINTING.checkpoint(run, *tensors)
