"""Regenerate megatron_lm_args.json: Megatron-LM's training `args` for the oracle's model.

Megatron-LM's training loop pickles its whole argparse Namespace into every checkpoint; its
parser lives in megatron/training, which the megatron-core wheel (the oracle) does not ship. This
script runs Megatron-LM's own `parse_args` and `validate_args` on the command line below and
writes every value, tagging the ones JSON cannot hold (enum members by class and name, torch
dtypes by name); megatron_core_checkpoints.py rebuilds them with the real classes.

Run by hand against a checkout of Megatron-LM at tag core_v0.16.1 (commit 55ac708), e.g.:
    PYTHONPATH=/path/to/Megatron-LM python tests/oracle/dump_megatron_lm_args.py \
        > tests/oracle/megatron_lm_args.json
Two imports that parsing never uses are stubbed when absent: `six` (BERT tokenization) and the
Triton kernels of megatron.core.transformer.custom_layers.batch_invariant_kernels.
"""

import enum
import json
import os
import sys
import types

import torch

COMMAND_LINE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--init-method-std", "0.2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.01",
    "--clip-grad", "0", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "VOCAB_FILE",
    "--merge-file", "MERGE_FILE", "--save", "SAVE_DIR", "--save-interval", "10",
    "--ckpt-format", "torch_dist", "--cuda-graph-scope", "attn",
]  # fmt: skip
"""The oracle's model (megatron_core_checkpoints.py) as Megatron-LM's pretrain_gpt.py takes it
on a CPU (local layer spec, fp32); `--cuda-graph-scope attn` puts a list of enum members in."""


def _stub_unused_imports() -> None:
    try:
        import six  # noqa: F401
    except ImportError:
        sys.modules["six"] = types.ModuleType("six")
    try:
        import triton  # noqa: F401
    except ImportError:
        kernels = types.ModuleType("batch_invariant_kernels")
        kernels.enable_batch_invariant_mode = lambda *args, **kwargs: None
        name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
        sys.modules[name] = kernels


def _tagged(value: object) -> object:
    if isinstance(value, enum.Enum):
        kind = type(value)
        return {"enum": f"{kind.__module__}.{kind.__qualname__}", "name": value.name}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_tagged(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"no JSON form for {type(value)}: {value!r}")


def main() -> None:
    """Print Megatron-LM's validated args for COMMAND_LINE as tagged JSON."""
    _stub_unused_imports()
    sys.argv = ["pretrain_gpt.py", *COMMAND_LINE]
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    from megatron.training.arguments import parse_args, validate_args

    stdout = sys.stdout
    sys.stdout = sys.stderr  # validate_args prints the arguments table
    args = parse_args()
    validate_args(args, {})
    sys.stdout = stdout
    entries = [f"{json.dumps(name)}: {json.dumps(_tagged(value))}" for name, value in
               sorted(vars(args).items())]  # fmt: skip
    print(f'{{"command_line": {json.dumps(COMMAND_LINE)},\n"args": {{')  # one arg a line
    print(",\n".join(entries) + "}}")


if __name__ == "__main__":
    main()
