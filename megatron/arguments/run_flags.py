"""Flag groups of `pretrain_gpt.py` that describe the run.

Training length and batch sizes, learning-rate schedule, checkpointing, logging (the parallel
layout and DeepSpeed are in `parallel_flags.py`). Names, defaults and meanings follow
Megatron-LM / Megatron-DeepSpeed; `megatron.arguments.build_parser` assembles these groups.
"""

from __future__ import annotations

import argparse

RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
"""`--recompute-modules` choices (Megatron-LM's)."""


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The training flags."""
    group = parser.add_argument_group("training")
    group.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="Samples per data-parallel rank per forward/backward pass (required, or the "
        "DeepSpeed config's train_micro_batch_size_per_gpu).",
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per iteration over all data-parallel ranks, reached by gradient "
        "accumulation; micro-batch x data-parallel size when unset.",
    )
    group.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Grow the global batch from START by INCREMENT over the first SAMPLES samples, "
        "then hold --global-batch-size; needs --train-samples.",
    )
    group.add_argument(
        "--train-iters", type=int, default=None, help="Iterations to train (or --train-samples)."
    )
    group.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Samples to train for (sets the iteration count); give this or --train-iters.",
    )
    group.add_argument(
        "--train-tokens",
        type=int,
        default=None,
        help="Also stop once this many tokens (global batch x sequence length per iteration, "
        "over all runs) are consumed, as in Megatron-DeepSpeed.",
    )
    group.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Save (with --save) and exit when the iteration number is a multiple of N.",
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=int,
        default=None,
        help="Save (with --save) and exit once this many minutes have passed since start-up.",
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM, finish the iteration, save (with --save) and exit without the final "
        "evaluation.",
    )
    group.add_argument(
        "--max-consecutive-skipped-iterations",
        type=int,
        default=100,
        help="Stop the run after this many iterations in a row were skipped (fp16 overflow, "
        "non-finite gradients) or had a NaN loss.",
    )
    group.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="Megatron's deprecated spelling of --recompute-granularity full with "
        "--recompute-method uniform and --checkpoint-num-layers layers per chunk.",
    )
    group.add_argument(
        "--checkpoint-num-layers",
        type=int,
        default=1,
        help="Layers per recomputed chunk for --checkpoint-activations (default: %(default)s).",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Activation recomputation: full (whole layers) or selective (attention core "
        "only); unset keeps all activations.",
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron's shorthand for --recompute-granularity selective.",
    )
    group.add_argument(
        "--recompute-modules",
        nargs="*",
        choices=RECOMPUTE_MODULES,
        default=None,
        help="With --recompute-granularity selective, the parts of each layer recomputed in "
        "the backward (Megatron-LM's; default core_attn): core_attn, mlp (the dense MLP), moe "
        "(the whole MoE layer), shared_experts, moe_act (the experts' activation), layernorm "
        "(the two norms' outputs), mla_up_proj (MLA's up-projections and rotary part).",
    )
    group.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="For full recomputation: uniform (every chunk of N layers) or block (only the "
        "first N layers); uniform when unset.",
    )
    group.add_argument(
        "--activations-checkpoint-method",
        choices=["uniform", "block"],
        default=None,
        help="Megatron-LM 2.x's switch: full recomputation with this method "
        "(--recompute-granularity full --recompute-method METHOD).",
    )
    group.add_argument(
        "--activations-checkpoint-num-layers",
        type=int,
        default=None,
        help="Megatron-LM 2.x's spelling of --recompute-num-layers.",
    )
    group.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="N of --recompute-method; 1 (or --checkpoint-num-layers) when unset.",
    )
    group.add_argument(
        "--distribute-saved-activations",
        "--distribute-checkpointed-activations",
        action="store_true",
        help="Keep only this tensor-parallel rank's share of each recomputed chunk's input "
        "(not with --sequence-parallel).",
    )
    group.add_argument(
        "--no-masked-softmax-fusion",
        action="store_false",
        dest="masked_softmax_fusion",
        help="Accepted for Megatron compatibility; no effect (there is no fused softmax kernel).",
    )
    group.add_argument(
        "--no-bias-gelu-fusion",
        action="store_false",
        dest="bias_gelu_fusion",
        help="Unfused bias add and the exact (erf) GeLU (tanh with --openai-gelu), instead of "
        "Megatron's fused tanh bias-GeLU (one compiled kernel on a GPU).",
    )
    group.add_argument(
        "--no-bias-dropout-fusion",
        action="store_false",
        dest="bias_dropout_fusion",
        help="Unfused bias add, dropout and residual add (fused into one compiled kernel on a "
        "GPU by default).",
    )
    group.add_argument(
        "--torch-compile",
        action="store_true",
        help="torch.compile (inductor): at TP=1 the whole model to the loss as one graph "
        "(not under ZeRO-3; on DeepSpeed's pipeline engine each stage one graph and the loss "
        "another, unless recomputing full layers), else each transformer layer (one graph "
        "shared by all layers); "
        "elementwise work fused; the first iteration pays the compile time. Generation with a "
        "key/value cache stays eager.",
    )
    group.add_argument(
        "--use-flash-attn",
        "--use-flash-attn-v1",
        "--use-flash-attn-triton",
        "--use-flash-attn-builder",
        action="store_true",
        help="Use flash attention (the flash_attn package if installed, else torch's flash "
        "kernel, compute capability 8.0+); needs a CUDA GPU.",
    )
    group.add_argument("--use-flash-attn-v2", action="store_true", help="Same as --use-flash-attn.")
    group.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="Draw full weights on the CPU, then split them: the same init for any "
        "tensor-parallel size.",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Seed of python, numpy and torch (plus 100 per pipeline stage) and of the data "
        "shuffles.",
    )
    group.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron-LM's loss normalisation: every unmasked token of the global batch "
        "weighs the same (the gradients are those of the summed loss divided by the global "
        "batch's token count) instead of every micro-batch's mean loss; the log line shows "
        "the token-weighted mean. Plain engine and Megatron's schedules. With --fp16 the "
        "loss scale multiplies a sum, so the dynamic scaler settles lower (it skips a few more "
        "iterations at the start).",
    )
    group.add_argument(
        "--dataloader-type",
        choices=["single", "cyclic"],
        default=None,
        help="Sampler: single (one pass in order) or cyclic (reshuffled every epoch); single "
        "when unset.",
    )
    group.add_argument(
        "--repeated-dataloader",
        action="store_true",
        help="When the training samples run out, read them again from the first instead of "
        "stopping (Megatron-DeepSpeed's; finetune_llama.py's Alpaca records are fewer than "
        "--train-iters takes). A resumed run continues where the pass it stopped in was.",
    )


def add_learning_rate_flags(parser: argparse.ArgumentParser) -> None:
    """The learning rate flags."""
    group = parser.add_argument_group("learning rate")
    group.add_argument(
        "--lr-warmup-init",
        type=float,
        default=0.0,
        help="Learning rate the warmup starts from (Megatron-LM's; default 0).",
    )
    group.add_argument(
        "--lr", type=float, default=None, help="Peak learning rate after warmup (required)."
    )
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning rate the decay ends at.")
    group.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="linear",
        help="Decay from --lr to --min-lr after warmup (default: %(default)s). WSD "
        "(Megatron-LM's warmup-stable-decay): --lr until the last --lr-wsd-decay-iters/-samples "
        "of the decay span, then --lr-wsd-decay-style down to --min-lr.",
    )
    group.add_argument(
        "--lr-wsd-decay-style",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        default="exponential",
        help="WSD's anneal curve (default: %(default)s).",
    )
    group.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD's anneal, in iterations (x --global-batch-size samples).",
    )
    group.add_argument(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="WSD's anneal, in samples.",
    )
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay over; --train-iters when unset (iteration-based runs only).",
    )
    group.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="Samples to decay over; --train-samples when unset (sample-based runs only).",
    )
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm up linearly over this fraction of the decay span (instead of "
        "--lr-warmup-iters/--lr-warmup-samples).",
    )
    group.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=0,
        help="Linear warmup iterations (with --train-iters).",
    )
    group.add_argument(
        "--lr-warmup-samples",
        type=int,
        default=0,
        help="Linear warmup samples (with --train-samples).",
    )
    group.add_argument(
        "--lr-warmup-tokens",
        type=int,
        default=None,
        help="Linear warmup over this many consumed tokens (Megatron-DeepSpeed); replaces the "
        "iteration/sample warmup.",
    )
    group.add_argument(
        "--lr-decay-tokens",
        type=int,
        default=None,
        help="Decay over this many consumed tokens (Megatron-DeepSpeed); replaces the "
        "iteration/sample decay span.",
    )
    group.add_argument(
        "--override-lr-scheduler",
        "--override-opt_param-scheduler",
        action="store_true",
        help="On resume, take the schedule (lr, min lr, warmup, decay) from the command line, "
        "not the checkpoint.",
    )
    group.add_argument(
        "--use-checkpoint-lr-scheduler",
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="On resume, take the schedule from the checkpoint, ignoring the command line "
        "(without either flag they must match).",
    )
    group.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="Peak learning rate of the input and output layers (word embeddings, untied output "
        "layer), on the same warmup and decay as --lr (Megatron-LM's).",
    )
    group.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="Floor of --decoupled-lr's decay (default: --min-lr).",
    )


def add_checkpointing_flags(parser: argparse.ArgumentParser) -> None:
    """The checkpointing flags."""
    group = parser.add_argument_group("checkpointing")
    group.add_argument(
        "--save",
        default=None,
        help="Checkpoint directory; saved to every --save-interval iterations and on exit.",
    )
    group.add_argument(
        "--save-interval", type=int, default=None, help="Iterations between saves (with --save)."
    )
    group.add_argument(
        "--no-save-optim",
        action="store_true",
        help="Leave optimizer and scheduler state out of checkpoints (not under --deepspeed).",
    )
    group.add_argument(
        "--no-save-rng", action="store_true", help="Leave RNG states out of checkpoints."
    )
    group.add_argument(
        "--load",
        default=None,
        help="Directory to resume from (Megatron or DeepSpeed layout); missing or empty "
        "starts a fresh run.",
    )
    group.add_argument(
        "--no-load-optim",
        action="store_true",
        help="Do not load optimizer and scheduler state; the schedule continues at the "
        "loaded iteration.",
    )
    group.add_argument(
        "--no-load-rng", action="store_true", help="Do not restore RNG states on resume."
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load model weights only and start at iteration 0 (no optimizer, scheduler or "
        "RNG state).",
    )
    group.add_argument(
        "--universal-checkpoint",
        action="store_true",
        help="Load a DeepSpeed universal checkpoint (made by deepspeed.checkpoint.ds_to_universal "
        "from a --deepspeed checkpoint), e.g. to resume on a different number of GPUs.",
    )


def add_dry_run_flags(parser: argparse.ArgumentParser) -> None:
    """The planner's flags: `--dry-run` and where and for whom it plans."""
    group = parser.add_argument_group("dry run (plan without training)")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate the flags and DeepSpeed config as a real run would, then print each "
        "rank's predicted peak memory (weights, gradients, optimizer, activations, buffers), "
        "communication bytes per iteration and FLOPs, and exit: no device, data files or "
        "process group needed.",
    )
    group.add_argument(
        "--dry-run-world-size",
        type=int,
        default=None,
        help="Plan for a job of N ranks (default: the launcher's WORLD_SIZE, else 1).",
    )
    group.add_argument(
        "--dry-run-json",
        default=None,
        metavar="PATH",
        help="Also write the plan as JSON to PATH (one entry per global rank).",
    )
    group.add_argument(
        "--dry-run-device",
        default=None,
        metavar="NAME",
        help="Judge the plan on this accelerator (H100, H200, A100-80GB, A100-40GB, L40S, ...): "
        "whether each rank fits, a roofline step time and MFU, and changes that make it fit.",
    )


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """The logging flags."""
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="Print the iteration line (loss, learning rate, throughput) every N iterations.",
    )
    group.add_argument(
        "--eval-interval",
        type=int,
        default=1000,
        help="Validate every N iterations; 0: only at the end.",
    )
    group.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="Global batches per evaluation; 0: no evaluation.",
    )
    group.add_argument(
        "--tensorboard-dir", default=None, help="TensorBoard directory (written by the last rank)."
    )
    group.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="Write per-iteration scalars (loss, lr, loss scale, grad norm) every N iterations.",
    )
    group.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Also write the timers (level 1 and up, whatever --timing-log-level says) every "
        "--log-interval.",
    )
    group.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Events TensorBoard's writer queues before it flushes to disk.",
    )
    group.add_argument(
        "--log-batch-size-to-tensorboard",
        action="store_true",
        help="Also write the global batch size (batch-size, and vs samples).",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Also write validation perplexity next to each validation loss.",
    )
    group.add_argument(
        "--log-optimizer-states-to-tensorboard",
        action="store_true",
        help="Also write norms of Adam's first and second moments and of the weights "
        "(costs one pass over the optimizer state per log).",
    )
    group.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Also write the memory in use (CUDA allocator, or the process's resident set).",
    )
    group.add_argument(
        "--log-world-size-to-tensorboard",
        action="store_true",
        help="Also write the number of processes.",
    )
    group.add_argument(
        "--no-log-learnig-rate-to-tensorboard",
        dest="log_learning_rate_to_tensorboard",
        action="store_false",
        help="Do not write the learning rate (Megatron's spelling, typo included).",
    )
    group.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard",
        action="store_false",
        help="Do not write the loss scale.",
    )
    group.add_argument(
        "--log-params-norm",
        action="store_true",
        help="Compute the L2 norm of all parameters; print it in the iteration line and "
        "write it to TensorBoard.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="0: time iterations only; 1 or 2: also print the train-step timer (min/max over "
        "ranks) every --log-interval.",
    )
    group.add_argument(
        "--timing-log-option",
        choices=["max", "minmax", "all"],
        default="minmax",
        help="Which times over ranks the timers print: the max, the min and max, or each rank's.",
    )
    group.add_argument(
        "--wandb-project",
        default=None,
        help="Also log scalars to this Weights & Biases project (offline without an API key).",
    )
    group.add_argument(
        "--wandb-exp-name", default=None, help="W&B run name; W&B picks one when unset."
    )
    group.add_argument(
        "--wandb-save-dir", default=None, help="W&B's local directory; ./wandb when unset."
    )
