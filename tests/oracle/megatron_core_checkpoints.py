"""Checkpoints and logits of megatron-core's own GPTModel (not this project's), on CPU.

Usage: python megatron_core_checkpoints.py JOB.json, run with the released megatron-core
importable as `megatron` (tests/conftest.py `run_oracle`). The job names a model (Megatron-LM's
argument names), `tokens` ([batch, seq] ids) and `kind`:
- save: build the model from `seed`, write it as Megatron-LM's training loop does
  (`{dir}/iter_{N:07d}/` through `dist_checkpointing.save` in the torch_dist format, `args`,
  `iteration` and `checkpoint_version` in its common state, `latest_checkpointed_iteration.txt`);
- load: build the model from another seed and load `{dir}`'s newest checkpoint into it;
- train_save: build the model from `seed`, train it `iteration` steps and save it as
  Megatron-LM's training loop does, its whole `args` and common state included
  (megatron_lm_save.py; `rerun` also writes the rerun machine's state, `vocab_file` and
  `merge_file` go into args).
Each way the model's logits on `tokens` (eval mode) go to `logits` (a .npy file).

megatron-core runs on CPU here with gloo, its local (non-Transformer-Engine) layer spec and CPU
initialization; the few GPU calls of its checkpoint writer are pointed at the CPU, and its
forward's GPU random-generator forks (dropout is 0) do nothing.
"""

import argparse
import contextlib
import json
import os
import sys

import numpy
import torch
import torch.distributed as dist


def _model(job):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=job["num_layers"],
        hidden_size=job["hidden_size"],
        num_attention_heads=job["num_attention_heads"],
        ffn_hidden_size=4 * job["hidden_size"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        init_method_std=0.2,
        bias_activation_fusion=True,  # Megatron-LM's default (--bias-gelu-fusion): tanh GeLU
    )
    torch.manual_seed(job.get("seed", 0))
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=job["padded_vocab_size"],
        max_sequence_length=job["max_position_embeddings"],
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )


def _args(job):
    """Megatron-LM's training arguments for the model, as its checkpoints carry them."""
    return argparse.Namespace(
        num_layers=job["num_layers"],
        hidden_size=job["hidden_size"],
        ffn_hidden_size=4 * job["hidden_size"],
        num_attention_heads=job["num_attention_heads"],
        num_query_groups=None,
        group_query_attention=False,
        kv_channels=job["hidden_size"] // job["num_attention_heads"],
        max_position_embeddings=job["max_position_embeddings"],
        seq_length=job["max_position_embeddings"],
        padded_vocab_size=job["padded_vocab_size"],
        make_vocab_size_divisible_by=job["padded_vocab_size"],
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        bias_gelu_fusion=True,
        openai_gelu=False,
        add_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=False,
        apply_residual_connection_post_layernorm=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_format="torch_dist",
        tokenizer_type="GPT2BPETokenizer",
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def _logits(model, tokens):
    model.eval()
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True: not attended
    with torch.no_grad():
        return model(tokens, positions, mask)


def main():
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(job["port"]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    # The checkpoint writer synchronizes the GPU and reduces its status flags on the current
    # GPU; without one, nothing to wait for and the CPU (gloo) holds the flags.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    parallel_state.initialize_model_parallel(1, 1)
    # Dropout is 0: the forward's GPU random-generator forks have nothing to draw.
    tracker = tensor_parallel_random.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    model = _model(job)
    root = job["dir"]
    if job["kind"] == "train_save":
        from megatron_lm_save import train_and_save

        train_and_save(job, model)
    elif job["kind"] == "save":
        iteration = job["iteration"]
        directory = os.path.join(root, f"iter_{iteration:07d}")
        os.makedirs(directory, exist_ok=True)
        state = {
            "args": _args(job),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model.sharded_state_dict(),
        }
        dist_checkpointing.save(state, directory)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as tracker:
            tracker.write(str(iteration))
    else:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as tracker:
            iteration = int(tracker.read().strip())
        directory = os.path.join(root, f"iter_{iteration:07d}")
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(loaded["model"])
    tokens = torch.tensor(job["tokens"], dtype=torch.long)
    numpy.save(job["logits"], _logits(model, tokens).float().numpy())
    dist.destroy_process_group()
    print("oracle checkpoint job done")


if __name__ == "__main__":
    main()
