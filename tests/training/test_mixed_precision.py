"""--fp16 / --bf16 on both paths: they train, track fp32, scale losses and resume bit-exactly.

The runs are real `pretrain_gpt.py` runs of a tiny GPT-2 (2 layers, h=64, 16 tokens, two
micro-batches of one sample per iteration, dropout on) on the stdlib corpus, 50 iterations
each, compared with the same run in fp32. Half-precision matmuls are ~10x slower than fp32 on
this CPU, hence the short sequences.

Tolerance of the loss comparison: bf16 keeps 8 significant bits and fp16 11, so each matmul
output is rounded by up to 2^-9 relative (bf16); through a 2-layer model and 50 updates the
loss moved by at most 2e-4 relative in our runs (bf16 parameters under DeepSpeed included).
We allow 0.5%: 25 times that, yet 40 times smaller than what the 50 iterations change
(10.8 -> 8.6), so a run that does not learn, or learns from other gradients, fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

from megatron.config import ModelConfig, model_params_dtype
from megatron.training.optimizer import DynamicLossScaler, GuardedAdamW
from megatron.training.scheduler import OptimizerParamScheduler
from megatron.training.step import PlainTrainer, train_step_plain
from tests.checkpointing.compare import differences, load_any, rolled_back
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE
from tests.distributed import free_port, run_distributed
from tests.preloaded import launch_command
from tests.pretrain_runs import cpu_env, iteration_logs, launch, tiny_gpt_flags

ITERATIONS = 50
RELATIVE_TOLERANCE = 5e-3
SHORT = (
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 2 "
    f"--train-iters {ITERATIONS}"
).split()
CASES = {
    "plain-bf16": ["--bf16"],
    # An initial scale that never overflows here: every iteration is applied and comparable.
    "plain-fp16": ["--fp16", "--initial-loss-scale", "4096"],
    "zero0-bf16": ["--bf16", "--zero-stage", "0"],
    "zero1-bf16": ["--bf16", "--zero-stage", "1"],
    "zero2-bf16": ["--bf16", "--zero-stage", "2"],
    # FP8 matmuls (torchao) on both paths: fp32 master weights under autocast, and DeepSpeed's
    # bf16 parameters.
    "plain-bf16-fp8": ["--bf16", "--fp8-format", "hybrid"],
    "zero1-bf16-fp8": ["--bf16", "--fp8-format", "hybrid", "--zero-stage", "1"],
}
# FP8 rounds each matmul operand to 3 (E4M3) or 2 (E5M2, gradients) mantissa bits, 2^-4 and
# 2^-3 relative: the loss moved by up to 0.4% from fp32's in our runs. Megatron-LM's and the
# issue's criterion for FP8 tracking bf16 is 2%; still 10 times smaller than the learning.
FP8_RELATIVE_TOLERANCE = 2e-2
RESUMED = ("plain-bf16", "plain-fp16", "zero1-bf16", "plain-bf16-fp8")


class Runs:
    """Each case's straight run (saving at 25 and 50), made once and shared by the tests."""

    def __init__(self, dataset: str, root: str) -> None:
        self.dataset, self.root, self.done = dataset, root, {}

    def flags(self, case: str) -> list[str]:
        """The command line of `case` (plus the DeepSpeed config for the zero cases)."""
        flags = tiny_gpt_flags(self.dataset) + SHORT + CASES.get(case, [])
        if case.startswith("zero"):
            config = os.path.join(self.root, "ds_config.json")
            with open(config, "w") as file:
                json.dump({"train_micro_batch_size_per_gpu": 1}, file)
            flags += ["--deepspeed", "--deepspeed_config", config]
        return flags

    def straight(self, case: str) -> tuple[list[dict], str]:
        """Iteration logs of the 50-iteration run and its --save directory."""
        if case not in self.done:
            save = os.path.join(self.root, case)
            flags = self.flags(case) + ["--save", save, "--save-interval", str(ITERATIONS // 2)]
            done = launch(1, flags, timeout=600)
            assert done.returncode == 0, done.stdout[-3000:]
            self.done[case] = (iteration_logs(done.stdout), save, done.stdout)
        logs, save, _ = self.done[case]
        return logs, save

    def output(self, case: str) -> str:
        """The straight run's whole log."""
        self.straight(case)
        return self.done[case][2]


@pytest.fixture(scope="module")
def runs(stdlib_dataset: str, tmp_path_factory) -> Runs:
    return Runs(stdlib_dataset, str(tmp_path_factory.mktemp("mixed_precision")))


def test_plain_path_keeps_fp32_parameters() -> None:
    for flags in ({"bf16": True}, {"fp16": True}, {}):
        args = argparse.Namespace(**{"deepspeed": False, "bf16": False, "fp16": False, **flags})
        assert model_params_dtype(args) == "float32"
    assert model_params_dtype(argparse.Namespace(deepspeed=True, bf16=True)) == "bfloat16"
    assert model_params_dtype(argparse.Namespace(deepspeed=True, fp16=True)) == "float16"
    # Megatron's own checkpoints store args.params_dtype as a torch.dtype: the rule ignores it.
    megatron_args = argparse.Namespace(
        num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
        max_position_embeddings=64, fp16=True, params_dtype=torch.float16,
    )  # fmt: skip
    assert ModelConfig.from_args(megatron_args).params_dtype == "float32"


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_an_update_below_half_resolution_moves_the_fp32_master_weight(half) -> None:
    """100 AdamW steps of 3e-5 on a weight of 1.0: each is below half precision's spacing."""

    def train(dtype: torch.dtype) -> float:
        weight = torch.nn.Parameter(torch.full((4, 4), 1.0, dtype=dtype))
        optimizer = GuardedAdamW([weight], lr=3e-5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        for _ in range(100):
            with torch.autocast("cpu", dtype=half):
                loss = (torch.ones(2, 4) @ weight).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return weight.float().mean().item()

    # Adam's step is ~lr per iteration whatever the gradient's size: 1.0 - 100 x 3e-5.
    assert train(torch.float32) == pytest.approx(0.997, abs=1e-5)
    # Stepping the half-precision weight itself loses every update (what we used to do).
    assert train(half) == 1.0


def test_an_injected_inf_gradient_skips_the_step_and_lowers_the_scale() -> None:
    """fp16 plain path, after real steps: an inf gradient (injected by a hook on one weight at
    step 4) skips the update, leaves weights and Adam state bit-identical, does not advance
    the LR schedule, and counts against the hysteresis (2): the scale halves at the 2nd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    optimizer = GuardedAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0
    )
    scheduler = OptimizerParamScheduler(
        optimizer, 0.0, 1e-2, 1e-3, 0, 100, "cosine", 0.01, 0.01, 100, "constant"
    )
    scaler = DynamicLossScaler(initial_scale=2.0**16, min_scale=1.0, growth_interval=1000)
    trainer = PlainTrainer(model, optimizer, scheduler, scaler, torch.float16, 2)
    data = iter(torch.randn(100, 4, 8, generator=torch.Generator().manual_seed(1)))

    def forward_step(iterator, module, args):  # noqa: ANN001, ANN202 - Megatron's signature
        output = module(next(iterator)).square().mean()
        return output, lambda out: (out, {"lm loss": out})

    args = argparse.Namespace(global_batch_size=2)
    for _ in range(3):
        assert not train_step_plain(forward_step, data, trainer, args).skipped

    def snapshot() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values()]
        return [t.clone() for t in [*model.parameters(), *state]]

    def poisoned_step():  # noqa: ANN202
        hook = model[0].weight.register_hook(lambda grad: grad * float("inf"))
        try:
            return train_step_plain(forward_step, data, trainer, args)
        finally:
            hook.remove()

    before, lr, samples = snapshot(), optimizer.param_groups[0]["lr"], scheduler.num_steps
    first = poisoned_step()
    assert first.skipped and first.grad_norm is None and not first.nan
    assert first.loss_scale == 2.0**16  # hysteresis 2 -> 1: the scale holds
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))
    assert (optimizer.param_groups[0]["lr"], scheduler.num_steps) == (lr, samples)
    assert poisoned_step().loss_scale == 2.0**15  # the second overflow halves it
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))
    applied = train_step_plain(forward_step, data, trainer, args)
    assert not applied.skipped and applied.loss_scale == 2.0**15
    assert not torch.equal(model[0].weight, before[0])


def _accumulated_gradient_errors(rank: int, world_size: int, stage: int, out: str) -> None:
    """Our reconciled config, then DeepSpeed's default (bf16), at ZeRO `stage`: each one's
    accumulated-gradient error (`_accumulated_gradient_error`) and optimizer, to `out`."""
    results = {
        name: _accumulated_gradient_error(world_size, stage, types)
        for name, types in (("filled", {}), ("bf16", {"data_types": {"grad_accum_dtype": "bf16"}}))
    }
    with open(out, "w") as file:
        json.dump(results, file)


def _accumulated_gradient_error(world_size: int, stage: int, config_types: dict) -> dict:
    """64 micro-batches of bf16 gradients through a DeepSpeed engine built from our reconciled
    config: the accumulated gradient's mean relative error against the fp32 sum."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from megatron.arguments import build_parser, validate_args

    argv = (
        "--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 8 --lr 0.0 "
        "--train-iters 1 --micro-batch-size 1 --global-batch-size 64 --bf16 --deepspeed "
        f"--zero-stage {stage} --no-pipeline-parallel"
    ).split()
    args = build_parser().parse_args(argv)
    args.deepspeed_config_dict = dict(config_types)
    config = validate_args(args, world_size).deepspeed_config_dict
    model = torch.nn.Linear(1024, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inputs = torch.randn(64, 1, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    for index, x in enumerate(inputs):
        engine.backward(engine(x).float().sum())
        if index < len(inputs) - 1:
            engine.step()  # not a boundary: DeepSpeed only accumulates
    # After the boundary's backward, before its step: the gradient the optimizer will use.
    got = safe_get_full_grad(model.weight).float().flatten()
    expected = (inputs.float() / len(inputs)).sum(0).flatten()
    error = ((got - expected).abs() / expected.abs().clamp_min(1e-3)).mean().item()
    return {"error": error, "optimizer": type(engine.optimizer).__name__}


@pytest.mark.slow  # 64 micro-batches through DeepSpeed's engine: 45 s at ZeRO-1
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_bf16_accumulates_gradients_in_fp32(stage: int, tmp_path) -> None:
    """The config we fill (grad_accum_dtype fp32) against DeepSpeed's default (bf16): the
    gradient of 64 micro-batches is off by ~2% in bf16; in fp32 it is exact (ZeRO-2) or rounded
    once to bf16 for the reduction (ZeRO-1's BF16_Optimizer, 2^-9 at most)."""

    out = str(tmp_path / "errors.json")
    run_distributed(_accumulated_gradient_errors, 1, stage, out)
    with open(out) as file:
        results = json.load(file)
    filled, in_bf16 = results["filled"], results["bf16"]
    assert in_bf16["error"] > 1e-2
    assert filled["error"] < (1e-6 if stage == 2 else 2.0**-9)
    assert filled["optimizer"] == ("BF16_Optimizer" if stage == 1 else "DeepSpeedZeroOptimizer")


@pytest.fixture(scope="module")
def fp32_losses(runs: Runs) -> list[float]:
    flags = tiny_gpt_flags(runs.dataset) + SHORT
    done = launch(1, flags, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    return [log["lm loss"] for log in iteration_logs(done.stdout)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_half_precision_tracks_fp32_for_50_iterations(
    case: str, runs: Runs, fp32_losses: list[float]
) -> None:
    logs, _ = runs.straight(case)
    assert len(logs) == len(fp32_losses) == ITERATIONS
    assert all(log["number of nan iterations"] == 0 for log in logs)
    assert all(log["number of skipped iterations"] == 0 for log in logs)
    tolerance = FP8_RELATIVE_TOLERANCE if case.endswith("fp8") else RELATIVE_TOLERANCE
    for log, expected in zip(logs, fp32_losses):
        assert log["lm loss"] == pytest.approx(expected, rel=tolerance), log
    assert fp32_losses[-1] < fp32_losses[0] - 1.0  # the comparison is over real learning
    # DeepSpeed 0.19 has no fp32 accumulation of bf16 gradients at ZeRO 0 (see ds_config.py).
    accumulation = "bf16" if case == "zero0-bf16" else "fp32"
    assert f"gradient accumulation {accumulation}" in runs.output(case)
    fp8_line = "FP8 matmuls hybrid tensorwise (torchao)"
    assert (fp8_line in runs.output(case)) == case.endswith("fp8")


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED)
def test_half_precision_resumes_bit_exactly(case: str, runs: Runs, tmp_path) -> None:
    """From the straight run's checkpoint at 25 to 50: the same losses, and the same final
    checkpoint (weights, fp32 master copy, optimizer state, loss scaler, RNG), `args` aside."""
    logs, save = runs.straight(case)
    half = ITERATIONS // 2
    resumed_dir = rolled_back(save, half, str(tmp_path / "resumed"))
    flags = runs.flags(case) + ["--load", resumed_dir, "--save", resumed_dir]
    done = launch(1, flags + ["--save-interval", str(half)], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"at iteration {half}" in done.stdout
    resumed = iteration_logs(done.stdout)
    assert [log["iteration"] for log in resumed] == list(range(half + 1, ITERATIONS + 1))
    assert [log["lm loss"] for log in resumed] == [log["lm loss"] for log in logs[half:]]
    name = f"global_step{ITERATIONS}" if case.startswith("zero") else f"iter_{ITERATIONS:07d}"
    assert differences(os.path.join(save, name), os.path.join(resumed_dir, name)) == []


def megatron_dynamic_grad_scaler(initial: float, found_infs: list[bool]) -> list[float]:
    """The scale after each iteration under Megatron's DynamicGradScaler.update (transcribed;
    min_scale 1, growth 2, backoff 0.5, growth_interval 1000, hysteresis 2: our defaults)."""
    scale, growth_tracker, hysteresis_tracker, scales = initial, 0, 2, []
    for found_inf in found_infs:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth_tracker += 1
            if growth_tracker == 1000:
                growth_tracker = 0
                hysteresis_tracker = 2
                scale = scale * 2.0
        scales.append(scale)
    return scales


# Megatron-DeepSpeed's examples/pretrain_gpt.sh (the 345M model, torchrun, --fp16, no
# DeepSpeed), with the model, lengths and intervals scaled to this CPU; every other flag as
# the script has it. --log-interval 1 so each iteration's loss scale is seen; --lr 6e-4 (the
# GPT-3 125M value) as the model is small: at 1.5e-4 two layers barely move in 50 iterations.
PRETRAIN_GPT_SH = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16
    --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 2 --lr 0.0006
    --train-iters 50 --lr-decay-iters 32 --lr-decay-style cosine --min-lr 1.0e-5
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --data-impl mmap --split 949,50,1
    --log-interval 1 --save-interval 25 --eval-interval 1000 --eval-iters 1
""".split()


def _torchrun_pretrain_gpt_sh(dataset: str, save: str, precision: list[str]) -> list[dict]:
    flags = [flag for flag in PRETRAIN_GPT_SH if flag != "--fp16"] + precision
    flags += [
        "--data-path", dataset, "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE,
        "--save", save, "--load", save,
    ]  # fmt: skip
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # Its rank forked from the preloaded process, with the environment torchrun gives it.
    done = launch_command(
        [torchrun, "--nproc_per_node=1", f"--master_port={free_port()}", "pretrain_gpt.py"] + flags,
        cpu_env(OMP_NUM_THREADS="1"),
        REPO_ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return iteration_logs(done.stdout)


@pytest.mark.slow
def test_megatron_deepspeed_pretrain_gpt_sh_fp16_trains(runs: Runs, tmp_path) -> None:
    """The script's --fp16 starts the loss scale at 2^32: the first iterations overflow and
    are skipped, the scale falls by Megatron's rule and settles, nothing turns NaN, and the
    loss falls as fp32's does once the updates are applied."""
    logs = _torchrun_pretrain_gpt_sh(runs.dataset, str(tmp_path / "fp16"), ["--fp16"])
    fp32 = _torchrun_pretrain_gpt_sh(runs.dataset, str(tmp_path / "fp32"), [])
    assert len(logs) == ITERATIONS
    assert all(log["number of nan iterations"] == 0 for log in logs)
    skipped = [log["number of skipped iterations"] == 1 for log in logs]
    assert sum(skipped) >= 10  # 2^32 is far too high: the schedule is exercised
    assert not any(skipped[-15:])  # ... and it settles (single overflows later are normal)
    assert [log["loss scale"] for log in logs] == megatron_dynamic_grad_scaler(2.0**32, skipped)
    # The last ten iterations read the same samples in both runs (a skipped iteration still
    # consumes its batch, as Megatron's): fp16 has fallen as far as fp32 by then.
    first = sum(log["lm loss"] for log in fp32[:5]) / 5
    last_fp32 = sum(log["lm loss"] for log in fp32[-10:]) / 10
    last_fp16 = sum(log["lm loss"] for log in logs[-10:]) / 10
    assert first - last_fp32 > 0.4
    assert last_fp16 == pytest.approx(last_fp32, abs=0.2)
    final = os.path.join(tmp_path, "fp16", f"iter_{ITERATIONS:07d}", "mp_rank_00")
    tensors = _tensors(load_any(os.path.join(final, "model_optim_rng.pt"))["model"])
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


def _tensors(value) -> list[torch.Tensor]:  # noqa: ANN001 - a nested state dict
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


GPU_CASES = {
    **CASES,
    "zero1-fp16": ["--fp16", "--initial-loss-scale", "4096", "--zero-stage", "1"],
    "plain-bf16-flash": ["--bf16", "--use-flash-attn"],
}


@pytest.fixture(scope="module")
def gpu_fp32_run(runs: Runs) -> tuple[list[float], str]:
    done = launch(1, tiny_gpt_flags(runs.dataset) + SHORT, timeout=600, env=_GPU_ENV)
    assert done.returncode == 0, done.stdout[-3000:]
    return [log["lm loss"] for log in iteration_logs(done.stdout)], done.stdout


_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "0", "DS_ACCELERATOR": "cuda"}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_half_precision_tracks_fp32_on_gpu(case: str, runs: Runs, gpu_fp32_run) -> None:
    """The same 50 iterations on one GPU (NCCL, CUDA kernels, DeepSpeed's CUDA accelerator
    with fp16 too), against the GPU's fp32 run, which uses TF32 matmuls."""
    fp32_losses, fp32_output = gpu_fp32_run
    assert "compute fp32 (TF32 matmuls)" in fp32_output
    flags = runs.flags(case.removesuffix("-flash").replace("zero1-fp16", "zero1-bf16"))
    flags = [flag for flag in flags if flag != "--bf16"] + GPU_CASES[case]
    done = launch(1, flags, timeout=600, env=_GPU_ENV)
    assert done.returncode == 0, done.stdout[-3000:]
    logs = iteration_logs(done.stdout)
    assert len(logs) == ITERATIONS
    assert all(log["number of nan iterations"] == 0 for log in logs)
    assert all(log["number of skipped iterations"] == 0 for log in logs)
    tolerance = FP8_RELATIVE_TOLERANCE if case.endswith("fp8") else RELATIVE_TOLERANCE
    for log, expected in zip(logs, fp32_losses):
        assert log["lm loss"] == pytest.approx(expected, rel=tolerance), log
