"""Loose-JSON training files, tokenized on first use and cached as Megatron `.bin/.idx` files.

Megatron-LM v1 trained straight from loose-JSON files (`--train-data corpus.json`, one JSON
object per line). Here such files are tokenized once with the preprocessing engine
(`megatron.data.corpus_tokenizer`: parallel, bounded memory, progress with an ETA, written
atomically) into `{cache_dir}/{stem}-{digest}_{key}_document.bin/.idx`, then trained on like
any `--data-path`. The digest names the source paths, the JSON key and the tokenizer's
files, so another tokenizer or key gets its own files.

A manifest beside the files records what they were built from (each source's size,
modification time and SHA-256). The cache is reused while the sources match it; a source
whose size or content changed is tokenized again (one whose time alone changed is re-hashed
and, unchanged, reused). The ranks of a job share one build: the first to take the cache's
file lock tokenizes while the others wait on the lock (no collective is open meanwhile, so a
long build meets no communication timeout), then find the cache fresh. A rank that waited
for a build that failed says so instead of tokenizing again; the builder names the bad line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cached_property

from megatron.atomic_files import atomic_outputs
from megatron.data.corpus_reader import InputError
from megatron.data.corpus_tokenizer import TokenizeOptions, tokenize_corpus
from megatron.data.document_encoder import EncoderConfig
from megatron.data.indexed_dataset import dataset_exists
from megatron.tokenizer.tokenizer import TokenizerConfig
from megatron.utils import print_rank_0

MANIFEST_FORMAT = 1
_HASH_BLOCK = 1 << 22


@dataclass(frozen=True)
class JsonCorpus:
    """Loose-JSON files to train on, and where their tokens are cached."""

    sources: tuple[str, ...]
    """Absolute paths of the files, in order (their documents are concatenated)."""
    json_key: str
    """The key holding each line's document (`--text-key`)."""
    cache_dir: str
    """Folder of the tokenized files (`--cache-dir`)."""
    tokenizer: TokenizerConfig
    """The tokenizer training uses; the cache is specific to its files."""
    label: str
    """How messages name the corpus: the command line's words, e.g. `--train-data webtext`."""

    @cached_property
    def output_prefix(self) -> str:
        """The cache files' prefix before `_{key}_document`.

        Computed once per corpus: it hashes every tokenizer file (a whole Hugging Face folder,
        weights included), and start-up asks for it several times on every rank.
        """
        identity = {
            "sources": list(self.sources),
            "json_key": self.json_key,
            "tokenizer": _tokenizer_identity(self.tokenizer),
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
        stem = os.path.splitext(os.path.basename(self.sources[0]))[0]
        return os.path.join(self.cache_dir, f"{stem}-{digest}")

    @property
    def data_prefix(self) -> str:
        """The dataset prefix training reads (`--data-path`)."""
        return f"{self.output_prefix}_{self.json_key}_document"


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _tokenizer_identity(config: TokenizerConfig) -> dict:
    """The tokenizer type and the SHA-256 of each of its files (a folder: of every file in it)."""
    files = {}
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(config, name)
        if path and os.path.isdir(path):
            for inner in sorted(glob.glob(os.path.join(path, "*"))):
                if os.path.isfile(inner):
                    files[f"{name}/{os.path.basename(inner)}"] = _file_sha256(inner)
        elif path:
            files[name] = _file_sha256(path)
    return {"type": config.tokenizer_type, "extra_ids": config.vocab_extra_ids, "files": files}


def _source_facts(path: str, digest: str | None = None) -> dict:
    status = os.stat(path)
    facts = {"path": path, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
    facts["sha256"] = digest if digest is not None else _file_sha256(path)
    return facts


def _manifest_path(corpus: JsonCorpus) -> str:
    return f"{corpus.data_prefix}.sources.json"


def _read_manifest(corpus: JsonCorpus) -> dict | None:
    try:
        with open(_manifest_path(corpus), encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_fresh(corpus: JsonCorpus) -> bool:
    """Whether the cache holds these sources' tokens (re-hashing a source touched only)."""
    manifest = _read_manifest(corpus)
    if not manifest or manifest.get("format") != MANIFEST_FORMAT:
        return False
    if not dataset_exists(corpus.data_prefix):
        return False
    recorded = manifest.get("sources", [])
    if [entry.get("path") for entry in recorded] != list(corpus.sources):
        return False
    touched = False
    for entry in recorded:
        status = os.stat(entry["path"])
        if status.st_size != entry.get("size"):
            return False
        if status.st_mtime_ns != entry.get("mtime_ns"):
            if _file_sha256(entry["path"]) != entry.get("sha256"):
                return False
            entry["mtime_ns"] = status.st_mtime_ns
            touched = True
    if touched:  # same bytes, new time: remember the time, so the next start needs no hash
        _write_manifest(corpus, manifest)
    return True


def _write_manifest(corpus: JsonCorpus, manifest: dict) -> None:
    with atomic_outputs(_manifest_path(corpus)) as (partial,):
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(manifest, file, indent=2)


@contextlib.contextmanager
def _build_lock(corpus: JsonCorpus) -> Iterator[bool]:
    """Hold the cache's file lock; yields whether another process held it when we came.

    Where the file system has no locks, every process builds its own copy (the files are
    published atomically and identical, so the last rename wins harmlessly).
    """
    os.makedirs(corpus.cache_dir, exist_ok=True)
    with open(f"{corpus.output_prefix}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            yield False
            return
        try:
            yield waited
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_index_maps(corpus: JsonCorpus, index_cache_dir: str | None) -> None:
    """The GPT dataset's cached sample maps of the old tokens describe documents now gone."""
    pattern = glob.escape(os.path.basename(corpus.data_prefix)) + "_*_indexmap_*"
    for folder in {corpus.cache_dir, index_cache_dir or corpus.cache_dir}:
        for path in glob.glob(os.path.join(folder, pattern)):
            os.remove(path)


def ensure_tokenized(
    corpus: JsonCorpus, index_cache_dir: str | None = None, workers: int | None = None
) -> str:
    """Tokenize `corpus` unless its cache is fresh; returns the dataset prefix to train on.

    `index_cache_dir` is where the GPT dataset caches its sample maps (`--data-cache-path`,
    default beside the data): a rebuild removes the maps of the old tokens there.
    """
    missing = [path for path in corpus.sources if not os.path.isfile(path)]
    if missing:
        raise InputError(f"{corpus.label}: {missing[0]} no longer exists")
    if _is_fresh(corpus):
        print_rank_0(f" > {corpus.label}: reusing the tokens in {corpus.data_prefix}.bin/.idx")
        return corpus.data_prefix
    with _build_lock(corpus) as waited:
        if _is_fresh(corpus):
            return corpus.data_prefix
        if waited:
            raise InputError(
                f"{corpus.label}: the process that was tokenizing it stopped without finishing "
                "(its error is above); nothing was written"
            )
        _build(corpus, index_cache_dir, workers or max(1, min(32, (os.cpu_count() or 2) - 1)))
    return corpus.data_prefix


def _build(corpus: JsonCorpus, index_cache_dir: str | None, workers: int) -> None:
    print(
        f" > {corpus.label}: tokenizing {', '.join(corpus.sources)} into "
        f"{corpus.data_prefix}.bin/.idx with {workers} worker(s) (first use or changed; reused "
        "while unchanged)",
        file=sys.stderr,
        flush=True,
    )
    # Recorded before tokenizing: a source that changes meanwhile is tokenized again next time.
    sources = [_source_facts(path) for path in corpus.sources]
    config = EncoderConfig(json_keys=[corpus.json_key], tokenizer=corpus.tokenizer, append_eod=True)
    options = TokenizeOptions(
        workers=workers,
        chunk_size=64,
        log_interval=10_000,
        bad_line_hint="fix or remove the line",
        input_label=corpus.label,
    )
    with contextlib.suppress(FileNotFoundError):
        os.remove(_manifest_path(corpus))
    summary = tokenize_corpus(list(corpus.sources), corpus.output_prefix, config, options)
    _remove_stale_index_maps(corpus, index_cache_dir)
    (builder,) = summary.outputs.values()
    manifest = {
        "format": MANIFEST_FORMAT,
        "sources": sources,
        "json_key": corpus.json_key,
        "tokenizer": asdict(corpus.tokenizer),
        "documents": builder.num_documents,
        "tokens": builder.num_tokens,
    }
    _write_manifest(corpus, manifest)
    print(
        f" > {corpus.label}: {builder.num_documents} documents, {builder.num_tokens} tokens",
        file=sys.stderr,
        flush=True,
    )
