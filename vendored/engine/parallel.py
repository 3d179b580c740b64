"""Tensor and pipeline parallelism: the engine launches its own worker processes and drives them step by step.

The driver (the process that made the LLMEngine) starts tp × pp workers (multiprocessing's forkserver: the driver's
script needs the usual `if __name__ == "__main__":` guard), keeps the scheduler and sends every worker the same step
batch over a pipe; the workers run the model over torch.distributed (gloo on the CPU, NCCL on CUDA, rendezvous
through a file) and tensor-parallel rank 0 of the last pipeline stage sends the logits back. Rank = stage · tp + tp
rank. Each worker holds its shard of the weights (vendored/engine/sharding.py) and its own StatePool and KVCache
for its layers; the driver holds only the bookkeeping (free slots and blocks). Workers zero a state slot when a
sequence's first piece arrives in it (a prefill without initial state), as the single-process engine zeroes a slot
when it hands it out.

Failure: a worker that raises sends its traceback before it exits; one that dies without a word (killed, segfault)
is seen through its process sentinel, and the tail of its log (faulthandler writes fatal-signal tracebacks there)
is quoted. A step that gets no answer within `timeout_s` (start-up: at least MIN_START_TIMEOUT_S) asks every live
worker to dump its stacks (SIGUSR1) and quotes them. In every case the workers are shut down and the call raises
EngineError: never a hang.

Lifetime: nothing outlives the driver, however it ends. A worker is a child of the forkserver, not of the driver, and
each one ties itself to the driver as it starts (_tie_to_driver): it gives back its copy of the forkserver's "alive"
pipe, so that the forkserver stops exactly when the driver does, and asks the kernel (Linux) to SIGKILL it when the
forkserver stops; the resource tracker stops when the last of them has. The run directory (rendezvous file, rank
logs), named bamba-engine-<driver pid>-*, is removed on close, on an exception or Ctrl-C during start-up or a step,
at interpreter exit, and on SIGTERM/SIGHUP where those would otherwise kill the driver outright; one left by a
driver that was SIGKILLed is removed by the next parallel engine started on the machine (remove_stale_run_dirs).
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, fields
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vendored.ops.rms_norm_gated import rms_norm_gated

from .cache import KVCache, StatePool
from .errors import EngineError
from .model import BambaEngineModel, StepBatch
from .sharding import RankShard, local_config, parallel_problems, plan_shard, shard_tensors, stage_layers
from .weights import EngineModelConfig, read_tensors

LOG_TAIL_CHARS = 4000
# Start-up (spawning Python, importing torch, loading a shard) is given at least this long, whatever the step timeout.
MIN_START_TIMEOUT_S = 300.0
# Run directories are named RUN_DIR_PREFIX + <driver pid> + "-" + random: a stale one names the driver that left it.
RUN_DIR_PREFIX = "bamba-engine-"
# How long ready workers get to leave by themselves after "close" before they are killed.
CLOSE_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1                          # <linux/prctl.h>
# The forkserver listens on a Unix socket at <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX; sun_path holds 108 bytes
# on Linux (104 on macOS and the BSDs), the terminating NUL included. A longer path fails deep inside multiprocessing
# with "AF_UNIX path too long", after the checkpoint is read, so the engine checks it first.
MAX_UNIX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103
FORKSERVER_SOCKET_NAME = "listener-XXXXXXXX"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its part of the engine (picklable: sent to spawned processes)."""

    checkpoint: str
    cfg: EngineModelConfig
    intermediate_size: int
    tp: int
    pp: int
    dtype: torch.dtype
    state_dtype: torch.dtype
    device_type: str
    first_device: int
    max_positions: int
    num_slots: int
    num_blocks: int
    block_size: int
    timeout_s: float
    run_dir: str


# ---- worker side ---------------------------------------------------------------------------------------------

class ShardedBambaModel(BambaEngineModel):
    """One rank's shard: local heads, groups and channels (cfg is the local config), the layers of its stage, and
    the two places where tensor-parallel ranks talk: output projections and gated-norm groups that span ranks."""

    def __init__(self, full_cfg: EngineModelConfig, shard: RankShard, tensors: dict[str, torch.Tensor], *,
                 dtype: torch.dtype, device: torch.device, max_positions: int, layers: range, tp_group) -> None:
        super().__init__(local_config(full_cfg, shard), tensors, dtype=dtype, device=device,
                         max_positions=max_positions, layers=layers)
        self.full_cfg, self.shard, self.tp_group = full_cfg, shard, tp_group
        heads_per_group = full_cfg.n_heads // full_cfg.n_groups
        # The gated-norm group of each local channel: the B/C group of its head.
        self.channel_group = torch.tensor([h // heads_per_group for h in shard.heads],
                                          device=device).repeat_interleave(full_cfg.head_dim)   # (H_l·P,)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return partial
        total = partial.float()                                       # summed in fp32 whatever the run dtype
        dist.all_reduce(total, group=self.tp_group)
        return total.to(partial.dtype)

    def _output_linear(self, x, name):
        out = self._reduce(F.linear(x, self.w[name + ".weight"]))   # this rank's columns: a partial product
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def _gated_norm(self, i: int, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        full, eps = self.full_cfg, self.cfg.rms_norm_eps
        group_size = full.n_heads * full.head_dim // full.n_groups
        weight = self.w[f"model.layers.{i}.mamba.norm.weight"]
        if self.shard.norm_groups_whole:
            return rms_norm_gated(y, z, weight, eps=eps, group_size=group_size, norm_before_gate=False)
        # A group spans ranks: each rank adds up the squares of its channels per group, the sums are added across
        # ranks, and every rank normalises its channels with its groups' totals (fp32, as the kernel computes).
        gated = y.float() * F.silu(z.float())                                                # (T, H_l·P)
        sums = torch.zeros(y.shape[0], full.n_groups, dtype=torch.float32, device=y.device)  # (T, G)
        sums.index_add_(1, self.channel_group, gated * gated)
        dist.all_reduce(sums, group=self.tp_group)
        inv_rms = 1.0 / torch.sqrt(sums / group_size + eps)                                 # (T, G)
        return (gated * inv_rms[:, self.channel_group] * weight.float()).to(y.dtype)


def _pack(batch: StepBatch) -> dict:
    """A StepBatch as plain numpy arrays and ints (pickled by value through the pipe)."""
    return {f.name: (getattr(batch, f.name).cpu().numpy() if isinstance(getattr(batch, f.name), torch.Tensor)
                     else getattr(batch, f.name)) for f in fields(batch)}


def _unpack(payload: dict, device: torch.device) -> StepBatch:
    return StepBatch(**{k: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
                        for k, v in payload.items()})


class _Worker:
    """One rank: its process group, its shard of the model, its states and K/V."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.stage, self.tp_rank = divmod(rank, spec.tp)
        world = spec.tp * spec.pp
        if spec.device_type == "cuda":
            self.device = torch.device("cuda", spec.first_device + rank)
            torch.cuda.set_device(self.device)
            backend, extra = "nccl", {"device_id": self.device}
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)          # the ranks share the machine's cores
            backend, extra = "gloo", {}
        # The driver's timeout comes first, so that a hang is reported with every rank's stack, not as one rank's
        # collective timing out.
        dist.init_process_group(backend, init_method=f"file://{Path(spec.run_dir) / 'rendezvous'}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=2 * spec.timeout_s + 60), **extra)
        self.tp_group = None                  # the default group when there is one stage
        if spec.pp > 1:
            for stage in range(spec.pp):      # every rank creates every group, in the same order
                group = dist.new_group(list(range(stage * spec.tp, (stage + 1) * spec.tp)))
                if stage == self.stage:
                    self.tp_group = group
        cfg = spec.cfg
        self.layers = stage_layers(cfg.num_layers, spec.pp, self.stage)
        shard = plan_shard(cfg, spec.intermediate_size, spec.tp, self.tp_rank)
        checkpoint = read_tensors(Path(spec.checkpoint))
        if cfg.tie_word_embeddings:
            checkpoint.setdefault("lm_head.weight", checkpoint.get("model.embed_tokens.weight"))
        tensors = shard_tensors(cfg, checkpoint.get, shard, self.layers)
        del checkpoint
        self.model = ShardedBambaModel(cfg, shard, tensors, dtype=spec.dtype, device=self.device,
                                       max_positions=spec.max_positions, layers=self.layers, tp_group=self.tp_group)
        local = self.model.cfg
        self.states = StatePool(local, spec.num_slots, dtype=spec.dtype, state_dtype=spec.state_dtype,
                                device=self.device, layers=self.layers)
        self.kv = KVCache(local, spec.num_blocks, spec.block_size, dtype=spec.dtype, device=self.device,
                          layers=self.layers)

    @property
    def returns_logits(self) -> bool:
        return self.stage == self.spec.pp - 1 and self.tp_rank == 0

    def step(self, payload: dict) -> np.ndarray | None:
        batch = _unpack(payload, self.device)
        for slot in batch.prefill_slots[~batch.prefill_has_initial_state].tolist():
            self.states.reset(slot)          # a sequence's first piece: its slot starts from zeros
        if self.stage == 0:
            h = self.model.embed(batch)
        else:
            h = torch.empty(batch.token_ids.shape[0], self.spec.cfg.hidden_size, dtype=self.spec.dtype,
                            device=self.device)                                             # (T, D)
            dist.recv(h, src=self.rank - self.spec.tp)
        h = self.model.run_layers(h, batch, self.states, self.kv)
        if self.stage < self.spec.pp - 1:
            dist.send(h.contiguous(), dst=self.rank + self.spec.tp)
            return None
        if self.tp_rank != 0:
            return None
        return self.model.logits(h, batch).cpu().numpy()


def _tie_to_driver() -> None:
    """End this worker when the driver ends, however it ends (Ctrl-C, SIGTERM, SIGKILL, a crash), also while the
    worker is blocked in the rendezvous or a collective and reads no pipe: before, a worker left waiting for a rank
    the interrupted driver never started sat in init_process_group until its timeout (2 · timeout_s + 60 s), and kept
    the forkserver and the resource tracker alive with it.

    The worker's parent is the forkserver, which stops once every copy of its "alive" pipe is closed: the driver
    holds one and each forked child inherits one, so the worker closes its own (it starts no processes) and the
    forkserver then stops exactly when the driver does. PR_SET_PDEATHSIG has the kernel SIGKILL the worker when the
    forkserver stops (Linux; elsewhere a worker notices the driver's end only at its next read of the step pipe).
    The forkserver may already have stopped before the prctl call, which then never fires: that can only happen
    after the driver's end, so the worker checks afterwards that the driver still holds its end of the pipe the
    worker was started through (multiprocessing's parent sentinel), and leaves if not.
    """
    server = multiprocessing.forkserver._forkserver          # this process' view of the forkserver it came from
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    driver = multiprocessing.parent_process()
    if driver is not None and not driver.is_alive():
        os._exit(1)


def _worker_main(spec: WorkerSpec, rank: int, conn) -> None:
    """The body of a worker process: build, say ready, then serve steps until told to close or the driver goes."""
    _tie_to_driver()
    log = open(Path(spec.run_dir) / f"rank{rank}.log", "w")            # noqa: SIM115 - open for the process' life
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    try:
        worker = _Worker(spec, rank)
        conn.send(("ready", rank, None))
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:                                            # the driver is gone
                break
            if kind == "close":
                break
            logits = worker.step(payload)
            if worker.returns_logits:
                conn.send(("logits", rank, logits))
        dist.destroy_process_group()
        log.close()
        os._exit(0)                           # skip the interpreter's teardown of torch: seconds per rank on a CPU
    except BaseException:                                               # noqa: BLE001 - reported to the driver
        message = traceback.format_exc()
        log.write(message)
        log.flush()
        try:
            conn.send(("error", rank, message))
        finally:
            os._exit(1)                       # other ranks may be blocked in a collective with us: no clean exit


# ---- driver side ---------------------------------------------------------------------------------------------

def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                   # someone else's process: running
        pass
    return True


def remove_stale_run_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove the run directories in `parent` (default: the temporary directory) whose driver no longer runs, and
    return them. A driver that is SIGKILLed has no chance to remove its own; the next one cleans up after it. Only
    directories of this user named RUN_DIR_PREFIX + <pid> + "-..." are touched, and only when no process has that
    pid (a reused pid keeps a stale directory a while longer, never removes a live one)."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*-*"):
        pid = path.name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        try:
            owned = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:                       # removed meanwhile by its own driver
            continue
        if owned and pid.isdigit() and not _pid_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class _Workers:
    """The worker processes of one ParallelModel, their pipes and their run directory: what has to be cleaned up
    however the driver's work ends. Apart from ParallelModel so that its finalizer holds no reference to the model;
    registered in _live_workers so that a fatal signal can clean it up too (_end_on_signal)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.processes: list = []
        self.conns: list = []
        self.ready = False                    # every rank said ready: they read their pipes from then on
        _live_workers.add(self)

    def shutdown(self) -> None:
        """Stop the workers and remove the run directory. Safe to call twice. Ready workers are asked to close and
        given CLOSE_GRACE_S; workers still starting read no pipe (they may be waiting in the rendezvous for a rank
        that will never come), so they are killed at once."""
        if self.ready:
            for conn in self.conns:
                try:
                    conn.send(("close", None))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + CLOSE_GRACE_S
            for proc in self.processes:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        for proc in self.processes:
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        _live_workers.discard(self)
        if not _live_workers:
            _restore_signal_defaults()

    def kill(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()


# The workers of every ParallelModel not yet shut down, and the signals whose default action (ending the driver at
# once, without unwinding) would leave their run directories behind.
_live_workers: set[_Workers] = set()
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _end_on_signal(signum: int, frame) -> None:
    """A SIGTERM/SIGHUP handler that does what the default action would (end the driver, by that very signal, so
    its exit status says so) after killing every worker and removing every run directory. Python runs it between two
    bytecodes of the main thread, so the cleanup is ordinary code, not a C-level signal context."""
    for workers in list(_live_workers):
        workers.kill()
        shutil.rmtree(workers.run_dir, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_cleanup() -> None:
    """Install _end_on_signal for each of _CLEANUP_SIGNALS left at its default action. A signal the program handles
    (or ignores) itself is left alone: its handler decides whether the driver ends, and if it does by raising, the
    finalizers clean up as for any exception. Only the main thread may set handlers; elsewhere, nothing is set."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _CLEANUP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _end_on_signal)


def _restore_signal_defaults() -> None:
    """Undo _install_signal_cleanup once no workers are left: a Python-level handler runs only between bytecodes,
    so it would delay a SIGTERM until a long C call returns, which the default action does not."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _CLEANUP_SIGNALS:
        if signal.getsignal(sig) is _end_on_signal:
            signal.signal(sig, signal.SIG_DFL)


class ParallelModel:
    """Drives tp × pp worker processes; `forward` has BambaEngineModel's signature and returns rank 0's logits.

    The states and kv arguments of forward are the driver's bookkeeping: the workers hold the tensors.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.world = spec.tp * spec.pp
        self.logits_rank = (spec.pp - 1) * spec.tp
        self._failed: str | None = None
        # The finalizer comes first: whatever interrupts the start-up (Ctrl-C while the forkserver imports torch,
        # a rank that fails) finds the workers started so far and the run directory in it.
        workers = _Workers(spec.run_dir)
        self.processes, self.conns = workers.processes, workers.conns
        self._finalizer = weakref.finalize(self, workers.shutdown)
        _install_signal_cleanup()
        try:
            # Workers fork from a server process that has imported torch and the engine once: a second engine in
            # the same driver starts in a fraction of a second instead of re-importing torch in every rank. The
            # server never touches CUDA, so its children may.
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["vendored.engine.parallel"])
            for rank in range(self.world):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(spec, rank, theirs), name=f"bamba-engine-rank{rank}",
                                   daemon=True)
                proc.start()
                theirs.close()
                self.processes.append(proc)
                self.conns.append(ours)
            self._wait(set(range(self.world)), "ready", "start-up", max(spec.timeout_s, MIN_START_TIMEOUT_S))
        except BaseException:
            self._finalizer()
            raise
        workers.ready = True

    def forward(self, batch: StepBatch, states: StatePool, kv: KVCache) -> torch.Tensor:
        """fp32 logits from the ranks."""
        if self._failed:
            raise EngineError(f"the parallel workers were shut down after an earlier failure: {self._failed}")
        payload = ("step", _pack(batch))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(payload)
            except OSError:
                self._fail(f"rank {rank}: cannot send it the step ({self._exit_reason(rank)})", rank)
        try:
            logits = self._wait({self.logits_rank}, "logits", "a step", self.spec.timeout_s)[self.logits_rank]
        except KeyboardInterrupt:
            # The workers are somewhere inside the step: a later step would read this one's logits. They are
            # shut down, and the engine says why if it is used again.
            self._failed = "interrupted (KeyboardInterrupt) during a step"
            self._finalizer()
            raise
        return torch.from_numpy(logits)

    def close(self) -> None:
        self._finalizer()

    def _wait(self, ranks: set[int], kind: str, what: str, timeout_s: float) -> dict[int, object]:
        """Wait for a `kind` message from each of `ranks`, watching every worker for errors and deaths."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.processes)}
        conns = {id(conn): rank for rank, conn in enumerate(self.conns)}
        while ranks - got.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(ranks - got.keys())
                self._fail(f"no answer from rank(s) {missing} within {timeout_s:g} s during {what}",
                           None, hung=True)
            ready = wait(self.conns + list(sentinels), timeout=left)
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):          # messages before deaths
                if isinstance(obj, int):
                    rank = sentinels[obj]
                    if self.conns[rank].poll():
                        continue                                                # its last words come first
                    self._fail(f"rank {rank} died during {what} ({self._exit_reason(rank)})", rank)
                rank = conns[id(obj)]
                try:
                    got_kind, _, body = obj.recv()
                except EOFError:
                    self._fail(f"rank {rank} died during {what} ({self._exit_reason(rank)})", rank)
                if got_kind == "error":
                    self._fail(f"rank {rank} raised during {what}:\n{body}", None)
                if got_kind != kind or rank not in ranks:
                    self._fail(f"rank {rank} sent {got_kind!r} during {what}, expected {kind!r} from {sorted(ranks)}",
                               None)
                got[rank] = body
        return got

    def _exit_reason(self, rank: int) -> str:
        proc = self.processes[rank]
        proc.join(timeout=5.0)                # a closed pipe can come a moment before the exit status
        if proc.exitcode is None:
            return "closed its pipe, still running"
        if proc.exitcode < 0:
            return f"killed by signal {signal.Signals(-proc.exitcode).name}"
        return f"exit code {proc.exitcode}"

    def _fail(self, message: str, rank: int | None, *, hung: bool = False) -> None:
        """Shut every worker down and raise EngineError with `message` (and the log of `rank`, or of every rank
        after a hang: the stack dumps they were asked for)."""
        if hung:
            for proc in self.processes:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)                   # let faulthandler write the stacks
        logs = []
        for r in range(self.world) if hung else ([rank] if rank is not None else []):
            path = Path(self.spec.run_dir) / f"rank{r}.log"
            text = path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.is_file() else ""
            if text.strip():
                logs.append(f"--- rank {r} log (tail) ---\n{text}")
            elif hung:
                logs.append(f"--- rank {r}: no stack dump (it did not answer SIGUSR1: stopped, or blocked outside "
                            "Python) ---")
        self._failed = message.splitlines()[0]
        for proc in self.processes:           # no grace: a rank may be blocked in a collective that never ends
            if proc.is_alive():
                proc.kill()
        self._finalizer()
        raise EngineError("\n".join([f"parallel engine (tp={self.spec.tp}, pp={self.spec.pp}): {message}"] + logs))


def forkserver_socket_problem() -> str | None:
    """Why multiprocessing's forkserver could not bind its socket in this process, or None when it can (or runs).

    The socket lives in multiprocessing's per-process temporary directory (under TMPDIR, created on first use and
    then fixed for the life of the process), so a long TMPDIR, such as a test framework's per-test directory, makes
    the path too long for a Unix socket."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_address", None) is not None:
        return None                                              # already listening: no new socket is needed
    path = os.path.join(multiprocessing.util.get_temp_dir(), FORKSERVER_SOCKET_NAME)
    if len(os.fsencode(path)) <= MAX_UNIX_SOCKET_PATH:
        return None
    return (f"the forkserver's socket would be {path!r}, {len(os.fsencode(path))} bytes, and a Unix socket path "
            f"holds at most {MAX_UNIX_SOCKET_PATH}; it lies in the temporary directory "
            f"{tempfile.gettempdir()!r}: set TMPDIR to a shorter directory (for example /tmp)")


def start_parallel_model(checkpoint, cfg: EngineModelConfig, tensors: dict[str, torch.Tensor], *, tp: int, pp: int,
                         dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, max_positions: int,
                         num_slots: int, num_blocks: int, block_size: int, timeout_s: float) -> ParallelModel:
    """Check that the model splits over tp × pp ranks (EngineError naming every problem otherwise), then start the
    workers. tensors: the checkpoint as the driver loaded it (only sizes are read; each worker loads its own shard)."""
    intermediate_size = (cfg.intermediate_size if cfg.granite
                         else tensors["model.layers.0.feed_forward.gate_proj.weight"].shape[0])
    problems = parallel_problems(cfg, intermediate_size, tp, pp)
    world = tp * pp
    if device.type == "cuda":
        first = device.index or 0
        if first + world > torch.cuda.device_count():
            problems.append(f"tensor_parallel_size × pipeline_parallel_size = {world} ranks from cuda:{first} need "
                            f"{first + world} CUDA devices, this machine has {torch.cuda.device_count()}")
    elif device.type != "cpu":
        problems.append(f"device {device}: parallel workers run on cpu (gloo) or cuda (nccl)")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        problems.append(f"parallel_timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if problems:
        raise EngineError(f"cannot split the model over tp = {tp} × pp = {pp} ranks: " + "; ".join(problems))
    socket_problem = forkserver_socket_problem()
    if socket_problem:
        raise EngineError(f"cannot start the parallel workers (tp = {tp} × pp = {pp}): {socket_problem}")
    remove_stale_run_dirs()
    spec = WorkerSpec(checkpoint=str(checkpoint), cfg=cfg, intermediate_size=intermediate_size, tp=tp, pp=pp,
                      dtype=dtype, state_dtype=state_dtype, device_type=device.type, first_device=device.index or 0,
                      max_positions=max_positions, num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                      timeout_s=float(timeout_s), run_dir=tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
    return ParallelModel(spec)
