"""Fingerprint fixed-seed runs over many layouts, to show a refactor changed no number.

Runs `pretrain_gpt.py` of a checkout (`--checkout`, this one by default) for 4 iterations on
each layout below (TP/SP/PP/VPP/DP/CP/EP/Ulysses/FSDP2/ZeRO on the four engines, 21 in all; a tiny
LLaMA-style model, fp32 or bf16, real GPT-2-tokenized text) and writes, per layout, the logged
iteration lines (loss, gradient norm, ...) and a SHA-1 of every tensor and number in the
checkpoint it saves at the end (model, optimizer, RNG state; saved argument namespaces are left
out, since they may change shape in a refactor). Comparing two such files is the before/after
check of a refactor that must leave behaviour unchanged:

    python scripts/layout_fingerprints.py --checkout /tmp/before --out before.json
    python scripts/layout_fingerprints.py --out after.json
    python scripts/layout_fingerprints.py --compare before.json after.json

`--only NAME,...` runs some layouts. Each run is a real `torchrun` launch on CPU over gloo.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gpt2")

MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 "
    "--seq-length 64 --max-position-embeddings 64 --swiglu --normalization RMSNorm "
    "--use-rotary-position-embeddings --no-position-embedding --disable-bias-linear "
    "--untie-embeddings-and-output-weights --init-method-std 0.2 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 1e-3 --lr-decay-style cosine --min-lr 1e-4 "
    "--lr-warmup-iters 1 --clip-grad 1.0 --weight-decay 0.01 --attention-dropout 0 "
    "--hidden-dropout 0 --seed 1234 --split 100,0,0 --eval-iters 0 --log-interval 1 "
    "--save-interval 4 --num-workers 0 --distributed-backend gloo"
).split()

ROUTED_MOE = "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2".split()

# name: (ranks, flags, DeepSpeed config or None)
LAYOUTS: dict[str, tuple[int, str, dict | None]] = {
    "plain-dp2": (2, "", None),
    "plain-dp2-bf16": (2, "--bf16", None),
    "plain-dp2-distributed-optimizer": (2, "--use-distributed-optimizer", None),
    "plain-fsdp2-dp2": (2, "--use-torch-fsdp2", None),
    "plain-tp2-sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel", None),
    "plain-cp2": (2, "--context-parallel-size 2", None),
    "plain-routed-moe-ep2": (2, " ".join(ROUTED_MOE), None),
    "plain-fsdp2-routed-moe-ep2": (2, "--use-torch-fsdp2 " + " ".join(ROUTED_MOE), None),
    "plain-tp2-torch-dist": (2, "--tensor-model-parallel-size 2 --ckpt-format torch_dist", None),
    "schedules-pp2": (2, "--pipeline-model-parallel-size 2", None),
    "schedules-pp2-vpp2": (
        2,
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
        None,
    ),
    "schedules-tp2-pp2": (
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel",
        None,
    ),
    "deepspeed-zero1-dp2": (
        2,
        "--deepspeed --no-pipeline-parallel",
        {"zero_optimization": {"stage": 1}},
    ),
    "deepspeed-zero2-tp2-dp2": (
        4,
        "--deepspeed --tensor-model-parallel-size 2",
        {"zero_optimization": {"stage": 2}},
    ),
    "deepspeed-zero3-dp2": (2, "--deepspeed", {"zero_optimization": {"stage": 3}}),
    "deepspeed-pipe-pp2": (2, "--deepspeed --pipeline-model-parallel-size 2", {}),
    "deepspeed-ulysses-s2": (
        2,
        "--deepspeed --no-pipeline-parallel --ds-sequence-parallel-size 2",
        {"zero_optimization": {"stage": 1}},
    ),
    "deepspeed-ulysses-s2-zero3": (
        2,
        "--deepspeed --ds-sequence-parallel-size 2",
        {"zero_optimization": {"stage": 3}},
    ),
    "deepspeed-cp2-zero1": (
        2,
        "--deepspeed --no-pipeline-parallel --context-parallel-size 2",
        {"zero_optimization": {"stage": 1}},
    ),
    "deepspeed-cp2-zero3": (
        2,
        "--deepspeed --context-parallel-size 2",
        {"zero_optimization": {"stage": 3}},
    ),
    "deepspeed-moe-ep2": (
        2,
        "--deepspeed --no-pipeline-parallel --num-experts 2 --moe-expert-parallel-size 2",
        {"zero_optimization": {"stage": 0}},
    ),
}


def build_dataset(checkout: str, work: str) -> str:
    """Tokenize 60 standard-library files with the GPT-2 vocabulary (once per `work`)."""
    prefix = os.path.join(work, "stdlib")
    if os.path.exists(prefix + "_text_document.idx"):
        return prefix + "_text_document"
    texts = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read(3000)
        if len(text) > 500:
            texts.append(json.dumps({"text": text}))
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as file:
        file.write("\n".join(texts[:60]) + "\n")
    subprocess.run(
        [sys.executable, os.path.join(checkout, "tools", "preprocess_data.py"), "--input", corpus,
         "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
         os.path.join(GPT2, "gpt2-vocab.json"), "--merge-file",
         os.path.join(GPT2, "gpt2-merges.txt"), "--append-eod", "--workers", "1"],
        check=True, capture_output=True, cwd=checkout,
    )  # fmt: skip
    return prefix + "_text_document"


def _digest_into(found: dict[str, str], key: str, value: object) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        raw = value.reshape(-1).view(torch.uint8)
        found[key] = (
            f"{value.dtype} {list(value.shape)} " + hashlib.sha1(raw.numpy().tobytes()).hexdigest()
        )
    elif isinstance(value, dict):
        for name, item in value.items():
            if name not in ("args", "ds_config", "ds_version", "saved_args"):
                _digest_into(found, f"{key}/{name}", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _digest_into(found, f"{key}/{index}", item)
    elif isinstance(value, (int, float, bool)) or value is None:
        found[key] = repr(value)


def checkpoint_digests(save: str) -> dict[str, str]:
    """SHA-1 of each tensor and number in every file of a saved checkpoint directory."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    found: dict[str, str] = {}
    for root, _, files in sorted(os.walk(save)):
        relative = os.path.relpath(root, save)
        if ".metadata" in files:  # torch.distributed.checkpoint: its whole state, gathered
            with tempfile.TemporaryDirectory() as scratch:
                whole = os.path.join(scratch, "whole.pt")
                dcp_to_torch_save(root, whole)
                _digest_into(found, relative, torch.load(whole, weights_only=False))
            continue
        for name in sorted(files):
            if name.endswith((".pt", ".pth")):
                state = torch.load(os.path.join(root, name), map_location="cpu",
                                   weights_only=False)  # fmt: skip
                _digest_into(found, f"{relative}/{name}", state)
    return found


_TIMING = ("time", "per second", "TFLOP", "throughput", "ETA")
"""Words of the log fields that vary from run to run (timings, rates, the ETA)."""


def iteration_lines(output: str) -> list[str]:
    """The log's iteration lines with their timing fields dropped."""
    lines = []
    for line in output.splitlines():
        if " iteration " in line and "lm loss" in line:
            fields = [f for f in line.split("|") if not any(word in f for word in _TIMING)]
            lines.append("|".join(field.strip() for field in fields[1:]))
    return lines


def run_layout(checkout: str, data: str, work: str, name: str) -> dict:
    """Launch one layout; its iteration lines and checkpoint digests."""
    ranks, flags, ds_config = LAYOUTS[name]
    save = os.path.join(work, name)
    shutil.rmtree(save, ignore_errors=True)
    argv = MODEL + flags.split() + [
        "--data-path", data, "--save", save,
        "--vocab-file", os.path.join(GPT2, "gpt2-vocab.json"),
        "--merge-file", os.path.join(GPT2, "gpt2-merges.txt"),
    ]  # fmt: skip
    if ds_config is not None:
        config = dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, **ds_config)
        if "--bf16" in argv:
            config["bf16"] = {"enabled": True}
        path = os.path.join(work, f"{name}.json")
        with open(path, "w") as file:
            json.dump(config, file)
        argv += ["--deepspeed_config", path]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = 29400 + sum(map(ord, name)) % 500
    command = [torchrun, f"--nproc_per_node={ranks}", f"--master_port={port}",
               os.path.join(checkout, "pretrain_gpt.py"), *argv]  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=checkout, PYTHONUNBUFFERED="1")  # fmt: skip
    started = time.time()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    output = done.stdout + done.stderr
    if done.returncode != 0:
        return {"failed": done.returncode, "output": output[-3000:]}
    print(f"  {name}: {time.time() - started:.0f} s", flush=True)
    return {"iterations": iteration_lines(output), "checkpoint": checkpoint_digests(save)}


def compare(before_path: str, after_path: str) -> int:
    """Print each layout's differences; 0 when every layout matches bit for bit."""
    with open(before_path) as file:
        before = json.load(file)
    with open(after_path) as file:
        after = json.load(file)
    differing = 0
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None or "failed" in old or "failed" in new:
            print(f"{name}: not comparable ({'missing' if not old or not new else 'failed'})")
            differing += 1
            continue
        problems = [f"iteration {i + 1}: {a!r} != {b!r}"
                    for i, (a, b) in enumerate(zip(old["iterations"], new["iterations"]))
                    if a != b]  # fmt: skip
        if len(old["iterations"]) != len(new["iterations"]):
            problems.append(f"{len(old['iterations'])} != {len(new['iterations'])} iterations")
        for key in sorted(set(old["checkpoint"]) | set(new["checkpoint"])):
            if old["checkpoint"].get(key) != new["checkpoint"].get(key):
                problems.append(f"checkpoint {key}: {old['checkpoint'].get(key)} != "
                                f"{new['checkpoint'].get(key)}")  # fmt: skip
        tensors = sum(1 for value in new["checkpoint"].values() if " [" in value)
        verdict = "identical" if not problems else f"{len(problems)} differences"
        print(f"{name}: {len(new['iterations'])} iterations, {tensors} checkpoint tensors, "
              f"{verdict}")  # fmt: skip
        for problem in problems[:10]:
            print(f"    {problem}")
        differing += bool(problems)
    print(f"{len(set(before) | set(after)) - differing} of {len(set(before) | set(after))} "
          "layouts identical")  # fmt: skip
    return 1 if differing else 0


def main() -> int:
    """Run the layouts (or compare two result files)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", default=REPO_ROOT, help="the checkout whose code runs")
    parser.add_argument("--out", help="where to write the fingerprints (JSON)")
    parser.add_argument("--work", default=os.path.join(REPO_ROOT, ".cache", "fingerprints"))
    parser.add_argument("--only", help="comma-separated layout names")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    options = parser.parse_args()
    if options.compare:
        return compare(*options.compare)
    if not options.out:
        parser.error("--out is needed to run the layouts")
    names = options.only.split(",") if options.only else list(LAYOUTS)
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        parser.error(f"--only: unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    os.makedirs(options.work, exist_ok=True)
    data = build_dataset(options.checkout, options.work)
    results = {}
    for index, name in enumerate(names):
        print(f"[{index + 1}/{len(names)}] {name}", flush=True)
        results[name] = run_layout(os.path.abspath(options.checkout), data, options.work, name)
        if "failed" in results[name]:
            print(results[name]["output"], flush=True)
        with open(options.out, "w") as file:
            json.dump(results, file, indent=1)
    failed = [name for name, result in results.items() if "failed" in result]
    print(f"{len(results) - len(failed)} of {len(results)} layouts ran; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
