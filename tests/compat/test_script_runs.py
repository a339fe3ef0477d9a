"""Real Megatron-DeepSpeed scripts, scaled to a tiny GPT, run on CPU through their launchers.

Each run keeps the script's flags and DeepSpeed config shape (parallel layout kind, ZeRO
stage, token-based schedule, TensorBoard flags, MoE flags, ...) and changes only the sizes: 2
layers, h=64, 32 tokens, 2 processes, a few iterations (and a few experts). DeepSpeed's CPU
accelerator has no fp16, so DeepSpeed runs swap --fp16 for --bf16; the plain-path script keeps
--fp16. What must hold: the run ends cleanly, the loss falls, every iteration line parses with
our parser (DeepSpeed's own `steps_per_print` lines never cut one), and the TensorBoard file
holds the tags the script's flags ask for. The Mixture-of-Experts scripts also log 'moe loss'
on every line and resume from a checkpoint to the same losses as a run that never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

from megatron.training.monitor import parse_iteration_log, parse_validation_line
from tests.checkpointing.compare import rolled_back
from tests.compat.scripts import SCRIPTS_DIR, bf16_for_cpu, load_script, localized, with_values
from tests.conftest import REPO_ROOT
from tests.distributed import free_port
from tests.preloaded import launch_command
from tests.pretrain_runs import cpu_env

SEQ, GLOBAL_BATCH = 32, 4
TOKENS_PER_ITERATION = SEQ * GLOBAL_BATCH
TINY = {
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--num-attention-heads": ["4"],
    "--seq-length": [str(SEQ)],
    "--max-position-embeddings": [str(SEQ)],
    "--micro-batch-size": ["1"],
    "--global-batch-size": [str(GLOBAL_BATCH)],
    "--log-interval": ["1"],
    "--eval-interval": ["5"],
    "--eval-iters": ["1"],
    "--save-interval": ["1000"],
    "--num-workers": ["0"],
    "--split": ["90,10,0"],
    "--make-vocab-size-divisible-by": ["128"],
    # A tiny model takes a larger step than the scripts' 1.5e-4..6e-3: the loss must fall in
    # ten iterations.
    "--lr": ["3e-3"],
}
# Megatron-DeepSpeed's token-based schedule, scaled: stop after 10 iterations' tokens although
# --train-samples allows 12; warm up over 2 iterations' tokens, decay over the 10.
TOKENS = {
    "--train-samples": [str(12 * GLOBAL_BATCH)],
    "--train-tokens": [str(10 * TOKENS_PER_ITERATION)],
    "--lr-warmup-tokens": [str(2 * TOKENS_PER_ITERATION)],
    "--lr-decay-tokens": [str(10 * TOKENS_PER_ITERATION)],
}
ITERATIONS = {"--train-iters": ["10"], "--lr-decay-iters": None, "--exit-interval": None}


def _launch(
    launcher: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    ranks: int = 2,
    for_real: bool = False,
):
    """pretrain_gpt.py with `argv` on `ranks` ranks as `launcher` ("deepspeed", "torchrun" or
    "torch.distributed.launch", the legacy launcher Megatron's examples still call) starts
    them: forked from the preloaded process (tests/preloaded.py) with the environment it gives
    each rank, or (`for_real`) through the launcher itself."""
    script = os.path.join(REPO_ROOT, "pretrain_gpt.py")
    port = free_port()
    bin_dir = os.path.dirname(sys.executable)
    commands = {
        "deepspeed": [
            os.path.join(bin_dir, "deepspeed"),
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(port),
            script,
        ],
        "torchrun": [
            os.path.join(bin_dir, "torchrun"),
            f"--nproc_per_node={ranks}",
            f"--master_port={port}",
            script,
        ],
        "torch.distributed.launch": [
            sys.executable,
            "-m",
            "torch.distributed.launch",
            f"--nproc_per_node={ranks}",
            f"--master_port={port}",
            script,
        ],
    }
    full_env = cpu_env(OMP_NUM_THREADS="1", MASTER_PORT=str(port), **(env or {}))
    if not for_real:
        return launch_command(commands[launcher] + argv, full_env, REPO_ROOT, timeout=600)
    return subprocess.run(
        commands[launcher] + argv,
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


def _tags(tensorboard_dir: str) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, list] = {}
    for root, _, files in os.walk(tensorboard_dir):
        if any(name.startswith("events.") for name in files):
            accumulator = EventAccumulator(root, size_guidance={"scalars": 0})
            accumulator.Reload()
            for tag in accumulator.Tags()["scalars"]:
                tags.setdefault(tag, []).extend(accumulator.Scalars(tag))
    return tags


def _iteration_lines(output: str) -> list[dict]:
    """Every line that looks like an iteration line, parsed; a cut or mixed line fails."""
    logs = []
    for line in output.splitlines():
        if "consumed samples:" in line:
            # Whole: nothing (a DeepSpeed `steps: N loss:` line, another rank) before or after.
            assert line.startswith(" iteration ") and line.endswith(" |"), line
            logs.append(parse_iteration_log(line))
    return [log for log in logs if "lm loss" in log]  # skipped iterations print no loss


def _script_argv(name: str, sizes: dict, dataset: str, scratch: str, cpu_bf16: bool) -> list[str]:
    """The script's argv at TINY and `sizes`, its config at the tiny batch, paths in `scratch`."""
    script = load_script(os.path.join(SCRIPTS_DIR, name + ".json"))
    argv, config = script.argv, script.ds_config
    if cpu_bf16:
        argv, config = bf16_for_cpu(argv, config)
    if config is not None:
        config = dict(config, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=1)
    script = dataclasses.replace(
        script, argv=with_values(argv, {**TINY, **sizes}), ds_config=config
    )
    return localized(script, dataset, scratch)


def _run(
    name: str,
    launcher: str,
    sizes: dict,
    dataset: str,
    scratch: str,
    cpu_bf16: bool,
    ranks: int = 2,
    for_real: bool = False,
):
    argv = _script_argv(name, sizes, dataset, scratch, cpu_bf16)
    done = _launch(launcher, argv, ranks=ranks, for_real=for_real)
    assert done.returncode == 0, done.stdout[-4000:]
    logs = _iteration_lines(done.stdout)
    assert logs, done.stdout[-4000:]
    losses = [log["lm loss"] for log in logs]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    assert all(math.isfinite(log["lm loss"]) for log in logs)
    return done.stdout, logs, _tags(os.path.join(scratch, "tensorboard-dir"))


@pytest.mark.slow
def test_rebase_125m_token_schedule_pipeline_zero1(stdlib_dataset: str, tmp_path) -> None:
    """rebase/ds_pretrain_gpt_125M.sh: deepspeed launcher, PipelineModule, ZeRO-1, tokens."""
    sizes = {
        **TOKENS,
        "--tensor-model-parallel-size": ["1"],
        "--pipeline-model-parallel-size": ["2"],
    }
    output, logs, tags = _run(
        "rebase__ds_pretrain_gpt_125M", "deepspeed", sizes, stdlib_dataset, str(tmp_path), True
    )
    assert logs[-1]["iteration"] == 10  # --train-tokens stopped it before --train-samples
    assert logs[-1]["consumed tokens"] == 10 * TOKENS_PER_ITERATION
    assert logs[-1]["progress"] == 100.0  # counted against the 10 iterations the tokens allow
    # Megatron-DeepSpeed's tags: each training scalar also against samples and tokens.
    for tag in (
        "lm-loss-training/lm loss",
        "lm-loss-training/lm loss vs samples",
        "lm-loss-training/lm loss vs tokens",
        "learning-rate/learning-rate",
        "batch-size/batch-size",  # --log-batch-size-to-tensorboard
        "lm-loss-validation/lm loss validation",
        "lm-loss-validation/lm loss validation ppl",  # --log-validation-ppl-to-tensorboard
        "train-step-time",  # --log-timers-to-tensorboard
        "optimizer/variance_l2",  # --log-optimizer-states-to-tensorboard
        "optimizer/momentum_l2",
    ):
        assert tag in tags, sorted(tags)
    steps = [event.step for event in tags["lm-loss-training/lm loss vs tokens"]]
    assert steps == [n * TOKENS_PER_ITERATION for n in range(1, 11)]


@pytest.mark.slow
def test_universal_checkpointing_bf16_tensor_parallel(stdlib_dataset: str, tmp_path) -> None:
    """universal_checkpointing/megatron_gpt/run_bf16.sh: deepspeed, TP=2, ZeRO-1, fp32 accum."""
    sizes = {
        **ITERATIONS,
        "--tensor-model-parallel-size": ["2"],
        "--pipeline-model-parallel-size": ["1"],
    }
    output, logs, tags = _run(
        "universal_checkpointing__megatron_gpt__run_bf16",
        "deepspeed",
        sizes,
        stdlib_dataset,
        str(tmp_path),
        False,
    )
    assert logs[-1]["iteration"] == 10
    assert "gradient accumulation fp32" in output
    assert "lm-loss-training/lm loss" in tags and "learning-rate/learning-rate" in tags


@pytest.mark.slow
def test_examples_pretrain_gpt_distributed_fp16_torch_distributed_launch(
    stdlib_dataset: str, tmp_path
) -> None:
    """examples/pretrain_gpt_distributed.sh (plain path, --fp16, DDP), torch.distributed.launch."""
    # Dynamic fp16 scaling starts at 2^12, not 2^32: ten iterations are too few to spend ~20 of
    # them finding the scale (tests/training/test_mixed_precision.py covers that descent).
    sizes = {
        **ITERATIONS,
        "--lr-warmup-fraction": [".1"],
        "--initial-loss-scale": ["4096"],
        "--tensorboard-dir": ["tb"],
    }
    output, logs, tags = _run(
        "examples__pretrain_gpt_distributed",
        "torch.distributed.launch",
        sizes,
        stdlib_dataset,
        str(tmp_path),
        False,
        for_real=True,  # the legacy launcher itself, once (tests/preloaded.py emulates it)
    )
    assert logs[-1]["iteration"] == 10
    assert all(log["number of nan iterations"] == 0 for log in logs)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_examples_distributed_with_mp_runs_megatrons_pipeline_schedule(
    precision: str, stdlib_dataset: str, tmp_path
) -> None:
    """examples/pretrain_gpt_distributed_with_mp.sh: TP=2 x PP=2 with --sequence-parallel and
    no DeepSpeed (Megatron's 1F1B on torch.distributed.pipelining), 4 processes under
    torch.distributed.launch, in the script's fp16 and in bf16."""
    sizes = {
        **ITERATIONS,
        "--lr-warmup-fraction": [".1"],
        "--tensorboard-dir": ["tb"],
        # The script's --fp16 or bf16 instead; dynamic fp16 scaling from 2^12 (see above).
        "--fp16": None,
        precision: [],
        **({"--initial-loss-scale": ["4096"]} if precision == "--fp16" else {}),
    }
    output, logs, tags = _run(
        "examples__pretrain_gpt_distributed_with_mp",
        "torch.distributed.launch",
        sizes,
        stdlib_dataset,
        str(tmp_path),
        False,
        ranks=4,
    )
    assert logs[-1]["iteration"] == 10
    assert "tensor-parallel 2 x pipeline-parallel 2 x data-parallel 1" in output
    assert all(log["number of nan iterations"] == 0 for log in logs)
    # The loss is the last stage's, written by the last rank as Megatron does.
    assert "lm-loss-training/lm loss" in tags


@pytest.mark.slow
def test_moe_350m_dense_zero0_moe_flags_one_expert(stdlib_dataset: str, tmp_path) -> None:
    """MoE/ds_pretrain_gpt_350M_dense.sh: deepspeed, ZeRO-0, MoE flags with --num-experts 1."""
    output, logs, tags = _run(
        "MoE__ds_pretrain_gpt_350M_dense", "deepspeed", TOKENS, stdlib_dataset, str(tmp_path), True
    )
    assert logs[-1]["iteration"] == 10
    assert "batch-size/batch-size" in tags
    assert "lm-loss-validation/lm loss validation ppl" in tags


# The MoE scripts' schedule, scaled: --train-iters (12) beside token-based --train-tokens (10
# iterations' worth, which ends the run), warm-up and decay.
MOE_SCHEDULE = {**TOKENS, "--train-samples": None, "--train-iters": ["12"]}
# The iteration-line fields a resumed run must repeat exactly (all but the timings).
RESUMED_FIELDS = (
    "consumed samples",
    "consumed tokens",
    "learning rate",
    "lm loss",
    "moe loss",
    "grad norm",
)


def _idle_experts(output: str) -> float:
    """Experts a token does not pass through, from the start-up model line's total and active
    parameter counts (a TINY expert: h 64 -> 4h -> h with biases)."""
    match = re.search(r"model: ([\d,]+) parameters \(.*, ([\d,]+) active per token\)", output)
    assert match, output[-4000:]
    total, active = (int(count.replace(",", "")) for count in match.groups())
    return (total - active) / (64 * 256 + 256 + 256 * 64 + 64)


def _moe_runs_and_resume(name: str, sizes: dict, dataset: str, scratch: str) -> str:
    """A straight 10-iteration run of an MoE script through the deepspeed launcher, saving at
    iteration 5; a copy of that checkpoint (trackers set to it, as a user rolls back) resumed
    by the same command line logs exactly what the straight run logged for 6-10. Returns the
    straight run's output."""
    sizes = {**sizes, "--save-interval": ["5"]}
    straight_scratch = os.path.join(scratch, "straight")
    output, straight, _ = _run(name, "deepspeed", sizes, dataset, straight_scratch, True)
    assert [log["iteration"] for log in straight] == list(range(1, 11))
    assert all(log["moe loss"] > 0 and math.isfinite(log["moe loss"]) for log in straight)
    argv = _script_argv(name, sizes, dataset, straight_scratch, True)
    at_5 = rolled_back(argv[argv.index("--save") + 1], 5, os.path.join(scratch, "at_5"))
    second = _launch("deepspeed", with_values(argv, {"--save": [at_5], "--load": [at_5]}))
    assert second.returncode == 0, second.stdout[-4000:]
    assert "at iteration 5" in second.stdout, second.stdout[-4000:]
    resumed = _iteration_lines(second.stdout)
    assert [log["iteration"] for log in resumed] == list(range(6, 11))
    differ = [
        (log["iteration"], field, log.get(field), again.get(field))
        for log, again in zip(straight[5:], resumed, strict=True)
        for field in RESUMED_FIELDS
        if log.get(field) != again.get(field)
    ]
    assert not differ, differ  # (iteration, field, straight, rolled back and resumed)
    assert _validation(second.stdout, 10) == _validation(output, 10)
    return output


def _validation(output: str, iteration: int) -> dict[str, float]:
    """The values of the validation line at `iteration` in `output`."""
    (line,) = [line for line in output.splitlines() if f"loss at iteration {iteration} |" in line]
    return parse_validation_line(line)


@pytest.mark.slow
def test_moe_125m_moe64_runs_and_resumes_bit_exactly(stdlib_dataset: str, tmp_path) -> None:
    """MoE/ds_pretrain_gpt_125M_MoE64.sh: deepspeed, ZeRO-0, top-1 experts in every second
    layer (64 scaled to 4) over EP=2, token dropping, --create-moe-param-group, activation
    checkpointing; the loss falls, every line logs 'moe loss', a checkpoint resumes exactly."""
    sizes = {**MOE_SCHEDULE, "--num-experts": ["4"], "--moe-expert-parallel-size": ["2"]}
    output = _moe_runs_and_resume(
        "MoE__ds_pretrain_gpt_125M_MoE64", sizes, stdlib_dataset, str(tmp_path)
    )
    assert _idle_experts(output) == 3  # of 4, top-1


@pytest.mark.slow
def test_moe_350m_pr_moe_runs_and_resumes_bit_exactly(stdlib_dataset: str, tmp_path) -> None:
    """MoE/ds_pretrain_gpt_350M_PR-MoE32or64.sh: PR-MoE (--mlp-type residual) with a per-layer
    expert list (32 x 10 then 64 x 2 scaled to 2 then 4, one MoE layer each at interval 1) over
    EP=2; the loss falls, every line logs 'moe loss', a checkpoint resumes exactly."""
    sizes = {
        **MOE_SCHEDULE,
        "--num-experts": ["2", "4"],
        "--expert-interval": ["1"],
        "--moe-expert-parallel-size": ["2"],
    }
    output = _moe_runs_and_resume(
        "MoE__ds_pretrain_gpt_350M_PR-MoE32or64", sizes, stdlib_dataset, str(tmp_path)
    )
    assert _idle_experts(output) == 1 + 3  # of 2 and of 4, top-1


# The shape of the Zenn tutorial's ds_config_gpt2_345m_4.json (as described in issue 16): an
# "optimizer" section DeepSpeed never uses here (Megatron-DeepSpeed hands it its own Adam), a
# "wandb" section, "steps_per_print": 1; fp16 becomes bf16 for DeepSpeed's CPU accelerator.
ZENN_CONFIG = {
    "train_batch_size": GLOBAL_BATCH,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]},
    },
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "wandb": {"enabled": True, "project": "zenn-megatron-deepspeed"},
}


@pytest.mark.slow
def test_zenn_config_with_optimizer_and_wandb_sections_runs_offline(
    stdlib_dataset: str, tmp_path
) -> None:
    """The optimizer section is set aside with a start-up line and one warning per value that
    differs from the flags; DeepSpeed's W&B monitor logs offline."""
    script = load_script(os.path.join(SCRIPTS_DIR, "examples__pretrain_gpt_distributed.json"))
    sizes = {**TINY, **ITERATIONS, "--micro-batch-size": ["2"], "--lr": ["1e-3"]}
    argv = with_values(script.argv, {**sizes, "--fp16": None, "--distributed-backend": None})
    argv = localized(dataclasses.replace(script, argv=argv), stdlib_dataset, str(tmp_path))
    config = tmp_path / "ds_config_gpt2_345m_4.json"
    config.write_text(json.dumps(ZENN_CONFIG))
    argv += ["--deepspeed", "--deepspeed_config", str(config)]
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    done = _launch(
        "deepspeed", argv, env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)}, ranks=1
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert 'its "optimizer" section is not used' in done.stdout
    warnings = [line for line in done.stdout.splitlines() if 'warning: "optimizer.' in line]
    assert len(warnings) == 2, warnings  # lr and betas differ; max_grad_norm equals --clip-grad
    assert any(
        '"optimizer.params.lr" (0.00015)' in line and "--lr (0.001)" in line for line in warnings
    )
    assert any('"optimizer.params.betas" ([0.9, 0.95])' in line for line in warnings)
    losses = [log["lm loss"] for log in _iteration_lines(done.stdout)]
    assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3]) - 0.6, losses
    # DeepSpeed's W&B monitor wrote an offline run.
    assert list(wandb_dir.glob("wandb/offline-run-*")), os.listdir(wandb_dir)


@pytest.mark.slow
def test_llama2_distributed_torchrun_sentencepiece_gqa(
    sentencepiece_dataset: str, sentencepiece_model: str, tmp_path
) -> None:
    """examples_deepspeed/pretrain_llama2_distributed.sh: torchrun with --deepspeed, bf16,
    GPTSentencePieceTokenizer, RMSNorm, SwiGLU, untied output, no biases, rotary positions,
    grouped-query attention (4 heads over 2 key/value heads) at TP=2."""
    sizes = {
        **ITERATIONS,
        "--tensor-model-parallel-size": ["2"],
        "--pipeline-model-parallel-size": ["1"],
        "--ffn-hidden-size": ["128"],
        "--num-key-value-heads": ["2"],
        "--tokenizer-model": [sentencepiece_model],
        "--lr-warmup-iters": ["2"],
    }
    output, logs, _ = _run(
        "pretrain_llama2_distributed",
        "torchrun",
        sizes,
        sentencepiece_dataset,
        str(tmp_path),
        False,
    )
    assert logs[-1]["iteration"] == 10
    assert "> building GPTSentencePieceTokenizer tokenizer" in output
