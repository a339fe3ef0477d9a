"""The run's features as `megatron.compatibility`'s table reads them, and its refusals raised.

Which engine runs which feature is one table (`megatron.compatibility.FEATURES`); the flag
checks here never ask for the engine themselves. `validate_args` checks the table's rows in
steps (`Step`), each at the point where what its rows read is settled:
`settle_sharding` (SHARDING), `validate_args` once the layout is built (LAYOUT),
`check_housekeeping` (HOUSEKEEPING), and last, after the DeepSpeed config's accumulation dtype
(OPTIMIZER).
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError
from megatron.arguments.muon_flags import DEEPSPEED_MUON
from megatron.compatibility import RunFeatures, Step, refusal
from megatron.layout import ParallelLayout


def _sharding_flag(args: argparse.Namespace) -> str:
    """The flag that asked for FSDP2 sharding, as refusals name it (the strongest typed)."""
    if args.use_torch_fsdp2:
        return "--use-torch-fsdp2"
    return "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-distributed-optimizer"


def _experts_flag(args: argparse.Namespace) -> str | None:
    """`--num-experts ...` as typed when some layer has DeepSpeed-MoE experts, else None."""
    counts = getattr(args, "num_experts", None) or [1]
    if getattr(args, "routed_moe", False):
        return None
    if not any(count > 1 for count in counts):
        return None
    return "--num-experts " + " ".join(map(str, counts))


def _muon_flags_for_deepspeed(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags that make Megatron-LM's Muon update as DeepSpeed's does (`DEEPSPEED_MUON`,
    and blockwise orthogonalization of tensor-parallel shards, which DeepSpeed's does)."""
    if args.optimizer != "muon":
        return ()  # the --muon-* flags mean nothing, and namespaces built in code may lack them
    needed = [flag for dest, value, flag in DEEPSPEED_MUON if getattr(args, dest) != value]
    if args.tensor_model_parallel_size > 1 and args.muon_tp_mode != "blockwise":
        needed.append("--muon-tp-mode blockwise")
    return tuple(needed)


def run_features(args: argparse.Namespace) -> RunFeatures:
    """What the flags ask for beyond the layout, as settled so far (each `Step` is checked
    once what its rows read is settled)."""
    config = args.deepspeed_config_dict or {}
    zero = config.get("zero_optimization") or {}  # an object: ds_config checks the section
    offload = zero.get("offload_optimizer") or {}
    types = config.get("data_types") or {}
    return RunFeatures(
        moe=_experts_flag(args),
        sharding_flag=_sharding_flag(args),
        decoupled_lr=args.decoupled_lr,
        per_token_loss=bool(args.calculate_per_token_loss),
        optimizer=args.optimizer,
        ckpt_format=args.ckpt_format,
        ckpt_convert_format=args.ckpt_convert_format,
        grad_accum_dtype=types.get("grad_accum_dtype") if isinstance(types, dict) else None,
        offload_optimizer=isinstance(offload, dict)
        and offload.get("device", "none") not in (None, "none"),
        zero3_reduce_scatter=bool(zero.get("reduce_scatter", True)),
        mtp_layers=getattr(args, "mtp_num_layers", None),
        muon_flags_for_deepspeed=_muon_flags_for_deepspeed(args),
        combined_1f1b=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
    )


def refuse_what_the_engine_cannot_run(
    args: argparse.Namespace, step: Step, layout: ParallelLayout | None = None
) -> None:
    """Raise, as an `ArgumentError`, the table's first refusal among the rows of `step` for
    this run (`layout`: `args.layout` unless given, as before the layout is settled)."""
    line = refusal(args.layout if layout is None else layout, run_features(args), step)
    if line is not None:
        raise ArgumentError(line)
