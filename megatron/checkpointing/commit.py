"""Checkpoint directories that become visible only when complete, and trackers that agree.

The rule: a checkpoint is *published* the moment its directory gets its final name, and every
reader in this code base sees the trackers of the newest published checkpoint, whatever moment
a kill (SIGKILL, OOM, node loss) lands at.

The protocol (`begin`, then `commit`, each a collective):

1. Every rank writes and fsyncs its files under `{final}.partial`; a barrier.
2. Rank 0 writes the commit journal `{root}/commit_journal.json` (the directory's name and the
   new text of each tracker file), fsynced.
3. Rank 0 renames `{final}.partial` to `{final}` and fsyncs `{root}`: the checkpoint is
   published.
4. Rank 0 rewrites the trackers, one atomic file each (DeepSpeed's `latest`, then Megatron's
   `latest_checkpointed_iteration.txt`), then deletes the journal.

A write that fails on any rank (a full disk, a quota, a read-only directory) is agreed on by
all ranks before step 2: rank 0 removes the staging directory, the previous checkpoint stays
published, and every rank raises `CheckpointSaveError` with the first failure's one line.

A kill before step 3 leaves the previous checkpoint published and its trackers untouched; a
kill after it leaves the new one published, with the journal saying what the trackers must
become. `read_tracker` and `read_deepspeed_tag` read the journal before the tracker files, so
the tools see the same, newest iteration at once; `recover` (rank 0 at the next start, before
any rank reads, and before every save) finishes such a commit on disk, or undoes one that never
reached step 3, so afterwards both files name the same complete checkpoint. A reader outside
this code (`cat latest_checkpointed_iteration.txt`) sees the two files agree once the run has
restarted. A leftover `.partial` directory is never read.

A save written in the background (`--async-save`) is recorded as it starts
(`record_background_save`: its directory, trackers, and the file whose presence says its write
is complete); a run that ends before committing it (an exception, a kill) has it committed at
the next start once that file is there, or discarded when its write never completed.

For crash tests, `MEGATRON_CHECKPOINT_FAULT=POINT:N` SIGKILLs rank 0 the N-th time it reaches
POINT (one of `FAULT_POINTS`) in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal

import torch.distributed as dist

from megatron.atomic_files import atomic_outputs
from megatron.checkpointing.disk import CheckpointSaveError, check_free_space, describe_failure

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER_FILENAME = "latest"
JOURNAL_FILENAME = "commit_journal.json"
BACKGROUND_FILENAME = "background_save.json"
STAGING_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"
FAULT_ENV = "MEGATRON_CHECKPOINT_FAULT"
FAULT_POINTS = (
    "before-rename",
    "after-rename",
    "between-trackers",
    "after-trackers",
    "background-written",  # async_save.py: a background save written, its commit not begun
)
_fault_counts: dict[str, int] = {}


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fault_point(point: str) -> None:
    """SIGKILL this process here if `MEGATRON_CHECKPOINT_FAULT` asks for it (crash tests)."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    name, _, count = wanted.partition(":")
    if name not in FAULT_POINTS or not (count or "1").isdigit():
        raise ValueError(f"{FAULT_ENV}={wanted!r}: expected POINT[:N], POINT one of {FAULT_POINTS}")
    if name == point:
        _fault_counts[point] = _fault_counts.get(point, 0) + 1
        if _fault_counts[point] == int(count or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def staging_directory(final: str) -> str:
    """Where a checkpoint bound for `final` is written until every rank is done."""
    return final + STAGING_SUFFIX


def fsync_path(path: str) -> None:
    """Flush a file or directory entry to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: str) -> None:
    """fsync every directory under `root` (files are fsynced by the rank that wrote them)."""
    for directory, _, _ in os.walk(root):
        fsync_path(directory)


def _parent(final: str) -> str:
    return os.path.dirname(final) or "."


def _remove_tree(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)


def begin(final: str, previous: tuple[str, int] | None = None) -> str:
    """Finish any interrupted commit, clear leftovers of `final`; returns the staging directory.

    `previous`: (directory, size in bytes) of the newest checkpoint, which the new one will
    match; a save is refused before anything is written when the disk has less free. A
    collective: every rank calls it before writing.
    """
    staging = staging_directory(final)
    failure = None
    if _is_rank_zero():
        root = _parent(final)
        try:
            os.makedirs(root, exist_ok=True)
            _report(finish_interrupted_commit(root))
            for leftover in (staging, final + _REPLACED_SUFFIX):
                _remove_tree(leftover)
            if previous is not None:
                failure = check_free_space(root, previous[1], _iteration_of(final), previous[0])
            if failure is None:
                os.makedirs(staging)
        except OSError as error:
            failure = describe_failure(error, root)
    agree(failure, staging)
    return staging


def _iteration_of(final: str) -> int | str:
    name = os.path.basename(final)
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else name


def agree(failure: str | None, staging: str) -> None:
    """Collective: if any rank's `failure` is set, every rank raises `CheckpointSaveError`.

    Rank 0 first removes `staging`, so a full disk gets its space back and the save leaves
    nothing behind. The error is the lowest failing rank's line; `None` means this rank is fine.
    """
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    first = next((text for text in failures if text), None)
    if first is None:
        return
    if _is_rank_zero():
        with contextlib.suppress(OSError):  # what is left is never read, and cleared next save
            _remove_tree(staging)
    raise CheckpointSaveError(first)


def commit(final: str, trackers: dict[str, str | None], failure: str | None = None) -> None:
    """Publish `final` from its staging directory, then set `trackers` (name -> text).

    A tracker whose text is None is removed. A collective: every rank calls it once its own
    files are written and fsynced, with the line saying why its writing failed, if it did.
    """
    staging = staging_directory(final)
    agree(failure, staging)
    published = False
    if _is_rank_zero():
        root = _parent(final)
        try:
            fsync_tree(staging)
            _write_journal(root, os.path.basename(final), trackers)
            fault_point("before-rename")
            replaced = final + _REPLACED_SUFFIX
            if os.path.isdir(final):
                # Saving an iteration again (a rerun past a checkpoint that was never tracked).
                os.replace(final, replaced)
            os.replace(staging, final)
            fsync_path(root)
            published = True
            fault_point("after-rename")
            _remove_tree(replaced)
            _write_trackers(root, trackers, inject_faults=True)
            fault_point("after-trackers")
            _end_journal(root)
            _end_background(root)
        except OSError as error:
            failure = describe_failure(error, root)
            if published:
                failure += f"; {final} is complete and the next start finishes its trackers"
            else:
                _undo_unpublished(root, final)
    agree(failure, staging)


def _undo_unpublished(root: str, final: str) -> None:
    """After a failed commit that never renamed `final` into place: drop its journal."""
    replaced = final + _REPLACED_SUFFIX
    with contextlib.suppress(OSError):  # else the next start's recovery does the same
        if os.path.isdir(replaced) and not os.path.isdir(final):
            os.replace(replaced, final)
        _end_journal(root)


def megatron_trackers(text: str) -> dict[str, str | None]:
    """The trackers a Megatron-layout commit sets: `text` (N or release), no DeepSpeed `latest`.

    A `latest` left by an earlier DeepSpeed run in the same directory would be read first.
    """
    return {TRACKER_FILENAME: text, DEEPSPEED_TRACKER_FILENAME: None}


def recover(root: str) -> None:
    """Collective: rank 0 finishes (or undoes) an interrupted commit in `root`; all wait.

    Run before any rank reads `root`'s trackers, so that all of them read the repaired files.
    """
    if _is_rank_zero() and os.path.isdir(root):
        _report(finish_interrupted_commit(root))
    _barrier()


def finish_interrupted_commit(root: str) -> str | None:
    """Bring `root`'s trackers in line with its newest published checkpoint (one process).

    With a journal: if its directory was renamed into place, write the trackers it names
    (roll forward); otherwise put back a directory it had moved aside and drop the staging
    copy (roll back). Without one: where DeepSpeed's `latest` and Megatron's tracker disagree
    (written by hand, or by an older version), rewrite Megatron's to match `latest`, which is
    what both DeepSpeed and `find_checkpoint` load. Returns what it did, or None.
    """
    journal = _read_journal(root)
    if journal is None:
        return _commit_finished_background_save(root) or _align_megatron_tracker(root)
    _end_background(root)  # the journal's commit decides; a background record is stale now
    name, trackers = journal
    final = os.path.join(root, name)
    staging = staging_directory(final)
    if os.path.isdir(final) and not os.path.isdir(staging):
        _remove_tree(final + _REPLACED_SUFFIX)
        _write_trackers(root, trackers, inject_faults=False)
        _end_journal(root)
        named = ", ".join(f"{tracker} = {text!r}" for tracker, text in trackers.items())
        return f"finished the interrupted commit of checkpoint {final}: {named}"
    replaced = final + _REPLACED_SUFFIX
    if os.path.isdir(replaced) and not os.path.isdir(final):
        os.replace(replaced, final)
        fsync_path(root)
    # The journal goes before the staging copy: while the copy exists, a rerun still undoes.
    _end_journal(root)
    _remove_tree(staging)
    return f"discarded the interrupted save of {final}: it was killed before it was complete"


def record_background_save(final: str, trackers: dict[str, str | None], complete: str) -> None:
    """Rank 0, as a background save starts writing `final`'s staging directory: record the
    trackers its commit sets and `complete`, the file whose presence there says every rank's
    write finished, so that a run ending before the commit has it committed at the next start."""
    if not _is_rank_zero():
        return
    root = _parent(final)
    record = {"directory": os.path.basename(final), "trackers": trackers, "complete": complete}
    with atomic_outputs(os.path.join(root, BACKGROUND_FILENAME)) as (partial,):
        with open(partial, "w") as handle:
            json.dump(record, handle)
    fsync_path(root)


def _end_background(root: str) -> None:
    _remove_record(root, BACKGROUND_FILENAME)


def _remove_record(root: str, name: str) -> None:
    """Remove `root`'s record file `name` (the journal, the background-save record), durably."""
    path = os.path.join(root, name)
    if os.path.exists(path):
        os.remove(path)
        fsync_path(root)


def _commit_finished_background_save(root: str) -> str | None:
    """The background save a run ended without committing: committed (journal, rename,
    trackers, as `commit`) when its write completed, else its staging directory removed."""
    path = os.path.join(root, BACKGROUND_FILENAME)
    try:
        with open(path) as handle:
            record = json.load(handle)
        name, trackers, complete = record["directory"], record["trackers"], record["complete"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a background-save record ({error!r}); remove it") from None
    final = os.path.join(root, name)
    staging = staging_directory(final)
    if not os.path.isdir(staging):  # committed or discarded already
        _end_background(root)
        return None
    if not os.path.isfile(os.path.join(staging, complete)):
        _remove_tree(staging)
        _end_background(root)
        return f"discarded the background save of {final}: the run ended before it was written"
    fsync_tree(staging)
    _write_journal(root, name, trackers)  # from here the journal finishes it, whatever happens
    replaced = final + _REPLACED_SUFFIX
    if os.path.isdir(final):
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_path(root)
    _remove_tree(replaced)
    _write_trackers(root, trackers, inject_faults=False)
    _end_journal(root)
    _end_background(root)
    return f"committed the background save of {final}: its write had completed before the run ended"


def _report(message: str | None) -> None:
    if message:
        print(f"> {message}", flush=True)


def _align_megatron_tracker(root: str) -> str | None:
    tag = read_deepspeed_tag(root)
    number = None if tag is None else tag_iteration(tag)
    if number is None or not os.path.isdir(os.path.join(root, tag)):
        return None
    tracker = read_tracker(root)
    if tracker is None or tracker == (number, False):
        return None
    tracker_path = os.path.join(root, TRACKER_FILENAME)
    write_tracker(tracker_path, str(number))
    return f"{tracker_path} said {tracker[0]}, {root}/latest names {tag}: set it to {number}"


def tag_iteration(tag: str) -> int | None:
    """N of a DeepSpeed tag `global_stepN`; None for any other tag."""
    match = re.fullmatch(r"global_step(\d+)", tag)
    return int(match.group(1)) if match else None


def _write_trackers(root: str, trackers: dict[str, str | None], inject_faults: bool) -> None:
    for index, (name, text) in enumerate(trackers.items()):
        if index and inject_faults:
            fault_point("between-trackers")
        path = os.path.join(root, name)
        if text is not None:
            write_tracker(path, text)
        elif os.path.exists(path):
            os.remove(path)
            fsync_path(root)


def _write_journal(root: str, name: str, trackers: dict[str, str | None]) -> None:
    with atomic_outputs(os.path.join(root, JOURNAL_FILENAME)) as (partial,):
        with open(partial, "w") as handle:
            json.dump({"directory": name, "trackers": trackers}, handle)
    fsync_path(root)


def _end_journal(root: str) -> None:
    _remove_record(root, JOURNAL_FILENAME)


def _read_journal(root: str) -> tuple[str, dict[str, str | None]] | None:
    path = os.path.join(root, JOURNAL_FILENAME)
    try:
        with open(path) as handle:
            journal = json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError as error:
        raise ValueError(f"{path} is not a commit journal ({error}); remove it") from None
    if not isinstance(journal, dict) or not isinstance(journal.get("trackers"), dict):
        raise ValueError(f"{path} is not a commit journal (no 'trackers'); remove it")
    return str(journal.get("directory")), journal["trackers"]


def _tracker_text(root: str, name: str) -> str | None:
    """A tracker's text as it is once any published-but-unfinished commit is finished.

    The journal is read first: it is deleted only after the trackers are written, so a commit
    finishing while this reads is seen either through the journal or in the files.
    """
    journal = _read_journal(root)
    if journal is not None:
        directory, trackers = journal
        final = os.path.join(root, directory)
        if name in trackers and os.path.isdir(final) and not os.path.isdir(final + STAGING_SUFFIX):
            return trackers[name]
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read().strip()


def write_tracker(path: str, text: str) -> None:
    """Replace a tracker file atomically (temporary name, fsync, rename, fsync directory)."""
    with atomic_outputs(path) as (partial,):
        with open(partial, "w") as handle:
            handle.write(text)
    fsync_path(os.path.dirname(path) or ".")


def read_tracker(root: str) -> tuple[int, bool] | None:
    """(iteration, release) from Megatron's tracker file, or None when there is none."""
    text = _tracker_text(root, TRACKER_FILENAME)
    if text is None:
        return None
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        path = os.path.join(root, TRACKER_FILENAME)
        raise ValueError(
            f"{path}: expected an iteration number or 'release', got {text!r}"
        ) from None


def read_deepspeed_tag(root: str, name: str = DEEPSPEED_TRACKER_FILENAME) -> str | None:
    """The tag DeepSpeed's `latest` (or another tracker) file names, or None when absent."""
    tag = _tracker_text(root, name)
    if tag is None:
        return None
    if not tag:
        raise ValueError(f"{os.path.join(root, name)} is empty; it should name a checkpoint")
    return tag
