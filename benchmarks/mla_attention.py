"""Benchmark: multi-latent attention against standard attention of the same width, and the
`--recompute-modules` choices, on CPU: tokens/s of a training step and the bytes it keeps for
the backward (issue 57).

    python benchmarks/mla_attention.py              # h 512, 16 heads, 4 layers, seq 512
    python benchmarks/mla_attention.py --quick      # smoke run: h 64, 2 layers, seq 64

One process, the model's own `GPTModel` (LLaMA-style: RMSNorm, SwiGLU, rope, untied output,
vocabulary 1024 so the output layer does not dominate), fp32, dropout 0, AdamW. Setups, built
from the same seed:

- mha: standard multi-head attention, h / heads channels per head;
- mla: DeepSeek-V3's attention at this width (a query latent of h / 4, a key/value latent of
  h / 8, h / heads query/key channels plus half as many rotary ones per head, h / heads value
  channels; YaRN off), core attention recomputed or not as in each row;
- mla + recompute: `--recompute-granularity selective` with `--recompute-modules` as named.

Bytes kept: every tensor autograd saves during one forward (`saved_tensors_hooks`), counted
once per storage at the end of the forward (so an output freed by `layernorm` / `mla_up_proj`
recomputation counts zero), parameters excluded: exact, the same on every run. Timing:
`--warmup` untimed rounds, then `--rounds` rounds, each one step (forward, backward, AdamW) of
every setup, the order rotating; tokens/s = micro-batch tokens / median step time; "vs mha" is
the ratio to the mha row measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron.config import MLAConfig, ModelConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel

SETUPS: dict[str, tuple[bool, tuple[str, ...] | None]] = {
    "mha": (False, None),
    "mla": (True, None),
    "mla, recompute core_attn": (True, ("core_attn",)),
    "mla, + mla_up_proj": (True, ("core_attn", "mla_up_proj")),
    "mla, + layernorm": (True, ("core_attn", "layernorm")),
    "mla, + mlp": (True, ("core_attn", "mlp")),
    "mla, all of them": (True, ("core_attn", "mla_up_proj", "layernorm", "mlp")),
}
"""name -> (multi-latent attention, recomputed modules or None for no recomputation)."""


def model_config(
    cli: argparse.Namespace, mla: bool, modules: tuple[str, ...] | None
) -> ModelConfig:
    """The benchmark's GPT at `cli`'s sizes."""
    h, heads = cli.hidden_size, cli.heads
    head = h // heads
    attention = None
    if mla:
        attention = MLAConfig(
            q_lora_rank=h // 4,
            kv_lora_rank=h // 8,
            qk_head_dim=head,
            qk_pos_emb_head_dim=head // 2,
            v_head_dim=head,
            rope_type="rope",
        )
    return ModelConfig(
        num_layers=cli.layers,
        hidden_size=h,
        num_attention_heads=heads,
        vocab_size=1024,
        max_position_embeddings=cli.seq_length,
        ffn_hidden_size=cli.ffn or 8 * h // 3 // 64 * 64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation="swiglu",
        normalization="rmsnorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        recompute_granularity=None if modules is None else "selective",
        recompute_modules=modules or ("core_attn",),
        mla=attention,
    )


class Setup:
    """One model, its optimizer and batch; `step` trains once, `kept_bytes` counts."""

    def __init__(self, config: ModelConfig, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        self.model = GPTModel(config).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens, self.labels = batch
        self.parameters = sum(param.numel() for param in self.model.parameters())

    def step(self) -> None:
        """Forward, backward and one AdamW step."""
        self.model(self.tokens, labels=self.labels).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def kept_bytes(self) -> int:
        """Bytes of the tensors one forward saves for the backward (not the parameters)."""
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = self.model(self.tokens, labels=self.labels).mean()
        params = {param.untyped_storage().data_ptr() for param in self.model.parameters()}
        storages = {}
        for tensor in saved:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in params:
                storages[pointer or id(storage)] = storage.nbytes()
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return sum(storages.values())


def timed_rounds(setups: dict[str, Setup], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each setup over `rounds` rounds, the order rotating."""
    names = list(setups)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            start = time.perf_counter()
            setups[name].step()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def print_table(setups: dict[str, Setup], times: dict[str, list[float]], tokens: int) -> None:
    """The results as a markdown table, ratios to the mha row."""
    kept = {name: setup.kept_bytes() for name, setup in setups.items()}
    speed = {name: tokens / statistics.median(times[name]) for name in setups}
    print("| setup | parameters | step (median) | tokens/s | vs mha | kept for backward | vs mha |")
    print("|---|---|---|---|---|---|---|")
    for name, setup in setups.items():
        print(
            f"| {name} | {setup.parameters:,} | {statistics.median(times[name]) * 1e3:.1f} ms "
            f"| {speed[name]:,.0f} | {speed[name] / speed['mha']:.2f}x "
            f"| {kept[name] / 2**20:.1f} MiB | {kept[name] / kept['mha']:.2f}x |"
        )


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None, help="default 8h/3 rounded to 64")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.hidden_size, cli.heads, cli.layers, cli.seq_length = 64, 4, 2, 64
        cli.warmup, cli.rounds = 1, 2
    return cli


def main(argv: list[str] | None = None) -> None:
    """Build every setup, time them, print the table."""
    cli = parse_cli(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (cli.micro_batch, cli.seq_length + 1), generator=generator)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    built = {
        name: Setup(model_config(cli, mla, modules), batch)
        for name, (mla, modules) in SETUPS.items()
    }
    print(
        f"mla_attention: h {cli.hidden_size}, {cli.heads} heads, {cli.layers} layers, seq "
        f"{cli.seq_length}, micro-batch {cli.micro_batch}, fp32, {torch.get_num_threads()} "
        f"threads; {cli.warmup} warm-up + {cli.rounds} timed rounds"
    )
    times = timed_rounds(built, cli.warmup, cli.rounds)
    print_table(built, times, cli.micro_batch * cli.seq_length)


if __name__ == "__main__":
    main()
