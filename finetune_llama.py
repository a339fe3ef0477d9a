"""Fine-tune a LLaMA on Alpaca instructions, as Megatron-DeepSpeed's finetune_llama.py.

    deepspeed finetune_llama.py --load llama-7b-mega-ds-T2P2 --finetune \\
        --data-path alpaca_data.json --tokenizer-type HFTokenizer --tokenizer-model HF_LLAMA \\
        --repeated-dataloader --deepspeed --deepspeed_config ds_config.json ...

(examples_deepspeed/finetune_hf_llama/finetune_llama.sh's middle stage; its first and last
stages are tools/hf2megads_weight_converter.py.) Everything but the data is pretrain_gpt.py's:
the flags, engines, loop, log line and checkpoints. `--data-path` is one Alpaca JSON file (a
list of {instruction, input, output}), read as Megatron-DeepSpeed's SupervisedDataset
(`megatron.data.prompt_dataset`): each record is one sample of --seq-length + 1 tokens, its
prompt rendered with Alpaca's template, its response the output and the tokenizer's
end-of-sequence token, and only the response's tokens are trained on. Every rank reads the
whole file; `--split` is not read (there is no validation or test data, as there).

`--finetune` loads the weights of `--load` only and starts at iteration 0. Without
`--repeated-dataloader` a run that needs more samples than the file has is refused before it
starts; with it, the records are read again from the first when they run out.
"""

from __future__ import annotations

import argparse
import sys

from megatron.arguments.data_checks import PROMPT_JSON_DATA
from megatron.data.corpus_reader import InputError
from megatron.data.prompt_dataset import build_supervised_dataset
from megatron.tokenizer import TokenizerConfig, create_tokenizer
from megatron.utils import print_rank_0
from pretrain_gpt import main as pretrain_gpt_main

ARGS_DEFAULTS = {PROMPT_JSON_DATA: True}
"""What makes --data-path one Alpaca JSON file (checked so by `validate_args`)."""


def datasets_provider(args: argparse.Namespace, num_samples: list[int]) -> tuple:
    """The Alpaca records of `--data-path` as the training set; no validation or test set."""
    tokenizer = create_tokenizer(TokenizerConfig.from_args(args))
    path = args.data_path[0]
    print_rank_0(f"> building the prompt/response dataset of {path} ...")
    train = build_supervised_dataset(path, tokenizer, args.seq_length, args.tokenizer_type)
    left_out = (
        f"; {train.left_out} left out (no response token within --seq-length {args.seq_length} + 1)"
        if train.left_out
        else ""
    )
    print_rank_0(f" > {len(train)} Alpaca records, one sample each{left_out}")
    if len(train) < num_samples[0] and not args.repeated_dataloader:
        wanted = (
            f"--train-samples {args.train_samples}"
            if getattr(args, "train_samples", None)
            else f"--train-iters {args.train_iters} x --global-batch-size {args.global_batch_size}"
        )
        raise InputError(
            f"--data-path {path}: {len(train)} samples, but {wanted} take {num_samples[0]}; "
            "pass --repeated-dataloader to read them again, or train on fewer"
        )
    return train, None, None


def main(argv: list[str] | None = None) -> int:
    """pretrain_gpt.py's `main` over the Alpaca dataset; a stopped run exits 1 with the reason."""
    return pretrain_gpt_main(argv, datasets_provider, ARGS_DEFAULTS)


if __name__ == "__main__":
    sys.exit(main())
