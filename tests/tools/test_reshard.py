"""tools/checkpoint/reshard.py: TP/PP resharding, and DeepSpeed checkpoints of real runs.

A random GPT-2 saved at TP=2, a random LLaMA-style model (RMSNorm, SwiGLU, 8 query and 4
key/value heads, RoPE, untied output layer, no linear biases) saved at TP=2 x PP=2, and two
Mixture-of-Experts models (GPT-2 with PR-MoE, experts whole on every TP rank; LLaMA with
SwiGLU experts split by expert tensor parallelism) saved at TP=2 are resharded to TP=1 ->
TP=4 -> TP=2: the weights stay bit-identical, and the TP=2 and TP=4 files, loaded rank by rank
into the tensor-parallel GPTModel in one spawned 4-rank gloo world, give the dense model's
logits up to the rounding of fp32 sums split over other ranks (`forward_terms`). Two real
`pretrain_gpt.py --deepspeed` runs with ZeRO-1 (TP=2 on the non-pipeline engine; PP=2 of 4
layers in bf16 on the pipeline engine, whose files carry DeepSpeed's bf16 optimizer
metadata) are converted to Megatron's layout with the weights of the DeepSpeed files, bit for
bit; the pipeline run also to 2 x 2 virtual stages (Megatron-LM's `model0`, `model1` per rank
file), and a run of Megatron's 1F1B pointed at its files is told, in one line, to convert
them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
import torch

from megatron.checkpointing.file_format import chunk_keys, flatten_model_state, load_file
from megatron.checkpointing.huggingface import model_config
from megatron.checkpointing.shards import (
    DenseCheckpoint,
    checkpoint_splits,
    load_dense_checkpoint,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE, run_cli
from tests.model.helpers import spawn_collect
from tests.one_line_errors import (
    assert_one_line_error,
    damaged_checkpoint,
    file_under_a_file,
    snapshot,
)
from tests.pretrain_runs import LLAMA_ARCHITECTURE, MOE_ARGS, launch
from tests.tolerances import assert_close_reordered, forward_terms
from tools.checkpoint import reshard

TRUE_VOCAB, DIVISIBLE = 100, 8  # padded to 104 at TP=1, 112 at TP=2, 128 at TP=4
ARGS = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=16,
    seq_length=16,
    make_vocab_size_divisible_by=DIVISIBLE,
    true_vocab_size=TRUE_VOCAB,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA_ARGS = dict(
    ARGS,
    num_attention_heads=8,
    num_key_value_heads=4,
    ffn_hidden_size=48,
    **LLAMA_ARCHITECTURE,
)
MOE = {**MOE_ARGS, "moe_top2_2nd_expert_sampling": False}
VARIANTS = {
    "gpt2": (ARGS, 1),
    "llama": (LLAMA_ARGS, 2),
    "pr-moe": ({**ARGS, **MOE, "mlp_type": "residual"}, 1),
    "llama-moe-expert-tp": (
        {**LLAMA_ARGS, **MOE, "num_experts": [2], "expert_interval": 2,
         "enable_expert_tensor_parallelism": True},
        1,
    ),
}  # fmt: skip
"""name -> (args, pipeline-parallel size of the source checkpoint). The MoE models: PR-MoE
(experts and its dense MLP whole on every tensor-parallel rank, a replicated gate and
coefficient); SwiGLU experts in the second layer, split over tensor-parallel ranks. Their
second expert is taken by argmax: DeepSpeed samples it in evaluation too, unless told not to."""
TOKENS = torch.randint(0, TRUE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
WORD = "language_model.embedding.word_embeddings.weight"


def dense_logits(state: dict[str, torch.Tensor], args: dict) -> torch.Tensor:
    """Logits [b, s, true vocab] of the single-process GPTModel holding `state`."""
    config = dataclasses.replace(model_config(args), vocab_size=state[WORD].size(0))
    model = GPTModel(dataclasses.replace(config, parallel_output=False))
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(TOKENS)[..., :TRUE_VOCAB]


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, dict]:
    """Per variant: a random model saved at TP=2, resharded by the tool to TP=1, TP=4, TP=2."""
    out = {}
    for name, (args, pp) in VARIANTS.items():
        root = tmp_path_factory.mktemp(f"reshard_{name}")
        torch.manual_seed(0)
        config = dataclasses.replace(model_config(args), vocab_size=TRUE_VOCAB)
        state = {k: torch.randn_like(t) * 0.3 for k, t in GPTModel(config).state_dict().items()}
        progress = {"consumed_train_samples": 240}
        source = DenseCheckpoint(state, dict(args), 30, TRUE_VOCAB, progress)
        save_megatron_checkpoint(source, str(root / "source"), 2, pp)
        dirs = {tp: str(root / f"tp{tp}") for tp in (1, 2, 4)}
        for src, tp in ((str(root / "source"), 1), (dirs[1], 4), (dirs[4], 2)):
            argv = ["--load", src, "--save", dirs[tp], "--target-tensor-parallel-size", str(tp)]
            assert reshard.main(argv + ["--target-pipeline-parallel-size", "1"]) == 0
        out[name] = {"args": args, "state": state, "dirs": dirs}
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reshard_keeps_weights_and_progress(chains, variant):
    chain = chains[variant]
    for tp, directory in chain["dirs"].items():
        loaded = load_dense_checkpoint(directory)
        assert loaded.args["tensor_model_parallel_size"] == tp
        assert loaded.args["padded_vocab_size"] == {1: 104, 2: 112, 4: 128}[tp]
        assert (loaded.iteration, loaded.train_state["consumed_train_samples"]) == (30, 240)
        assert sorted(loaded.state_dict) == sorted(chain["state"])
        for name, tensor in chain["state"].items():
            assert torch.equal(loaded.state_dict[name], tensor), (tp, name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dense_forward_agrees_across_sizes(chains, variant):
    """The same weights, padded to 104, 112 or 128 vocabulary rows (zeros) instead of 100: the
    same logits. The padding changes only the output layer's matmul (more rows, so possibly
    another blocking of the kernel): within the rounding of its sums over hidden."""
    chain = chains[variant]
    expected = dense_logits(chain["state"], chain["args"])
    for directory in chain["dirs"].values():
        loaded = load_dense_checkpoint(directory)
        rows, splits = loaded.args["padded_vocab_size"], checkpoint_splits(loaded.args)
        padded = shard_state_dict(loaded.state_dict, 1, 0, rows, splits)
        logits = dense_logits(padded, loaded.args)
        assert_close_reordered(logits, expected, terms=loaded.args["hidden_size"])


def test_reshard_to_a_tp_not_dividing_the_key_value_heads_is_refused(chains, tmp_path, capsys):
    argv = ["--load", chains["llama"]["dirs"][1], "--save", str(tmp_path / "tp8")]
    assert reshard.main(argv + ["--target-tensor-parallel-size", "8"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["error: tensor-parallel size 8 does not divide num_key_value_heads 4"]
    assert not (tmp_path / "tp8").exists()


def test_moe_checkpoint_stays_at_pipeline_parallel_size_1(chains, tmp_path, capsys):
    argv = ["--load", chains["pr-moe"]["dirs"][1], "--save", str(tmp_path / "pp2")]
    assert reshard.main(argv + ["--target-pipeline-parallel-size", "2"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "pipeline-parallel size 2 x 1 virtual stage(s)" in error[0]
    assert "Mixture-of-Experts model runs without pipeline parallelism" in error[0]
    assert not (tmp_path / "pp2").exists()


def _parallel_logits(tp: int, directory: str) -> torch.Tensor:
    """This rank's TP-group forward on the rank's own file of the TP-`tp` checkpoint."""
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(5)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    iteration = sorted(name for name in os.listdir(directory) if name.startswith("iter_"))[-1]
    saved = load_file(
        os.path.join(directory, iteration, f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt")
    )
    args = dict(vars(saved["args"]))
    config = dataclasses.replace(model_config(args), parallel_output=False)
    model = GPTModel(config)
    model.load_state_dict(flatten_model_state(saved["model"]))
    with torch.no_grad():
        logits = model.eval()(TOKENS)[..., :TRUE_VOCAB]
    parallel_state.destroy_model_parallel()
    return logits


def _parallel_body(rank: int, world: int, dirs: dict[str, dict]) -> dict[str, torch.Tensor]:
    del rank, world
    return {
        f"{name}-tp{tp}": _parallel_logits(tp, variant[tp])
        for name, variant in dirs.items()
        for tp in (4, 2)
    }


def test_parallel_forward_at_tp2_and_tp4(chains):
    """Each TP rank's forward on its own file gives the dense logits, up to the rounding of
    the sums that tensor parallelism splits into per-rank parts (all-reduced)."""
    expected = {name: dense_logits(c["state"], c["args"]) for name, c in chains.items()}
    dirs = {name: chain["dirs"] for name, chain in chains.items()}
    for results in spawn_collect(_parallel_body, 4, dirs):
        for key, logits in results.items():
            name = key.rsplit("-", 1)[0]
            terms = forward_terms(model_config(chains[name]["args"]), TOKENS.numel())
            assert_close_reordered(logits, expected[name], terms=terms, msg=key)


# --- DeepSpeed checkpoints of real pretrain_gpt.py runs ---------------------------------------

RUNS = {
    "tp2-zero1": ["--tensor-model-parallel-size", "2", "--no-pipeline-parallel"],
    "pp2-zero1-bf16": ["--pipeline-model-parallel-size", "2", "--bf16", "--num-layers", "4"],
}


DS_ZERO1 = ["--deepspeed", "--deepspeed_config", f"{REPO_ROOT}/examples/ds_configs/ds_zero1.json"]


def _tiny_run(data_prefix: str, *flags: str) -> subprocess.CompletedProcess:
    """One iteration of a tiny GPT (2 layers unless `flags` say more), 2 CPU processes."""
    return launch(
        2,
        [
            *"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 2 "
            "--train-iters 1 --lr 1e-3 --split 98,2,0 --eval-iters 0 "
            "--eval-interval 1000 --num-workers 0 --distributed-backend gloo".split(),
            *["--data-path", data_prefix, "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE],
            *flags,
        ],
    )


def _pretrain(save: str, data_prefix: str, flags: list[str]) -> None:
    """One iteration of a tiny GPT under `--deepspeed` (ZeRO-1), 2 CPU processes, then save."""
    run = _tiny_run(data_prefix, "--save", save, "--save-interval", "1", *DS_ZERO1, *flags)
    assert run.returncode == 0, run.stdout[-5000:]


@pytest.fixture(scope="module", params=sorted(RUNS))
def deepspeed_run(request, tmp_path_factory, stdlib_dataset) -> tuple[str, str, str]:
    """(name, DeepSpeed checkpoint dir, its Megatron-layout conversion by the tool)."""
    root = tmp_path_factory.mktemp(request.param)
    source, target = str(root / "ds"), str(root / "megatron")
    _pretrain(source, stdlib_dataset, RUNS[request.param])
    assert reshard.main(["--load", source, "--save", target]) == 0
    return request.param, source, target


def test_deepspeed_run_converts_to_megatron_layout(deepspeed_run, stdlib_dataset):
    name, source, target = deepspeed_run
    tag = open(os.path.join(source, "latest")).read().strip()
    assert tag == "global_step1"
    ds_dir, mg_dir = os.path.join(source, tag), os.path.join(target, "iter_0000001")
    assert open(os.path.join(target, "latest_checkpointed_iteration.txt")).read() == "1"
    if name.startswith("tp2"):
        for tp_rank in range(2):
            module = load_file(os.path.join(ds_dir, f"mp_rank_{tp_rank:02d}_model_states.pt"))
            saved = load_file(os.path.join(mg_dir, f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"))
            expected = module["module"]
            assert_bit_identical(flatten_model_state(saved["model"]), expected)
    else:  # 4 layers in 2 stages, then in 2 x 2 virtual stages (Megatron-LM's model0, model1)
        layers = {
            n: load_file(os.path.join(ds_dir, f"layer_{n:02d}-model_00-model_states.pt"))
            for n in range(6)
        }
        interleaved = os.path.join(target + "_vpp2", "iter_0000001")
        assert reshard.main(["--load", source, "--save", os.path.dirname(interleaved),
                             "--target-virtual-pipeline-parallel-size", "2"]) == 0  # fmt: skip
        for directory, virtual in ((mg_dir, 1), (interleaved, 2)):
            for rank in range(2):
                saved = load_file(f"{directory}/mp_rank_00_{rank:03d}/model_optim_rng.pt")
                for chunk, key in enumerate(chunk_keys(virtual)):
                    expected = pipeline_layer_files(layers, chunk * 2 + rank, 2 * virtual)
                    assert_bit_identical(flatten_model_state(saved[key]), expected)
                assert vars(saved["args"])["virtual_pipeline_model_parallel_size"] == (
                    virtual if virtual > 1 else None
                )
        first = load_file(f"{mg_dir}/mp_rank_00_000/model_optim_rng.pt")["model"]
        assert flatten_model_state(first)[WORD].dtype == torch.bfloat16
        # Megatron's 1F1B (no --deepspeed) cannot read the engine's files: it names the tool.
        refused = _tiny_run(stdlib_dataset, "--load", source, *RUNS[name])
        errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
        assert refused.returncode != 0 and errors, refused.stdout[-3000:]
        for error in errors:  # one line per rank, naming its own file
            assert "saved by DeepSpeed's pipeline engine" in error and "reshard.py" in error
    saved = load_file(os.path.join(mg_dir, os.listdir(mg_dir)[0], "model_optim_rng.pt"))
    assert saved["iteration"] == 1 and saved["train_state"]["consumed_train_samples"] == 2
    assert vars(saved["args"])["true_vocab_size"] == 50257


def pipeline_layer_files(layers: dict[int, dict], stage: int, stages: int) -> dict:
    """What Megatron's stage `stage` of `stages` holds (layers numbered from 0), from the
    DeepSpeed pipeline engine's layer files (0 embedding, 1..L layers, L + 1 final norm)."""
    per_stage = (len(layers) - 2) // stages
    expected = {}
    if stage == 0:
        expected.update({f"language_model.embedding.{k}": t for k, t in layers[0].items()})
    for local in range(per_stage):
        layer = layers[stage * per_stage + local + 1]
        expected.update({f"language_model.encoder.layers.{local}.{k}": t for k, t in layer.items()})
    if stage == stages - 1:
        norm = layers[len(layers) - 1]
        expected.update({f"language_model.encoder.final_layernorm.{k}": t for k, t in norm.items()})
        expected["word_embeddings_for_head.weight"] = layers[0]["word_embeddings.weight"]
    return expected


def assert_bit_identical(actual: dict, expected: dict) -> None:
    """Same names, equal tensors (padding rows of the vocabulary included)."""
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


# --- the command line ------------------------------------------------------------------------


def test_missing_load_directory_is_one_line_error(tmp_path):
    missing, save = str(tmp_path / "missing"), str(tmp_path / "out")
    result = run_cli("tools/checkpoint/reshard.py", "--load", missing, "--save", save)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint directory {missing} does not exist"
    ]
    assert not os.path.exists(save)


def test_save_holding_a_checkpoint_is_refused(chains, capsys):
    dirs = chains["gpt2"]["dirs"]
    before = sorted(os.listdir(dirs[1]))
    argv = ["--load", dirs[2], "--save", dirs[1]]
    assert reshard.main(argv) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and dirs[1] in error[0] and "--force" in error[0]
    assert sorted(os.listdir(dirs[1])) == before


# case -> (--load, --save and more, the fragments the error line must name)
BAD_RUNS = {
    "no_checkpoint": (["{d}/empty", "--save", "{d}/new"], ["no checkpoint in {d}/empty"]),
    "damaged_file": (["{d}/damaged", "--save", "{d}/new"], ["{damaged_file}"]),
    "save_is_a_file": (["{d}/damaged", "--save", "{d}/notes.txt"], ["--save {d}/notes.txt"]),
    "save_under_a_file": (["{d}/damaged", "--save", "{blocked}"], ["--save {blocked}"]),
    "size_not_an_int": (["{d}/damaged", "--save", "{d}/new", "--target-tensor-parallel-size",
                         "two"], ["--target-tensor-parallel-size", "'two'"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1, no traceback, one last `error:` line naming the flag or file; nothing written."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("a file where --save should go\n")
    paths = dict(d=tmp_path, damaged_file=damaged_checkpoint(tmp_path / "damaged"))
    paths["blocked"] = file_under_a_file(tmp_path)
    before = snapshot(tmp_path)
    flags, named = BAD_RUNS[case]
    code = reshard.main(["--load"] + [f.format(**paths) for f in flags])
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()
