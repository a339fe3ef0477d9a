"""`pretrain()`: Megatron's entry point. Initialize, build the run's engine (model, optimizer
and LR scheduler; wrapped by `deepspeed.initialize` on DeepSpeed's engines), build the data
iterators, then train with periodic logging, evaluation and checkpoints.

Providers (all receive the validated `args`):
- `model_provider(args) -> torch.nn.Module`: the GPT in the form the run's engine trains
  (`megatron.training.engines.engine_class(args.layout).build_model`); under FSDP2 sharding
  it runs in a meta-device build (`megatron.core.tensor_parallel.meta_init`: weights it
  writes into the model are lost unless it builds it in `meta_init.whole_build()`).
- `train_valid_test_datasets_provider(args, [train, valid, test] sample counts)`.
- `forward_step_func(data_iterator, model, args) -> (output_tensor, loss_func)`.
- `pipeline_batch`: a `PipelineBatch`, for the pipeline engines.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.data.corpus_reader import InputError
from megatron.data.samplers import build_pretraining_data_loader
from megatron.dry_run import (
    dry_run_requested,
    predicted_peak_bytes,
    predicted_peak_line,
    run_dry_run,
)
from megatron.initialize import initialize_megatron
from megatron.model.fp8 import fp8_report
from megatron.model.model_size import model_size_report
from megatron.model.moe_experts import grouped_gemm_fallback_note
from megatron.settled_args import with_settled
from megatron.tokenizer.tokenizer import tokenizer_with_sizes
from megatron.training.engines import PipelineBatch, TrainingEngine, engine_class
from megatron.training.failures import collective_failures_reported
from megatron.training.loop import TrainingLoop
from megatron.training.monitor import MetricsWriter, Timers, format_validation_block
from megatron.training.step import ForwardStep
from megatron.training.training_log import write_validation_scalars
from megatron.utils import current_device, print_rank_0, print_rank_last


def compute_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype the run's matmuls compute in: --bf16's, --fp16's (autocast or DeepSpeed's
    half-precision parameters), else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _device_and_capability() -> tuple[str, tuple[int, int] | None]:
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_capability()
    return "cpu", None


def build_engine(
    model_provider: Callable,
    args: argparse.Namespace,
    forward_step_func: ForwardStep | None = None,
    pipeline_batch: PipelineBatch | None = None,
) -> TrainingEngine:
    """The run's engine (`args.layout.engine`) over `model_provider(args)`'s model, with its
    AdamW and `OptimizerParamScheduler` (wrapped by `deepspeed.initialize` on DeepSpeed's).

    `forward_step_func` drives the whole-model engines; `pipeline_batch` the pipeline ones.
    """
    config = ModelConfig.from_args(args)
    print_rank_0(model_size_report(config, args.seq_length))
    fallback = grouped_gemm_fallback_note(config, compute_dtype(args), *_device_and_capability())
    if fallback is not None:
        print_rank_0(fallback)
    engine = engine_class(args.layout)
    with engine.model_build(args.layout):  # on the meta device under FSDP2 sharding
        model = model_provider(args)
    if getattr(args, "fp8", None) is not None:
        print_rank_0(fp8_report(model))
    return engine.create(model, args, forward_step_func, pipeline_batch)


def setup_model_and_optimizer(
    model_provider: Callable,
    args: argparse.Namespace,
    forward_step_func: ForwardStep | None = None,
    pipeline_batch: PipelineBatch | None = None,
):  # noqa: ANN201 - Megatron's (model, optimizer, scheduler) triple
    """Megatron's entry point: `build_engine`'s model, optimizer and scheduler.

    The model is the DeepSpeed engine under DeepSpeed, else a `PlainTrainer` (DDP over the
    data-parallel group; fp32 parameters under fp16/bf16 autocast, fp16 loss scaling) or,
    under Megatron's schedules, a `PipelineTrainer` over this rank's chunks.
    """
    engine = build_engine(model_provider, args, forward_step_func, pipeline_batch)
    return engine.model, engine.optimizer, engine.scheduler


def _cyclic(loader) -> Iterator:  # noqa: ANN001 - a DataLoader or None
    while True:
        yield from loader


def repeated_train_iterator(
    loader_from: Callable[[int], object], samples: int, global_micro_batch: int, consumed: int
) -> Iterator:
    """`--repeated-dataloader` over the sequential sampler: its passes over the `samples`
    training samples, each from the first, without end (Megatron-DeepSpeed's RepeatingLoader).

    A pass reads whole global micro-batches (`global_micro_batch` samples; the rest is left
    out, as the sampler leaves it), so a run resumed at `consumed` samples starts at the same
    sample of its pass that it would have read had it not stopped.
    """
    per_pass = samples - samples % global_micro_batch
    if per_pass == 0:
        raise InputError(
            f"--repeated-dataloader: the training data has {samples} samples, fewer than one "
            f"global micro-batch ({global_micro_batch}: --micro-batch-size x data-parallel size)"
        )

    def passes() -> Iterator:
        yield from loader_from(consumed % per_pass)
        again = loader_from(0)
        while True:
            yield from again

    return passes()


def build_data_iterators(
    datasets_provider: Callable, args: argparse.Namespace, state: TrainState
) -> tuple[Iterator | None, Iterator | None, Iterator | None]:
    """Megatron's sample counts per split, the datasets, and resumable loaders over them.

    Every rank reads its own micro-batches (the mmap'd dataset makes this cheap), so no
    broadcast across tensor-parallel ranks is needed; the sampler gives all ranks of one
    data-parallel replica the same samples. With --repeated-dataloader the training samples
    are read again from the first when they run out (`repeated_train_iterator`).
    """
    eval_runs = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    num_samples = [
        args.train_samples or args.train_iters * args.global_batch_size,
        eval_runs * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]
    print_rank_0(" > building train, validation, and test datasets ...")
    train_ds, valid_ds, test_ds = datasets_provider(args, num_samples)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()

    def loader(dataset, consumed: int):  # noqa: ANN001, ANN202
        return build_pretraining_data_loader(
            dataset,
            consumed,
            args.micro_batch_size,
            dp_rank,
            dp_size,
            args.num_workers,
            args.dataloader_type or "single",
        )

    consumed = state.consumed_train_samples
    if train_ds is None:
        train = None
    elif not getattr(args, "repeated_dataloader", False):
        train = iter(loader(train_ds, consumed))
    elif args.dataloader_type == "cyclic":  # its sampler reshuffles and goes on by itself
        train = _cyclic(loader(train_ds, consumed))
    else:
        train = repeated_train_iterator(
            lambda start: loader(train_ds, start),
            len(train_ds),
            args.micro_batch_size * dp_size,
            consumed,
        )
    valid = loader(valid_ds, state.consumed_valid_samples)
    test = loader(test_ds, 0)
    return (
        train,
        _cyclic(valid) if valid is not None else None,
        _cyclic(test) if test is not None else None,
    )


def evaluate(engine: TrainingEngine, data_iterator: Iterator) -> dict[str, float]:
    """Mean reported losses over `--eval-iters` global batches, averaged over DP ranks."""
    return engine.evaluate(data_iterator, engine.args.eval_iters)


def evaluate_and_print_results(
    label: str,
    engine: TrainingEngine,
    data_iterator: Iterator,
    state: TrainState,
    writer: MetricsWriter | None,
    test: bool = False,
) -> dict[str, float]:
    """Evaluate and print Megatron's validation block; write the losses (and, with
    --log-validation-ppl-to-tensorboard, the PPL) against `state`'s iteration, samples, tokens.

    `test` names the tags '... test' instead of '... validation', as Megatron's test set.
    """
    losses = evaluate(engine, data_iterator)
    if writer is not None:
        ppl = engine.args.log_validation_ppl_to_tensorboard
        write_validation_scalars(writer, losses, state, test=test, log_ppl=ppl)
    print_rank_last(format_validation_block(label, losses))
    return losses


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: ForwardStep,
    extra_args_provider: Callable | None = None,
    args_defaults: dict | None = None,
    argv: Sequence[str] | None = None,
    pipeline_batch: PipelineBatch | None = None,
) -> TrainState | None:
    """Megatron's `pretrain`: initialize, set up, train, evaluate, save. Returns the state
    (None after `--dry-run`, which plans the job and trains nothing).

    `pipeline_batch`: how the pipeline engines turn a loader batch into stage inputs and
    which loss they apply (the whole-model engines call `forward_step_func` instead).
    """
    start = time.time()
    if dry_run_requested(argv):
        run_dry_run(argv, extra_args_provider, args_defaults)
        return None
    args = initialize_megatron(extra_args_provider, args_defaults, argv)
    stack_dir = args.save or args.tensorboard_dir or "."
    with collective_failures_reported(stack_dir, args.distributed_timeout_minutes):
        return _set_up_and_train(
            train_valid_test_datasets_provider,
            model_provider,
            forward_step_func,
            pipeline_batch,
            args,
            start,
        )


def convert_loaded_checkpoint(
    engine: TrainingEngine, state: TrainState, args: argparse.Namespace
) -> None:
    """Megatron-LM's `--ckpt-convert-format`: write what `--load` just gave (weights,
    optimizer state, scheduler, counters, random generators) in that format to
    `--ckpt-convert-save/FORMAT`, synchronously, then stop. Into torch_dist the layout is the
    saved one; out of torch_dist any layout the command line asks for."""
    args = with_settled(
        args,
        ckpt_format=args.ckpt_convert_format,
        save=os.path.join(args.ckpt_convert_save, args.ckpt_convert_format),
        async_save=False,
    )
    engine.save(state, args)
    print_rank_0(
        f"> converted checkpoint: {args.load} -> {args.ckpt_format} in {args.save} "
        f"(iteration {state.iteration}, optimizer state included)"
    )


def _set_up_and_train(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: ForwardStep,
    pipeline_batch: PipelineBatch | None,
    args: argparse.Namespace,
    start: float,
) -> TrainState:
    """Everything of `pretrain` after initialization."""
    tokenizer, sizes = tokenizer_with_sizes(args)
    # What the run learns from its tokenizer joins the settled flags (a new namespace): the
    # embedding's padded rows; the true size, saved in checkpoints for the conversion tools.
    args = with_settled(
        args, **sizes, eod_token_id=tokenizer.eod, true_vocab_size=tokenizer.vocab_size
    )
    predicted_peaks = predicted_peak_bytes(args, current_device().type)
    print_rank_0(predicted_peak_line(predicted_peaks))
    # --log-timers-to-tensorboard asks for the timers whatever --timing-log-level says (which
    # no Megatron-DeepSpeed script sets): time at level 1 at least; print only at the flag's.
    timer_level = max(args.timing_log_level, 1 if args.log_timers_to_tensorboard else 0)
    timers = Timers(timer_level, args.timing_log_option)
    engine = build_engine(model_provider, args, forward_step_func, pipeline_batch)
    state = engine.load()
    print_rank_0(f"> model, optimizer and scheduler ready in {time.time() - start:.1f}s")
    if args.ckpt_convert_format is not None:
        convert_loaded_checkpoint(engine, state, args)
        return state
    train_iter, valid_iter, test_iter = build_data_iterators(
        train_valid_test_datasets_provider, args, state
    )
    writer = None
    if dist.get_rank() == dist.get_world_size() - 1:
        writer = MetricsWriter(
            args.tensorboard_dir,
            args.wandb_project,
            args.wandb_exp_name,
            args.wandb_save_dir,
            config=vars(args),
            queue_size=args.tensorboard_queue_size,
        )
    loop = TrainingLoop(args, engine, timers, writer)
    if predicted_peaks is not None:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        loop.predicted_peak_bytes = predicted_peaks[stage]
    # --exit-duration-in-mins counts from the start of pretrain(), as Megatron's does, so set-up,
    # checkpoint loading and dataset building count against a job's time limit too.
    loop.start_time = start
    loop.evaluate = lambda label, iterator, at: evaluate_and_print_results(
        label, engine, iterator, at, writer
    )
    print_rank_0("> training ...")
    loop.train(train_iter, valid_iter, state)
    # After SIGTERM, Megatron exits right after the checkpoint: no final evaluation.
    if args.eval_iters > 0 and not loop.stopped_by_signal:
        label = "the end of training for {} data"
        if valid_iter is not None:
            loop.evaluate(label.format("val"), valid_iter, state)
        if test_iter is not None:
            evaluate_and_print_results(
                label.format("test"), engine, test_iter, state, writer, test=True
            )
    if writer is not None:
        writer.close()
    return state
