"""Typed configuration objects, built once from the parsed arguments and passed down.

Library code (core, model, data) takes these instead of reading a global `args`.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass

from megatron.deepseek_config import (
    MLAConfig,
    MTPConfig,
    mla_config_from_args,
    mtp_config_from_args,
)
from megatron.moe_config import (
    MoEConfig,
    RoutedMoEConfig,
    moe_config_from_args,
    routed_moe_config_from_args,
)
from megatron.yarn_config import YarnConfig, yarn_config_from_args


def model_params_dtype(args: Namespace) -> str:
    """The dtype the model's parameters are created in for `--fp16` / `--bf16` on each path.

    With `--deepspeed` the parameters are half precision: DeepSpeed's engine casts the model
    to its `fp16` / `bf16` dtype anyway and keeps the fp32 master copy in its optimizer.
    Without it they stay fp32 and *are* the master weights: the forward and backward run in
    half precision under `torch.autocast`, gradients arrive (and accumulate over
    micro-batches, and all-reduce) in fp32, and AdamW keeps fp32 state. We chose this over
    Megatron's `Float16OptimizerWithFloat16Params` (half parameters plus an fp32 copy in the
    optimizer) because one fp32 tensor per weight is what the optimizer, DDP, clipping and
    the checkpoint all read, so no second copy has to be kept in step; the memory is the
    same (4 + 4 + 8 bytes per parameter against Megatron's 2 + 4 + 4 + 8 with fp32
    gradients), and autocast caches each weight's half-precision cast within a micro-batch.
    """
    half = "bfloat16" if getattr(args, "bf16", False) else None
    half = half or ("float16" if getattr(args, "fp16", False) else None)
    return half if half and getattr(args, "deepspeed", False) else "float32"


@dataclass
class DataConfig:
    """Where the training data is and how GPT samples are cut from it."""

    data_path: list[str] | None
    """A dataset prefix, or weight/prefix pairs to blend (`--data-path 0.3 a 0.7 b`), cut into
    the splits by `split`; None with the per-split paths or `mock_data`."""
    seq_length: int
    """Tokens per sample (each sample reads seq_length + 1 tokens for the shifted labels)."""
    train_data_path: list[str] | None = None
    """The train split's own datasets, whole, in --data-path's form (`--train-data-path`)."""
    valid_data_path: list[str] | None = None
    """The validation split's own datasets (`--valid-data-path`)."""
    test_data_path: list[str] | None = None
    """The test split's own datasets (`--test-data-path`)."""
    mock_data: bool = False
    """Megatron-LM's synthetic documents instead of files (`--mock-data`)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (`--seed`)."""
    split: str = "969, 30, 1"
    """Train/valid/test weights over the documents of each dataset (`--split`)."""
    data_cache_path: str | None = None
    """Folder for the cached index arrays; default: beside each dataset (`--data-cache-path`)."""
    data_impl: str = "mmap"
    """Indexed dataset implementation; only Megatron's default `mmap` exists (`--data-impl`)."""
    mmap_warmup: bool = False
    """Read every page of the .bin once when opening it (`--mmap-warmup`)."""
    num_workers: int = 2
    """DataLoader worker processes (`--num-workers`)."""
    dataloader_type: str = "single"
    """`single` (sequential, Megatron's default) or `cyclic` (reshuffled every epoch)."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary size: every token id must be below it (None: not checked)."""
    eod_token_id: int | None = None
    """The tokenizer's end of document, which ends every mock document."""
    sft: bool = False
    """Every dataset has its SFT loss mask beside it (`--sft`; `megatron.data.loss_mask`). The
    masks are read where they exist without it too."""

    @classmethod
    def from_args(cls, args: Namespace) -> DataConfig:
        """Build from Megatron-style parsed arguments."""

        def listed(name: str) -> list[str] | None:
            value = getattr(args, name, None)
            return list(value) if value else None

        return cls(
            data_path=listed("data_path"),
            seq_length=args.seq_length,
            train_data_path=listed("train_data_path"),
            valid_data_path=listed("valid_data_path"),
            test_data_path=listed("test_data_path"),
            mock_data=bool(getattr(args, "mock_data", False)),
            seed=args.seed,
            split=args.split,
            data_cache_path=getattr(args, "data_cache_path", None),
            data_impl=getattr(args, "data_impl", "mmap"),
            mmap_warmup=getattr(args, "mmap_warmup", False),
            num_workers=getattr(args, "num_workers", 2),
            dataloader_type=getattr(args, "dataloader_type", "single") or "single",
            vocab_size=getattr(args, "tokenizer_vocab_size", None),
            eod_token_id=getattr(args, "eod_token_id", None),
            sft=bool(getattr(args, "sft", False)),
        )


@dataclass(frozen=True)
class Fp8Config:
    """FP8 matmuls in the transformer layers' linear layers through torchao's float8 training
    (`--fp8-format`, `--fp8-recipe`; megatron.model.fp8). Weights, gradients, optimizer state
    and checkpoints stay in the run's precision: FP8 is the format of the matmuls' inputs."""

    format: str = "hybrid"
    """`e4m3` (every operand E4M3) or `hybrid` (E4M3 forward, E5M2 gradients)."""
    recipe: str = "tensorwise"
    """`tensorwise`: one scale per tensor from its current amax (Transformer Engine's
    Float8CurrentScaling, torchao's tensorwise recipe)."""
    wgrad: bool = True
    """The weight gradient's matmul in FP8 too (`--no-fp8-wgrad`: in the run's precision)."""
    bf16_layers_at_start: int = 0
    """The first N transformer layers keep their matmuls in the run's precision
    (`--first-last-layers-bf16 --num-layers-at-start-in-bf16 N`)."""
    bf16_layers_at_end: int = 0
    """Likewise the last N layers (`--num-layers-at-end-in-bf16`)."""
    param_gather: bool = False
    """Under FSDP2 sharding, all-gather each weight in FP8 (`--fp8-param-gather`)."""

    def __post_init__(self) -> None:
        """Reject a format or recipe that is not built."""
        if self.format not in ("e4m3", "hybrid"):
            raise ValueError(f"Fp8Config.format must be e4m3 or hybrid, not {self.format!r}")
        if self.recipe != "tensorwise":
            raise ValueError(f"Fp8Config.recipe must be tensorwise, not {self.recipe!r}")

    def covers_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer `layer_number` (1-based, of `num_layers`) runs in FP8."""
        return self.bf16_layers_at_start < layer_number <= num_layers - self.bf16_layers_at_end


def fp8_config_from_args(args: Namespace) -> Fp8Config | None:
    """The FP8 settings of validated flags (megatron.arguments.fp8_flags); None without FP8."""
    if getattr(args, "fp8", None) is None:
        return None
    keep = bool(getattr(args, "first_last_layers_bf16", False))
    return Fp8Config(
        format=args.fp8,
        recipe=args.fp8_recipe,
        wgrad=bool(getattr(args, "fp8_wgrad", True)),
        bf16_layers_at_start=args.num_layers_at_start_in_bf16 if keep else 0,
        bf16_layers_at_end=args.num_layers_at_end_in_bf16 if keep else 0,
        param_gather=bool(getattr(args, "fp8_param_gather", False)),
    )


@dataclass
class ModelConfig:
    """Shape and numerics of the GPT model, plus how its layers are split and recomputed.

    Field names follow Megatron's flags (`--hidden-size` -> `hidden_size`); the tensor- and
    pipeline-parallel sizes come from `megatron.core.parallel_state`, not from here.
    """

    num_layers: int
    """Transformer layers (`--num-layers`)."""
    hidden_size: int
    """Model width h (`--hidden-size`)."""
    num_attention_heads: int
    """Attention heads; must be divisible by the tensor-parallel size."""
    vocab_size: int
    """Embedding rows: the tokenizer's vocab padded by `--make-vocab-size-divisible-by` x TP."""
    max_position_embeddings: int
    """Rows of the learned position table; the longest sequence the model accepts."""
    ffn_hidden_size: int | None = None
    """MLP width (`--ffn-hidden-size`); default 4h."""
    kv_channels: int | None = None
    """Per-head width (`--kv-channels`); default h / heads."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on each residual branch (`--hidden-dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (`--attention-dropout`)."""
    layernorm_epsilon: float = 1e-5
    """Layer norm epsilon (`--layernorm-epsilon`)."""
    init_method_std: float = 0.02
    """Std of the normal init; output layers use std / sqrt(2 L) (`--init-method-std`)."""
    activation: str = "gelu_tanh"
    """`gelu_tanh` (Megatron's fused bias-GeLU and `--openai-gelu`), `gelu` (exact erf),
    `swiglu` (`--swiglu`: silu(gate) * up, both halves of `dense_h_to_4h`) or `quick_geglu`
    (`--quick-geglu`, gpt-oss's: gate * sigmoid(1.702 gate) * up)."""
    glu_linear_offset: float = 0.0
    """Added to the linear half of a gated activation: act(gate) * (up + offset)
    (`--glu-linear-offset`; gpt-oss: 1)."""
    activation_clamp_value: float | None = None
    """A gated activation's gate clamped to at most v and its linear half to [-v, v] first
    (`--activation-func-clamp-value`; gpt-oss: 7)."""
    normalization: str = "layernorm"
    """`layernorm` or `rmsnorm` (`--normalization`; RMSNorm has a weight and no bias)."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights (`--apply-layernorm-1p`): each norm multiplies by 1 + weight,
    the weight starting at 0, so weight decay pulls it toward 1 (Megatron-LM's LayerNorm1P)."""
    num_key_value_heads: int | None = None
    """Key/value heads (`--num-key-value-heads`); fewer than the query heads is grouped-query
    attention, 1 multi-query; default: one per query head."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output layer `language_model.output_layer` instead of the word embeddings."""
    add_bias_linear: bool = True
    """Biases on the four linear layers of each block (`--disable-bias-linear` turns off)."""
    add_qkv_bias: bool = False
    """A bias on the query/key/value projection, also without add_bias_linear (`--add-qkv-bias`)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys (`normalization`, width kv_channels, one weight
    shared by the heads) before the rotary embedding (`--qk-layernorm`, Qwen3's)."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention (`--window-size`, Mistral's): a query at position q sees the keys
    q - left .. q + right of (left, right); right is 0 for causal attention. None: no window."""
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    """Which layers keep the whole sequence despite `window_size` (`--window-attn-skip-freq`):
    with N, layer numbers divisible by N; or per layer, 1 windowed, 0 whole (`layer_window`)."""
    softmax_type: str = "vanilla"
    """`vanilla`, `off-by-one` (a zero logit beside every query's scores) or `learnable` (a
    learned logit per head: gpt-oss's attention sinks) (`--softmax-type`)."""
    position_embedding_type: str = "learned_absolute"
    """`learned_absolute` (GPT-2), `rope` (`--use-rotary-position-embeddings`), `yarn` (rope
    with YaRN's scaling, `yarn`) or `none` (`--no-position-embedding` alone)."""
    yarn: YarnConfig | None = None
    """YaRN's settings with `position_embedding_type` yarn (`--position-embedding-type yarn`)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate (`--rotary-percent`)."""
    rotary_base: float = 10000.0
    """Base of the rotary angles (`--rotary-position-embeddings-theta`, RoPE theta)."""
    attention_backend: str = "sdpa"
    """`sdpa` (torch's fused attention), `flash` (flash kernels only) or `unfused` (explicit)."""
    apply_query_key_layer_scaling: bool = False
    """Scale scores by 1/layer_number before an fp32 softmax (`unfused` only; fp16 safety)."""
    params_dtype: str = "float32"
    """Parameter dtype: `float32`, `bfloat16` or `float16` (see `model_params_dtype`)."""
    sequence_parallel: bool = False
    """Split layer norm and dropout regions along the sequence (`--sequence-parallel`)."""
    use_cpu_initialization: bool = False
    """Draw full weights on the CPU, then split: results independent of TP size."""
    recompute_granularity: str | None = None
    """`full` (whole layers) or `selective` (attention core only); None keeps activations."""
    recompute_method: str = "uniform"
    """`uniform` (every group of N layers) or `block` (only the first N layers)."""
    recompute_num_layers: int = 1
    """N of `recompute_method` (`--recompute-num-layers`, `--checkpoint-num-layers`)."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """Under selective recomputation, the parts of each layer recomputed in the backward
    (`--recompute-modules`: core_attn, mlp, moe, shared_experts, moe_act, layernorm,
    mla_up_proj; `megatron.model.utils.recomputes`)."""
    distribute_saved_activations: bool = False
    """Keep 1/tp of each recomputed layer's input on every TP rank."""
    parallel_output: bool = True
    """Return logits split over the vocabulary (True for training) or gathered."""
    check_labels: bool = False
    """Raise on a label outside the (padded) vocabulary, at a device sync (`--check-labels`)."""
    sequence_split_gradient_scale: int = 1
    """Under a sequence split (DeepSpeed-Ulysses or context parallelism over S ranks), the factor
    on the gradient of each rank's part of the per-token losses: S where the gradient reduction
    averages over the split ranks whose parts must add up (DDP over data x context ranks,
    ZeRO-3's reduce-scatter); 1 where DeepSpeed sums them (`Engine.sequence_split_gradient_scale`,
    read off the run's layout)."""
    cp_comm_types: tuple[str, ...] = ("p2p",)
    """Per layer, how context-parallel attention exchanges keys and values (`--cp-comm-type`):
    `p2p` (ring attention), `allgather` (all-gather K/V) or `a2a` (all-to-all, head-split)."""
    bias_gelu_fusion: bool = True
    """On a GPU, run the MLP's bias add and GeLU as one compiled kernel (`--bias-gelu-fusion`)."""
    bias_dropout_fusion: bool = True
    """On a GPU, run bias add, dropout and residual add as one kernel (`--bias-dropout-fusion`)."""
    torch_compile: bool = False
    """Compile with `torch.compile` (`--torch-compile`): each transformer layer, or at TP=1
    the whole model from ids to loss (see `compile_whole_model`)."""
    compile_whole_model: bool = True
    """With `torch_compile` at TP=1, one graph from ids to loss. Off under ZeRO-3: its hooks
    gather each module's parameters as the module runs, and the tied output layer uses the
    embedding's weight outside that module, which a whole-model graph does not replay."""
    moe: MoEConfig | None = None
    """DeepSpeed-MoE layers (Megatron-DeepSpeed's `--num-experts` above 1), or None."""
    routed_moe: RoutedMoEConfig | None = None
    """Megatron-LM's MoE layers (`--num-experts` with its `--moe-*` flags), or None."""
    fp8: Fp8Config | None = None
    """FP8 matmuls in the transformer layers (`--fp8-format`), or None."""
    mla: MLAConfig | None = None
    """Multi-latent attention in every layer (`--multi-latent-attention`), or None."""
    mtp: MTPConfig | None = None
    """Multi-token prediction modules after the last layer (`--mtp-num-layers`), or None."""

    def __post_init__(self) -> None:
        """Fill the derived defaults and reject impossible shapes."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) is not divisible by "
                    f"--num-attention-heads ({self.num_attention_heads}); set --kv-channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be a multiple of "
                f"--num-key-value-heads ({self.num_key_value_heads})"
            )
        choices = {
            "activation": ("gelu_tanh", "gelu", "swiglu", "quick_geglu"),
            "softmax_type": ("vanilla", "off-by-one", "learnable"),
            "normalization": ("layernorm", "rmsnorm"),
            "position_embedding_type": ("learned_absolute", "rope", "yarn", "none"),
            "attention_backend": ("sdpa", "flash", "unfused"),
            "params_dtype": ("float32", "bfloat16", "float16"),
            "recompute_granularity": (None, "full", "selective"),
            "recompute_method": ("uniform", "block"),
        }
        if self.distribute_saved_activations and self.sequence_parallel:
            raise ValueError(
                "--distribute-saved-activations (--partition-activations) cannot be combined "
                "with --sequence-parallel: sequence-parallel activations are already split"
            )
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {allowed}, not {getattr(self, name)!r}"
                )

    @property
    def gated(self) -> bool:
        """Whether the MLP's activation is gated (`dense_h_to_4h` twice as wide: gate | up)."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def glu_keeps_input_only(self) -> bool:
        """Whether the gated activation is `gated_activation.gated_activation` (quick-GeGLU, or
        any clamp or offset), which keeps only its input; plain SwiGLU also keeps silu(gate)."""
        plain = self.glu_linear_offset == 0.0 and self.activation_clamp_value is None
        return self.activation == "quick_geglu" or (self.activation == "swiglu" and not plain)

    @property
    def rotary(self) -> bool:
        """Whether attention rotates queries and keys (rope or yarn)."""
        return self.position_embedding_type in ("rope", "yarn")

    def layer_window(self, layer_number: int) -> tuple[int, int] | None:
        """Layer `layer_number`'s (from 1) sliding window, or None where it sees the whole
        sequence (megatron-core's `is_layer_window_attention`)."""
        skip = self.window_attn_skip_freq
        if self.window_size is None or skip is None:
            return self.window_size
        if isinstance(skip, int):
            return self.window_size if layer_number % skip != 0 else None
        return self.window_size if skip[(layer_number - 1) % len(skip)] else None

    @property
    def projection_size(self) -> int:
        """Total attention width: heads x kv_channels."""
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        """Width of the keys (and of the values): key/value heads x kv_channels."""
        return self.num_key_value_heads * self.kv_channels

    @property
    def torch_dtype(self):
        """`params_dtype` as a torch.dtype."""
        import torch

        return getattr(torch, self.params_dtype)

    @classmethod
    def from_args(cls, args: Namespace) -> ModelConfig:
        """Build from Megatron-style parsed arguments (after validation)."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        if get("use_flash_attn") or get("use_flash_attn_v2"):
            backend = "flash"
        elif get("apply_query_key_layer_scaling") and get("fp16"):
            backend = "unfused"
        else:
            backend = "sdpa"
        granularity = get("recompute_granularity")
        if get("checkpoint_activations") and granularity is None:
            granularity = "full"
        moe = moe_config_from_args(args)
        routed_moe = routed_moe_config_from_args(args)
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            vocab_size=args.padded_vocab_size,
            max_position_embeddings=args.max_position_embeddings,
            ffn_hidden_size=get("ffn_hidden_size"),
            kv_channels=get("kv_channels"),
            hidden_dropout=get("hidden_dropout", 0.1),
            attention_dropout=get("attention_dropout", 0.1),
            layernorm_epsilon=get("layernorm_epsilon", 1e-5),
            init_method_std=get("init_method_std", 0.02),
            activation=_activation(args),
            normalization=str(get("normalization") or "layernorm").lower(),
            apply_layernorm_1p=bool(get("apply_layernorm_1p")),
            num_key_value_heads=get("num_key_value_heads"),
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
            add_bias_linear=bool(get("add_bias_linear", True)),
            add_qkv_bias=bool(get("add_qkv_bias")),
            qk_layernorm=bool(get("qk_layernorm")),
            # (Saved args hold it as a list.)
            window_size=None if get("window_size") is None else tuple(get("window_size")),
            window_attn_skip_freq=_window_attn_skip_freq(args),
            softmax_type=get("softmax_type") or "vanilla",
            glu_linear_offset=float(get("glu_linear_offset") or 0.0),
            activation_clamp_value=get("activation_func_clamp_value"),
            position_embedding_type=_position_embedding_type(args),
            yarn=yarn_config_from_args(args),
            rotary_percent=get("rotary_percent", 1.0),
            rotary_base=float(get("rope_theta", 10000)),
            attention_backend=backend,
            apply_query_key_layer_scaling=bool(get("apply_query_key_layer_scaling")),
            params_dtype=model_params_dtype(args),
            sequence_parallel=bool(get("sequence_parallel")),
            use_cpu_initialization=bool(get("use_cpu_initialization")),
            recompute_granularity=granularity,
            recompute_method=get("recompute_method") or "uniform",
            recompute_num_layers=get("recompute_num_layers") or get("checkpoint_num_layers") or 1,
            recompute_modules=tuple(get("recompute_modules") or ("core_attn",)),
            distribute_saved_activations=bool(
                get("distribute_saved_activations") or get("partition_activations")
            ),
            check_labels=bool(get("check_labels")),
            sequence_split_gradient_scale=(
                args.layout.sequence_split_gradient_scale if get("layout") else 1
            ),
            cp_comm_types=_cp_comm_types(args),
            bias_gelu_fusion=bool(get("bias_gelu_fusion", True)),
            bias_dropout_fusion=bool(get("bias_dropout_fusion", True)),
            torch_compile=bool(get("torch_compile")),
            # MoE layers' all-to-all, DeepSpeed's gating and Ulysses' all-to-alls stay eager
            # (outside any graph): the layers are compiled one by one around them.
            compile_whole_model=(get("zero_stage") or 0) < 3
            and moe is None
            and routed_moe is None
            and not get("mtp_num_layers")
            and (get("ds_sequence_parallel_size") or 1) == 1
            and (get("context_parallel_size") or 1) == 1,
            moe=moe,
            routed_moe=routed_moe,
            fp8=fp8_config_from_args(args),
            mla=mla_config_from_args(args),
            mtp=mtp_config_from_args(args),
        )


def _cp_comm_types(args: Namespace) -> tuple[str, ...]:
    """`--cp-comm-type` per layer: one value for all, or one per layer (Megatron-LM's form)."""
    types = list(getattr(args, "cp_comm_type", None) or ["p2p"])
    return tuple(types * args.num_layers if len(types) == 1 else types)


def _activation(args: Namespace) -> str:
    if getattr(args, "swiglu", False):
        return "swiglu"
    if getattr(args, "quick_geglu", False):
        return "quick_geglu"
    if getattr(args, "openai_gelu", False) or getattr(args, "bias_gelu_fusion", True):
        return "gelu_tanh"
    return "gelu"


def _window_attn_skip_freq(args: Namespace) -> int | tuple[int, ...] | None:
    """`--window-attn-skip-freq`: N, or the per-layer 0/1 pattern."""
    skip = getattr(args, "window_attn_skip_freq", None)
    return tuple(skip) if isinstance(skip, list) else skip


def _position_embedding_type(args: Namespace) -> str:
    if getattr(args, "position_embedding_type", None) == "yarn":
        return "yarn"
    if getattr(args, "use_rotary_position_embeddings", False):
        return "rope"
    return "learned_absolute" if getattr(args, "add_position_embedding", True) else "none"
