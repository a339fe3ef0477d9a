"""`pretrain()`: Megatron's entry point. Initialize, build the model, optimizer and LR
scheduler (wrapped by `deepspeed.initialize` with `--deepspeed`), build the data iterators,
then train with periodic logging, evaluation and checkpoints.

Providers (all receive the validated `args`):
- `model_provider(args) -> torch.nn.Module`: a `GPTModel`, or a `GPTModelPipe` when
  pipeline parallelism is on (`args.pipeline_parallel`).
- `train_valid_test_datasets_provider(args, [train, valid, test] sample counts)`.
- `forward_step_func(data_iterator, model, args) -> (output_tensor, loss_func)`.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.checkpointing import TrainState
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import PipelineRunner, initialize_tied_embedding
from megatron.data.samplers import build_pretraining_data_loader
from megatron.dry_run import (
    dry_run_requested,
    predicted_peak_bytes,
    predicted_peak_line,
    run_dry_run,
)
from megatron.initialize import initialize_megatron
from megatron.model.moe import set_up_expert_groups
from megatron.model.moe_aux_loss import MOE_AUX_LOSSES
from megatron.model.pipeline_chunks import activation_shape
from megatron.tokenizer import build_tokenizer
from megatron.training.failures import collective_failures_reported
from megatron.training.loop import TrainingLoop
from megatron.training.monitor import MetricsWriter, Timers, format_validation_block
from megatron.training.optimizer import (
    GuardedAdamW,
    get_param_groups,
    loss_scaler_from_args,
    optimizer_from_args,
)
from megatron.training.pipeline_step import MicroBatchLoss, PipelineTrainer, evaluate_pipelined
from megatron.training.scheduler import scheduler_from_args
from megatron.training.step import (
    ForwardStep,
    PlainTrainer,
    accumulate_reported,
    average_over_data_parallel,
)
from megatron.training.training_log import write_validation_scalars
from megatron.utils import current_device, print_rank_0, print_rank_last


def _build_optimizer(model: torch.nn.Module, args: argparse.Namespace, guard: bool):
    """A bare AdamW over Megatron's param groups (no weight decay on biases and norms).

    With `guard`, our optimizer itself clips, measures the norm and refuses non-finite
    gradients: the paths where nothing else does (plain torch, DeepSpeed fp32 ZeRO-0).
    """
    groups = _param_groups(model, args)
    if not guard:
        # DeepSpeed recognises torch's own AdamW (its ZeRO code paths are tested with it).
        return optimizer_from_args(model, args, groups)
    return GuardedAdamW(
        groups,
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        clip_grad=args.clip_grad,
        guard=True,
        model_parallel_group=parallel_state.get_model_parallel_group(),
        expert_parallel_group=_expert_parallel_group if getattr(args, "moe", False) else None,
    )


def _param_groups(model: torch.nn.Module, args: argparse.Namespace) -> list[dict]:
    """Megatron's groups; with MoE, DeepSpeed's expert groups split off when asked
    (`--create-moe-param-group`) or needed (ZeRO 1-2 reduces and partitions experts apart)."""
    groups = get_param_groups(model)
    if getattr(args, "moe", False) and (args.create_moe_param_group or (args.zero_stage or 0) > 0):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def _expert_parallel_group(name: str):  # noqa: ANN202 - a torch process group
    """DeepSpeed's expert-parallel group `name` (made by `deepspeed.initialize`)."""
    from deepspeed.utils import groups

    return groups._get_expert_parallel_group(name)


def _deepspeed_guards_steps(args: argparse.Namespace) -> bool:
    """Whether DeepSpeed itself skips non-finite steps and reports the gradient norm.

    It does with fp16 or bf16 and in ZeRO stages 1-3 (the flags already agree with the
    config); fp32 ZeRO-0 hands the client optimizer the raw gradients, so there our
    optimizer guards the step.
    """
    return bool(args.fp16 or args.bf16 or args.zero_stage > 0)


def setup_model_and_optimizer(model_provider: Callable, args: argparse.Namespace):
    """Build the model, AdamW and `OptimizerParamScheduler`; with `--deepspeed` wrap all
    three (with Megatron's mpu and the reconciled config) in `deepspeed.initialize`.

    Returns `(model, optimizer, scheduler)`: the engine as model under DeepSpeed, else a
    `PlainTrainer` (DDP over the data-parallel group; fp32 parameters under fp16/bf16 autocast,
    fp16 loss scaling).
    """
    model = model_provider(args)
    if args.deepspeed:
        import deepspeed

        config = dict(args.deepspeed_config_dict)
        mpu = parallel_state.deepspeed_mpu()
        if args.zero_stage == 3 and parallel_state.get_sequence_parallel_world_size() > 1:
            # DeepSpeed partitions a ZeRO-3 model over mpu.get_data_parallel_group(), which
            # leaves the Ulysses ranks out: nothing would sum their gradients (each rank kept
            # its own part's). Partitioned here over the sequence-data-parallel group instead.
            deepspeed.zero.Init(
                module=model,
                data_parallel_group=parallel_state.get_sequence_data_parallel_group(),
                config_dict_or_path=config,
                mpu=mpu,
                dtype=next(model.parameters()).dtype,
            )
        guard = not _deepspeed_guards_steps(args)
        if guard:
            config["gradient_clipping"] = 0.0  # the optimizer clips, so it sees the norm first
        optimizer = _build_optimizer(model, args, guard)
        scheduler = scheduler_from_args(optimizer, args)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            mpu=None if args.pipeline_parallel else mpu,
            config=config,
        )
        if args.pipeline_parallel:
            engine.set_batch_fn(model._megatron_batch_fn)
        return engine, optimizer, scheduler
    model.to(current_device())
    set_up_expert_groups(model)  # what deepspeed.initialize does for DeepSpeed's engine
    if args.plain_pipeline:
        return _pipeline_trainer(model, args)
    optimizer = _build_optimizer(model, args, guard=True)
    scheduler = scheduler_from_args(optimizer, args)
    if parallel_state.get_data_parallel_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None,
            process_group=parallel_state.get_data_parallel_group(),
        )
    trainer = PlainTrainer(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_scaler=loss_scaler_from_args(args),
        autocast_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    return trainer, optimizer, scheduler


def _pipeline_trainer(chunks: torch.nn.ModuleList, args: argparse.Namespace):
    """Megatron's schedules without DeepSpeed: this rank's chunks, AdamW, the runner."""
    initialize_tied_embedding(chunks)
    optimizer = _build_optimizer(chunks, args, guard=True)
    scheduler = scheduler_from_args(optimizer, args)
    loss = MicroBatchLoss(chunks.loss_func)
    trainer = PipelineTrainer(
        model=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_scaler=loss_scaler_from_args(args),
        autocast_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        runner=PipelineRunner(
            chunks,
            loss,
            current_device(),
            (args.micro_batch_size, args.seq_length),
            activation_shape(chunks[0].config, args.micro_batch_size, args.seq_length),
            chunks[0].config.torch_dtype,
        ),
        batch_fn=chunks.batch_fn,
        loss=loss,
    )
    return trainer, optimizer, scheduler


def _cyclic(loader) -> Iterator:  # noqa: ANN001 - a DataLoader or None
    while True:
        yield from loader


def build_data_iterators(
    datasets_provider: Callable, args: argparse.Namespace, state: TrainState
) -> tuple[Iterator | None, Iterator | None, Iterator | None]:
    """Megatron's sample counts per split, the datasets, and resumable loaders over them.

    Every rank reads its own micro-batches (the mmap'd dataset makes this cheap), so no
    broadcast across tensor-parallel ranks is needed; the sampler gives all ranks of one
    data-parallel replica the same samples.
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

    train = loader(train_ds, state.consumed_train_samples)
    valid = loader(valid_ds, state.consumed_valid_samples)
    test = loader(test_ds, 0)
    return (
        iter(train) if train is not None else None,
        _cyclic(valid) if valid is not None else None,
        _cyclic(test) if test is not None else None,
    )


def evaluate(
    forward_step_func: ForwardStep,
    data_iterator: Iterator,
    model,  # noqa: ANN001 - engine, pipeline engine or PlainTrainer
    args: argparse.Namespace,
) -> dict[str, float]:
    """Mean reported losses over `--eval-iters` global batches, averaged over DP ranks."""
    if args.plain_pipeline:
        return evaluate_pipelined(data_iterator, model, args)
    if args.pipeline_parallel:
        losses = [float(model.eval_batch(data_iter=data_iterator)) for _ in range(args.eval_iters)]
        return {"lm loss": sum(losses) / args.eval_iters}
    module = model.model if isinstance(model, PlainTrainer) else model
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    micro_batches = args.gradient_accumulation_steps * args.eval_iters
    MOE_AUX_LOSSES.start()
    with torch.no_grad():
        for _ in range(micro_batches):
            plain = isinstance(model, PlainTrainer)
            with model.autocast() if plain else contextlib.nullcontext():
                output, loss_func = forward_step_func(data_iterator, module, args)
                _, reported = loss_func(output)
            accumulate_reported(sums, reported)
    accumulate_reported(sums, MOE_AUX_LOSSES.pop())
    module.train()
    return average_over_data_parallel(sums, micro_batches)


def evaluate_and_print_results(
    label: str,
    forward_step_func: ForwardStep,
    data_iterator: Iterator,
    model,  # noqa: ANN001
    args: argparse.Namespace,
    state: TrainState,
    writer: MetricsWriter | None,
    test: bool = False,
) -> dict[str, float]:
    """Evaluate and print Megatron's validation block; write the losses (and, with
    --log-validation-ppl-to-tensorboard, the PPL) against `state`'s iteration, samples, tokens.

    `test` names the tags '... test' instead of '... validation', as Megatron's test set.
    """
    losses = evaluate(forward_step_func, data_iterator, model, args)
    if writer is not None:
        ppl = args.log_validation_ppl_to_tensorboard
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
) -> TrainState | None:
    """Megatron's `pretrain`: initialize, set up, train, evaluate, save. Returns the state
    (None after `--dry-run`, which plans the job and trains nothing)."""
    start = time.time()
    if dry_run_requested(argv):
        run_dry_run(argv, extra_args_provider, args_defaults)
        return None
    args = initialize_megatron(extra_args_provider, args_defaults, argv)
    stack_dir = args.save or args.tensorboard_dir or "."
    with collective_failures_reported(stack_dir, args.distributed_timeout_minutes):
        return _set_up_and_train(
            train_valid_test_datasets_provider, model_provider, forward_step_func, args, start
        )


def _set_up_and_train(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: ForwardStep,
    args: argparse.Namespace,
    start: float,
) -> TrainState:
    """Everything of `pretrain` after initialization."""
    tokenizer = build_tokenizer(args)  # sets args.padded_vocab_size
    args.eod_token_id = tokenizer.eod
    args.true_vocab_size = tokenizer.vocab_size  # saved in checkpoints for the conversion tools
    predicted_peaks = predicted_peak_bytes(args, current_device().type)
    print_rank_0(predicted_peak_line(predicted_peaks))
    # --log-timers-to-tensorboard asks for the timers whatever --timing-log-level says (which
    # no Megatron-DeepSpeed script sets): time at level 1 at least; print only at the flag's.
    timer_level = max(args.timing_log_level, 1 if args.log_timers_to_tensorboard else 0)
    timers = Timers(timer_level, args.timing_log_option)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, args)
    state = checkpointing.load_checkpoint(model, optimizer, scheduler, args)
    print_rank_0(f"> model, optimizer and scheduler ready in {time.time() - start:.1f}s")
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
    loop = TrainingLoop(args, model, optimizer, scheduler, forward_step_func, timers, writer)
    if predicted_peaks is not None:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        loop.predicted_peak_bytes = predicted_peaks[stage]
    # --exit-duration-in-mins counts from the start of pretrain(), as Megatron's does, so set-up,
    # checkpoint loading and dataset building count against a job's time limit too.
    loop.start_time = start
    loop.evaluate = lambda label, iterator, at: evaluate_and_print_results(
        label, forward_step_func, iterator, model, args, at, writer
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
                label.format("test"), forward_step_func, test_iter, model, args, state, writer, True
            )
    if writer is not None:
        writer.close()
    return state
