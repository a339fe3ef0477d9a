"""`pretrain_gpt.py --dry-run`: real scripts planned from one process, the JSON, the verdict
and the suggestions on a device, and what a dry run does not need or do."""

from __future__ import annotations

import json
import os

import pytest

from megatron.arguments import parse_args
from megatron.dry_run import plan_from_args, plan_with_changes, run_dry_run
from megatron.planning.devices import find_device
from megatron.planning.suggestions import apply_flags
from tests.planning.megatron_lm_memory import DenseGPT, total_bytes

HERE = os.path.dirname(__file__)


def _gpt3_175b_argv() -> list[str]:
    """Megatron-LM's GPT-3 175B example as written, less the one flag refused here."""
    with open(os.path.join(HERE, "megatron_lm_gpt3_175b.json")) as file:
        script = json.load(file)
    return apply_flags(script["argv"], {"--step-batch-size-schedule": False})


def _megatron_lm_figure(sequence_parallel_selective: bool) -> float:
    # The layout's padded vocabulary: GPT-2's 50,257 tokens to a multiple of 128 x TP 8.
    return total_bytes(
        DenseGPT(96, 12288, 96, 4 * 12288, 51200, 2048, 1, 8, 16, 192, sequence_parallel_selective)
    )


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel", "--recompute-activations"]])
def test_gpt3_175b_on_1024_gpus_is_within_15_percent_of_megatron_lms_estimate(
    extra, tmp_path, capsys
):
    """The first pipeline stage (the most loaded) against Megatron-LM's own estimate
    (theoretical_memory_usage.py) for the same layout, as written and with SP + selective."""
    path = str(tmp_path / "plan.json")
    argv = _gpt3_175b_argv() + extra
    argv += ["--dry-run", "--dry-run-world-size", "1024", "--dry-run-json", path]
    run_dry_run(argv + ["--dry-run-device", "H100"])
    with open(path) as file:
        plan = json.load(file)
    assert plan["world_size"] == 1024 and len(plan["ranks"]) == 1024
    first_stage = max(rank["memory"]["peak_bytes"] for rank in plan["ranks"])
    ratio = first_stage / _megatron_lm_figure(bool(extra))
    assert 0.85 <= ratio <= 1.15, ratio
    assert "stage" in capsys.readouterr().out


def test_step_batch_size_schedule_is_refused_in_one_line(capsys):
    argv = _gpt3_175b_argv() + ["--step-batch-size-schedule", "0:16 2.4B:320", "--dry-run"]
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv, world_size=1024)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--step-batch-size-schedule" in error


GPT2_XL = [
    "--num-layers", "48", "--hidden-size", "1600", "--num-attention-heads", "25",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--micro-batch-size", "32", "--global-batch-size", "256",
    "--lr", "1.5e-4", "--train-iters", "1000", "--bf16",
    "--deepspeed", "--zero-stage", "0", "--no-pipeline-parallel",
    "--data-path", "/nowhere/openwebtext_text_document",
]  # fmt: skip


def test_a_job_that_does_not_fit_gets_suggestions_that_parse_and_fit(tmp_path, capsys):
    """GPT-2 1.5B, bf16, ZeRO-0, micro-batch 32 on 8 H100s: does not fit; every suggested
    command line validates and its own plan fits."""
    path = str(tmp_path / "plan.json")
    argv = GPT2_XL + ["--dry-run", "--dry-run-world-size", "8", "--dry-run-device", "H100"]
    plan = run_dry_run(argv + ["--dry-run-json", path])
    assert plan.fits is False
    output = capsys.readouterr().out
    assert "DOES NOT FIT" in output and "to fit H100, change" in output
    with open(path) as file:
        suggestions = json.load(file)["suggestions"]
    assert suggestions
    device = find_device("H100")
    for suggestion in suggestions:
        assert suggestion["peak_bytes"] <= device.usable_bytes
        args = parse_args(suggestion["argv"])  # the suggested command line as typed
        replanned = plan_from_args(args, device)
        assert replanned.fits and replanned.peak_bytes == suggestion["peak_bytes"]


def test_changes_through_the_deepspeed_config_file(tmp_path):
    """With the ZeRO stage and micro-batch in the config file, a suggestion edits the file's
    keys too, so flags and config agree and the changed job validates."""
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 32,
                "train_batch_size": 256,
                "zero_optimization": {"stage": 0},
                "bf16": {"enabled": True},
            }
        )
    )
    argv = apply_flags(GPT2_XL, {"--zero-stage": False, "--micro-batch-size": False})
    argv += ["--deepspeed_config", str(config), "--dry-run", "--dry-run-world-size", "8"]
    args = parse_args(argv + ["--dry-run-device", "H100"])
    plan = plan_from_args(args, find_device("H100"))
    assert not plan.fits
    from megatron.dry_run import suggest

    suggestions = suggest(argv, args, plan)
    assert suggestions
    assert any(item["config"].get("zero_optimization") for item in suggestions) or any(
        "train_micro_batch_size_per_gpu" in item["config"] for item in suggestions
    )


def test_plan_json_has_one_entry_per_rank_with_the_runs_coordinates(tmp_path):
    path = str(tmp_path / "plan.json")
    argv = [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--lr", "1e-4", "--train-iters", "10",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--dry-run", "--dry-run-world-size", "8", "--dry-run-json", path,
    ]  # fmt: skip
    run_dry_run(argv)
    with open(path) as file:
        plan = json.load(file)
    from megatron.core.parallel_state import generate_rank_groups

    groups = generate_rank_groups(8, 2, 2)
    for entry in plan["ranks"]:
        rank = entry["rank"]
        tensor = next(group for group in groups["tensor"] if rank in group)
        pipeline = next(group for group in groups["pipeline"] if rank in group)
        data = next(group for group in groups["data"] if rank in group)
        assert (entry["tp_rank"], entry["pp_rank"], entry["dp_rank"]) == (
            tensor.index(rank),
            pipeline.index(rank),
            data.index(rank),
        )
        memory, comm = entry["memory"], entry["comm_bytes_per_iteration"]
        assert set(memory) >= {"weights", "gradients", "optimizer", "activations", "buffers"}
        assert memory["peak_bytes"] > memory["weights"] > 0
        assert comm["total"] == sum(
            comm[kind] for kind in ("tensor_parallel", "data_parallel", "pipeline", "all_to_all")
        )
        assert comm["tensor_parallel"] > 0 and comm["data_parallel"] > 0 and comm["pipeline"] > 0


def test_dry_run_needs_no_files_and_writes_nothing_else(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = GPT2_XL + [
        "--vocab-file", "/nowhere/vocab.json", "--merge-file", "/nowhere/merges.txt",
        "--save", "/nowhere/checkpoints", "--save-interval", "100", "--dry-run",
    ]  # fmt: skip
    run_dry_run(argv)
    output = capsys.readouterr().out
    assert "assumed GPT-2's 50,257 tokens" in output
    assert os.listdir(tmp_path) == []


def test_without_the_tokenizers_files_the_plan_takes_the_given_vocab_size(capsys):
    """A published model's command line names its vocabulary: a 256,000-token model is
    planned with 256,000 embedding rows (padded), not GPT-2's, and the plan says so."""
    absent = ["--vocab-file", "/nowhere/vocab.json", "--merge-file", "/nowhere/merges.txt"]
    gpt2 = run_dry_run(GPT2_XL + absent + ["--dry-run"])
    given = run_dry_run(GPT2_XL + absent + ["--vocab-size", "256000", "--dry-run"])
    assert "--vocab-size 256,000 tokens" in capsys.readouterr().out
    assert (gpt2.inputs.model.vocab_size, given.inputs.model.vocab_size) == (50304, 256000)
    assert given.peak_bytes > gpt2.peak_bytes


def test_other_ranks_of_a_launched_dry_run_print_nothing(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert run_dry_run(GPT2_XL + ["--dry-run", "--dry-run-world-size", "8"]) is None
    assert capsys.readouterr().out == ""


def test_unknown_device_is_refused_in_one_line():
    with pytest.raises(SystemExit) as stopped:
        run_dry_run(GPT2_XL + ["--dry-run", "--dry-run-device", "TPUv9"])
    assert "--dry-run-device TPUv9: not a known device" in str(stopped.value.code)


def test_plan_with_changes_applies_flags_and_config():
    argv = GPT2_XL + ["--dry-run", "--dry-run-world-size", "8"]
    new_argv, patch, plan = plan_with_changes(argv, [], parse_args(argv), None)
    assert new_argv == argv and patch == {} and plan.inputs.dp == 8


def test_pairs_with_config_batch_keys_and_older_spellings_validate(tmp_path):
    """A 7B model on 8 A100-40GBs, written with Megatron-LM v1's --batch-size and
    --model-parallel-size and a config file holding the batch keys: no single change fits,
    so pairs are planned; every suggested pair validates with its config keys."""
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 4,
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True},
            }
        )
    )
    argv = [
        "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--seq-length", "4096", "--max-position-embeddings", "4096", "--batch-size", "4",
        "--model-parallel-size", "2", "--lr", "3e-4", "--train-iters", "1000", "--bf16",
        "--deepspeed", "--deepspeed_config", str(config), "--no-pipeline-parallel",
        "--data-path", "/nowhere/x", "--dry-run", "--dry-run-world-size", "8",
        "--dry-run-device", "A100-40GB",
    ]  # fmt: skip
    args = parse_args(argv)
    plan = plan_from_args(args, find_device("A100-40GB"))
    assert not plan.fits
    from megatron.dry_run import suggest

    suggestions = suggest(argv, args, plan)
    assert suggestions
    for item in suggestions:
        if "micro-batch" in item["change"]:
            assert "--batch-size" not in item["argv"]
        if "tensor parallel" in item["change"]:
            assert "--model-parallel-size" not in item["argv"]
        patched = {**json.loads(config.read_text()), **item["config"]}
        if "zero_optimization" in item["config"]:
            patched["zero_optimization"] = item["config"]["zero_optimization"]
        replanned = plan_from_args(
            parse_args(item["argv"], defaults={"deepspeed_config_dict": patched}),
            find_device("A100-40GB"),
        )
        assert replanned.fits


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--dry-run-json", "plan.json"], "--dry-run-json needs --dry-run"),
        (["--dry-run", "--dry-run-world-size", "0"], "--dry-run-world-size must be at least 1"),
        (["--dry-run", "--dry-run-json", "/nowhere/plan.json"], "/nowhere is not a writable"),
        (["--dry-run", "--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0"),
    ],
)
def test_bad_dry_run_flags_are_refused_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(GPT2_XL + extra)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error


def test_a_plain_job_that_does_not_fit_gets_suggestions_and_its_json(tmp_path, capsys):
    """Without --deepspeed (the plain engine) at PP=1: DeepSpeed's ZeRO stages are among the
    candidates, and the plan with its suggestions is written (issue 36, defect 1: a TypeError
    in the suggestions, no JSON)."""
    path = str(tmp_path / "plan.json")
    plain = [flag for flag in GPT2_XL if flag not in ("--deepspeed", "--no-pipeline-parallel")]
    plain.remove("--zero-stage")
    plain.remove("0")
    argv = plain + ["--dry-run", "--dry-run-world-size", "8", "--dry-run-device", "H100"]
    plan = run_dry_run(argv + ["--dry-run-json", path])
    assert plan.fits is False and plan.inputs.engine == "plain"
    with open(path) as file:
        suggestions = json.load(file)["suggestions"]
    assert suggestions and "to fit H100, change" in capsys.readouterr().out
    for suggestion in suggestions:
        assert plan_from_args(parse_args(suggestion["argv"]), find_device("H100")).fits


def test_deepspeeds_default_engine_at_pp1_is_offered_every_zero_stage(tmp_path):
    """--deepspeed at PP=1 without --no-pipeline-parallel runs DeepSpeed's pipeline engine at
    ZeRO 0-1 and switches to its plain engine at ZeRO 2-3, as validation does: stages 2 and 3
    are candidates, with no --no-pipeline-parallel added (issue 36, defect 2)."""
    from megatron.planning.suggestions import candidate_changes

    argv = [flag for flag in GPT2_XL if flag != "--no-pipeline-parallel"]
    plan = plan_from_args(parse_args(argv + ["--dry-run", "--dry-run-world-size", "8"]), None)
    assert plan.inputs.engine == "deepspeed-pipeline" and plan.inputs.pp == 1
    zero = [change for change in candidate_changes(plan.inputs, 256, None) if change.knob == "zero"]
    assert [change.flags for change in zero] == [{"--zero-stage": str(s)} for s in (1, 2, 3)]
    for stage in (2, 3):
        args = parse_args(apply_flags(argv, {"--zero-stage": str(stage)}) + ["--dry-run"])
        assert plan_from_args(args, None).inputs.engine == "deepspeed"


def test_predicted_peak_bytes_reports_a_refused_plan_and_surfaces_a_planner_bug(
    tmp_path, monkeypatch
):
    """A run's start-up line: a job DeepSpeed would refuse (fp16 ZeRO-0 accumulating in fp32;
    validation refuses that config, so the key is put in after it) has no prediction; any
    other exception is the planner's bug and is raised, not hidden."""
    from megatron import dry_run
    from megatron.dry_run import predicted_peak_bytes

    fp16 = [flag if flag != "--bf16" else "--fp16" for flag in GPT2_XL]
    args = parse_args(fp16 + ["--dry-run"])
    args.deepspeed_config_dict["data_types"] = {"grad_accum_dtype": "fp32"}
    assert predicted_peak_bytes(args, "cuda") is None
    assert predicted_peak_bytes(parse_args(GPT2_XL + ["--dry-run"]), "cuda")

    def broken(*_: object, **__: object) -> None:
        raise ZeroDivisionError("a planner bug")

    monkeypatch.setattr(dry_run, "build_plan", broken)
    with pytest.raises(ZeroDivisionError):
        predicted_peak_bytes(parse_args(GPT2_XL + ["--dry-run"]), "cuda")


def test_when_every_candidate_change_is_refused_the_dry_run_says_why(tmp_path, monkeypatch, capsys):
    """Not an empty list of suggestions: each refused change, with validation's own line."""
    import sys

    from megatron import dry_run

    argv = GPT2_XL + ["--dry-run", "--dry-run-world-size", "8", "--dry-run-device", "H100"]
    real = dry_run.parse_args

    def refusing(changed: list, *rest: object, **options: object):  # noqa: ANN202
        if changed != argv + ["--dry-run-json", str(tmp_path / "plan.json")]:
            sys.stderr.write("error: --example-flag is refused here\n")
            raise SystemExit(2)
        return real(changed, *rest, **options)

    monkeypatch.setattr(dry_run, "parse_args", refusing)
    run_dry_run(argv + ["--dry-run-json", str(tmp_path / "plan.json")])
    output = capsys.readouterr().out
    assert "every candidate change was refused" in output
    assert "full recomputation: error: --example-flag is refused here" in output
    with open(tmp_path / "plan.json") as file:
        plan = json.load(file)
    assert plan["suggestions"] == [] and plan["refused_changes"]
    assert all(
        item["reason"].startswith("error: --example-flag") for item in plan["refused_changes"]
    )
