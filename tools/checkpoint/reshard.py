"""Rewrite a GPT checkpoint for other tensor/pipeline-parallel sizes, in Megatron's layout.

    python tools/checkpoint/reshard.py --load checkpoints/gpt2 --save checkpoints/gpt2_tp4 \\
        --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1
    python tools/checkpoint/reshard.py --load checkpoints/gpt2 --save checkpoints/gpt2_vpp \\
        --target-pipeline-parallel-size 2 --target-virtual-pipeline-parallel-size 2
    python tools/checkpoint/reshard.py --load checkpoints/moe_tp2_ep2 --save checkpoints/moe_ep4 \\
        --target-tensor-parallel-size 1 --target-expert-model-parallel-size 4

Reads either layout (Megatron's `iter_*/mp_rank_*`, or DeepSpeed's `global_step*` from
`--deepspeed` runs, pipeline engine and ZeRO-3 included), merges every shard, and writes
Megatron's layout split the new way; without target sizes it keeps the source's, which turns
a DeepSpeed checkpoint into a Megatron one. With virtual pipeline stages (Megatron's
interleaved schedule) each rank file holds `model0`, `model1`, ..., read and written as
Megatron-LM does. A Mixture-of-Experts checkpoint (DeepSpeed-MoE's expert files) is written
with every expert of a layer in each rank file, under its global number: the expert-parallel
size is then chosen by the run that loads it (`--moe-expert-parallel-size`); experts are split
over tensor-parallel ranks only if it was trained with `--enable-expert-tensor-parallelism`,
and it stays at pipeline-parallel size 1. Megatron-LM's MoE (`--num-experts` with
`--moe-router-topk`) is written for `--target-expert-model-parallel-size` ranks, each file
`mp_rank_TT[_PPP]_EEE` holding its block of every layer's experts. Model weights and
training progress (iteration, consumed samples) are carried; optimizer and RNG state are
not: `pretrain_gpt.py --load NEW` continues from the weights and counters with a fresh
optimizer (DeepSpeed's universal checkpoint, or the torch_dist format, reshards optimizer
state too).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

from megatron.checkpointing.layouts import holds_checkpoint  # noqa: E402
from megatron.checkpointing.pipeline_stages import check_pipeline_split  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.tokenizer.tokenizer import vocab_size_with_padding  # noqa: E402
from tools.checkpoint import CONVERSION_ERRORS  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (Megatron checkpoint_util's flag names)."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory to read.")
    parser.add_argument("--save", required=True, help="Directory to write (must hold none).")
    parser.add_argument(
        "--target-tensor-parallel-size", type=int, default=None, help="Default: the source's."
    )
    parser.add_argument(
        "--target-pipeline-parallel-size", type=int, default=None, help="Default: the source's."
    )
    parser.add_argument(
        "--target-virtual-pipeline-parallel-size",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (Megatron's interleaved schedule; files hold "
        "model0, model1, ...). Default: the source's when the pipeline size stays, else 1.",
    )
    parser.add_argument(
        "--target-expert-model-parallel-size",
        type=int,
        default=None,
        help="Expert-parallel ranks of Megatron-LM's MoE (files mp_rank_TT[_PPP]_EEE, each "
        "holding a block of every layer's experts). Default: the source's.",
    )
    parser.add_argument(
        "--iteration", type=int, default=None, help="Checkpoint to read; default: the latest."
    )
    parser.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="Tokenizer vocabulary size, for checkpoints that do not record it.",
    )
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=None,
        help="Vocabulary padding of the output; default: the source's.",
    )
    parser.add_argument(
        "--force", action="store_true", help="Overwrite a checkpoint already in --save."
    )
    args = parser.parse_args(argv)
    check_output_path(args.save, "--save", is_folder=True)
    return args


def _sizes(args: dict) -> tuple[int, int, int]:
    """(TP, PP, virtual stages) a checkpoint's args record (None: 1, as Megatron saves it)."""
    return (
        args.get("tensor_model_parallel_size") or 1,
        args.get("pipeline_model_parallel_size") or 1,
        args.get("virtual_pipeline_model_parallel_size") or 1,
    )


def _describe(tp: int, pp: int, virtual: int) -> str:
    split = f"tensor-parallel {tp} x pipeline-parallel {pp}"
    return split + (f" x {virtual} virtual stages" if virtual > 1 else "")


def reshard(args: argparse.Namespace) -> None:
    """Read `--load`, write `--save`; progress lines on stdout."""
    if os.path.abspath(args.load) == os.path.abspath(args.save):
        raise CheckpointConversionError(f"--save {args.save} is the --load directory")
    if holds_checkpoint(args.save) and not args.force:
        raise CheckpointConversionError(
            f"--save {args.save} already holds a checkpoint; choose another directory or pass "
            "--force to replace it"
        )
    print(f"reading checkpoint {args.load} ...", flush=True)
    dense = load_dense_checkpoint(args.load, args.iteration, args.true_vocab_size)
    source = _sizes(dense.args)
    print(
        f"read {dense.layout} checkpoint at iteration {dense.iteration}: {_describe(*source)}, "
        f"{len(dense.state_dict)} tensors, vocabulary {dense.true_vocab_size} (padded "
        f"{dense.args.get('padded_vocab_size')})",
        flush=True,
    )
    targets = (
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.target_virtual_pipeline_parallel_size,
    )
    tp, pp, virtual = (size if target is None else target for target, size in zip(targets, source))
    if args.target_virtual_pipeline_parallel_size is None and pp != source[1]:
        virtual = 1  # the source's virtual stages belong to its pipeline size
    try:
        check_pipeline_split(dense.args["num_layers"], pp, virtual)
    except CheckpointConversionError as error:
        raise CheckpointConversionError(
            f"--target-pipeline-parallel-size {pp} --target-virtual-pipeline-parallel-size "
            f"{virtual}: {error}"
        ) from None
    directory = save_megatron_checkpoint(
        dense,
        args.save,
        tp,
        pp,
        args.make_vocab_size_divisible_by,
        overwrite=args.force,
        virtual_size=virtual,
        expert_size=args.target_expert_model_parallel_size,
    )
    files = len([n for n in os.listdir(directory) if n.startswith("mp_rank_")])
    ep = args.target_expert_model_parallel_size or dense.args.get("expert_model_parallel_size")
    experts = f" x expert-parallel {ep}" if dense.args.get("routed_moe") and (ep or 1) > 1 else ""
    print(
        f"wrote Megatron checkpoint {directory}: {_describe(tp, pp, virtual)}{experts} "
        f"({files} files)",
        flush=True,
    )
    divisible = args.make_vocab_size_divisible_by or dense.args.get(
        "make_vocab_size_divisible_by", 128
    )
    source_rows = dense.args.get("padded_vocab_size")
    target_rows = vocab_size_with_padding(dense.true_vocab_size, divisible, tp)
    if source_rows and target_rows and target_rows > source_rows:
        # The padding logits join the softmax, so new (zero) rows shift the loss a little.
        print(
            f"warning: the vocabulary padding grew from {source_rows} to {target_rows} rows "
            f"(--make-vocab-size-divisible-by x TP {tp}); the new rows are zeros, which changes "
            "the training loss slightly; pick --make-vocab-size-divisible-by so both sizes "
            "match to resume with the same loss",
            flush=True,
        )
    print(
        "note: optimizer and RNG state are not carried (a run resuming from it starts a fresh "
        "optimizer); DeepSpeed's universal checkpoint reshards optimizer state too",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: reshard(get_args(argv)), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
