"""The training configurations the `--dry-run` planner is checked against, and a runner.

`CONFIGS` lists them (name, launcher, processes, flags, DeepSpeed config); another script
imports it and builds each command with `command()`. Run as a script, it trains each one for
3 iterations under `benchmarks/measured_run.py` on CPU and prints what every rank measured:

    python benchmarks/planner_configs.py                      # all; a stdlib dataset is built
    python benchmarks/planner_configs.py --only tp2-sp-selective ddp-dp2 --out /tmp/measured
    python benchmarks/planner_configs.py --unmetered          # plain pretrain_gpt.py, timing only

The model is small but its tensors dominate the process (2 layers, h 256, 4 heads, 256
tokens, GPT-2's 50k vocabulary, micro-batch 4, global batch 8, no dropout, no evaluation).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests.distributed import free_port  # noqa: E402
from tests.pretrain_runs import build_stdlib_dataset, cpu_env, iteration_logs  # noqa: E402

MEASURED_RUN = os.path.join(REPO_ROOT, "benchmarks", "measured_run.py")
PRETRAIN_GPT = os.path.join(REPO_ROOT, "pretrain_gpt.py")
VOCAB_FILE = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
MERGE_FILE = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")

MODEL_FLAGS = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-4 --train-iters 3"
).split()
"""The model and schedule every configuration shares."""

# --eval-iters 0: the final evaluation would run inside the last iteration's window.
RUN_FLAGS = (
    "--split 90,10,0 --eval-iters 0 --eval-interval 1000 --log-interval 1 --num-workers 0 "
    "--distributed-backend gloo --seed 1234"
).split()


def zero_config(stage: int) -> dict:
    """A bf16 DeepSpeed config at ZeRO `stage` for MODEL_FLAGS' batch sizes on 2 ranks."""
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
    }


def fp16_config(stage: int, micro_batch: int = 4) -> dict:
    """An fp16 DeepSpeed config at ZeRO `stage`: a static loss scale of 128, so none of the
    three steps is skipped for an overflow (a skipped step neither steps nor gathers)."""
    config = {key: value for key, value in zero_config(stage).items() if key != "bf16"}
    config["train_micro_batch_size_per_gpu"] = micro_batch
    return {**config, "fp16": {"enabled": True, "loss_scale": 128}}


def cpu_runs_fp16() -> bool:
    """Whether DeepSpeed runs fp16 on this CPU: its CPU accelerator's is_fp16_supported()
    (deepspeed/accelerator/cpu_accelerator.py) asks oneDNN for fp16 (AVX512-FP16 / AMX-FP16)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class PlannerConfig:
    """One training configuration: how it is launched, its flags beyond the shared ones."""

    name: str
    launcher: str
    """"python" (one process), "torchrun" or "deepspeed"."""
    processes: int
    flags: tuple[str, ...]
    ds_config: dict | None
    """The --deepspeed_config contents (the command adds --deepspeed), or None."""

    @property
    def fp16(self) -> bool:
        """Whether it trains in fp16 (DeepSpeed on a CPU with fp16 only)."""
        return "--fp16" in self.flags


# A LLaMA-style shape unlike MODEL_FLAGS' (deeper, narrower, longer, GQA, untied, no biases,
# two micro-batches per iteration): the plan must not be fitted to one shape.
LLAMA_FLAGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 8 --num-key-value-heads 2 "
    "--ffn-hidden-size 352 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 "
    "--swiglu --normalization RMSNorm --use-rotary-position-embeddings "
    "--untie-embeddings-and-output-weights --disable-bias-linear"
).split()

CONFIGS: tuple[PlannerConfig, ...] = (
    PlannerConfig("plain-1", "python", 1, (), None),
    PlannerConfig("ddp-dp2", "torchrun", 2, (), None),
    PlannerConfig(
        "tp2-sp-selective",
        "torchrun",
        2,
        ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-activations"),
        None,
    ),
    PlannerConfig(
        "tp2-full-recompute",
        "torchrun",
        2,
        ("--tensor-model-parallel-size", "2", "--recompute-granularity", "full"),
        None,
    ),
    # Autocast, two micro-batches per iteration, dropout on (CPU attention's math kernel).
    PlannerConfig(
        "ddp-bf16-accum-dropout",
        "torchrun",
        2,
        (
            "--bf16",
            "--micro-batch-size",
            "2",
            "--hidden-dropout",
            "0.1",
            "--attention-dropout",
            "0.1",
        ),
        None,
    ),
    PlannerConfig(
        "ds-zero1-bf16", "deepspeed", 2, ("--no-pipeline-parallel", "--bf16"), zero_config(1)
    ),
    PlannerConfig(
        "ds-zero2-bf16", "deepspeed", 2, ("--no-pipeline-parallel", "--bf16"), zero_config(2)
    ),
    PlannerConfig(
        "ds-zero3-bf16", "deepspeed", 2, ("--no-pipeline-parallel", "--bf16"), zero_config(3)
    ),
    # fp16: DeepSpeed's FP16_UnfusedOptimizer on its pipeline engine (bf16 there runs the
    # partitioned BF16_Optimizer), DeepSpeedZeroOptimizer at stage 1 on either engine; two
    # micro-batches per iteration, so the whole fp16 gradient is held across them.
    PlannerConfig(
        "ds-zero0-fp16-pipe-dp2",
        "deepspeed",
        2,
        ("--fp16", "--micro-batch-size", "2"),
        fp16_config(0, 2),
    ),
    PlannerConfig(
        "ds-zero1-fp16",
        "deepspeed",
        2,
        ("--no-pipeline-parallel", "--fp16", "--micro-batch-size", "2"),
        fp16_config(1, 2),
    ),
    # Four data-parallel ranks: the whole fp16 gradient (2 bytes per parameter) apart from
    # a partition's share (4 / Z bytes, the same at Z = 2).
    PlannerConfig(
        "ds-zero1-fp16-dp4",
        "deepspeed",
        4,
        ("--no-pipeline-parallel", "--fp16", "--micro-batch-size", "1"),
        fp16_config(1, 1),
    ),
    PlannerConfig(
        "ds-pipe-pp2-fp16-zero1",
        "deepspeed",
        2,
        ("--pipeline-model-parallel-size", "2", "--fp16"),
        fp16_config(1),
    ),
    PlannerConfig(
        "ds-pipe-pp2-bf16",
        "deepspeed",
        2,
        ("--pipeline-model-parallel-size", "2", "--bf16"),
        zero_config(1),
    ),
    PlannerConfig("megatron-pp2", "torchrun", 2, ("--pipeline-model-parallel-size", "2"), None),
    PlannerConfig(
        "megatron-pp2-interleaved",
        "torchrun",
        2,
        (
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers",
            "4",
            "--virtual-pipeline-model-parallel-size",
            "2",
            "--micro-batch-size",
            "2",
        ),
        None,
    ),
    PlannerConfig("llama-ddp-bf16", "torchrun", 2, (*LLAMA_FLAGS, "--bf16"), None),
    PlannerConfig(
        "llama-ds-zero2-tp2-bf16",
        "deepspeed",
        2,
        (*LLAMA_FLAGS, "--bf16", "--no-pipeline-parallel", "--tensor-model-parallel-size", "2"),
        {**zero_config(2), "train_micro_batch_size_per_gpu": 2},
    ),
    PlannerConfig(
        "ds-ulysses-sp2-bf16",
        "deepspeed",
        2,
        ("--no-pipeline-parallel", "--bf16", "--ds-sequence-parallel-size", "2"),
        zero_config(1),
    ),
    PlannerConfig(
        "ds-moe-ep2-bf16",
        "deepspeed",
        2,
        (
            "--no-pipeline-parallel",
            "--bf16",
            "--num-experts",
            "4",
            "--moe-expert-parallel-size",
            "2",
            "--topk",
            "2",
        ),
        zero_config(1),
    ),
    # torch FSDP2 on the plain engine (no DeepSpeed) at DP 2, both strategies, fp32 and bf16
    # autocast, two micro-batches per iteration: the unsharded gradients FSDP2 accumulates
    # between its reduce-scatters, and its gathered parameters kept or freed after a forward.
    *(
        PlannerConfig(
            f"fsdp2-{strategy}-{precision}",
            "torchrun",
            2,
            (flag, "--micro-batch-size", "2", *(("--bf16",) if precision == "bf16" else ())),
            None,
        )
        for strategy, flag in (
            ("optim-grads", "--use-distributed-optimizer"),
            ("optim-grads-params", "--use-torch-fsdp2"),
        )
        for precision in ("fp32", "bf16")
    ),
)


# BigScience's BLOOM-176B run (bigscience-workshop/bigscience train/tr11-176B-ml/
# tr11-176B-ml.slurm): 70 layers, h 14336, 112 heads, seq 2048, TP 4 x PP 12 x DP 8 on 384
# A100 80GB, micro-batch 2, global batch 2048, bf16 at ZeRO-0 (DeepSpeed's BF16_Optimizer),
# full recomputation, GeLU, ALiBi, a layer norm after the embedding, 250,680 tokens padded to
# 250,880. What the flags cannot say: ALiBi (no position table: --no-position-embedding; its
# bias adds no parameter), the embedding layer norm (2 x 14,336 parameters on the end
# stages), BigScience's `--pp-partition-method type:transformer|embedding` (stages of
# [embedding + 5 layers], 6, ..., 6, [5 layers + embedding]: every stage here holds the same
# number of layers, so 70 layers are planned as 72 (middle stages exact) and as 60 (end
# stages exact)).
BLOOM_TOKENS = 250_680
"""BLOOM's tokenizer size (tr11-176B-ml README: "Vocabulary size is 250,680 tokens")."""

BLOOM_FLAGS = (
    "--hidden-size 14336 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 2 --global-batch-size 2048 --train-samples 220000000 "
    "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 12 "
    "--checkpoint-activations --deepspeed-activation-checkpointing --no-position-embedding "
    "--init-method-std 0.0048 --lr 6e-5 --min-lr 6e-6 --clip-grad 1.0 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --seed 42 --tokenizer-type HFTokenizer"
).split()


def bloom_ds_config(precision: str, stage: int) -> dict:
    """tr11-176B-ml's DeepSpeed config, in `precision` at ZeRO `stage`."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2048,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        precision: {"enabled": True},
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


def write_bloom_tokenizer(path: str) -> str:
    """A stand-in tokenizer.json of BLOOM's 250,680 tokens at `path` (a plan reads only the
    tokenizer's size; BLOOM's own tokenizer.json gives the same plan)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{index}": index for index in range(BLOOM_TOKENS - 1)}
    vocab["</s>"] = BLOOM_TOKENS - 1
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(path)
    return path


def bloom_flags(
    layers: int, heads: int, precision: str, stage: int, tokenizer: str, ds_config_path: str
) -> list[str]:
    """pretrain_gpt.py's flags for BLOOM-176B's layout with `layers` layers of `heads` heads
    in `precision` at ZeRO `stage` (its config written at `ds_config_path`)."""
    flags = [*BLOOM_FLAGS, "--num-layers", str(layers), "--num-attention-heads", str(heads)]
    flags += [f"--{precision}", "--zero-stage", str(stage), "--tokenizer-model", tokenizer]
    flags += ["--deepspeed", "--deepspeed_config", ds_config_path, "--data-path", "/nowhere/x"]
    return flags


def pretrain_flags(config: PlannerConfig, data_prefix: str, ds_config_path: str | None) -> list:
    """All of pretrain_gpt.py's flags for `config` (the DeepSpeed config at `ds_config_path`)."""
    flags = [*MODEL_FLAGS, "--data-path", data_prefix, "--vocab-file", VOCAB_FILE]
    flags += ["--merge-file", MERGE_FILE, *RUN_FLAGS, *config.flags]
    if config.ds_config is not None:
        if ds_config_path is None:
            raise ValueError(f"{config.name} needs a DeepSpeed config path")
        flags += ["--deepspeed", "--deepspeed_config", ds_config_path]
    return flags


def command(
    config: PlannerConfig, data_prefix: str, work_dir: str, measure_out: str | None
) -> list[str]:
    """The command line of `config`: under measured_run.py writing to `measure_out`, or plain
    pretrain_gpt.py when it is None. Writes the DeepSpeed config into `work_dir`."""
    ds_config_path = None
    if config.ds_config is not None:
        ds_config_path = os.path.join(work_dir, f"{config.name}.ds_config.json")
        with open(ds_config_path, "w") as file:
            json.dump(config.ds_config, file)
    script = [PRETRAIN_GPT]
    if measure_out is not None:
        script = [MEASURED_RUN, "--measure-out", measure_out, PRETRAIN_GPT]
    flags = pretrain_flags(config, data_prefix, ds_config_path)
    if config.launcher == "python":
        return [sys.executable, *script, *flags]
    program = os.path.join(os.path.dirname(sys.executable), config.launcher)
    if config.launcher == "deepspeed":
        options = ["--num_gpus", str(config.processes), "--master_port", str(free_port())]
    else:
        options = [f"--nproc_per_node={config.processes}", f"--master_port={free_port()}"]
    return [program, *options, *script, *flags]


def run(
    config: PlannerConfig,
    data_prefix: str,
    work_dir: str,
    measured: bool = True,
    launch: Callable[..., subprocess.CompletedProcess] | None = None,
) -> dict:
    """Run `config` to the end; its return code, wall seconds, output and rank reports.

    `launch(argv, env, cwd, timeout)` starts the command line and returns it finished, stdout
    and stderr together: by default as a user would (`subprocess.run`); the tests fork its
    ranks from a preloaded process instead (`tests.preloaded.launch_command`).
    """
    out = os.path.join(work_dir, config.name)
    argv = command(config, data_prefix, work_dir, out if measured else None)
    started = time.time()
    done = (launch or _launch)(argv, cpu_env(OMP_NUM_THREADS="1"), REPO_ROOT, 900)
    reports = []
    for path in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(path) as file:
            reports.append(json.load(file))
    return {
        "returncode": done.returncode,
        "wall_seconds": time.time() - started,
        "output": done.stdout,
        "reports": reports,
        "argv": argv,
    }


def _launch(
    argv: list[str], env: dict[str, str], cwd: str, timeout: float
) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout,
    )  # fmt: skip


def iteration_ms(result: dict) -> str:
    """Megatron's "elapsed time per iteration (ms)" of iterations 2 and 3, as "a / b"."""
    logs = [log for log in iteration_logs(result["output"]) if log["iteration"] >= 2]
    return " / ".join(f"{log['elapsed time per iteration (ms)']:.0f}" for log in logs)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _calls(iteration: dict) -> str:
    """'op@group xN M MB' for every counted entry of one iteration's breakdown."""
    parts = []
    for key, entry in iteration["calls"].items():
        if entry["bytes"] or entry["kind"] == "pipeline_received":
            parts.append(f"{key} x{entry['calls']} {_mb(entry['bytes'])}")
    return "; ".join(parts)


def table_rows(name: str, result: dict, iteration: int = 3) -> list[str]:
    """One markdown row per rank: peaks, framework memory, comm MB by kind at `iteration`."""
    rows = []
    for report in result["reports"]:
        it = next((i for i in report["iterations"] if i["iteration"] == iteration), None)
        comm = it["comm_bytes"] if it else {}
        cells = [
            name,
            str(report["rank"]),
            _mb(report["peak_tensor_bytes_after_first"]),
            _mb(report["framework_resident_bytes"]),
            *(_mb(comm.get(kind)) for kind in ("tensor_parallel", "data_parallel", "pipeline")),
            _mb(comm.get("all_to_all")),
            _mb(comm.get("total")),
            _mb(comm.get("pipeline_received")),
            iteration_ms(result),
            f"{result['wall_seconds']:.1f}",
            _calls(it) if it else "",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


HEADER = (
    "| config | rank | peak tensor MB (it>=2) | framework MB | TP MB | DP MB | PP MB | a2a MB "
    "| total MB | PP recv MB | it 2 / 3 ms | wall s | iteration 3 calls (counted) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> int:
    """Run the chosen configurations and print the table (and where the reports are)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--out", help="where the reports go (default: a temporary folder)")
    parser.add_argument("--data-path", help="a dataset prefix (default: build a stdlib one)")
    parser.add_argument("--unmetered", action="store_true", help="plain pretrain_gpt.py runs")
    cli = parser.parse_args()
    names = {config.name for config in CONFIGS}
    unknown = set(cli.only or ()) - names
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {sorted(names)}")
    work_dir = cli.out or tempfile.mkdtemp(prefix="planner_configs_")
    os.makedirs(work_dir, exist_ok=True)
    data_prefix = cli.data_path or build_stdlib_dataset(work_dir)
    print(HEADER)
    status = 0
    for config in CONFIGS:
        if cli.only and config.name not in cli.only:
            continue
        result = run(config, data_prefix, work_dir, measured=not cli.unmetered)
        if result["returncode"] != 0:
            status = 1
            print(
                f"| {config.name} | failed ({result['returncode']}) |\n{result['output'][-3000:]}"
            )
            continue
        if cli.unmetered:
            ms, wall = iteration_ms(result), result["wall_seconds"]
            print(f"| {config.name} | unmetered | it 2 / 3: {ms} ms | wall {wall:.1f} s |")
            continue
        print("\n".join(table_rows(config.name, result)), flush=True)
    print(f"reports: {work_dir}/<config>/rank<R>.json")
    return status


if __name__ == "__main__":
    sys.exit(main())
