"""Turn loose-JSON lines into token arrays, the worker side of `tools/preprocess_data.py`.

Each line is one JSON object; every `--json-keys` key holds a document (a string, or a list
of strings taken as its sentences). Token ids and sequence lengths follow Megatron-LM's
preprocess_data.py exactly: one sequence per document (or per non-empty sentence with
`--split-sentences`), the tokenizer's end-of-document token (`<|endoftext|>` for GPT-2)
appended to the last sequence with `--append-eod`. Any tokenizer `create_tokenizer` builds
works: GPT-2 BPE, SentencePiece, Llama2, Hugging Face, tiktoken or NullTokenizer.
Lines that cannot be used are reported with their line number instead of crashing the run.

With `sft` set, lines are SFT records instead (`megatron.data.sft_encoder`): each becomes one
or more documents of tokens (ending with the end-of-document token) written to
`_sft_document`, and their loss masks, written beside them to `_sft_document_loss_mask`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron.data.corpus_reader import BadLineError
from megatron.data.indexed_dataset import DType
from megatron.data.loss_mask import LOSS_MASK_DTYPE, LOSS_MASK_SUFFIX
from megatron.data.sft_encoder import SFT_KEYS, SFTConfig, SFTEncoder
from megatron.tokenizer.tokenizer import TokenizerConfig, create_tokenizer

UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class EncoderConfig:
    """What the encoder needs; built from preprocess_data's flags."""

    json_keys: list[str]
    tokenizer: TokenizerConfig
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    sft: SFTConfig | None = None
    """SFT records (conversations, Alpaca, prompt/response) instead of `json_keys` documents."""

    def record_keys(self) -> list[str]:
        """The keys of a record this run reads (a table input reads only these columns)."""
        return list(SFT_KEYS) if self.sft else list(self.json_keys)


SFT_OUTPUT = "sft"
SFT_LOSS_MASK_OUTPUT = "sft_loss_mask"


@dataclass
class KeyTokens:
    """All tokens of one JSON key across a batch of lines, with their sequence structure."""

    tokens: list[np.ndarray] = field(default_factory=list)
    sequence_lengths: list[int] = field(default_factory=list)
    sequences_per_document: list[int] = field(default_factory=list)


@dataclass
class EncodedBatch:
    """The result of encoding consecutive lines of one input file."""

    file_index: int
    num_documents: int = 0
    """Documents written (a line of several SFT conversations makes several)."""
    num_bytes: int = 0
    num_blank_lines: int = 0
    # (line number, reason) of every line that could not be used, in line order.
    errors: list[tuple[int, str]] = field(default_factory=list)
    keys: dict[str, KeyTokens] = field(default_factory=dict)
    """Per output (a JSON key, or the SFT tokens and loss mask)."""


def _unicode_error_message(line: bytes, error: UnicodeDecodeError) -> str:
    return (
        f"not valid UTF-8 (byte 0x{line[error.start]:02x} at byte offset {error.start} of the line)"
    )


def parse_json_line(line: bytes, strip_bom: bool = False) -> dict:
    """The JSON object on one raw input line, or BadLineError saying why there is none."""
    if strip_bom and line.startswith(UTF8_BOM):
        line = line[len(UTF8_BOM) :]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadLineError(_unicode_error_message(line, error)) from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadLineError(f"malformed JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise BadLineError(f"expected a JSON object, got a {type(record).__name__}")
    return record


class DocumentEncoder:
    """Parses and tokenizes lines; one instance per worker process."""

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self.tokenizer = create_tokenizer(config.tokenizer)
        # Token dtype of the .bin file, chosen from the vocabulary size as Megatron does.
        self.dtype = np.dtype(DType.optimal_dtype(self.tokenizer.vocab_size))
        self.split: Callable[[str], list[str]] = (
            build_sentence_splitter(config.lang, config.keep_newlines)
            if config.split_sentences
            else lambda text: [text]
        )
        self.sft = SFTEncoder(self.tokenizer, config.sft, self.dtype) if config.sft else None
        # Output name -> (suffix of its file prefix after --output-prefix, dtype).
        level = "sentence" if config.split_sentences else "document"
        self.outputs: dict[str, tuple[str, np.dtype]] = (
            {
                SFT_OUTPUT: ("_sft_document", self.dtype),
                SFT_LOSS_MASK_OUTPUT: ("_sft_document" + LOSS_MASK_SUFFIX, LOSS_MASK_DTYPE),
            }
            if self.sft
            else {key: (f"_{key}_{level}", self.dtype) for key in config.json_keys}
        )

    def encode_lines(self, file_index: int, first_line: int, lines: list[bytes]) -> EncodedBatch:
        """Encode consecutive raw lines; `first_line` is the 1-based number of `lines[0]`."""
        batch = EncodedBatch(file_index, keys={name: KeyTokens() for name in self.outputs})
        for line_number, line in enumerate(lines, start=first_line):
            batch.num_bytes += len(line)
            if not line.strip():
                batch.num_blank_lines += 1
                continue
            try:
                documents = self.encode_line(line, strip_bom=line_number == 1)
            except BadLineError as error:
                batch.errors.append((line_number, str(error)))
                continue
            batch.num_documents += len(next(iter(documents.values())))
            for name, output_documents in documents.items():
                out = batch.keys[name]
                for sentences in output_documents:
                    out.tokens.extend(sentences)
                    out.sequence_lengths.extend(len(s) for s in sentences)
                    out.sequences_per_document.append(len(sentences))
        for out in batch.keys.values():
            # One array per output keeps the result cheap to send back to the main process.
            out.tokens = [np.concatenate(out.tokens)] if out.tokens else []
        return batch

    def encode_line(
        self, line: bytes, strip_bom: bool = False
    ) -> dict[str, list[list[np.ndarray]]]:
        """Per output, the documents (each a list of sequences) of one JSON line, or
        BadLineError: one document per key, or an SFT record's documents and loss masks."""
        record = parse_json_line(line, strip_bom)
        if self.sft:
            documents = self.sft.encode_record(record)
            return {
                SFT_OUTPUT: [[document.tokens] for document in documents],
                SFT_LOSS_MASK_OUTPUT: [[document.loss_mask] for document in documents],
            }
        return {key: [self._encode_document(record, key)] for key in self.config.json_keys}

    def _encode_document(self, record: dict, key: str) -> list[np.ndarray]:
        if key not in record:
            keys = ", ".join(list(record)[:8]) or "none"
            raise BadLineError(f"no key {key!r} (keys: {keys}); choose keys with --json-keys")
        value = record[key]
        if isinstance(value, str):
            sentences = self.split(value)
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            sentences = value  # already split into sentences, as Megatron accepts
        else:
            raise BadLineError(f"key {key!r} holds a {type(value).__name__}, expected a string")
        sequences = []
        for sentence in sentences:
            try:
                ids = self.tokenizer.tokenize_to_array(sentence)
            except ValueError as error:  # text the tokenizer cannot read (NullTokenizer's)
                raise BadLineError(f"key {key!r}: {error}") from None
            if len(ids):
                sequences.append(ids.astype(self.dtype))
        if not sequences:
            raise BadLineError(f"key {key!r} is an empty document (no tokens)")
        if self.config.append_eod:
            sequences[-1] = np.append(sequences[-1], np.array(self.tokenizer.eod, self.dtype))
        return sequences


def build_sentence_splitter(lang: str, keep_newlines: bool) -> Callable[[str], list[str]]:
    """NLTK punkt sentence splitting as Megatron does it (--split-sentences, --keep-newlines)."""
    try:
        from nltk.tokenize import punkt
    except ImportError:
        raise ImportError(
            "--split-sentences needs NLTK: pip install nltk (or pip install -e '.[sentences]')"
        ) from None
    params = _trained_punkt_parameters(punkt, lang)
    if keep_newlines:
        # Megatron's variant: whitespace after a sentence end stays with the sentence.
        class NewlineKeepingVars(punkt.PunktLanguageVars):
            _period_context_fmt = r"""
                \S*                          # some word material
                %(SentEndChars)s             # a potential sentence ending
                \s*                          # keep the whitespace, newlines included
                (?=(?P<after_tok>
                    %(NonWord)s              # either other punctuation
                    |
                    (?P<next_tok>\S+)        # or the next word
                ))"""

        splitter = punkt.PunktSentenceTokenizer(params, lang_vars=NewlineKeepingVars())
    else:
        splitter = punkt.PunktSentenceTokenizer(params)
    return splitter.tokenize


def _trained_punkt_parameters(punkt, lang: str):  # type: ignore[no-untyped-def]
    """The trained punkt model for `lang` when NLTK's data is installed, else defaults."""
    try:
        return punkt.PunktTokenizer(lang)._params  # NLTK >= 3.9: punkt_tab data
    except (AttributeError, LookupError, OSError, ValueError):
        pass
    try:
        import nltk

        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params  # older NLTK
    except (LookupError, OSError, ValueError):
        pass
    warnings.warn(
        f"NLTK's trained punkt model for {lang!r} is not installed, so sentences are split "
        "without its abbreviation list; install it with `python -m nltk.downloader punkt_tab` "
        "for Megatron-identical sentence boundaries",
        stacklevel=3,
    )
    return punkt.PunktParameters()
