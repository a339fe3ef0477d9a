"""tools/generate_samples_gpt.py on a tiny checkpoint written by `save_megatron_checkpoint`.

The end-to-end runs start the tool as a user would (`python`, and `torchrun` for TP=2, on CPU
over gloo); the prompt sources, output file and errors are checked through `main(argv)`.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing.shards import DenseCheckpoint, save_megatron_checkpoint
from megatron.config import ModelConfig, MoEConfig
from megatron.model import GPTModel
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE
from tests.one_line_errors import (
    assert_one_line_error,
    damaged_checkpoint,
    file_under_a_file,
    snapshot,
)
from tests.pretrain_runs import MOE_ARGS
from tools.generate_samples_gpt import (
    INTERACTIVE_PROMPT,
    build_model_and_tokenizer,
    get_args,
    main,
)

TOOL = os.path.join(REPO_ROOT, "tools", "generate_samples_gpt.py")
GPT2_VOCAB = 50257
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
GREEDY = ["--prompt", "def main(", "--greedy", "--out-seq-length", "8"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random 2-layer GPT with the GPT-2 tokenizer, saved at TP=2 (iteration 3)."""
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(vocab_size=50304, **SHAPE))
    state = model.state_dict()
    embeddings = "language_model.embedding.word_embeddings.weight"
    state[embeddings] = state[embeddings][:GPT2_VOCAB]
    args = dict(
        SHAPE,
        seq_length=64,
        make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=VOCAB_FILE,
        merge_file=MERGE_FILE,
    )
    root = str(tmp_path_factory.mktemp("generate") / "checkpoint")
    save_megatron_checkpoint(DenseCheckpoint(state, args, 3, GPT2_VOCAB), root, 2, 1)
    return root


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    """A random 2-layer GPT with 4 experts per layer (top-2, the second sampled), saved in
    Megatron's layout (every expert, globally numbered) with the flags of an expert-parallel
    run."""
    torch.manual_seed(0)
    moe = MoEConfig(experts_per_layer=(4, 4), top_k=2)
    model = GPTModel(ModelConfig(vocab_size=50304, moe=moe, **SHAPE))
    state = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    embeddings = "language_model.embedding.word_embeddings.weight"
    state[embeddings] = state[embeddings][:GPT2_VOCAB]
    args = dict(SHAPE, seq_length=64, vocab_file=VOCAB_FILE, merge_file=MERGE_FILE, **MOE_ARGS)
    args["moe_expert_parallel_size"] = 2  # as trained: 2 experts per rank
    root = str(tmp_path_factory.mktemp("generate_moe") / "checkpoint")
    save_megatron_checkpoint(DenseCheckpoint(state, args, 3, GPT2_VOCAB), root, 1, 1)
    return root


def test_moe_checkpoint_generates_in_one_process(moe_checkpoint, capsys):
    """Every expert runs in the one process, and top-2 gating takes the second expert by
    argmax: the same tokens give the same logits (DeepSpeed would sample it)."""
    assert main(["--load", moe_checkpoint, *GREEDY]) == 0
    (text,) = continuations(capsys.readouterr().out)
    assert text.strip()
    model, tokenizer = build_model_and_tokenizer(
        get_args(["--load", moe_checkpoint]), torch.device("cpu")
    )
    assert [layer.mlp.num_local_experts for layer in model.language_model.encoder.layers] == [4, 4]
    tokens = torch.tensor([tokenizer.tokenize("def main(): return 1")])
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens))


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory) -> str:
    """A random DeepSeek-V3-shaped GPT (MLA with a query latent and YaRN, group-limited
    sigmoid routing with expert biases, a shared expert, the first layer dense, one MTP
    module; tests/tools/test_hf_deepseek.py), saved at TP=1."""
    from tests.tools.hf_routed_moe import random_routed_checkpoint
    from tests.tools.test_hf_deepseek import VARIANT_ARGS

    root = str(tmp_path_factory.mktemp("generate_deepseek") / "checkpoint")
    save_megatron_checkpoint(random_routed_checkpoint(VARIANT_ARGS["v3"]), root, 1, 1)
    return root


def test_deepseek_checkpoint_generates_from_its_latent_cache(deepseek_checkpoint, capsys):
    """The tool's greedy text is what the model gives without a cache: the latent cache
    (each MLA layer's compressed latent and rotated shared key) is exact."""
    from megatron.text_generation import generate

    assert main(["--load", deepseek_checkpoint, *GREEDY]) == 0
    (text,) = continuations(capsys.readouterr().out)
    args = get_args(["--load", deepseek_checkpoint])
    model, tokenizer = build_model_and_tokenizer(args, torch.device("cpu"))
    ids = tokenizer.tokenize("def main(")
    runs = [generate(model, ids, 8, greedy=True, use_cache=use, vocab_size=GPT2_VOCAB)
            for use in (True, False)]  # fmt: skip
    assert runs[0] == runs[1]
    assert text == tokenizer.detokenize(runs[0][0])


def run_tool(launcher: list[str], *args: str) -> subprocess.CompletedProcess:
    """The tool's process (or torchrun's) on CPU; stdout and stderr kept apart."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(
        [*launcher, TOOL, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def continuations(output: str) -> list[str]:
    """The generated texts of the tool's output blocks (trailing newlines dropped)."""
    chunks = output.split("Megatron-LM: ")[1:]
    return [re.split(r"\nContext(?=: | prompt)", chunk)[0].rstrip("\n") for chunk in chunks]


@pytest.mark.slow
def test_greedy_prompt_then_tp2_gives_the_same_text(checkpoint):
    single = run_tool([sys.executable], "--load", checkpoint, *GREEDY)
    assert single.returncode == 0, single.stderr
    assert "Context: def main(" in single.stdout
    (text,) = continuations(single.stdout)
    assert text.strip()
    torchrun = ["torchrun", "--standalone", "--nproc_per_node", "2"]
    tp2 = run_tool(torchrun, "--load", checkpoint, "--tensor-model-parallel-size", "2", *GREEDY)
    assert tp2.returncode == 0, tp2.stderr
    assert "(TP=2)" in tp2.stdout
    assert continuations(tp2.stdout) == [text]  # printed once: rank 0 only


def test_missing_load_directory_is_a_one_line_error(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert main(["--load", missing, *GREEDY]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--load" in err and missing in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--top_k", "-1"], "--top_k"),
        (["--top_k", "3", "--top_p", "0.5"], "--top_p"),
        (["--temperature", "0"], "--temperature"),
        (["--vocab-file", "/no/such/vocab.json"], "--vocab-file"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    ],
)
def test_bad_flags_are_one_line_errors(checkpoint, capsys, flags, named):
    assert main(["--load", checkpoint, "--prompt", "x", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_input_file_to_default_output_file(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\n\nimport os\n", encoding="utf-8")
    assert main(["--load", checkpoint, "--sample-input-file", str(prompts), "--greedy",
                 "--out-seq-length", "4"]) == 0  # fmt: skip
    written = (tmp_path / "prompts.txt.out").read_text(encoding="utf-8")
    assert written.count("Context: ") == 2  # the empty line is skipped
    assert "Context: def main(" in written and "Context: import os" in written
    assert continuations(written) == continuations(capsys.readouterr().out)


def test_seeded_samples_are_reproducible(checkpoint, capsys):
    def sample(seed: str) -> list[str]:
        flags = ["--prompt", "hello", "--top_k", "50", "--num-samples", "2", "--seed", seed]
        assert main(["--load", checkpoint, *flags, "--out-seq-length", "6"]) == 0
        return continuations(capsys.readouterr().out)

    first = sample("7")
    assert len(first) == 2 and first[0] != first[1]  # each sample of a prompt differs
    assert sample("7") == first
    assert sample("8") != first


def test_interactive_reads_prompts_until_stop(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def main(\n\nstop\nnever read\n"))
    assert main(["--load", checkpoint, "--greedy", "--out-seq-length", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count(INTERACTIVE_PROMPT.strip()) == 3
    assert "Prompt should not be empty!" in out
    assert "Context: def main(" in out and "never read" not in out
    assert len(continuations(out)) == 1


def test_unconditional_samples(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("not a prompt\n"))
    assert main(["--load", checkpoint, "--num-samples", "2", "--out-seq-length", "4"]) == 0
    out = capsys.readouterr().out
    assert len(continuations(out)) == 2 and "not a prompt" not in out


# case -> (flags after --load, the fragments the error line must name)
BAD_RUNS = {
    "no_checkpoint": (["{d}/empty", "--prompt", "x"], ["no checkpoint in {d}/empty"]),
    "damaged_checkpoint": (["{d}/damaged", "--prompt", "x"], ["{damaged_file}"]),
    "missing_input": (["{ckpt}", "--sample-input-file", "{d}/no.txt"], ["--sample-input-file"]),
    "output_under_a_file": (["{ckpt}", "--prompt", "x", "--sample-output-file", "{blocked}"],
                            ["--sample-output-file {blocked}"]),
    "tokenizer_type": (["{ckpt}", "--prompt", "x", "--tokenizer-type", "Foo",
                        "--sample-output-file", "{earlier}"], ["--tokenizer-type Foo"]),
    "not_an_int": (["{ckpt}", "--prompt", "x", "--top_k", "abc"], ["--top_k", "'abc'"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(checkpoint, tmp_path, capsys, case):
    """Exit 1, no traceback, one last `error:` line naming the flag or file; an earlier
    --sample-output-file is left as it was."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "earlier.out").write_text("earlier samples\n")
    paths = dict(d=tmp_path, ckpt=checkpoint, earlier=tmp_path / "earlier.out")
    paths.update(blocked=file_under_a_file(tmp_path))
    paths["damaged_file"] = damaged_checkpoint(tmp_path / "damaged")
    before = snapshot(tmp_path)
    flags, named = BAD_RUNS[case]
    code = main(["--load"] + [f.format(**paths) for f in flags] + ["--out-seq-length", "2"])
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before
