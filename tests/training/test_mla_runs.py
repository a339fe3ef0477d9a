"""`pretrain_gpt.py --multi-latent-attention --mtp-num-layers 1` trains, saves and resumes
(issue 57).

A real run of the tiny GPT with DeepSeek-V3's attention (a query latent, a shared key/value
latent with its norms, decoupled rotary channels, YaRN at factor 4) and one multi-token
prediction module on the stdlib corpus with the real GPT-2 vocabulary, torchrun TP=2 with
sequence parallelism, torch_dist checkpoints: the loss and the logged 'mtp_1 loss' fall over 12
iterations; a second launch resumed from a copy of the iteration-6 checkpoint logs the first
run's values for iterations 7-12 (the same digits: a bit-exact resume); and a third, resumed
from the same copy at PP=2 on Megatron's pipeline schedules (the MTP module and the copy of
the word embeddings it embeds with on the last stage), logs them within fp32 reordering.

From a plain run's weights resharded by tools/checkpoint/reshard.py, MLA runs as stages of
DeepSpeed's pipeline engine (PP=2), and MTP on the last model chunk of Megatron's interleaved
schedule (PP=2 x 2 chunks): the plain resume's losses, the MTP loss after an update too (the
last stage's copy of the untied embeddings gets the first stage's gradient). At CP=2, MLA logs
one process's losses.
"""

from __future__ import annotations

import pytest

from tests.checkpointing.compare import rolled_back
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

MODEL = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 24 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 8 --v-head-dim 12 --rotary-scaling-factor 4 --mscale 1.0 "
    "--mscale-all-dim 1.0 --qk-layernorm --position-embedding-type rope --normalization "
    "RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --hidden-dropout 0 --attention-dropout 0 "
    "--ckpt-format torch_dist --make-vocab-size-divisible-by 64"
).split()
"""(The vocabulary padded alike at TP 1 and 2: 50,304 rows.)"""
TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel".split()
PP2 = "--pipeline-model-parallel-size 2".split()
LOGGED = ("lm loss", "mtp_1 loss", "grad norm")


def _logged(output: str) -> list[tuple[float, ...]]:
    return [tuple(log[name] for name in LOGGED) for log in iteration_logs(output)]


@pytest.mark.slow
def test_mla_mtp_run_learns_resumes_bit_exactly_and_at_pp2(stdlib_dataset, tmp_path) -> None:
    """12 iterations (saved at 6), then 6 more from that checkpoint at TP=2+SP and at PP=2."""
    save = str(tmp_path / "straight")
    flags = tiny_gpt_flags(stdlib_dataset) + MODEL + ["--global-batch-size", "4"]
    flags += ["--train-iters", "12", "--lr", "5e-3", "--min-lr", "5e-4"]
    first = launch(2, flags + TP2_SP + ["--save", save, "--save-interval", "6"])
    assert first.returncode == 0, first.stdout[-3000:]
    logged = _logged(first.stdout)
    assert len(logged) == 12, first.stdout[-3000:]
    lm, mtp = [row[0] for row in logged], [row[1] for row in logged]
    assert lm[-1] < lm[0] - 1.0 and mtp[-1] < mtp[0] - 1.0, logged

    resumed_dir = rolled_back(save, 6, str(tmp_path / "resumed"))
    resumed = launch(2, flags + TP2_SP + ["--load", resumed_dir])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert _logged(resumed.stdout) == logged[6:]

    at_pp2 = launch(2, flags + PP2 + ["--load", rolled_back(save, 6, str(tmp_path / "pp2"))])
    assert at_pp2.returncode == 0, at_pp2.stdout[-3000:]
    assert "> layout: TP 1 x PP 2 x DP 1, fp32 on megatron_schedules" in at_pp2.stdout
    for got, expected in zip(_logged(at_pp2.stdout), logged[6:], strict=True):
        # Losses within fp32 reordering; the gradient norm is logged to 3 decimals.
        assert got[:2] == pytest.approx(expected[:2], rel=1e-4), (got, expected)
        assert got[2] == pytest.approx(expected[2], abs=2e-3), (got, expected)


@pytest.mark.slow
def test_mla_mtp_run_on_deepspeed_zero1_in_bf16(stdlib_dataset) -> None:
    """DeepSpeed's engine (ZeRO-1 over DP=2, bf16 parameters) trains the same model: its
    module walks (`model.apply`) reach the attention's rotary module, and both losses fall."""
    flags = tiny_gpt_flags(stdlib_dataset) + MODEL + ["--global-batch-size", "4"]
    flags += ["--train-iters", "6", "--lr", "5e-3", "--min-lr", "5e-4"]
    flags += "--deepspeed --no-pipeline-parallel --zero-stage 1 --bf16".split()
    run = launch(2, flags)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "> layout: TP 1 x PP 1 x DP 2, bf16, ZeRO-1 on deepspeed" in run.stdout
    logged = _logged(run.stdout)
    assert len(logged) == 6, run.stdout[-3000:]
    assert logged[-1][0] < logged[0][0] - 0.5 and logged[-1][1] < logged[0][1] - 0.5, logged


@pytest.mark.slow
def test_mla_run_at_cp2_logs_one_process_losses(stdlib_dataset) -> None:
    """Context parallelism with MLA (ring attention, its values padded to the queries' width):
    4 iterations at CP=2 log one process's losses and gradient norms."""
    model = [flag for flag in MODEL if flag not in ("--mtp-num-layers", "1")]
    model = [flag for flag in model if flag not in ("--mtp-loss-scaling-factor", "0.1")]
    flags = tiny_gpt_flags(stdlib_dataset) + model + ["--global-batch-size", "4"]
    flags += ["--train-iters", "4", "--lr", "5e-3", "--min-lr", "5e-4"]
    alone = launch(1, flags)
    assert alone.returncode == 0, alone.stdout[-3000:]
    split = launch(2, flags + ["--context-parallel-size", "2"])
    assert split.returncode == 0, split.stdout[-3000:]
    assert "CP 2" in split.stdout, split.stdout[-3000:]
    names = ("lm loss", "grad norm")
    expected = [tuple(log[n] for n in names) for log in iteration_logs(alone.stdout)]
    got = [tuple(log[n] for n in names) for log in iteration_logs(split.stdout)]
    assert len(got) == len(expected) == 4, split.stdout[-3000:]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine[0] == pytest.approx(theirs[0], rel=1e-4), (mine, theirs)
        assert mine[1] == pytest.approx(theirs[1], abs=2e-3), (mine, theirs)


def _from_resharded(dataset: str, tmp_path, model: list[str], target: list[str], engine: list[str]):
    """A plain 2-rank run of `model` saved at iteration 2 (Megatron's per-rank files), resharded
    by tools/checkpoint/reshard.py (`target`), resumed on `engine` and, unchanged, on the plain
    engine, both with a fresh optimizer: (the resumed run's, the plain resume's) logs."""
    from tools.checkpoint import reshard

    save, resharded = str(tmp_path / "plain"), str(tmp_path / "resharded")
    flags = tiny_gpt_flags(dataset) + model + ["--global-batch-size", "4"]
    flags += ["--train-iters", "4", "--lr", "5e-3", "--min-lr", "5e-4"]
    first = launch(2, flags + ["--save", save, "--save-interval", "2", "--exit-interval", "2"])
    assert first.returncode == 0, first.stdout[-3000:]
    assert reshard.main(["--load", save, "--save", resharded, *target]) == 0
    fresh = ["--no-load-optim", "--no-load-rng"]
    moved = launch(2, flags + engine + fresh + ["--load", resharded])
    assert moved.returncode == 0, moved.stdout[-3000:]
    plain = launch(2, flags + fresh + ["--load", save])
    assert plain.returncode == 0, plain.stdout[-3000:]
    return iteration_logs(moved.stdout), iteration_logs(plain.stdout)


def _assert_same_losses(got: list[dict], expected: list[dict], names: tuple[str, ...]) -> None:
    assert [log["iteration"] for log in got] == [log["iteration"] for log in expected] == [3, 4]
    for mine, theirs in zip(got, expected, strict=True):
        for name in names:  # fp32 sums in other orders
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4), (name, mine, theirs)


@pytest.mark.slow
def test_mla_on_deepspeeds_pipeline_engine(stdlib_dataset, tmp_path) -> None:
    """MLA layers as DeepSpeed pipeline-engine stages (PP=2): from the plain run's weights,
    resharded, iterations 3-4 log the plain resume's losses."""
    model = [flag for flag in MODEL if flag not in ("--mtp-num-layers", "1")]
    model = [flag for flag in model if flag not in ("--mtp-loss-scaling-factor", "0.1")]
    model = [flag for flag in model if flag not in ("--ckpt-format", "torch_dist")]
    got, expected = _from_resharded(
        stdlib_dataset, tmp_path, model, ["--target-pipeline-parallel-size", "2"],
        ["--deepspeed", "--pipeline-model-parallel-size", "2"],
    )  # fmt: skip
    _assert_same_losses(got, expected, ("lm loss",))


@pytest.mark.slow
def test_mtp_on_the_last_virtual_stage(stdlib_dataset, tmp_path) -> None:
    """Megatron's interleaved schedule (PP=2, 2 model chunks per rank over 4 layers): the MTP
    module on the last chunk of the last stage, as megatron-core places it; from the plain
    run's weights, resharded, iterations 3-4 log the plain resume's lm and MTP losses."""
    model = [flag for flag in MODEL if flag not in ("--ckpt-format", "torch_dist")]
    model += ["--num-layers", "4"]
    target = [
        "--target-pipeline-parallel-size",
        "2",
        "--target-virtual-pipeline-parallel-size",
        "2",
    ]
    got, expected = _from_resharded(
        stdlib_dataset, tmp_path, model, target,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    )  # fmt: skip
    _assert_same_losses(got, expected, ("lm loss", "mtp_1 loss"))
