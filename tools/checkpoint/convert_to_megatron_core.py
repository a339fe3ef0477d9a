"""Write a GPT checkpoint (either layout or torch_dist, any TP x PP) as Megatron-LM's torch_dist.

    python tools/checkpoint/convert_to_megatron_core.py --load checkpoints/gpt2 --save mcore/gpt2

megatron-core's `dist_checkpointing.load` (and so Megatron-LM's `--load` with `--ckpt-format
torch_dist`) reads the result: its names, the layers stacked per tensor, Megatron-LM's `args`
in `common.pt`, weights only (see `megatron/checkpointing/megatron_core.py`). The other way
needs no tool: `convert_to_hf.py`, `reshard.py` (whose output `pretrain_gpt.py` resumes at any
TP x PP) and `generate_samples_gpt.py` read Megatron-LM's torch_dist checkpoints directly
(`--true-vocab-size` where its args name no tokenizer files). The directory is written under
`{save}.partial-{pid}` and renamed when complete; an existing non-empty `--save` is refused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

import torch  # noqa: E402

from megatron.checkpointing.dist_checkpoint import DistCheckpointError  # noqa: E402
from megatron.checkpointing.megatron_core import write_megatron_core  # noqa: E402
from megatron.checkpointing.shapes import OUTPUT_LAYER, WORD_EMBEDDINGS  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
)
from tools.checkpoint import CONVERSION_ERRORS  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory to read.")
    parser.add_argument("--save", required=True, help="Directory to write (new or empty).")
    parser.add_argument("--iteration", type=int, default=None, help="Default: the latest.")
    parser.add_argument(
        "--true-vocab-size", type=int, default=None, help="Default: from the checkpoint."
    )
    args = parser.parse_args(argv)
    check_output_path(args.save, "--save", is_folder=True)
    if os.path.isdir(args.save) and os.listdir(args.save):
        parser.error(f"--save {args.save} is not empty; choose another directory")
    return args


def convert(args: argparse.Namespace) -> None:
    """Read `--load`, write `--save` in megatron-core's torch_dist layout."""
    dense = load_dense_checkpoint(args.load, args.iteration, args.true_vocab_size)
    state = dict(dense.state_dict)
    # megatron-core keeps the padded vocabulary rows its args' padded_vocab_size names.
    state[WORD_EMBEDDINGS] = torch.cat([state[WORD_EMBEDDINGS], dense.vocab_padding])
    if OUTPUT_LAYER in state and dense.output_layer_padding is not None:
        state[OUTPUT_LAYER] = torch.cat([state[OUTPUT_LAYER], dense.output_layer_padding])
    model_args = dict(dense.args, true_vocab_size=dense.true_vocab_size)
    save = os.path.abspath(args.save)
    staging = f"{save}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        try:
            write_megatron_core(state, model_args, staging, dense.iteration)
        except DistCheckpointError as error:
            raise CheckpointConversionError(f"{args.load}: {error}") from None
        if os.path.isdir(save):
            os.rmdir(save)  # empty, checked above
        os.replace(staging, save)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"wrote megatron-core torch_dist checkpoint {args.save} (iteration {dense.iteration}, "
        f"{dense.args['num_layers']} layers, vocabulary {state[WORD_EMBEDDINGS].size(0)} rows)"
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: convert(get_args(argv)), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
