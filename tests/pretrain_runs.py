"""Real `pretrain_gpt.py` runs for tests: a small stdlib dataset, launch, parse the log.

`build_stdlib_dataset` tokenizes 100 standard-library files with the real GPT-2 vocabulary;
`launch` runs `pretrain_gpt.py` as a user would (`python` for one process, `torchrun` or the
`deepspeed` launcher for several) on CPU over gloo and returns the finished process with
stdout and stderr together.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from megatron.training.monitor import parse_iteration_log
from tests import preloaded
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE
from tests.distributed import free_port


def cpu_env(**overrides: str) -> dict[str, str]:
    """The environment of a CPU run: this venv's launchers first on PATH, no GPU visible."""
    env = dict(os.environ)
    env.update(
        PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),
        PYTHON=sys.executable,
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
        MASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env


def build_stdlib_dataset(work_dir: str, documents: int = 100, paragraphs: bool = False) -> str:
    """Tokenize `documents` standard-library files into `{work_dir}/stdlib_text_document`;
    with `paragraphs`, every 2 lines of their blank-line-separated paragraphs are a document
    (about 25 tokens: samples pack several)."""
    corpus = os.path.join(work_dir, "corpus.jsonl")
    texts = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read(3000)
        if len(text) > 500:
            texts.append(text)
        if len(texts) == documents:
            break
    if paragraphs:
        lines = [part.split("\n") for text in texts for part in text.split("\n\n")]
        texts = ["\n".join(part[i : i + 2]) for part in lines for i in range(0, len(part), 2)]
        texts = [text for text in texts if text.strip()]
    with open(corpus, "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    prefix = os.path.join(work_dir, "stdlib")
    command = [
        sys.executable,
        os.path.join(REPO_ROOT, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--json-keys",
        "text",
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        VOCAB_FILE,
        "--merge-file",
        MERGE_FILE,
        "--append-eod",
        "--workers",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"preprocess_data.py failed:\n{result.stderr[-3000:]}")
    return prefix + "_text_document"


LLAMA_ARCHITECTURE = dict(
    normalization="rmsnorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    rope_theta=500000.0,
)
"""The saved args of a LLaMA-style checkpoint, beyond its sizes (what its flags validate to)."""
MOE_ARGS = dict(
    num_experts=[4],
    expert_interval=1,
    moe_expert_parallel_size=1,
    topk=2,
    moe_train_capacity_factor=1.0,
    moe_eval_capacity_factor=1.0,
    moe_min_capacity=4,
    moe_token_dropping=True,
    moe_top2_2nd_expert_sampling=True,
    mlp_type="standard",
    enable_expert_tensor_parallelism=False,
)
"""The saved MoE args of a DeepSpeed-MoE checkpoint: 4 experts in every layer, top-2 gating
with the second expert sampled (DeepSpeed's default; it samples in evaluation too)."""


def tiny_gpt_flags(data_prefix: str) -> list[str]:
    """A 2-layer GPT-2 (h=64, 4 heads, 64 tokens, dropout on) on `data_prefix`, on CPU."""
    return (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --lr 1e-3 --min-lr 1e-4 "
        "--lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.01 "
        f"--data-path {data_prefix} --vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE} "
        "--split 90,10,0 --eval-iters 1 --eval-interval 1000 --log-interval 1 "
        "--num-workers 0 --distributed-backend gloo --seed 1234"
    ).split()


def command(
    processes: int, flags: list[str], launcher: str = "torchrun", port: int | None = None
) -> list[str]:
    """`python pretrain_gpt.py` for one process, else `torchrun --nproc_per_node N` (or, with
    `launcher="deepspeed"`, `deepspeed --num_gpus N`) on `port` (a free one by default)."""
    script = os.path.join(REPO_ROOT, "pretrain_gpt.py")
    if processes == 1:
        return [sys.executable, script, *flags]
    program = os.path.join(os.path.dirname(sys.executable), launcher)
    port = free_port() if port is None else port
    if launcher == "deepspeed":
        options = ["--num_gpus", str(processes), "--master_port", str(port)]
    else:
        options = [f"--nproc_per_node={processes}", f"--master_port={port}"]
    return [program, *options, script, *flags]


def launch(
    processes: int,
    flags: list[str],
    timeout: int = 300,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess:
    """Run pretrain_gpt.py to the end; stdout and stderr together; never raises on failure.

    `env`: variables to set on top of the CPU environment (e.g. a fault to inject);
    `launcher`: "torchrun" or "deepspeed", for more than one process. The ranks are forked
    from a preloaded process with the environment that launcher gives them (tests/preloaded.py;
    `launch_for_real` starts the launcher itself).
    """
    port = free_port()
    return preloaded.launch(
        command(processes, flags, launcher, port),
        os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        flags,
        processes,
        launcher if processes > 1 else "python",
        cpu_env(OMP_NUM_THREADS="1", MASTER_PORT=str(port), **(env or {})),
        REPO_ROOT,
        port,
        timeout,
    )


def launch_for_real(
    processes: int,
    flags: list[str],
    timeout: int = 300,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess:
    """`launch` through the launcher's own command line (`command`), every rank a new Python
    process: for what depends on the launcher itself (its output, its error reports)."""
    return subprocess.run(
        command(processes, flags, launcher),
        cwd=REPO_ROOT,
        env=cpu_env(OMP_NUM_THREADS="1", **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def shared_memory_left_by(run: subprocess.CompletedProcess) -> list[str]:
    """The /dev/shm files that `run` (a `launch` under the deepspeed launcher) left behind.

    DeepSpeed's CPU all-reduce op names its 69 MB per-rank buffers after the master port; our
    runs do not build that op (megatron.deepspeed_facts.skip_deepspeed_cpu_inference_comm), so
    this is empty.
    """
    port = run.args[run.args.index("--master_port") + 1]
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


def start(processes: int, flags: list[str], log_path: str) -> subprocess.Popen:
    """Start pretrain_gpt.py in its own process group, logging to `log_path`."""
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process by the caller
    return subprocess.Popen(
        command(processes, flags),
        cwd=REPO_ROOT,
        env=cpu_env(OMP_NUM_THREADS="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its ranks in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The name field may hold spaces; the parent pid follows the closing paren.
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def signal_tree(process: subprocess.Popen, signum: int, include_launcher: bool = True) -> None:
    """Send `signum` to every rank (and to the launcher unless told not to)."""
    targets = descendants(process.pid) + ([process.pid] if include_launcher else [])
    for pid in targets:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


# A launcher's own lines: torchrun's log lines, the deepspeed launcher's.
_LAUNCHER_LINE = re.compile(
    r"^([WEI]\d{4} [\d:.]+ \d+ torch/distributed/"
    r"|\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\] \[launch\.py:)"
)


def rank_output(output: str) -> list[str]:
    """The lines of `output` before the launcher's closing report.

    That report is torchrun's traceback and ChildFailedError banner, or log lines of the
    launcher (torchrun's, deepspeed's) after the ranks' last line.
    """
    lines = output.splitlines()
    if "ChildFailedError" in output:
        lines = lines[: max(i for i, line in enumerate(lines) if line.startswith("Traceback"))]
    while lines and (not lines[-1].strip() or _LAUNCHER_LINE.match(lines[-1])):
        lines.pop()
    return lines


def last_rank_line(output: str) -> str:
    """The last line the ranks printed, before the launcher's closing report."""
    lines = rank_output(output)
    return lines[-1] if lines else ""


def iteration_logs(output: str) -> list[dict]:
    """Megatron's iteration log lines of a run, parsed."""
    return [
        parse_iteration_log(line) for line in output.splitlines() if line.startswith(" iteration")
    ]
