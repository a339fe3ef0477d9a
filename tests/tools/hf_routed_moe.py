"""Shared pieces of the Hugging Face tests of Megatron-LM's MoE (`test_hf_glm4_moe.py`,
`test_hf_mixtral_routed.py`): random checkpoints, our model's reading of a prompt, the
tolerance of another implementation's logits, and the real command lines end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys

import torch

from megatron.checkpointing.huggingface import model_config
from megatron.checkpointing.huggingface_routed import routed_moe_args
from megatron.checkpointing.shards import DenseCheckpoint
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.text_generation import generate
from tests.conftest import REPO_ROOT
from tests.pretrain_runs import iteration_logs, launch
from tests.tolerances import forward_terms
from tests.tools.test_hf_conversion import ARGS, LLAMA_ARGS, TRUE_VOCAB, our_model
from tests.tools.test_hf_transformers4 import EOD, NEW_TOKENS
from tools.checkpoint import convert_from_hf, convert_to_hf
from tools.checkpoint.hf_tokenizer import tokenizer_source

LLAMA_STYLE = {**ARGS, **LLAMA_ARGS}
"""2 layers, hidden 64, 8 query heads over 2 key/value heads, ffn 96, RoPE base 500000, untied
output layer, no linear biases, the GPT-2 tokenizer (`test_hf_conversion`)."""


def routed_args(base: dict | None = None, **moe) -> dict:
    """The args a run of `base` (default `LLAMA_STYLE`) with Megatron-LM's MoE flags `moe`
    (dest names; `num_experts` and `moe_router_topk` required) saves."""
    experts, top_k = moe.pop("num_experts"), moe.pop("moe_router_topk")
    return {**(base or LLAMA_STYLE), **routed_moe_args(experts, top_k, **moe)}


def random_routed_checkpoint(args: dict, seed: int = 1) -> DenseCheckpoint:
    """A dense (TP=1) checkpoint of Megatron-LM's MoE, every weight random (norms around 1,
    expert biases of the size of sigmoid scores' gaps): our initialisation would hide a mixed
    up expert, gate or up half no less than a wrong router."""
    torch.manual_seed(seed)
    config = dataclasses.replace(model_config(args), vocab_size=TRUE_VOCAB)
    state = {}
    for name, tensor in GPTModel(config).state_dict().items():
        noise = torch.randn_like(tensor) * 0.2
        if "local_tokens_per_expert" in name:
            noise = torch.zeros_like(tensor)
        state[name] = 1 + noise if "layernorm.weight" in name else noise
    return DenseCheckpoint(state, dict(args), 7, TRUE_VOCAB)


def export_folder(dense: DenseCheckpoint, folder: str) -> str:
    """convert_to_hf.py's writing of `dense` (the GPT-2 tokenizer of its args) into `folder`;
    the architecture written."""
    os.makedirs(folder)
    cli = convert_to_hf.get_args(["--load", "unused", "--save", folder])
    return convert_to_hf.write_folder(folder, dense, tokenizer_source(cli, dense.args))


def import_folder(hf_dir: str, save: str, *flags: str) -> DenseCheckpoint:
    """What convert_from_hf.py (with `flags`) reads from `hf_dir` before writing it."""
    return convert_from_hf.read_hf_folder(
        convert_from_hf.get_args(["--load", hf_dir, "--save", save, *flags])
    )


def our_reading(dense: DenseCheckpoint, ids: list[int]) -> dict:
    """What our model of `dense` reads from `ids`: logits [s, v] and greedy tokens."""
    model = our_model(dense.state_dict, dense.args)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][:, :TRUE_VOCAB]
    greedy = generate(model, ids, NEW_TOKENS, greedy=True, eod_token_id=EOD, vocab_size=TRUE_VOCAB)
    return dict(ids=ids, logits=logits, greedy=greedy[0])


def routed_forward_terms(config: ModelConfig, tokens: int) -> int:
    """`forward_terms` (attention and a dense MLP in every layer) plus, in each MoE layer, what
    another implementation sums in another order: the router's logits (hidden), the chosen
    scores' normalisation and the weighted combination (k terms each), an expert's two
    linears (hidden, its ffn) and the shared expert's (hidden, its ffn)."""
    moe = config.routed_moe
    terms = forward_terms(config, tokens)
    for is_moe in moe.moe_layers:
        if is_moe:
            terms += 3 * config.hidden_size + 2 * moe.top_k
            terms += (moe.ffn_hidden_size or config.ffn_hidden_size) + (
                moe.shared_expert_ffn_hidden_size or 0
            )
    return terms


def read_config(folder: str) -> dict:
    """A Hugging Face folder's config.json."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


def printed_flags(stdout: str) -> list[str]:
    """The model flags convert_from_hf.py prints after 'train from it with: pretrain_gpt.py'
    (its `--load DIR --finetune` left out), as a shell splits them."""
    line = next(line for line in stdout.splitlines() if line.startswith("train from it with:"))
    words = shlex.split(line.removeprefix("train from it with: pretrain_gpt.py"))
    assert words[0] == "--load" and words[2] == "--finetune", words[:3]
    return words[3:]


def first_losses(flags: list[str], data_flags: list[str], loads: list[str]) -> list[float]:
    """The first iteration's lm loss of a `pretrain_gpt.py --load L --finetune` run with
    `flags` for each L of `loads` (one process, 2 iterations, the same data and seed)."""
    losses = []
    for load in loads:
        run = launch(1, [*data_flags, *flags, "--load", load, "--finetune", "--train-iters", "2"])
        assert run.returncode == 0, run.stdout[-4000:]
        assert f"loaded megatron checkpoint {load}" in run.stdout, run.stdout[-4000:]
        losses.append(iteration_logs(run.stdout)[0]["lm loss"])
    return losses


def run_checkpoint_tool(name: str, *argv: str) -> subprocess.CompletedProcess:
    """`python tools/checkpoint/{name} ARGV` in a new process, as a user runs it; must succeed."""
    tool = os.path.join(REPO_ROOT, "tools", "checkpoint", name)
    done = subprocess.run(
        [sys.executable, tool, *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
