"""Pretrain GPT-2 with Megatron's flags, on DeepSpeed (`--deepspeed`) or plain torch.

    deepspeed --num_gpus 2 pretrain_gpt.py --deepspeed --deepspeed_config ds_config.json ...
    torchrun --nproc_per_node 2 pretrain_gpt.py ...
    python pretrain_gpt.py ...                      # one process

See scripts/ and examples/ for complete command lines, and `python pretrain_gpt.py --help`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial

import torch

from megatron.checkpointing import CheckpointError, CheckpointSaveError
from megatron.config import DataConfig, ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import LabelOutOfVocabularyError
from megatron.core.tensor_parallel.mappings import this_ranks_sequence_part
from megatron.data.corpus_reader import InputError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.data.json_corpus import ensure_tokenized
from megatron.tokenizer import TokenizerFileError
from megatron.training import pretrain
from megatron.training.engines import PipelineBatch, engine_class
from megatron.training.failures import CollectiveFailure, report_error
from megatron.training.loop import TrainingStopped
from megatron.training.scheduler import SchedulerMismatchError
from megatron.utils import current_device, get_ltor_masks_and_position_ids


def model_provider(args: argparse.Namespace) -> torch.nn.Module:
    """GPT-2 in the form the run's engine trains: a `GPTModel`, DeepSpeed's `GPTModelPipe`, or
    this rank's chunks under Megatron's pipeline schedules (`args.layout.engine`)."""
    return engine_class(args.layout).build_model(ModelConfig.from_args(args), args.layout)


def datasets_provider(args: argparse.Namespace, num_samples: list[int]) -> tuple:
    """Train/valid/test GPT datasets over `--data-path` (blended when weighted), the per-split
    `--train-data-path`/`--valid-data-path`/`--test-data-path`, or `--mock-data`."""
    if args.train_data_corpus is not None:  # v1's loose-JSON --train-data, tokenized once
        ensure_tokenized(args.train_data_corpus, args.data_cache_path)
    if not (args.data_path or args.train_data_path or args.mock_data):
        raise SystemExit(
            "error: --data-path is required (a prefix from tools/preprocess_data.py; or "
            "--train-data with loose-JSON files, --train-data-path, or --mock-data)"
        )
    return build_train_valid_test_datasets(DataConfig.from_args(args), num_samples)


def tokens_and_labels(data: dict, args: argparse.Namespace, device: torch.device) -> tuple:
    """A loader batch on `device`: tokens, labels, loss mask, attention mask, position ids.

    Every label counts but, with --eod-mask-loss, those after an end-of-document token. A batch
    that carries its own `loss_mask` (one per label: SFT data from tools/preprocess_data.py
    --sft, finetune_llama.py's prompt/response samples) is multiplied into that: only the
    labels it marks are trained on.
    """
    text = data["text"].to(device, non_blocking=True).long()  # from pinned memory on GPUs
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        args.eod_token_id,
        args.reset_position_ids,
        args.reset_attention_mask,
        args.eod_mask_loss,
    )
    if "loss_mask" in data:
        loss_mask = loss_mask * data["loss_mask"].to(device, non_blocking=True).float()
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_batch(data_iterator: Iterator, args: argparse.Namespace) -> tuple:
    """Next micro-batch: tokens, labels, loss mask, attention mask, position ids.

    Under a sequence split (DeepSpeed-Ulysses, context parallelism) every rank of a sequence
    group reads the same samples and keeps its part of the tokens, labels and positions; the
    loss mask and the attention mask stay whole (the model returns the whole sequence's
    losses; attention sees all of it: Ulysses' over the whole sequence, context parallelism's
    picks its chunks' rows and columns). Under `--reset-attention-mask` the attention mask is
    the document ids [b, s]; `--reset-position-ids` restarts the positions per document
    before the split, as in one process.
    """
    tokens, labels, loss_mask, attention_mask, position_ids = tokens_and_labels(
        next(data_iterator), args, current_device()
    )
    tokens, labels, position_ids = map(this_ranks_sequence_part, (tokens, labels, position_ids))
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_batch_pipe(data: dict, args: argparse.Namespace) -> tuple:
    """A raw batch as the pipeline stages take it: ((tokens, position_ids), (labels, mask)),
    with the document ids [b, s] third among the inputs under `--reset-attention-mask`.

    The tensors are already on this rank's device: the loader's batch is copied from pinned
    memory without blocking, and DeepSpeed's own `.clone().to(device)` of each is then a copy
    on the GPU. (Left on the CPU, DeepSpeed clones them into pageable memory and copies each
    with a blocking transfer per micro-batch.)
    """
    tokens, labels, loss_mask, document_ids, position_ids = tokens_and_labels(
        data, args, current_device()
    )
    # Context parallelism (Megatron's schedules): this rank's part, as in `get_batch`.
    tokens, labels, position_ids = map(this_ranks_sequence_part, (tokens, labels, position_ids))
    inputs = (
        (tokens, position_ids) if document_ids is None else (tokens, position_ids, document_ids)
    )
    return inputs, (labels, loss_mask)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Mean per-token loss over the unmasked tokens, and the value to report.

    (An MoE model's load-balancing losses reach the backward through the model itself, and
    the training step reports them as 'moe loss': `megatron.model.moe_aux_loss`.)
    """
    losses = output_tensor.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def per_token_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """`--calculate-per-token-loss` (Megatron-LM's loss_func): the sum of the unmasked tokens'
    losses, their count, and the [sum, count] pair to report (the log line divides the pairs'
    totals over the global batch)."""
    losses = output_tensor.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator: Iterator, model: torch.nn.Module, args: argparse.Namespace):  # noqa: ANN201
    """Megatron's GPT forward step: per-token losses, then `loss_func` reduces them."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, args)
    # Multi-token prediction weighs its modules' losses by the (shifted) loss mask.
    extra = {"loss_mask": loss_mask} if getattr(args, "mtp_num_layers", None) else {}
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, **extra)
    reduce = per_token_loss_func if getattr(args, "calculate_per_token_loss", False) else loss_func
    return output_tensor, partial(reduce, loss_mask)


# Failures a user causes or must act on (bad files, a full disk, a stopped run, a stalled or
# dead rank): one `error:` line, exit 1, no traceback (MEGATRON_DEBUG_TRACEBACKS=1 shows it).
USER_ERRORS = (
    TrainingStopped,
    SchedulerMismatchError,
    CheckpointError,
    CheckpointSaveError,
    IndexedDatasetError,
    InputError,
    TokenizerFileError,
    CollectiveFailure,
    LabelOutOfVocabularyError,
)


def main(
    argv: list[str] | None = None,
    train_valid_test_datasets_provider: Callable = datasets_provider,
    args_defaults: dict | None = None,
) -> int:
    """Run `pretrain` with GPT's providers; a stopped run exits 1 with the reason.

    Other entry scripts (finetune_llama.py) pass their own datasets provider and the defaults
    that set their flags' meaning.
    """
    try:
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            forward_step,
            args_defaults=args_defaults,
            argv=argv,
            pipeline_batch=PipelineBatch(
                batch_fn=get_batch_pipe,
                loss_func=loss_func,
                per_token_loss_func=per_token_loss_func,
            ),
        )
    except USER_ERRORS as stopped:
        if os.environ.get("MEGATRON_DEBUG_TRACEBACKS", "0") not in ("", "0"):
            raise
        report_error(str(stopped))
        return 1
    finally:
        parallel_state.destroy_model_parallel()
        _destroy_process_group()
    return 0


def _destroy_process_group() -> None:
    """Join the process group's threads now, while everything they use is alive.

    Left to interpreter shutdown, a still-joinable gloo thread can abort the process (exit -6,
    and a fatal-error dump glued onto other ranks' lines), after a clean finish or after the
    one-line error of a stopped run alike. Tearing the group down makes no collective call,
    so a peer that is already gone cannot hold it up.
    """
    if not torch.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the run's own outcome is what counts
        pass


if __name__ == "__main__":
    sys.exit(main())
