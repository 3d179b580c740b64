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
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import shutil
import signal
import tempfile
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
from .engine import EngineError
from .model import BambaEngineModel, StepBatch
from .sharding import RankShard, local_config, parallel_problems, plan_shard, shard_tensors, stage_layers
from .weights import EngineModelConfig, read_tensors

LOG_TAIL_CHARS = 4000
# Start-up (spawning Python, importing torch, loading a shard) is given at least this long, whatever the step timeout.
MIN_START_TIMEOUT_S = 300.0


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

    def _output_linear(self, x, name):
        out = F.linear(x, self.w[name + ".weight"])                  # this rank's columns: a partial product
        if self.shard.size > 1:
            total = out.float()                                       # summed in fp32 whatever the run dtype
            dist.all_reduce(total, group=self.tp_group)
            out = total.to(out.dtype)
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


def _worker_main(spec: WorkerSpec, rank: int, conn) -> None:
    """The body of a worker process: build, say ready, then serve steps until told to close or the driver goes."""
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

def _shutdown(processes: list, conns: list, run_dir: str) -> None:
    """Stop the workers (politely, then by force) and remove their run directory. Safe to call twice."""
    for conn in conns:
        try:
            conn.send(("close", None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 10.0
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(run_dir, ignore_errors=True)


class ParallelModel:
    """Drives tp × pp worker processes; `forward` has BambaEngineModel's signature and returns rank 0's logits.

    The states and kv arguments of forward are the driver's bookkeeping: the workers hold the tensors.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.world = spec.tp * spec.pp
        self.logits_rank = (spec.pp - 1) * spec.tp
        self._failed: str | None = None
        # Workers fork from a server process that has imported torch and the engine once: a second engine in the
        # same driver starts in a fraction of a second instead of re-importing torch in every rank. The server never
        # touches CUDA, so its children may.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["vendored.engine.parallel"])
        self.processes, self.conns = [], []
        for rank in range(self.world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(spec, rank, theirs), name=f"bamba-engine-rank{rank}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.processes.append(proc)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns, spec.run_dir)
        self._wait(set(range(self.world)), "ready", "start-up", max(spec.timeout_s, MIN_START_TIMEOUT_S))

    def forward(self, batch: StepBatch, states: StatePool, kv: KVCache) -> torch.Tensor:
        if self._failed:
            raise EngineError(f"the parallel workers were shut down after an earlier failure: {self._failed}")
        payload = ("step", _pack(batch))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(payload)
            except OSError:
                self._fail(f"rank {rank}: cannot send it the step ({self._exit_reason(rank)})", rank)
        logits = self._wait({self.logits_rank}, "logits", "a step", self.spec.timeout_s)[self.logits_rank]
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


def start_parallel_model(checkpoint, cfg: EngineModelConfig, tensors: dict[str, torch.Tensor], *, tp: int, pp: int,
                         dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, max_positions: int,
                         num_slots: int, num_blocks: int, block_size: int, timeout_s: float) -> ParallelModel:
    """Check that the model splits over tp × pp ranks (EngineError naming every problem otherwise), then start the
    workers. tensors: the checkpoint as the driver loaded it (only sizes are read; each worker loads its own shard)."""
    intermediate_size = tensors["model.layers.0.feed_forward.gate_proj.weight"].shape[0]
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
    spec = WorkerSpec(checkpoint=str(checkpoint), cfg=cfg, intermediate_size=intermediate_size, tp=tp, pp=pp,
                      dtype=dtype, state_dtype=state_dtype, device_type=device.type, first_device=device.index or 0,
                      max_positions=max_positions, num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                      timeout_s=float(timeout_s), run_dir=tempfile.mkdtemp(prefix="bamba-engine-"))
    return ParallelModel(spec)
