"""Megatron-LM's training loop, trimmed to what its checkpoint holds, on megatron-core's classes.

Imported by megatron_core_checkpoints.py (job kind `train_save`), in the oracle's environment:
the released megatron-core importable as `megatron`, megatron/training absent (the wheel does
not ship it). What Megatron-LM core_v0.16.1 (commit 55ac708) does, and what stands in here:

- `args`: its parse_args + validate_args Namespace for the model's command line, kept in
  megatron_lm_args.json (dump_megatron_lm_args.py regenerates it) and rebuilt with the real
  classes (`AttnBackend.auto`, `[CudaGraphScope.attn]`, `signal.SIGTERM`, torch dtypes), then
  what the run adds: `padded_vocab_size` (tokenizer), `model_type` (`get_model`: a
  `ModelType.encoder_or_decoder`), `iteration` and FLOPs 0 (a run without --load), and the
  counters of the training loop (`consumed_train_samples`, `curr_iteration`, ...);
- the model wrapped in megatron-core's DistributedDataParallel, its optimizer from
  `get_megatron_optimizer` with the `AdamOptimizerConfig` and config overrides
  `setup_model_and_optimizer` builds from args, its `OptimizerParamScheduler` as
  `get_optimizer_param_scheduler` builds it, trained `iteration` steps;
- `save_checkpoint` -> `generate_state_dict`: `args`, `checkpoint_version` 3.0, `iteration`,
  `model` and `optimizer` sharded state dicts (with the sharding metadata it builds),
  `opt_param_scheduler`, `rerun_state_machine` (only when the rerun machine asked for the
  checkpoint: `rerun=True` writes that case), `rng_state` as the ShardedObject `get_rng_state`
  makes, `num_floating_point_operations_so_far`; `dist_checkpointing.save` with the
  content metadata; then the tracker.

On the CPU: megatron-core's GPU-only tensors (`device='cuda'` in its optimizer) are made on
the CPU, and the CUDA generator's state in `rng_state` is the CPU generator's.
"""

import dataclasses
import functools
import importlib
import json
import os
import random
import signal  # noqa: F401 - `signal.Signals` in args is rebuilt by name

import numpy
import torch

ARGS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_args.json")


def _rebuilt(value):
    """A value of megatron_lm_args.json with its enum members and dtypes made real again."""
    if isinstance(value, list):
        return [_rebuilt(item) for item in value]
    if isinstance(value, dict) and "enum" in value:
        module, _, name = value["enum"].rpartition(".")
        return getattr(importlib.import_module(module), name)[value["name"]]
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    return value


def megatron_lm_args(job):
    """Megatron-LM's args Namespace at the save of iteration `job["iteration"]`."""
    import argparse

    from megatron.core.enums import ModelType

    saved = json.load(open(ARGS_FILE))["args"]
    args = argparse.Namespace(**{name: _rebuilt(value) for name, value in saved.items()})
    iteration = job["iteration"]
    args.vocab_file, args.merge_file, args.save = job["vocab_file"], job["merge_file"], job["dir"]
    args.padded_vocab_size = job["padded_vocab_size"]
    args.model_type = ModelType.encoder_or_decoder
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    args.consumed_train_samples = iteration * args.global_batch_size
    args.curr_iteration = iteration - 1
    args.do_train, args.do_valid, args.do_test = 1, 0, 0
    return args


def _on_cpu(factory):
    @functools.wraps(factory)
    def made(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return made


def cpu_for_cuda():
    """megatron-core's `device='cuda'` tensors (optimizer scales, overflow flags) on the CPU."""
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.cuda.get_rng_state = torch.get_rng_state


def _optimizer(args, ddp_model):
    from megatron.core.optimizer import (
        AdamOptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )

    fields = dataclasses.fields(AdamOptimizerConfig)
    config = AdamOptimizerConfig(**{f.name: getattr(args, f.name) for f in fields
                                    if hasattr(args, f.name)})  # fmt: skip
    overrides = get_standard_config_overrides(config=config)
    return get_megatron_optimizer(config, [ddp_model], config_overrides=overrides)


def _scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=(args.lr_decay_iters or args.train_iters) * args.global_batch_size,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def _train(args, ddp_model, optimizer, scheduler, steps, seed):
    """`steps` iterations of Megatron-LM's train_step on random token batches."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq = args.global_batch_size, args.seq_length
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    for _ in range(steps):
        tokens = torch.randint(0, 50257, (batch, seq + 1), generator=generator)
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp_model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        ddp_model.finish_grad_sync()
        updated, _, _ = optimizer.step()
        assert updated, "the optimizer skipped a step"
        scheduler.step(increment=batch)


def _rng_state():
    """`get_rng_state("torch_dist", ...)` of Megatron-LM at TP = PP = DP = 1."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", [state], (1, 1), (0, 0), replica_id=0)


def _rerun_state(iteration):
    """The rerun machine's state when it asked for a checkpoint (validation found a mismatch:
    the step reruns from the checkpoint); None when not asked, as in a plain run."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.current_iteration = iteration
    return machine.state_dict(data_iterator=None, ckpt_format="torch_dist")


def train_and_save(job, model):
    """Train `model` as Megatron-LM does and save it as its save_checkpoint does (torch_dist)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron.core import dist_checkpointing, parallel_state

    cpu_for_cuda()
    args = megatron_lm_args(job)
    iteration = job["iteration"]
    ddp_model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = _optimizer(args, ddp_model)
    scheduler = _scheduler(args, optimizer)
    _train(args, ddp_model, optimizer, scheduler, iteration, job["seed"])

    # save_checkpoint: _build_sharded_state_dict_metadata, then generate_state_dict.
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    state_dict["model"] = model.sharded_state_dict(metadata=metadata)
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    rerun = _rerun_state(iteration) if job.get("rerun") else None
    if rerun:
        state_dict["rerun_state_machine"] = rerun
    state_dict["rng_state"] = _rng_state()
    flops_per_step = 6 * sum(p.numel() for p in model.parameters()) * args.global_batch_size
    state_dict["num_floating_point_operations_so_far"] = float(
        flops_per_step * args.seq_length * iteration
    )
    directory = os.path.join(job["dir"], f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(
        state_dict,
        directory,
        get_default_save_sharded_strategy(args.ckpt_format),
        async_sharded_save=False,
        validate_access_integrity=True,
        preprocess_common_before_consistancy_check=None,
        content_metadata=_clean_metadata_for_serialization(metadata),
    )
    with open(os.path.join(job["dir"], "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write(str(iteration))
