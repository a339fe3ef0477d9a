"""Supervised fine-tuning end to end: tools/preprocess_data.py --sft, then pretrain_gpt.py --sft.

tests/data/sft_tiny.jsonl (a few dozen short conversations, Alpaca and prompt/response records)
is tokenized with GPT-2 and the built-in ChatML template; a tiny GPT trains on it with the
replies' loss mask for 100 iterations on CPU, samples packed to --seq-length across the
conversations with each attending to itself (--dataloader-inter-document-masking); its loss
(over the reply tokens only) falls, and it then answers a ChatML prompt in the template's
format.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE
from tests.pretrain_runs import iteration_logs, launch

SFT_DATA = os.path.join(REPO_ROOT, "tests", "data", "sft_tiny.jsonl")


QUESTIONS = ("What is the capital of Japan?", "What is 3 plus 5?")
CHATML_REPLY = re.compile(r"Megatron-LM: ([^<\n]+)<\|im_end\|>")


@pytest.mark.slow
def test_sft_loss_falls_and_the_model_answers_in_the_template(tmp_path, capsys):
    """100 iterations on the replies' loss (packed conversations, each attending to itself):
    the loss falls from ln(50257) by over 5 nats, and greedy generation after a ChatML
    prompt gives a reply closed by `<|im_end|>`, the template's format."""
    from tools import generate_samples_gpt, preprocess_data

    prefix = str(tmp_path / "tiny")
    flags = ["--input", SFT_DATA, "--output-prefix", prefix, "--sft"]
    assert preprocess_data.main([*flags, "--sft-tokenizer-prompt-format", "chatml"]) == 0
    tokenizer = f"--vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE}".split()
    run = launch(
        1,
        (
            "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 4 "
            "--lr 3e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine "
            "--train-iters 100 --split 90,10,0 --eval-iters 1 --eval-interval 100 "
            "--attention-dropout 0 --hidden-dropout 0 --dataloader-inter-document-masking "
            f"--log-interval 1 --num-workers 0 --seed 1234 --distributed-backend gloo --sft "
            f"--data-path {prefix}_sft_document --save {tmp_path / 'checkpoint'} "
            "--save-interval 100"
        ).split()
        + tokenizer,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    losses = [log["lm loss"] for log in iteration_logs(run.stdout)]
    assert len(losses) == 100
    assert abs(losses[0] - 10.82) < 0.2, losses  # untrained: about ln(50257)
    assert max(losses[-10:]) < losses[0] - 5.0, losses
    assert "validation loss at iteration 100" in run.stdout
    for question in QUESTIONS:
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        argv = ["--load", str(tmp_path / "checkpoint"), "--prompt", prompt, "--greedy"]
        assert generate_samples_gpt.main([*argv, "--out-seq-length", "16", *tokenizer]) == 0
        answer = capsys.readouterr().out
        assert CHATML_REPLY.search(answer), answer
