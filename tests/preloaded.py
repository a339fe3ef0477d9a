"""Launch a script's ranks forked from a process that has imported torch, DeepSpeed and megatron.

Every `pretrain_gpt.py` launch of the suite used to start its launcher and each rank as new
Python processes; each paid 3-6 CPU seconds importing torch, torch's compiler (which
`torch.optim` pulls in), DeepSpeed and this project before its first step of a few hundred
milliseconds: most of the suite's CPU time. Here a preloaded process (one per pytest worker and
per set of import-time variables) forks the ranks instead, and each rank runs the script as
`python script.py` would (`runpy.run_path` as `__main__`, `sys.argv` and `sys.path[0]` set,
`os.environ` replaced, stdout and stderr into the run's log, Python's and numpy's global
random states reseeded; at its end threads joined, `atexit` run, files flushed, the exit code
as Python's, but no teardown of every object: `_run_as_main`), with the environment its
launcher would give it:

- `torchrun --nproc_per_node N --master_port P`: OMP_NUM_THREADS=1 (unless set), RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, GROUP_WORLD_SIZE, MASTER_ADDR/PORT,
  TORCHELASTIC_RESTART_COUNT 0 and TORCHELASTIC_MAX_RESTARTS 0 (rank 0 serves the rendezvous
  store instead of torchrun's agent); a failing rank has the others terminated (SIGTERM, then
  SIGKILL after `TERMINATE_GRACE_S`) and the launch exits 1.
- `python -m torch.distributed.launch` (torch's legacy launcher, torchrun underneath): the same,
  and a leading `--local-rank=i` argument unless `--use-env` is given.
- `deepspeed --num_gpus N --master_port P`: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
  CROSS_RANK/SIZE, MASTER_ADDR/PORT and a leading `--local_rank=i` argument, as
  deepspeed.launcher.launch passes them; the launch exits with the first failing rank's code.
- one process: `python script.py ...`, its own exit code.

What this cannot reproduce, and the suite keeps real launchers for: the launchers' own output,
error reports and signal handling (the SIGKILL and stalled-rank tests), `torchrun
--max-restarts`, the launchers under their other names (the first launch of each v1 script,
Megatron's examples under `torch.distributed.launch` once, the base install's runs), and a
hash seed of its own per rank (the ranks share the preloaded process's `PYTHONHASHSEED`).
`launch_command` takes a launcher's command line as typed; tests/launcher_shim.py puts
stand-ins for the launchers on a launch script's PATH.
tests/test_preloaded.py checks that a preloaded launch and the real launchers log the same
losses and write the same checkpoint files.

Variables read while those modules are imported (`IMPORT_TIME_PREFIXES`: OpenMP's, ATen's,
DeepSpeed's accelerator, torch's and Python's own) cannot change per launch: a launch whose
values differ gets a preloaded process of its own.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import NoReturn

PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",  # torch.optim's constructors import it: 2 s a rank
    "torch.distributed.run",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # deepspeed.initialize's sanity check
    "megatron.training.engines.deepspeed",
    "megatron.training.engines.megatron_schedules",
    "megatron.checkpointing",
    "pretrain_gpt",
    "torch.distributed.pipelining",  # megatron's pipeline schedules
    "deepspeed.module_inject.auto_ep_config",  # DeepSpeed's config parser
    "setuptools",  # DeepSpeed's op builder, asked whether an op is compatible
    "megatron.data.corpus_tokenizer",  # tools/preprocess_data.py
)
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "DS_", "CUDA_", "PYTHON")
IMPORT_TIME_PREFIXES += ("TORCH", "PYTORCH_", "LD_")
# glibc's malloc in the preloaded process and so in its ranks: blocks up to 32 MiB (a tiny
# model's logits over GPT-2's vocabulary) come from the heap and stay there when freed, instead
# of being mapped afresh, and zero-filled page by page, at every step (a fifth of a launch's
# system time, measured: tests/preloaded.py's launches only, not what users run).
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295"
TERMINATE_GRACE_S = 30.0
HOST = "127.0.0.1"
_ACCEPT_POLL_S = 2.0
TORCHRUN_LIKE = ("torchrun", "torch.distributed.launch")


def import_time_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that a preloaded process fixed when it imported its modules."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def rank_environments(
    launcher: str, processes: int, port: int, caller_env: dict[str, str]
) -> list[dict[str, str]]:
    """The variables `launcher` ("torchrun", "torch.distributed.launch", "deepspeed" or "python")
    sets for each rank, started from `caller_env`."""
    if launcher == "python":
        return [{}]
    common = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "WORLD_SIZE": str(processes)}
    ranks = []
    for rank in range(processes):
        env = dict(common, RANK=str(rank), LOCAL_RANK=str(rank))
        if launcher in TORCHRUN_LIKE:
            env.update(
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                ROLE_NAME="default",
                LOCAL_WORLD_SIZE=str(processes),
                GROUP_WORLD_SIZE="1",
                ROLE_WORLD_SIZE=str(processes),
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="none",
                TORCHELASTIC_USE_AGENT_STORE="False",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
            )
            if processes > 1 and "OMP_NUM_THREADS" not in caller_env:
                env["OMP_NUM_THREADS"] = "1"  # torchrun's default for more than one rank
        elif launcher == "deepspeed":
            env.update(CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(processes))
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        ranks.append(env)
    return ranks


# ---------------------------------------------------------------------------------------------
# The preloaded process (`python -m tests.preloaded SOCKET`).


def _serve(socket_path: str) -> None:
    for module in PRELOAD:
        __import__(module)
    # The tokenizer most runs build: its files are then read and checked once, here (a rank
    # still builds its own tokenizer from what this process read).
    from megatron.tokenizer import GPT2BPETokenizer

    dataset = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dataset")
    GPT2BPETokenizer(
        os.path.join(dataset, "gpt2-vocab.json"), os.path.join(dataset, "gpt2-merges.txt")
    )
    # The preloaded objects are never garbage: out of the collector's sight, a rank's collection
    # (DeepSpeed's `see_memory_usage` runs one) neither walks them nor writes to their pages,
    # which forked ranks share until written.
    gc.freeze()
    if threading.active_count() != 1:
        names = [thread.name for thread in threading.enumerate()]
        raise SystemExit(f"preloading started threads {names}: forking would not be safe")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(8)
    listener.settimeout(_ACCEPT_POLL_S)
    parent = os.getppid()
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    while os.getppid() == parent:  # the pytest worker that started this one is alive
        _reap()
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:
            listener.close()
            _launch(connection)  # never returns: the launcher and its ranks end in it
        connection.close()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _launch(connection: socket.socket) -> NoReturn:
    """The launcher of one request: fork its ranks, supervise them, report their exit codes.

    Every process it makes `_exit`s: the launcher once its ranks ended, a rank once its
    script ended (`_run_as_main`).
    """
    try:
        os.setsid()  # the ranks share this session: the client can kill the whole launch
        request = json.loads(connection.makefile("r").readline())
        environments = rank_environments(
            request["launcher"], request["processes"], request["port"], request["env"]
        )
        children: dict[int, int] = {}
        for rank in range(len(environments)):
            pid = os.fork()
            if pid == 0:
                break
            children[pid] = rank
        else:
            connection.sendall(f"started {os.getpid()}\n".encode())
            codes, first_failure = _supervise(children, request["launcher"])
            reply = {"codes": codes, "first_failure": first_failure}
            connection.sendall((json.dumps(reply) + "\n").encode())
            os._exit(0)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    connection.close()
    _become_rank(request, rank, environments[rank])


def _become_rank(request: dict, rank: int, rank_env: dict[str, str]) -> NoReturn:
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(rank_env)
    threads = rank_env.get("OMP_NUM_THREADS")
    if threads:
        # Read by torch at its import, in the preloaded process: set as the rank's own would be.
        import torch

        torch.set_num_threads(int(threads))
    os.chdir(request["cwd"])
    for descriptor, path in ((1, request["log"]), (2, request.get("errors") or request["log"])):
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, descriptor)
        os.close(log)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    script = request["script"]
    local_rank = {
        "deepspeed": [f"--local_rank={rank}"],
        "torch.distributed.launch": [f"--local-rank={rank}"],
    }.get(request["launcher"], [])
    sys.argv = [script, *local_rank, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # A new process draws its own seeds; these were drawn once, in the preloaded process.
    random.seed()
    import numpy

    numpy.random.seed()
    os._exit(_run_as_main(script))


def _run_as_main(script: str) -> int:
    """Run `script` as `__main__` and end as the interpreter would, but for its last stage;
    returns the exit code.

    Python's exit joins the threads left running, calls the `atexit` functions (which also run
    `weakref.finalize` callbacks, logging's flush and multiprocessing's clean-up), flushes the
    standard streams, and then tears down every module and object. That last stage touches every
    page inherited from the preloaded process (a copy for each) and took a third of a short
    launch's CPU time; here open files are flushed instead, as their deallocation would.
    """
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:  # as Python's own handling of it
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what interpreter exit runs first: wait for non-daemon threads
    atexit._run_exitfuncs()
    for generation in range(3):  # this rank's objects; what was preloaded is frozen
        for candidate in gc.get_objects(generation):
            # type(), not isinstance(): a dead weak proxy (torch.compile leaves some) raises
            if issubclass(type(candidate), io.IOBase) and not candidate.closed:
                try:
                    candidate.flush()
                except (OSError, ValueError):
                    pass  # as a failing flush at deallocation: not the exit code's business
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code & 0xFF


def _supervise(children: dict[int, int], launcher: str) -> tuple[list[int], int]:
    """Wait for every rank; once one fails, stop the others as the launchers do (torchrun:
    SIGTERM, then SIGKILL after a grace period; deepspeed's: SIGKILL). Returns every rank's
    exit code and the first failing one's (0 when none failed)."""
    codes: list[int | None] = [None] * len(children)
    first_failure, failed_at = 0, None
    while any(code is None for code in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() > failed_at + TERMINATE_GRACE_S:
                _signal(children, codes, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in children:
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[children[pid]] = code
        if code != 0 and failed_at is None:
            first_failure, failed_at = code, time.monotonic()
            _signal(children, codes, signal.SIGKILL if launcher == "deepspeed" else signal.SIGTERM)
    return [int(code) for code in codes], first_failure


def _signal(children: dict[int, int], codes: list, signum: int) -> None:
    for pid, rank in children.items():
        if codes[rank] is None:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------------------------
# The client (in the pytest process).


class _Preloaded:
    """One preloaded process, started on first use, ended with the pytest process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="preloaded_")
        self.socket_path = os.path.join(self.directory, "socket")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.errors = open(os.path.join(self.directory, "stderr.txt"), "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded", self.socket_path],
            cwd=root,
            env={"GLIBC_TUNABLES": MALLOC_TUNABLES, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            start_new_session=True,
        )
        # Imports may print first (DeepSpeed logs its accelerator to stdout).
        for line in self.process.stdout:
            if line.strip() == "ready":
                break
        else:
            self.process.wait()
            raise RuntimeError(f"the preloaded launcher did not start:\n{self._stderr()}")

    def run(self, request: dict, timeout: float) -> dict:
        """Send one launch; wait for its exit codes (killing it past `timeout`): {"codes":
        each rank's, "first_failure": the first non-zero one, or 0}."""
        try:
            return send_launch(self.socket_path, request, timeout)
        except LaunchNotStarted:
            raise RuntimeError(f"the preloaded launcher failed:\n{self._stderr()}") from None

    def _stderr(self) -> str:
        with open(self.errors.name) as errors:
            return errors.read()[-3000:]

    def close(self) -> None:
        """End the preloaded process; remove its folder."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.errors.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class LaunchNotStarted(RuntimeError):
    """The preloaded process did not start the launch (its stderr says why)."""


def send_launch(socket_path: str, request: dict, timeout: float) -> dict:
    """Send one launch to the preloaded process listening on `socket_path`; wait for its exit
    codes (killing its ranks past `timeout`, then raising TimeoutError): {"codes": each rank's,
    "first_failure": the first non-zero one, or 0}."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(socket_path)
        connection.sendall((json.dumps(request) + "\n").encode())
        replies = connection.makefile("r")
        started = replies.readline().split()
        if started[:1] != ["started"]:
            raise LaunchNotStarted(socket_path)
        session = int(started[1])
        connection.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            return json.loads(replies.readline())
        except (socket.timeout, TimeoutError, json.JSONDecodeError):
            _kill_session(session)
            raise


def exit_code(launcher: str, reply: dict) -> int:
    """The launch's exit code as `launcher` ends with it: torchrun 1 when a rank failed; the
    deepspeed launcher `sys.exit`s with the first failing rank's code (a signal's negative code
    as its low byte); `python` its one process's."""
    if launcher in TORCHRUN_LIKE:
        return 1 if reply["first_failure"] else 0
    if launcher == "deepspeed":
        return reply["first_failure"] & 0xFF
    return reply["codes"][0]


def _kill_session(session: int) -> None:
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass


_PRELOADED: dict[tuple, _Preloaded] = {}


def preloaded_for(env: dict[str, str]) -> _Preloaded:
    """The preloaded process of `env`'s import-time variables, started on first use."""
    key = import_time_key(env)
    if key not in _PRELOADED:
        _PRELOADED[key] = _Preloaded(dict(env))
    return _PRELOADED[key]


def launch(
    command: list[str],
    script: str,
    args: list[str],
    processes: int,
    launcher: str,
    env: dict[str, str],
    cwd: str,
    port: int = 0,
    timeout: float = 300,
    separate_stderr: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script args` on `processes` ranks as `launcher` would start them, forked from a
    preloaded process; stdout and stderr together (or apart, `separate_stderr`), `command` (the
    real launcher's command line) as `args`; raises `subprocess.TimeoutExpired` past `timeout`
    (the ranks killed)."""
    preloaded = preloaded_for(env)
    with (
        tempfile.NamedTemporaryFile("r", prefix="launch_", suffix=".log") as log,
        tempfile.NamedTemporaryFile("r", prefix="launch_", suffix=".err") as errors,
    ):
        request = dict(
            script=script, args=args, processes=processes, launcher=launcher, env=env, cwd=cwd,
            port=port, log=log.name, errors=errors.name if separate_stderr else None,
        )  # fmt: skip
        try:
            reply = preloaded.run(request, timeout)
        except (socket.timeout, TimeoutError) as error:
            raise subprocess.TimeoutExpired(command, timeout, output=log.read()) from error
        output, stderr = log.read(), errors.read() if separate_stderr else None
    returncode = exit_code(launcher, reply)
    return subprocess.CompletedProcess(command, returncode, stdout=output, stderr=stderr)


# The launcher options a preloaded launch reproduces, by launcher: (processes, port) and the
# single-node options it can ignore (with the only values that keep a launch on this machine).
_LAUNCHER_OPTIONS = {
    "torchrun": ("--nproc_per_node", "--master_port"),
    "torch.distributed.launch": ("--nproc_per_node", "--master_port"),
    "deepspeed": ("--num_gpus", "--master_port"),
}
_SINGLE_NODE = {
    "--nnodes": ("1",),
    "--num_nodes": ("1",),
    "--node_rank": ("0",),
    "--master_addr": ("localhost", "127.0.0.1"),
}
_DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's


def parse_command(command: list[str]) -> tuple[str, int, int, str, list[str]]:
    """(launcher, processes, port, script, its arguments) of a command line as a user types it:
    `python SCRIPT.py ARGS`, `torchrun --nproc_per_node N --master_port P SCRIPT ARGS` (or
    `python -m torch.distributed.launch` with the same options), `deepspeed
    --num_gpus N --master_port P SCRIPT ARGS` (options as `--name value` or `--name=value`, with
    `-` or `_`; one node). Anything else is a ValueError: it would not be launched as typed."""
    program = os.path.basename(command[0])
    if program == "deepspeed.pt":  # the deepspeed launcher under its 2020 name
        program = "deepspeed"
    if program.startswith("python") and command[1:3] == ["-m", "torch.distributed.launch"]:
        program, command = "torch.distributed.launch", command[2:]
    elif program.startswith("python"):
        if len(command) < 2 or not command[1].endswith(".py"):
            raise ValueError(f"not a script run: {' '.join(command[:2])}")
        return "python", 1, 0, command[1], command[2:]
    if program not in _LAUNCHER_OPTIONS:
        raise ValueError(f"not a launcher this can emulate: {command[0]}")
    processes_option, port_option = _LAUNCHER_OPTIONS[program]
    options, index = {}, 1
    while index < len(command) and command[index].startswith("--"):
        name, equals, value = command[index].partition("=")
        name = name.replace("-", "_").replace("__", "--", 1)
        if program == "torch.distributed.launch" and name == "--use_env" and not equals:
            program, index = "torchrun", index + 1  # the ranks read LOCAL_RANK: torchrun's way
            continue
        if not equals:
            index += 1
            value = command[index] if index < len(command) else ""
        ignorable = value in _SINGLE_NODE.get(name, ())
        if name not in (processes_option, port_option) and not ignorable:
            raise ValueError(f"{program}'s {name} {value} is not emulated (tests/preloaded.py)")
        options[name] = value
        index += 1
    if index >= len(command) or processes_option not in options:
        raise ValueError(f"no script or no {processes_option} in {' '.join(command)}")
    port = int(options.get(port_option, _DEFAULT_PORT))
    return program, int(options[processes_option]), port, command[index], command[index + 1 :]


def launch_command(
    command: list[str], env: dict[str, str], cwd: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`launch` for a launcher's command line as a user types it (`parse_command`); stdout and
    stderr together."""
    launcher, processes, port, script, args = parse_command(command)
    if launcher != "python":
        env = dict(env, MASTER_PORT=str(port))
    return launch(command, script, args, processes, launcher, env, cwd, port, timeout)


def close_all() -> None:
    """End every preloaded process (at the end of the pytest session)."""
    for preloaded in _PRELOADED.values():
        preloaded.close()
    _PRELOADED.clear()


if __name__ == "__main__":
    _serve(sys.argv[1])
