"""Flag groups of `pretrain_gpt.py` that describe the model and its data.

Model shape, regularization and optimizer, mixed precision, data. Names, defaults and meanings
follow Megatron-LM; `megatron.arguments.build_parser` assembles these groups.
"""

from __future__ import annotations

import argparse

from megatron.tokenizer.flags import add_vocabulary_flags


def add_model_size_flags(parser: argparse.ArgumentParser) -> None:
    """The model size flags."""
    group = parser.add_argument_group("model size")
    group.add_argument(
        "--num-layers",
        "--encoder-num-layers",
        type=int,
        default=None,
        help="Number of transformer layers (required).",
    )
    group.add_argument(
        "--hidden-size", type=int, default=None, help="Transformer hidden size h (required)."
    )
    group.add_argument(
        "--num-attention-heads",
        type=int,
        default=None,
        help="Attention heads per layer (required); divisible by the tensor-parallel size.",
    )
    group.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP hidden size; 4 x h when unset."
    )
    group.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="Per-head width; h / attention heads when unset.",
    )
    group.add_argument(
        "--seq-length",
        "--encoder-seq-length",
        type=int,
        default=None,
        help="Tokens per training sample (required).",
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Rows of the position-embedding table (longest sequence); --seq-length when unset.",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times the tensor-parallel size.",
    )
    group.add_argument(
        "--layernorm-epsilon",
        "--norm-epsilon",
        type=float,
        default=1e-5,
        help="Epsilon of every layer norm (LayerNorm or RMSNorm).",
    )
    group.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Std of the normal weight init; output projections use std / sqrt(2 x layers).",
    )
    group.add_argument(
        "--apply-query-key-layer-scaling",
        action="store_true",
        help="Scale attention scores by 1/layer-number before an fp32 softmax (fp16 overflow "
        "guard); takes effect only with --fp16, where it selects the unfused attention path.",
    )
    group.add_argument(
        "--no-query-key-layer-scaling",
        dest="apply_query_key_layer_scaling",
        action="store_false",
        help="Megatron-DeepSpeed's spelling of leaving --apply-query-key-layer-scaling off "
        "(the default here).",
    )
    group.add_argument(
        "--openai-gelu",
        action="store_true",
        help="Use the tanh approximation of GeLU (as OpenAI's GPT-2); it is already the "
        "default, so this matters only with --no-bias-gelu-fusion.",
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Use rotary position embeddings (RoPE) instead of learned absolute positions.",
    )
    group.add_argument(
        "--rotary-position-embeddings-theta",
        "--rotary-base",
        dest="rope_theta",
        type=float,
        default=10000,
        help="Base of the rotary angles (RoPE theta; LLaMA-3 uses 500000). --rotary-base is "
        "Megatron-LM's spelling.",
    )
    group.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="No learned absolute position embeddings (implied by "
        "--use-rotary-position-embeddings; alone: no position information at all).",
    )
    group.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope", "yarn", "none"],
        default=None,
        help="Megatron-LM's spelling: rope is --use-rotary-position-embeddings, none is "
        "--no-position-embedding.",
    )
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's channels that RoPE rotates (default: %(default)s).",
    )
    group.add_argument(
        "--normalization",
        type=lambda text: text.lower(),
        choices=["layernorm", "rmsnorm"],
        default="layernorm",
        help="layernorm (GPT-2) or rmsnorm (LLaMA; weight only, no bias). Megatron-LM's "
        "spellings LayerNorm/RMSNorm are accepted.",
    )
    group.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="Zero-centred norm weights (Megatron-LM's LayerNorm1P): each norm scales by "
        "1 + weight, the weight starting at 0; --normalization layernorm or rmsnorm.",
    )
    group.add_argument(
        "--swiglu",
        action="store_true",
        help="SwiGLU MLP (silu(x W_gate) * x W_up); --ffn-hidden-size defaults to "
        "int(8h / 3 / 64) * 64 with it, as in Megatron-DeepSpeed.",
    )
    group.add_argument(
        "--num-key-value-heads",
        type=int,
        default=None,
        help="Key/value heads: fewer than --num-attention-heads is grouped-query attention "
        "(1: multi-query); each must be divisible by the tensor-parallel size. Default: "
        "--num-attention-heads.",
    )
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Megatron-LM's switch for grouped-query attention; the group count is "
        "--num-query-groups.",
    )
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Megatron-LM's spelling of --num-key-value-heads (with --group-query-attention).",
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weights (language_model.output_layer) instead of "
        "the word embeddings.",
    )
    group.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="No biases in the attention and MLP linear layers (LLaMA).",
    )
    group.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="A bias on the query/key/value projection even with --disable-bias-linear "
        "(Qwen2's attention; the output projection and the MLP stay without).",
    )
    group.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Normalize each head's queries and keys (--normalization, with the same epsilon; "
        "one weight of --kv-channels shared by the heads) before the rotary embedding "
        "(Qwen3's q_norm and k_norm).",
    )
    group.add_argument(
        "--window-size",
        type=window_size,
        default=None,
        help="Sliding-window attention as Megatron-LM's (left, right), e.g. '(4096, 0)': a "
        "query at position q sees keys q - left .. q (Mistral's sliding_window is left + 1); "
        "right must be 0 (a GPT attends causally); left -1 means no window.",
    )


def window_size(text: str) -> tuple[int, int] | None:
    """`--window-size`'s value: '(left, right)' or 'left,right' -> (left, 0), or None for -1."""
    try:
        values = tuple(int(part) for part in text.strip().strip("()").split(","))
    except ValueError:
        values = ()
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not two integers '(left, right)'")
    left, right = values
    if right != 0:
        raise argparse.ArgumentTypeError(
            f"right {right}: a GPT attends causally, the window's right side must be 0"
        )
    if left == -1:
        return None
    if left < 0:
        raise argparse.ArgumentTypeError(f"left {left} must be -1 (no window) or at least 0")
    return (left, 0)


def add_regularization_flags(parser: argparse.ArgumentParser) -> None:
    """The regularization flags."""
    group = parser.add_argument_group("regularization and optimizer")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities."
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout on embeddings and residual branches.",
    )
    group.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="Decoupled (AdamW) weight decay; biases and 1-D (layer-norm) weights get none.",
    )
    group.add_argument(
        "--start-weight-decay",
        type=float,
        default=None,
        help="Weight decay at the start of a --weight-decay-incr-style linear/cosine ramp.",
    )
    group.add_argument(
        "--end-weight-decay",
        type=float,
        default=None,
        help="Weight decay at the end of the ramp (reached at the last training sample).",
    )
    group.add_argument(
        "--weight-decay-incr-style",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="How weight decay moves from --start-weight-decay to --end-weight-decay; "
        "constant keeps --weight-decay.",
    )
    group.add_argument(
        "--sgd-momentum",
        type=float,
        default=0.9,
        help="Accepted without effect: Megatron's SGD momentum; --optimizer sgd is not built here.",
    )
    group.add_argument(
        "--clip-grad", type=float, default=1.0, help="Max global gradient L2 norm; 0 = no clipping."
    )
    group.add_argument(
        "--adam-beta1", type=float, default=0.9, help="Adam beta1 (first-moment decay)."
    )
    group.add_argument(
        "--adam-beta2", type=float, default=0.999, help="Adam beta2 (second-moment decay)."
    )
    group.add_argument(
        "--adam-eps", type=float, default=1e-8, help="Adam epsilon added to the denominator."
    )
    group.add_argument(
        "--optimizer",
        choices=["adam", "adamw", "muon", "dist_muon"],
        default="adam",
        help="Optimizer: adam and adamw both mean AdamW (Adam with decoupled weight decay), as "
        "in Megatron; muon is Megatron-LM's Muon for the 2-D hidden weights (--muon-*) with "
        "AdamW for the rest; dist_muon is its deprecated spelling of muon with "
        "--use-distributed-optimizer.",
    )


def add_mixed_precision_flags(parser: argparse.ArgumentParser) -> None:
    """The mixed precision flags."""
    group = parser.add_argument_group("mixed precision")
    group.add_argument(
        "--fp16",
        action="store_true",
        help="Train in float16 mixed precision with loss scaling (DeepSpeed: fp16.enabled).",
    )
    group.add_argument(
        "--bf16", action="store_true", help="bfloat16 mixed precision (DeepSpeed: bf16.enabled)."
    )
    group.add_argument(
        "--loss-scale", type=float, default=None, help="Static fp16 loss scale; dynamic when unset."
    )
    group.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="Initial dynamic fp16 loss scale (power of 2 with --deepspeed).",
    )
    group.add_argument(
        "--min-loss-scale", type=float, default=1.0, help="Floor of the dynamic fp16 loss scale."
    )
    group.add_argument(
        "--loss-scale-window",
        type=float,
        default=1000,
        help="fp16 iterations without overflow before the loss scale doubles.",
    )
    group.add_argument(
        "--hysteresis", type=int, default=2, help="fp16 overflows before the loss scale halves."
    )


class _InterDocumentMasking(argparse.Action):
    """`--dataloader-inter-document-masking`: document masks and positions restarting per
    document, as Megatron-LM's packed-sequence attention computes them."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        namespace.reset_attention_mask = True
        namespace.reset_position_ids = True


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    """The data flags."""
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefix from tools/preprocess_data.py, or weight/prefix pairs "
        "W1 P1 W2 P2 ... to blend; cut into train/valid/test by --split.",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"The {split} split's own datasets, in --data-path's form, each used whole "
            "(--split is not read); not with --data-path.",
        )
    group.add_argument(
        "--mock-data",
        action="store_true",
        help="Train on Megatron-LM's synthetic documents (megatron-core's MockGPTDataset) "
        "instead of files; not with --data-path or the per-split paths.",
    )
    group.add_argument(
        "--sft",
        action="store_true",
        help="Supervised fine-tuning (Megatron-LM's flag): every dataset has the loss mask that "
        "tools/preprocess_data.py --sft writes beside it, and only the tokens it marks (the "
        "replies) are trained on. Masks are read where they exist without it too.",
    )
    group.add_argument(
        "--split",
        default="969, 30, 1",
        help="Train/valid/test weights over each dataset's documents, comma- or "
        "slash-separated (default: %(default)s).",
    )
    group.add_argument(
        "--data-impl",
        choices=["mmap", "infer"],
        default="mmap",
        help="Indexed-dataset format; only mmap exists (infer opens it too).",
    )
    group.add_argument(
        "--mmap-warmup", action="store_true", help="Read each .bin file once when opening it."
    )
    group.add_argument(
        "--data-cache-path",
        default=None,
        help="Folder for the cached index arrays; beside each dataset when unset.",
    )
    group.add_argument(
        "--num-workers", type=int, default=2, help="DataLoader worker processes per rank."
    )
    group.add_argument(
        "--vocab-file",
        default=None,
        help="GPT-2 BPE vocabulary (vocab.json); GPT2BPETokenizer needs it.",
    )
    group.add_argument(
        "--merge-file",
        default=None,
        help="GPT-2 BPE merges (merges.txt); GPT2BPETokenizer needs it.",
    )
    group.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=[
            "GPT2BPETokenizer",
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "HFTokenizer",
            "HuggingFaceTokenizer",
            "TikTokenizer",
            "NullTokenizer",
            "Llama3Tokenizer",
            "MistralTokenizer",
        ],
        help="Tokenizer (default: %(default)s, from --vocab-file/--merge-file). "
        "SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer read a "
        "SentencePiece --tokenizer-model, HFTokenizer (Megatron-LM's current spelling: "
        "HuggingFaceTokenizer) a Hugging Face one, TikTokenizer a tiktoken JSON vocabulary; "
        "NullTokenizer reads integer ids below --vocab-size. The BERT word-piece tokenizers "
        "and Llama3Tokenizer/MistralTokenizer (removed from Megatron-LM) are refused in one "
        "line.",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model file (SentencePieceTokenizer, GPTSentencePieceTokenizer, "
        "Llama2Tokenizer), Hugging Face tokenizer folder or tokenizer.json (HFTokenizer, "
        "loaded offline), or tiktoken JSON vocabulary (TikTokenizer).",
    )
    add_vocabulary_flags(group)
    group.add_argument(
        "--eod-mask-loss", action="store_true", help="Leave end-of-document tokens out of the loss."
    )
    group.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="Restart position ids after each end of document.",
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="Stop attention across end-of-document tokens: the batch carries document ids and "
        "attention runs FlexAttention's block-sparse kernel (GPU) or one SDPA call per "
        "document (CPU), never a dense [s, s] mask; under --context-parallel-size, ring "
        "attention skips the blocks no document crosses into and masks those one ends in.",
    )
    group.add_argument(
        "--dataloader-inter-document-masking",
        action=_InterDocumentMasking,
        nargs=0,
        help="Megatron-LM's switch for attention restricted to each packed document (its "
        "cu_seqlens path): here --reset-attention-mask with --reset-position-ids.",
    )
    group.add_argument(
        "--check-labels",
        action="store_true",
        help="Debugging: check every micro-batch's labels are inside the vocabulary (an error "
        "names the label and its position); costs a device sync per micro-batch.",
    )
