"""Shared pieces of the training-step tests: layouts, data, one dense GPT, a recording runner.

Every layout (plain torch, DeepSpeed ZeRO 0-3, tensor / pipeline / data parallel) trains the
same tiny GPT from the same dense fp32 state dict, built once in the pytest process and loaded
into each rank's local model inside the `model_provider` handed to
`setup_model_and_optimizer` (TP shards cut along each parameter's `partition_dim`; pipeline
stages through `load_gpt_state_dict_into_pipeline`), on the same global batches (an in-memory
dataset read through `build_pretraining_data_loader`, so each data-parallel rank gets its slice
as in a real run). `run_layout` drives `TrainingLoop.step` and records, per iteration, the
`StepResult`, the scheduler and (optionally) the local weights; `run_training_loop` drives
`TrainingLoop.train`. A `Poison` switch turns one rank's losses NaN in chosen iterations.
`hand_training` is the single-process reference written with torch alone.

Spawned bodies never assert (as in tests/model/helpers.py): they return numbers and the
pytest process asserts, so a mismatch cannot leave one rank waiting in a collective.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.layout import Engine
from megatron.model import GPTModel
from megatron.settled_args import with_settled
from megatron.training.step import StepResult

NUM_LAYERS = 2
HIDDEN = 32
HEADS = 4
SEQ = 16
VOCAB = 128
"""The tokenizer's vocabulary size; padded as `pretrain()` pads it (a no-op at TP 1 and 2)."""
DIVISIBLE_BY = 64
GLOBAL_BATCH = 4
ITERATIONS = 5
LR, MIN_LR, WARMUP_ITERS, CLIP = 1e-2, 1e-3, 1, 1.0
WEIGHT_DECAY, BETAS, EPS = 0.1, (0.9, 0.999), 1e-8
INIT_STD = 0.2
"""Larger than GPT-2's 0.02 so the gradient norm exceeds --clip-grad and clipping acts."""
DATA_SEED, MODEL_SEED = 7, 11
POSITION_KEY = "language_model.embedding.position_embeddings.weight"

BASE_FLAGS = (
    f"--num-layers {NUM_LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} "
    f"--seq-length {SEQ} --max-position-embeddings {SEQ} "
    f"--make-vocab-size-divisible-by {DIVISIBLE_BY} --init-method-std {INIT_STD} "
    "--attention-dropout 0 --hidden-dropout 0 "
    f"--global-batch-size {GLOBAL_BATCH} --train-iters {ITERATIONS} "
    f"--lr {LR} --min-lr {MIN_LR} --lr-warmup-iters {WARMUP_ITERS} --lr-decay-style cosine "
    f"--weight-decay {WEIGHT_DECAY} --adam-beta1 {BETAS[0]} --adam-beta2 {BETAS[1]} "
    f"--adam-eps {EPS} --clip-grad {CLIP} --seed 1234 --num-workers 0 "
    "--distributed-backend gloo --log-interval 1000 --eval-interval 0"
).split()


@dataclass(frozen=True)
class Layout:
    """One way of running the same training: engine, parallel sizes, ZeRO stage, micro-batch."""

    name: str
    world_size: int
    micro_batch: int
    tp: int = 1
    pp: int = 1
    zero: int | None = None
    """ZeRO stage under --deepspeed; None is the plain-torch path."""
    pipeline_engine: bool = False
    """DeepSpeed's PipelineEngine (the default under --deepspeed); else --no-pipeline-parallel."""
    flags: tuple[str, ...] = ()
    """More flags of the run (e.g. the loss normalisation)."""

    def argv(self, config_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
        """The command line of this layout (a DeepSpeed config file is written when needed)."""
        argv = [*BASE_FLAGS, "--micro-batch-size", str(self.micro_batch)]
        argv += ["--tensor-model-parallel-size", str(self.tp)]
        argv += ["--pipeline-model-parallel-size", str(self.pp)]
        if self.zero is not None:
            path = os.path.join(config_dir, "ds_config.json")
            with open(path, "w", encoding="utf-8") as file:
                # The rest comes from the flags (megatron.arguments.ds_config reconciles them).
                json.dump({"wall_clock_breakdown": False}, file)
            argv += ["--deepspeed", "--deepspeed_config", path, "--zero-stage", str(self.zero)]
            if not self.pipeline_engine:
                argv.append("--no-pipeline-parallel")
        return argv + list(self.flags) + list(extra)


def model_config() -> ModelConfig:
    """The dense model every layout trains."""
    return ModelConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        use_cpu_initialization=True,
    )


def dense_state_dict() -> dict[str, torch.Tensor]:
    """One fp32 GPTModel state dict (TP=1), fixed by MODEL_SEED; built in the pytest process."""
    torch.manual_seed(MODEL_SEED)
    return {name: tensor.clone() for name, tensor in GPTModel(model_config()).state_dict().items()}


def sample_tokens(count: int, seed: int = DATA_SEED) -> np.ndarray:
    """`count` samples of SEQ + 1 tokens: a learnable affine chain with 10% random tokens."""
    rng = np.random.default_rng(seed)
    tokens = np.empty((count, SEQ + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCAB, count)
    for position in range(1, SEQ + 1):
        tokens[:, position] = (5 * tokens[:, position - 1] + 3) % VOCAB
    noise = rng.random((count, SEQ + 1)) < 0.1
    tokens[noise] = rng.integers(0, VOCAB, int(noise.sum()))
    return tokens


class TokenDataset(torch.utils.data.Dataset):
    """An in-memory GPT dataset: sample i is {"text": SEQ + 1 int64 tokens}, like GPTDataset."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"text": self.tokens[index]}


# --- inside a spawned rank ------------------------------------------------------------------


def _shard(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This TP rank's piece of a dense tensor, cut the way the parallel layers split it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if param.partition_stride != 1:
        raise ValueError(f"strided partitions are not handled (stride {param.partition_stride})")
    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(world, dim=param.partition_dim)[rank]


def _pipeline_names(dense: dict[str, torch.Tensor]) -> dict[str, str]:
    """GPTModelPipe parameter name -> GPTModel name."""
    from megatron.model.pipeline import gpt_to_pipeline_name

    return {gpt_to_pipeline_name(name, NUM_LAYERS): name for name in dense}


def load_dense(module: torch.nn.Module, dense: dict[str, torch.Tensor], pipeline: bool) -> list:
    """Copy `dense` into a GPTModel or GPTModelPipe (TP shards); the local names left unset."""
    params = dict(module.named_parameters())
    names = _pipeline_names(dense) if pipeline else {name: name for name in dense}
    local = {names[key]: key for key in params if key in names}  # dense name -> local name
    sharded = {name: _shard(dense[name], params[key]) for name, key in local.items()}
    with torch.no_grad():
        if pipeline:
            from megatron.model.pipeline import load_gpt_state_dict_into_pipeline

            load_gpt_state_dict_into_pipeline(module, sharded, NUM_LAYERS)
        else:
            for name, tensor in sharded.items():
                params[name].copy_(tensor)
    # Anything the loader missed would keep its seeded init: report it (compared, not ignored).
    return sorted(
        key
        for key, param in params.items()
        if key not in names or not torch.equal(param.detach(), sharded[names[key]])
    )


def load_dense_into_chunks(chunks: torch.nn.ModuleList, dense: dict) -> list:
    """Copy `dense` into this rank's Megatron-schedule chunks (each numbers its layers from
    0, as Megatron's files do); the local names left unset."""
    from megatron.checkpointing.pipeline_stages import chunk_state_dict

    size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    unset = []
    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            wanted = chunk_state_dict(dense, NUM_LAYERS, size, len(chunks), rank, index)
            for name, param in chunk.named_parameters():
                if name in wanted:
                    param.copy_(_shard(wanted[name], param))
                else:
                    unset.append(f"{index}.{name}")
    return unset


def _chunk_weights(chunks: torch.nn.ModuleList) -> dict[str, torch.Tensor]:
    """This rank's chunks' parameters under GPTModel names (the head copy of the tied
    embedding left out), TP shards gathered to full size."""
    from megatron.checkpointing.pipeline_stages import HEAD_WEIGHT, chunk_layers, renumber_layers
    from tests.model.helpers import gather_shards

    size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    weights = {}
    for index, chunk in enumerate(chunks):
        first = chunk_layers(NUM_LAYERS, size, len(chunks), rank, index).start
        state = {
            name: gather_shards(param.detach().clone(), param)
            for name, param in chunk.named_parameters()
            if name != HEAD_WEIGHT
        }
        weights.update(renumber_layers(state, first))
    return weights


def local_module(model) -> torch.nn.Module:  # noqa: ANN001 - engine or PlainTrainer
    """The GPTModel / GPTModelPipe inside a PlainTrainer (maybe DDP) or a DeepSpeed engine."""
    from megatron.training.step import PlainTrainer

    if not isinstance(model, PlainTrainer):
        return model.module
    ddp = isinstance(model.model, torch.nn.parallel.DistributedDataParallel)
    return model.model.module if ddp else model.model


def local_weights(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Copies of this rank's parameters as they are stored (shards, partitions): bit-exact."""
    return {name: p.detach().clone() for name, p in local_module(model).named_parameters()}


def dense_weights(model, layout: Layout, dense: dict) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """This rank's parameters under GPTModel names, TP shards gathered to full size.

    ZeRO-3 partitions are gathered first. A pipeline stage other than the first reports no
    position table: its copy of the tied embedding module never uses (or trains) it.
    """
    from tests.model.helpers import gather_shards

    module = local_module(model)
    if isinstance(module, torch.nn.ModuleList):  # Megatron's schedules
        return _chunk_weights(module)
    params = list(module.named_parameters())
    names = _pipeline_names(dense) if layout.pipeline_engine else {name: name for name, _ in params}
    if layout.zero == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    else:
        gathered = torch.no_grad()
    unused_position_table = layout.pipeline_engine and not parallel_state.is_pipeline_first_stage()
    weights = {}
    with gathered:
        for key, param in params:
            name = names[key]
            if name == POSITION_KEY and unused_position_table:
                continue
            weights[name] = gather_shards(param.detach().clone(), param)
    return weights


class Poison:
    """A switch the driver flips: while on, this rank's per-token losses become NaN."""

    def __init__(self) -> None:
        self.on = False

    def forward_step(self, forward_step: Callable) -> Callable:
        """`forward_step` whose output is multiplied by NaN while the switch is on."""

        def poisoned(data_iterator, model, args):  # noqa: ANN001, ANN202
            output, loss_func = forward_step(data_iterator, model, args)
            if self.on:
                output = output * float("nan")
            return output, loss_func

        return poisoned

    def batch_fn(self, batch_fn: Callable) -> Callable:
        """A pipeline batch function whose loss mask is NaN while the switch is on."""

        def poisoned(data, args):  # noqa: ANN001, ANN202
            inputs, (labels, loss_mask) = batch_fn(data, args)
            if self.on:
                loss_mask = loss_mask * float("nan")
            return inputs, (labels, loss_mask)

        return poisoned


def build(  # noqa: ANN201
    layout: Layout,
    dense: dict,
    config_dir: str,
    extra: tuple[str, ...] = (),
    poison: Poison | None = None,
):
    """Flags, groups, seeds, then the run's engine (`build_engine`) with the dense weights
    loaded, over pretrain_gpt's forward step and pipeline batch (switchable to NaN by
    `poison`). Returns (args, engine, names the loader left unset).
    """
    import pretrain_gpt
    from megatron.arguments import parse_args
    from megatron.core.tensor_parallel.meta_init import whole_build
    from megatron.initialize import set_random_seed
    from megatron.tokenizer.tokenizer import vocab_size_with_padding
    from megatron.training.engines import PipelineBatch
    from megatron.training.training import build_engine

    args = parse_args(layout.argv(config_dir, extra), world_size=layout.world_size)
    # What pretrain() takes from the tokenizer.
    padded = vocab_size_with_padding(VOCAB, DIVISIBLE_BY, layout.tp, False)
    args = with_settled(args, padded_vocab_size=padded, eod_token_id=0)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(layout.tp, layout.pp)
    set_random_seed(args.seed)
    unset: list[str] = []

    def provider(args):  # noqa: ANN001, ANN202
        with whole_build():  # the dense weights go into it (FSDP2 would build on meta)
            model = pretrain_gpt.model_provider(args)
        if args.layout.engine is Engine.MEGATRON_SCHEDULES:
            unset.extend(load_dense_into_chunks(model, dense))
        else:
            unset.extend(load_dense(model, dense, args.layout.engine is Engine.DEEPSPEED_PIPE))
        return model

    forward_step, batch_fn = pretrain_gpt.forward_step, pretrain_gpt.get_batch_pipe
    if poison is not None:
        forward_step, batch_fn = poison.forward_step(forward_step), poison.batch_fn(batch_fn)
    pipeline_batch = PipelineBatch(
        batch_fn=batch_fn,
        loss_func=pretrain_gpt.loss_func,
        per_token_loss_func=pretrain_gpt.per_token_loss_func,
    )
    engine = build_engine(provider, args, forward_step, pipeline_batch)
    return args, engine, unset


def data_iterator(args, samples: np.ndarray):  # noqa: ANN001, ANN201
    """This rank's micro-batches of the shared samples, as pretrain() reads them."""
    from megatron.data.samplers import build_pretraining_data_loader

    loader = build_pretraining_data_loader(
        TokenDataset(samples),
        0,
        args.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        num_workers=0,
    )
    return iter(loader)


@dataclass
class Iteration:
    """What one `TrainingLoop.step` gave, plus the scheduler after it and (maybe) weights."""

    result: StepResult
    lr: float
    scheduler_steps: int
    weights: dict[str, torch.Tensor] | None = None


def _wire(layout: Layout, dense: dict, config_dir: str, extra: tuple[str, ...] = ()):  # noqa: ANN202
    """`build`, then a `TrainingLoop` whose forward step / pipeline batch function a `Poison`
    switch can turn NaN. Returns (args, model, scheduler, loop, poison, unset)."""
    from megatron.training.loop import TrainingLoop
    from megatron.training.monitor import Timers

    poison = Poison()
    args, engine, unset = build(layout, dense, config_dir, extra, poison)
    loop = TrainingLoop(args, engine, Timers(0), None)
    return args, engine.model, engine.scheduler, loop, poison, unset


def without_batch(samples: np.ndarray, number: int | None) -> np.ndarray:
    """The samples with global batch `number` (1-based) removed; all of them for None."""
    if number is None:
        return samples
    start = (number - 1) * GLOBAL_BATCH
    return np.delete(samples, np.arange(start, start + GLOBAL_BATCH), axis=0)


def run_layout(
    layout: Layout,
    dense: dict,
    samples: np.ndarray,
    config_dir: str,
    iterations: int = ITERATIONS,
    poison_at: int | None = None,
    poison_ranks: tuple[int, ...] | None = None,
    keep_weights: bool = False,
    drop_batch: int | None = None,
) -> dict[str, object]:
    """Train `iterations` steps through `TrainingLoop.step`; record every iteration.

    In iteration `poison_at` (1-based) the per-token losses become NaN on the global ranks in
    `poison_ranks` (None: every rank). `keep_weights` records this rank's bit-exact local
    parameters before and after each iteration. `drop_batch` trains on the samples without
    that global batch (the twin of a run whose iteration `drop_batch` was skipped).
    """
    args, model, scheduler, loop, poison, unset = _wire(layout, dense, config_dir)
    rank = torch.distributed.get_rank()
    batches = data_iterator(args, without_batch(samples, drop_batch))
    record = {
        "initial": local_weights(model) if keep_weights else None,
        "initial_scheduler_steps": scheduler.num_steps,
        "iterations": [],
    }
    for number in range(1, iterations + 1):
        poison.on = number == poison_at and (poison_ranks is None or rank in poison_ranks)
        result = loop.step(batches)
        poison.on = False
        record["iterations"].append(
            Iteration(
                result=result,
                lr=scheduler.get_lr(),
                scheduler_steps=scheduler.num_steps,
                weights=local_weights(model) if keep_weights else None,
            )
        )
    record.update(
        final=dense_weights(model, layout, dense),
        unset=unset,
        rank=rank,
    )
    return record


def run_training_loop(
    layout: Layout,
    dense: dict,
    samples: np.ndarray,
    config_dir: str,
    bad_iterations: tuple[int, ...],
    train_iters: int,
    max_consecutive: int,
) -> dict[str, object]:
    """`TrainingLoop.train` with NaN losses in `bad_iterations` (1-based); how it ended."""
    from dataclasses import asdict

    from megatron.checkpointing import TrainState
    from megatron.training.loop import TrainingStopped

    extra = (
        "--train-iters",
        str(train_iters),
        "--max-consecutive-skipped-iterations",
        str(max_consecutive),
    )
    args, _, _, loop, poison, _ = _wire(layout, dense, config_dir, extra)
    state = TrainState()
    step = loop.step

    def step_poisoned_when_bad(*step_args, **step_kwargs):  # noqa: ANN002, ANN003, ANN202
        poison.on = state.iteration + 1 in bad_iterations  # the loop counts after the step
        try:
            return step(*step_args, **step_kwargs)
        finally:
            poison.on = False

    loop.step = step_poisoned_when_bad
    try:
        loop.train(data_iterator(args, samples), None, state)
        stopped = None
    except TrainingStopped as error:
        stopped = str(error)
    return {"stopped": stopped, "state": asdict(state)}


def init_deepspeed_comm() -> None:
    """DeepSpeed's communication layer over the default (gloo) group run_distributed made."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


RUNNERS = {"steps": run_layout, "loop": run_training_loop}


def run_jobs(rank: int, world_size: int, jobs: list, dense: dict, samples, tmp: str) -> dict:
    """Spawned body: each job `(key, runner, layout, kwargs)` in turn; {key: its record}.

    `runner` names `run_layout` ("steps") or `run_training_loop` ("loop").
    """
    del world_size
    init_deepspeed_comm()
    records = {}
    for index, (key, runner, layout, kwargs) in enumerate(jobs):
        config_dir = os.path.join(tmp, f"job{index}-rank{rank}")
        os.makedirs(config_dir, exist_ok=True)
        records[key] = RUNNERS[runner](layout, dense, samples, config_dir, **kwargs)
    return records


# --- the reference by hand, in the pytest process --------------------------------------------


def scheduled_lr(consumed_samples: int) -> float:
    """Megatron's warmup + cosine schedule over samples, written out from its definition."""
    warmup = WARMUP_ITERS * GLOBAL_BATCH
    decay = ITERATIONS * GLOBAL_BATCH
    if consumed_samples <= warmup:
        return LR * consumed_samples / warmup
    ratio = (consumed_samples - warmup) / (decay - warmup)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def hand_training(
    dense: dict, samples: np.ndarray, iterations: int = ITERATIONS, eod_mask: bool = False
) -> dict:
    """torch AdamW + clip_grad_norm_ + the schedule above on one GPTModel: losses, norms.

    The loss is the mean over the global batch's tokens; with `eod_mask`, over those whose
    input is not the end-of-document token 0 (`--eod-mask-loss`), every one weighing the same.
    """
    model = GPTModel(model_config())
    model.load_state_dict(dense)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1 or n.endswith(".bias")]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
    )
    losses, norms = [], []
    for step in range(iterations):
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(step * GLOBAL_BATCH)
        text = torch.from_numpy(samples[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH])
        per_token = model(text[:, :-1], labels=text[:, 1:])
        if eod_mask:
            mask = (text[:, :-1] != 0).float()
            loss = (per_token * mask).sum() / mask.sum()
        else:
            loss = per_token.mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "final": dict(model.state_dict())}


def spawn_jobs(
    world_size: int, jobs: list, dense: dict, samples: np.ndarray
) -> dict[str, list[dict]]:
    """Run `jobs` (see `run_jobs`) in one spawned gloo world; {key: [record of each rank]}."""
    import tempfile

    from tests.model.helpers import spawn_collect

    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn_collect(run_jobs, world_size, jobs, dense, samples, tmp)
    return {key: [records[key] for records in ranks] for key in ranks[0]}


# --- comparing weights -----------------------------------------------------------------------


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (flattened), minus the key entries if it is a query_key_value bias.

    Adding the key bias b_k adds q_i . b_k to every score of query i, which the softmax
    ignores: its gradient is exactly zero, and in fp32 it is rounding noise (~1e-9) that
    Adam's normalization turns into steps of about +-lr whose signs follow the summation
    order. No two layouts (nor two summation orders) agree on it, so it is left out of weight
    comparisons. The bias is laid out [heads, (q, k, v), head width], as Megatron's.
    """
    if not name.endswith("self_attention.query_key_value.bias"):
        return tensor.reshape(-1)
    keep = torch.ones(HEADS, 3, tensor.numel() // (3 * HEADS), dtype=torch.bool)
    keep[:, 1] = False
    return tensor.reshape(-1)[keep.reshape(-1)]
