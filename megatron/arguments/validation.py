"""`validate_args`: every inconsistency between flags is an error naming the flags and numbers.

It also derives what Megatron derives (data-parallel size, default global batch, the
recompute flags behind `--checkpoint-activations`, the distributed backend) so the rest of
the program reads each fact from one place. With `--deepspeed` it reconciles the DeepSpeed
config with the flags (`megatron.arguments.ds_config`) and keeps the result in
`args.deepspeed_config_dict`. `format_arguments` prints Megatron's sorted argument block.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from megatron.arguments.checkpoint_format_flags import (
    settle_checkpoint_conversion,
    settle_checkpoint_format,
)
from megatron.arguments.compat_flags import refuse_unsupported_flags
from megatron.arguments.context_parallel_checks import settle_context_parallel
from megatron.arguments.data_checks import (  # noqa: F401 - SHIPPED_* are imported from here
    PROMPT_JSON_DATA,
    SHIPPED_GPT2_MERGES,
    SHIPPED_GPT2_VOCAB,
    check_per_split_files,
    check_prompt_json_file,
    settle_data_sources,
    settle_tokenizer,
)
from megatron.arguments.ds_config import (
    load_deepspeed_config,
    reconcile_deepspeed_config,
    settle_gradient_accumulation_dtype,
)
from megatron.arguments.ds_unused_sections import set_aside_unused_sections
from megatron.arguments.engine_notes import note_what_the_engine_ignores
from megatron.arguments.engine_refusals import refuse_what_the_engine_cannot_run
from megatron.arguments.errors import ArgumentError, flag_name
from megatron.arguments.fp8_flags import settle_fp8
from megatron.arguments.gpt_oss_flags import check_gpt_oss, settle_gpt_oss
from megatron.arguments.housekeeping_flags import check_housekeeping
from megatron.arguments.mla_flags import check_mla
from megatron.arguments.moe_flags import settle_moe
from megatron.arguments.moe_overlap_flags import settle_moe_overlap
from megatron.arguments.mtp_flags import settle_mtp
from megatron.arguments.muon_flags import settle_muon
from megatron.arguments.parallel_flags import job_backend
from megatron.arguments.pipeline_checks import settle_pipeline
from megatron.arguments.precision import check_flash_attention_precision
from megatron.arguments.routed_moe_flags import choose_moe_family, settle_routed_moe
from megatron.arguments.sharding_flags import settle_sharding
from megatron.arguments.ulysses_checks import settle_ulysses
from megatron.arguments.v1_flags import train_data_corpus, translate_v1_flags
from megatron.atomic_files import nearest_existing
from megatron.compatibility import Step
from megatron.config import model_params_dtype
from megatron.extensions import install_hint
from megatron.layout import ParallelLayout
from megatron.settled_args import settle
from megatron.training.batch_schedule import BatchSizeSchedule


def _require(args: argparse.Namespace, *flags: str) -> None:
    missing = [flag for flag in flags if getattr(args, flag.lstrip("-").replace("-", "_")) is None]
    if missing:
        raise ArgumentError(f"missing required flag(s): {', '.join(missing)}")


def _parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sp = args.ds_sequence_parallel_size = getattr(args, "ds_sequence_parallel_size", 1)
    cp = args.context_parallel_size = getattr(args, "context_parallel_size", 1)
    if tp < 1 or pp < 1:
        raise ArgumentError(
            f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) "
            "must be at least 1"
        )
    if sp < 1:
        raise ArgumentError(f"--ds-sequence-parallel-size ({sp}) must be at least 1")
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size ({cp}) must be at least 1")
    if sp > 1 and cp > 1:
        raise ArgumentError(
            f"--context-parallel-size {cp} with --ds-sequence-parallel-size {sp}: both split "
            "the sequence; choose one (context parallelism also runs DeepSpeed-Ulysses' "
            "all-to-all pattern as --cp-comm-type a2a)"
        )
    if sp > 1 and (tp > 1 or pp > 1):
        raise ArgumentError(
            f"--ds-sequence-parallel-size ({sp}) needs "
            f"{flag_name(args, 'tensor_model_parallel_size')} 1 and "
            f"{flag_name(args, 'pipeline_model_parallel_size')} 1, not {tp} and {pp}: "
            "DeepSpeed-Ulysses runs without them, as in Megatron-DeepSpeed (or use "
            "--context-parallel-size, which does)"
        )
    split = sp * cp
    if world_size % (tp * pp * split) != 0:
        sizes = ""
        if sp > 1:
            sizes = f" x --ds-sequence-parallel-size ({sp})"
        elif cp > 1:
            sizes = f" x --context-parallel-size ({cp})"
        raise ArgumentError(
            f"world size ({world_size}) is not divisible by "
            f"{flag_name(args, 'tensor_model_parallel_size')} ({tp}) x "
            f"{flag_name(args, 'pipeline_model_parallel_size')} ({pp}){sizes} = "
            f"{tp * pp * split}"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * split)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron: nothing to split with one TP rank


def _model_shape(args: argparse.Namespace) -> None:
    _require(args, "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp != 0:
        raise ArgumentError(
            f"--num-attention-heads ({args.num_attention_heads}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads != 0:
        raise ArgumentError(
            f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
            f"({args.num_attention_heads}); set --kv-channels"
        )
    settle_gpt_oss(args)
    _architecture(args, tp)
    check_mla(args)
    check_gpt_oss(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length ({args.seq_length}) is longer than --max-position-embeddings "
            f"({args.max_position_embeddings})"
        )
    if args.sequence_parallel and args.seq_length % tp != 0:
        raise ArgumentError(
            f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )


def _architecture(args: argparse.Namespace, tp: int) -> None:
    """LLaMA-style options: position embeddings, key/value heads, SwiGLU's MLP width."""
    kind = getattr(args, "position_embedding_type", None)
    if kind in ("rope", "yarn"):  # yarn: rope with YaRN's frequencies (`yarn_config.py`)
        args.use_rotary_position_embeddings = True
    elif kind is not None and args.use_rotary_position_embeddings:
        raise ArgumentError(
            f"--position-embedding-type {kind} contradicts --use-rotary-position-embeddings"
        )
    if kind == "none" or args.use_rotary_position_embeddings:
        args.add_position_embedding = False  # as Megatron-DeepSpeed: rope replaces them
    if getattr(args, "group_query_attention", False):
        groups = getattr(args, "num_query_groups", None)
        if groups is None:
            raise ArgumentError("--group-query-attention needs --num-query-groups")
        if args.num_key_value_heads not in (None, groups):
            raise ArgumentError(
                f"--num-query-groups ({groups}) contradicts --num-key-value-heads "
                f"({args.num_key_value_heads})"
            )
        args.num_key_value_heads = groups
    if args.num_key_value_heads is None:
        args.num_key_value_heads = args.num_attention_heads
    kv_heads = args.num_key_value_heads
    if kv_heads < 1 or args.num_attention_heads % kv_heads != 0:
        raise ArgumentError(
            f"--num-attention-heads ({args.num_attention_heads}) is not a multiple of "
            f"--num-key-value-heads ({kv_heads})"
        )
    if kv_heads % tp != 0:
        raise ArgumentError(
            f"--num-key-value-heads ({kv_heads}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}): each rank holds whole key/value heads "
            "(replicating them over ranks is not built here)"
        )
    if args.swiglu and args.ffn_hidden_size is None:
        # Megatron-DeepSpeed's rule: two input projections, about the parameters of 4h.
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp != 0:
        raise ArgumentError(
            f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )


def _batch_sizes(args: argparse.Namespace) -> None:
    _require(args, "--micro-batch-size")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step != 0:
        raise ArgumentError(
            f"{flag_name(args, 'global_batch_size')} ({args.global_batch_size}) is not "
            f"divisible by {flag_name(args, 'micro_batch_size')} ({args.micro_batch_size}) x "
            f"data-parallel size ({args.data_parallel_size}) = {per_step}"
        )
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    if (args.train_iters is None) == (args.train_samples is None):
        raise ArgumentError("give exactly one of --train-iters and --train-samples")
    _schedule_units(args)
    if args.rampup_batch_size is not None:
        if args.train_samples is None:
            raise ArgumentError("--rampup-batch-size needs --train-samples (not --train-iters)")
        try:
            schedule = BatchSizeSchedule(
                args.global_batch_size,
                args.micro_batch_size,
                args.data_parallel_size,
                tuple(args.rampup_batch_size),
            )
        except ValueError as error:
            raise ArgumentError(str(error)) from None
        args.train_iters = schedule.iterations_for(args.train_samples)
    elif args.train_samples is not None:
        args.train_iters = args.train_samples // args.global_batch_size


def _schedule_units(args: argparse.Namespace) -> None:
    """Megatron's rule: the LR schedule is counted in the unit of the run's length."""
    if args.train_samples is None:
        length, other = (
            "--train-iters",
            {
                "--lr-decay-samples": getattr(args, "lr_decay_samples", None),
                "--lr-warmup-samples": getattr(args, "lr_warmup_samples", 0),
            },
        )
    else:
        length, other = (
            "--train-samples",
            {
                "--lr-decay-iters": getattr(args, "lr_decay_iters", None),
                "--lr-warmup-iters": getattr(args, "lr_warmup_iters", 0),
            },
        )
    ignored = [flag for flag, value in other.items() if value]
    if ignored:
        unit = "iterations" if length == "--train-iters" else "samples"
        raise ArgumentError(
            f"{' and '.join(ignored)} cannot be combined with {length}: with {length} the LR "
            f"schedule is counted in {unit}"
        )


def _their_spellings(args: argparse.Namespace, typed: set[str] | None) -> None:
    """Megatron-DeepSpeed's flags: features we lack refused in one line, shorthands expanded."""
    refuse_unsupported_flags(args, typed)
    settle_tokenizer(args)
    settle_data_sources(args, typed)
    if getattr(args, "recompute_activations", False):
        # Megatron's shorthand, expanded (and the flag dropped) as its validate_args does.
        if args.recompute_granularity not in (None, "selective"):
            raise ArgumentError(
                "--recompute-activations means --recompute-granularity selective, not "
                f"{args.recompute_granularity}"
            )
        args.recompute_granularity = "selective"
    style = getattr(args, "weight_decay_incr_style", "constant")
    start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
    if style == "constant" and (start is not None or end is not None):
        raise ArgumentError(
            "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
            "cosine (constant keeps --weight-decay)"
        )
    if style != "constant" and (start is None or end is None):
        raise ArgumentError(
            f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay"
        )


def _precision_and_optimizer(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 cannot both be set")
    check_flash_attention_precision(args)
    _require(args, "--lr")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ArgumentError(
            "--lr-warmup-fraction cannot be combined with --lr-warmup-iters/--lr-warmup-samples"
        )
    if args.use_checkpoint_lr_scheduler and args.override_lr_scheduler:
        raise ArgumentError(
            "--use-checkpoint-lr-scheduler and --override-lr-scheduler cannot both be set"
        )


def _recompute(args: argparse.Namespace) -> None:
    if args.activations_checkpoint_method is not None:
        # Megatron-LM 2.x (the sc21 scripts, Megatron-DeepSpeed's GPT-3 examples): the method
        # alone turned full recomputation on.
        method = args.activations_checkpoint_method
        if args.recompute_granularity not in (None, "full") or args.recompute_method not in (
            None,
            method,
        ):
            raise ArgumentError(
                f"--activations-checkpoint-method {method} means --recompute-granularity full "
                f"--recompute-method {method}; drop the other recomputation flags"
            )
        args.recompute_granularity, args.recompute_method = "full", method
    if args.activations_checkpoint_num_layers is not None:
        args.recompute_num_layers = args.recompute_num_layers or (
            args.activations_checkpoint_num_layers
        )
    if args.checkpoint_activations:
        # Megatron's deprecated flag: full recomputation of every N layers.
        if args.recompute_granularity not in (None, "full"):
            raise ArgumentError(
                "--checkpoint-activations means --recompute-granularity full, not "
                f"{args.recompute_granularity}"
            )
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or args.checkpoint_num_layers
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
    args.recompute_num_layers = args.recompute_num_layers or 1
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        args.compat_notes.append(
            f" > --recompute-modules {' '.join(args.recompute_modules)}: accepted; no effect "
            "without --recompute-granularity selective (as in Megatron-LM)"
        )
    if args.sequence_parallel and (args.distribute_saved_activations or args.partition_activations):
        raise ArgumentError(
            "--distribute-saved-activations/--partition-activations cannot be combined with "
            "--sequence-parallel"
        )


def _pipeline_and_checkpoints(args: argparse.Namespace) -> None:
    settle_pipeline(args)
    args.max_consecutive_skipped_iterations = getattr(
        args, "max_consecutive_skipped_iterations", 100
    )
    if args.max_consecutive_skipped_iterations < 1:
        raise ArgumentError(
            "--max-consecutive-skipped-iterations must be at least 1, got "
            f"{args.max_consecutive_skipped_iterations}"
        )
    if args.save is not None and args.save_interval is None:
        raise ArgumentError("--save needs --save-interval (how many iterations between saves)")
    if args.save_interval is not None and args.save is None:
        # Megatron-DeepSpeed's finetune_llama.sh passes --save-interval 1500 and no --save.
        args.compat_notes.append(
            f" > --save-interval {args.save_interval} without --save: no checkpoint is written "
            "(as Megatron-DeepSpeed)"
        )


def _data_files(args: argparse.Namespace) -> None:
    """Every --data-path (and per-split) prefix, --vocab-file and --merge-file exists, before
    anything starts."""
    from megatron.data.blendable_dataset import parse_data_path
    from megatron.data.indexed_dataset import data_file_path, dataset_exists, index_file_path

    args.train_data_corpus = None
    if getattr(args, "train_data", None):
        args.train_data_corpus = train_data_corpus(args)  # tokenized once training starts
        args.data_path = [args.train_data_corpus.data_prefix]
    elif getattr(args, "data_path", None) and getattr(args, PROMPT_JSON_DATA, False):
        check_prompt_json_file(args)
    elif getattr(args, "data_path", None):
        try:
            prefixes, _ = parse_data_path(args.data_path)
        except ValueError as error:
            raise ArgumentError(str(error)) from None
        for prefix in prefixes:
            if not dataset_exists(prefix):
                raise ArgumentError(
                    f"--data-path {prefix}: no dataset there (need {data_file_path(prefix)} and "
                    f"{index_file_path(prefix)}; make them with tools/preprocess_data.py)"
                )
    check_per_split_files(args)
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isfile(path):
            raise ArgumentError(f"--{flag.replace('_', '-')} {path}: no such file")


def _run_directories(args: argparse.Namespace) -> None:
    """--load is a directory if it exists; --save and the log directories can be created.

    Checked before anything starts: a --save under a file would otherwise fail at the first
    checkpoint, after hours of training.
    """
    load = getattr(args, "load", None)
    if load and os.path.exists(load) and not os.path.isdir(load):
        raise ArgumentError(f"--load {load}: a file, not a checkpoint directory")
    for flag in ("save", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, flag, None)
        if not path:
            continue
        name = "--" + flag.replace("_", "-")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"{name} {path}: a file, not a directory")
        parent = nearest_existing(os.path.dirname(os.path.abspath(path)))
        if not os.path.isdir(parent):
            raise ArgumentError(f"{name} {path}: cannot be created, {parent} is a file")
        if not os.access(parent if not os.path.isdir(path) else path, os.W_OK | os.X_OK):
            raise ArgumentError(f"{name} {path}: not writable by this user")


def _logging_packages(args: argparse.Namespace) -> None:
    """--wandb-project's package (the wandb extra), checked before anything starts: a W&B run
    that cannot start would otherwise stop the job after its model was built."""
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(
            f"--wandb-project {args.wandb_project}: needs the wandb package: "
            f"{install_hint('wandb', 'wandb')}"
        )


def _schedule(args: argparse.Namespace) -> None:
    """Check the LR schedule's settings as the scheduler does: its errors name the flags."""
    from megatron.training.scheduler import check_schedule, scheduler_arguments

    try:
        check_schedule(scheduler_arguments(args))
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def _backend(args: argparse.Namespace) -> None:
    import torch

    # The launcher's LOCAL_RANK wins over a --local_rank in the script: DeepSpeedExamples'
    # ds_pretrain_gpt2.sh passes `--local_rank 0` after the launcher's own `--local_rank=N`,
    # which would put every rank of a node on its first GPU.
    if os.environ.get("LOCAL_RANK", "").isdigit():
        args.local_rank = int(os.environ["LOCAL_RANK"])

    if args.distributed_backend is None:
        args.distributed_backend = job_backend(args)
    elif args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPUs")
    _timeout(args)


def _dry_run(args: argparse.Namespace) -> None:
    """A dry run plans for the job's machines, not this one: the data files, run directories
    and devices the job will have need not exist here (nor are any created); what the flags
    say about them is still checked."""
    args.train_data_corpus = None
    if getattr(args, "train_data", None):
        args.data_path = list(args.train_data)
    elif getattr(args, "data_path", None):
        from megatron.data.blendable_dataset import parse_data_path

        try:
            parse_data_path(args.data_path)
        except ValueError as error:
            raise ArgumentError(str(error)) from None
    args.distributed_backend = job_backend(args)
    _timeout(args)
    if args.dry_run_json:
        parent = os.path.dirname(os.path.abspath(args.dry_run_json))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ArgumentError(
                f"--dry-run-json {args.dry_run_json}: {parent} is not a writable directory"
            )


def _dry_run_flags_alone(args: argparse.Namespace) -> None:
    for flag in ("dry_run_world_size", "dry_run_json", "dry_run_device"):
        if getattr(args, flag, None) is not None:
            name = "--" + flag.replace("_", "-")
            raise ArgumentError(f"{name} needs --dry-run (it says how to plan, not to train)")


def _timeout(args: argparse.Namespace) -> None:
    timeout = getattr(args, "distributed_timeout_minutes", 10)
    if not timeout > 0:
        raise ArgumentError(f"--distributed-timeout-minutes {timeout:g}: must be above 0")


def _deepspeed_config(args: argparse.Namespace, explicit_flags: set[str] | None) -> str:
    if explicit_flags is None:
        # A namespace built in code has no command line: whatever it sets counts as given.
        explicit_flags = {
            name for name, value in vars(args).items() if value is not None and value is not False
        }
    if args.deepspeed_config_dict is not None:  # programmatic use: a dict instead of a file
        config, source = args.deepspeed_config_dict, "args.deepspeed_config_dict"
    elif args.deepspeed_config is None:
        # DeepSpeed itself would stop; every fact it needs is in the flags, so build it from them.
        config, source = {}, "the flags (no --deepspeed_config given)"
        args.compat_notes.append(
            " > --deepspeed without --deepspeed_config: DeepSpeed's config is built from the "
            "flags (batch sizes, precision, gradient clipping, --zero-stage, else DeepSpeed's "
            "defaults)"
        )
    else:
        config = load_deepspeed_config(args.deepspeed_config)
        source = f"--deepspeed_config {args.deepspeed_config}"
    args.deepspeed_config_dict = reconcile_deepspeed_config(args, config, explicit_flags, source)
    return source


def validate_args(
    args: argparse.Namespace, world_size: int, explicit_flags: set[str] | None = None
) -> argparse.Namespace:
    """Check every flag combination against the others and the world size; fill derived values.

    `explicit_flags` (dest names of the flags typed on the command line) decides which flags may
    contradict the DeepSpeed config; None counts every flag not left at None or False as typed.
    """
    args.deepspeed_config_dict = getattr(args, "deepspeed_config_dict", None)
    args.deepspeed = bool(getattr(args, "deepspeed", False))
    args.deepspeed_config = getattr(args, "deepspeed_config", None)
    # Start-up lines about the DeepSpeed config (printed by initialize_megatron).
    args.deepspeed_config_notes = []
    args.compat_notes = []  # start-up lines about spellings and defaults of other versions
    translate_v1_flags(args, explicit_flags, world_size)  # v1 spellings -> today's settings
    _their_spellings(args, explicit_flags)
    choose_moe_family(args, explicit_flags)  # Megatron-LM's MoE or DeepSpeed-MoE
    _parallel_sizes(args, world_size)
    _model_shape(args)
    if args.deepspeed:
        # Before the batch arithmetic: the config may give the micro or global batch size.
        config_source = _deepspeed_config(args, explicit_flags)
    _batch_sizes(args)
    _precision_and_optimizer(args)
    _recompute(args)
    _pipeline_and_checkpoints(args)
    settle_muon(args)  # before the sharding: Muon reads --use-distributed-optimizer
    settle_sharding(args)
    settle_checkpoint_format(args)
    settle_checkpoint_conversion(args)
    # Settled once: everything past here (and past validation) reads the layout.
    args.layout = ParallelLayout.from_args(args)
    refuse_what_the_engine_cannot_run(args, Step.LAYOUT)
    note_what_the_engine_ignores(args)
    settle_moe(args)
    settle_routed_moe(args)
    settle_moe_overlap(args)
    settle_mtp(args)
    check_housekeeping(args)
    settle_ulysses(args)
    settle_context_parallel(args)
    settle_fp8(args)
    if args.deepspeed:
        settle_gradient_accumulation_dtype(args, args.deepspeed_config_dict, config_source)
    # After the accumulation dtype: it picks DeepSpeed's optimizer wrapper.
    refuse_what_the_engine_cannot_run(args, Step.OPTIMIZER)
    _schedule(args)
    if getattr(args, "dry_run", False):
        _dry_run(args)
    else:
        _dry_run_flags_alone(args)
        _data_files(args)
        _run_directories(args)
        _logging_packages(args)
        _backend(args)
    args.params_dtype = model_params_dtype(args)
    if args.deepspeed:
        args.deepspeed_config_notes += set_aside_unused_sections(
            args, args.deepspeed_config_dict, config_source
        )
    return settle(args)  # read-only from here on


def batch_arithmetic(args: argparse.Namespace) -> str:
    """The start-up line: micro x accumulation x data-parallel = global batch, tokens/step."""
    tokens = args.global_batch_size * args.seq_length
    return (
        f" > batch: micro-batch {args.micro_batch_size} x gradient accumulation "
        f"{args.gradient_accumulation_steps} x data-parallel {args.data_parallel_size} = "
        f"global batch {args.global_batch_size} samples ({tokens:,} tokens per iteration)"
    )


def format_arguments(args: argparse.Namespace) -> str:
    """Megatron's sorted argument block (`------ arguments ------`, name ........ value)."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args), key=str.lower):
        if name in ("deepspeed_config_notes", "compat_notes"):
            continue  # printed as their own start-up lines
        dots = "." * (48 - len(name))
        lines.append(f"  {name} {dots} {getattr(args, name)}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
