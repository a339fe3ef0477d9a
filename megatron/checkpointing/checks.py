"""Whether a checkpoint fits this run: model shape, parallel split, experts, ZeRO partitions.

Each refusal is a `CheckpointError`: one line naming the file, what differs and the command
or flag that loads it anyway (a conversion, `--no-load-optim`, a universal checkpoint).
"""

from __future__ import annotations

import argparse

from megatron.deepspeed_facts import optimizer_state_partitioned, optimizer_wrapper
from megatron.moe_config import experts_per_layer
from megatron.utils import print_rank_0

RESHARD_TOOL = "tools/checkpoint/reshard.py"
MODEL_SHAPE_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "kv_channels": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings",
    "position_embedding_type": "--position-embedding-type",
}
PARALLEL_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
}


class CheckpointError(ValueError):
    """A checkpoint this run cannot load; the message says why and what to run instead."""


def check_checkpoint_args(
    saved: dict, args: argparse.Namespace, path: str, any_layout: bool = False
) -> None:
    """Refuse a checkpoint whose parallel split, model shape or vocabulary differ from ours.

    `any_layout` (a torch_dist checkpoint): another split and vocabulary padding load."""
    if any_layout:
        _check_model_shape(saved, args, path)
        theirs, ours = saved.get("padded_vocab_size"), getattr(args, "padded_vocab_size", None)
        if theirs is not None and ours is not None and theirs != ours:
            print_rank_0(
                f"> {path}: vocabulary padded to {theirs} rows there, {ours} here; the common "
                "rows load, padding rows are added as zeros or dropped"
            )
        return
    for name, flag in PARALLEL_FLAGS.items():
        theirs, ours = saved.get(name), getattr(args, name)
        if theirs is not None and theirs != ours:
            raise CheckpointError(
                f"{path} was saved with {flag} {theirs}, this run has {flag} {ours}: convert "
                f"it with {RESHARD_TOOL} --load {args.load} --save NEW_DIR "
                f"--target-tensor-parallel-size {args.tensor_model_parallel_size} "
                f"--target-pipeline-parallel-size {args.pipeline_model_parallel_size}"
            )
    theirs = saved.get("expert_model_parallel_size") or 1
    ours = getattr(args, "expert_model_parallel_size", 1) or 1
    if theirs != ours:
        raise CheckpointError(
            f"{path} was saved with --expert-model-parallel-size {theirs}, this run has "
            f"--expert-model-parallel-size {ours}: a torch-format checkpoint of Megatron-LM's "
            f"MoE loads at its own expert-parallel size; save with --ckpt-format torch_dist to "
            "change it"
        )
    theirs = saved.get("virtual_pipeline_model_parallel_size") or 1
    ours = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if theirs != ours:
        raise CheckpointError(
            f"{path} was saved with {theirs} virtual pipeline stage(s) per rank, this run has "
            f"{ours}: convert it with {RESHARD_TOOL} --load {args.load} --save NEW_DIR "
            f"--target-pipeline-parallel-size {args.pipeline_model_parallel_size} "
            f"--target-virtual-pipeline-parallel-size {ours}"
        )
    _check_model_shape(saved, args, path)
    theirs, ours = saved.get("padded_vocab_size"), getattr(args, "padded_vocab_size", None)
    if theirs is not None and ours is not None and theirs != ours:
        raise CheckpointError(
            f"{path} has a vocabulary of {theirs} rows (padded), this run {ours}: use the "
            "checkpoint's tokenizer files and --make-vocab-size-divisible-by "
            f"{saved.get('make_vocab_size_divisible_by')}"
        )


def _check_model_shape(saved: dict, args: argparse.Namespace, path: str) -> None:
    for name, flag in MODEL_SHAPE_FLAGS.items():
        theirs, ours = saved.get(name), getattr(args, name, None)
        if theirs is not None and ours is not None and theirs != ours:
            raise CheckpointError(
                f"{path} was saved with {flag} {theirs}, this run has {flag} {ours}: "
                "pass the checkpoint's model flags"
            )
    theirs, ours = _experts(saved), _experts(vars(args))
    if theirs != ours:
        raise CheckpointError(
            f"{path} was saved with {_describe_experts(saved)}, this run has "
            f"{_describe_experts(vars(args))}: pass the checkpoint's MoE flags"
        )


def _experts(args: dict) -> tuple | None:
    """(experts of each layer, --mlp-type) of a model's flags; None when it has no MoE layer.
    Megatron-LM's MoE: ("megatron", experts, --moe-layer-freq)."""
    counts = list(args.get("num_experts") or [1])
    if args.get("routed_moe"):
        return "megatron", counts[0], str(args.get("moe_layer_freq", 1))
    if all(count == 1 for count in counts):
        return None
    per_layer = experts_per_layer(counts, args["num_layers"], args.get("expert_interval", 2))
    return per_layer, args.get("mlp_type", "standard")


def _describe_experts(args: dict) -> str:
    if _experts(args) is None:
        return "no MoE layers"
    if args.get("routed_moe"):
        return f"--num-experts {args['num_experts'][0]} --moe-layer-freq {args['moe_layer_freq']}"
    counts = " ".join(map(str, args["num_experts"]))
    flags = f"--num-experts {counts} --expert-interval {args.get('expert_interval', 2)}"
    return flags + (" --mlp-type residual" if args.get("mlp_type") == "residual" else "")


def check_expert_split(saved: dict, args: argparse.Namespace, path: str) -> None:
    """Refuse DeepSpeed optimizer state split over another expert-parallel size (the weights
    alone load at any size: DeepSpeed reads each expert's file by its global number)."""
    theirs = saved.get("moe_expert_parallel_size") or 1
    ours = getattr(args, "moe_expert_parallel_size", 1)
    if getattr(args, "moe", False) and theirs != ours:
        raise CheckpointError(
            f"{path} was saved with --moe-expert-parallel-size {theirs}, this run has "
            f"--moe-expert-parallel-size {ours}: its optimizer state is split by expert-parallel "
            f"rank; add --no-load-optim to load the weights only, or convert it with "
            f"{RESHARD_TOOL} --load {args.load} --save NEW_DIR"
        )


def check_zero_partitions(
    saved: dict,
    args: argparse.Namespace,
    found,  # noqa: ANN001
    pipe_module_names: bool,
) -> None:
    """Refuse, in one line, DeepSpeed optimizer state partitioned over another number of ranks
    (data x sequence split, Ulysses' or context-parallel; ZeRO 1-3, and bf16 ZeRO-0 on the
    pipeline engine): DeepSpeed would stop with a traceback. The weights load at any size,
    and a universal checkpoint takes the optimizer state to any."""
    # Which wrapper DeepSpeed ran and whether it partitions: megatron.deepspeed_facts (bf16 at
    # ZeRO-0 partitions under the pipeline engine only). A checkpoint that names neither its
    # engine nor `pipeline_parallel` counts as the pipeline engine's (partitioned in bf16).
    if "engine" in saved:
        theirs_pipe = saved["engine"] == "deepspeed_pipe"
    else:
        theirs_pipe = saved.get("pipeline_parallel", True)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    accumulation = ((args.deepspeed_config_dict or {}).get("data_types") or {}).get(
        "grad_accum_dtype"
    )
    wrapper = optimizer_wrapper(
        precision, args.zero_stage, pipe_module_names or theirs_pipe, accumulation
    )
    partitioned = optimizer_state_partitioned(wrapper)
    theirs = (saved.get("data_parallel_size") or 1) * (saved.get("ds_sequence_parallel_size") or 1)
    theirs *= saved.get("context_parallel_size") or 1
    ours = args.layout.optimizer_sharded_ranks
    if not partitioned or saved.get("data_parallel_size") is None or theirs == ours:
        return
    raise CheckpointError(
        f"{found.directory} holds optimizer state partitioned over {theirs} data x sequence "
        f"parallel (Ulysses or context) rank(s), this run has {ours}: add --no-load-optim to "
        "load the weights only, "
        "or convert it (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
        f"{found.directory} --output_folder {found.directory}_universal) and resume with "
        "--universal-checkpoint"
    )
