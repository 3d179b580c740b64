"""Import the peers' Triton ops (fetched by bench/fetch_peers.py) without installing or importing vLLM or mamba_ssm.

`python -m bench.fetch_peers` copies this file to DEST/peer_loader.py beside DEST/vendor/; the benchmarks put DEST on
sys.path, set PEERS_VENDOR to DEST/vendor and call:

    load_vllm()       name, mamba_chunk_scan_combined_varlen, selective_state_update, causal_conv1d_fn,
                      causal_conv1d_update, rms_norm_gated, chunk_metadata(cu_seqlens, Q, device),
                      conv1d_metadata(query_start_loc, device)
    load_vllm(v)      an older release (VLLM_RELEASES): version, modules {file stem: module} of what it has; its
                      functions differ by release (tests/kernels/providers.py maps each)
    load_mamba_ssm()  name, mamba_chunk_scan_combined, selective_state_update, rmsnorm_fn,
                      autotuned_kernels["_chunk_scan_fwd_kernel"]
    load_fla()        name, chunk_simple_gla (the SSD recurrence as scalar-gated linear attention)

How: the peers' parent packages (`vllm`, `mamba_ssm`, ...) are registered in sys.modules as empty packages whose
__path__ is the vendored folder, so the ops' own absolute imports resolve to the vendored files and no project
__init__ runs. The handful of vLLM modules the ops import from the rest of vLLM (platforms, triton_utils, logger,
envs, _custom_ops, utils.platform_utils, v1.attention.backends.utils) are small stand-ins defined here, describing
a CUDA GPU (or, under TRITON_INTERPRET=1, a GPU without programmatic dependent launch). A process that has imported
the real vLLM or mamba_ssm cannot load the peers: that is an error, not a silent mix.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import types
from pathlib import Path

VLLM_VERSION, MAMBA_SSM_VERSION, FLA_VERSION = "0.33.0", "2.3.2.post1", "0.6.0"
VLLM_RELEASES = ("0.7.3", "0.10.2", VLLM_VERSION)       # oldest first; bench/fetch_peers.py pins each
_MARK = "__bamba_peer_stub__"


def vendor_dir() -> Path:
    """$PEERS_VENDOR, else vendor/ beside this file."""
    return Path(os.environ.get("PEERS_VENDOR") or Path(__file__).resolve().parent / "vendor").resolve()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _module(name: str, *search: Path, package: bool = False, **attrs) -> types.ModuleType:
    """Put module `name` into sys.modules and hang it on its parent. package: give it a __path__ (the folders in
    `search`, possibly none), so that its submodules can be imported or registered."""
    module = types.ModuleType(name)
    if package or search:
        module.__path__ = [str(p) for p in search]
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _ours(name: str) -> bool:
    """True when `name` is already our stand-in; RuntimeError when the real package is imported."""
    module = sys.modules.get(name)
    if module is None:
        return False
    if getattr(module, _MARK, False):
        return True
    raise RuntimeError(f"the real {name!r} is imported in this process ({getattr(module, '__file__', None)}): the "
                       "peers' vendored copies cannot be loaded beside it")


def _need(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: fetch the peers first ({what}; `make fetch-peers`)")


# ---- mamba_ssm ---------------------------------------------------------------------------------------------------

def load_mamba_ssm() -> types.SimpleNamespace:
    root = vendor_dir() / "mamba_ssm_ops"
    _need(root / "ops" / "triton" / "ssd_combined.py", f"mamba-ssm {MAMBA_SSM_VERSION}")
    if not _ours("mamba_ssm"):
        _module("mamba_ssm", root, **{_MARK: True, "__version__": MAMBA_SSM_VERSION})
        for sub in ("ops", "ops.triton", "utils"):
            _module(f"mamba_ssm.{sub}", root.joinpath(*sub.split(".")))
    ops = {name: importlib.import_module(f"mamba_ssm.ops.triton.{name}")
           for name in ("ssd_combined", "selective_state_update", "layernorm_gated", "ssd_chunk_scan")}
    return types.SimpleNamespace(
        name=f"mamba_ssm-{MAMBA_SSM_VERSION}",
        mamba_chunk_scan_combined=ops["ssd_combined"].mamba_chunk_scan_combined,
        selective_state_update=ops["selective_state_update"].selective_state_update,
        rmsnorm_fn=ops["layernorm_gated"].rmsnorm_fn,
        autotuned_kernels={"_chunk_scan_fwd_kernel": ops["ssd_chunk_scan"]._chunk_scan_fwd_kernel},
        modules=ops,
    )


def drop_sm90_racy_configs(autotuner) -> int:
    """Remove from an autotuner the configs that Triton 3.x miscompiles on sm90 (whole warpgroups, BLOCK_SIZE_M a
    multiple of 64 and more than one pipeline stage: the wgmma of `tl.dot(cb, x)` outlives the registers it reads and
    whole output rows come out NaN/Inf). vLLM 0.33 filters its own chunk-scan configs by this rule; mamba_ssm 2.3.2
    does not. Returns how many were dropped (none when that would leave no config)."""
    safe = [c for c in autotuner.configs
            if c.num_stages == 1 or c.num_warps % 4 or c.kwargs.get("BLOCK_SIZE_M", 0) % 64]
    if not safe:
        return 0
    dropped = len(autotuner.configs) - len(safe)
    autotuner.configs, autotuner.cache = safe, {}
    return dropped


# ---- vLLM ----------------------------------------------------------------------------------------------------------

class _Capability(tuple):
    """(major, minor) with the accessors vLLM's DeviceCapability has."""

    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])

    def to_int(self) -> int:
        return 10 * self[0] + self[1]


class _CudaPlatform:
    """What the ops ask vllm.platforms.current_platform: an NVIDIA GPU; never the CPU or XPU fallbacks (those need
    vLLM's compiled ops). Under the Triton interpreter there is no capability, so no PDL and no sm90 filters."""

    device_type = device_name = "cuda"

    @staticmethod
    def get_device_capability(device_id: int = 0) -> _Capability | None:
        import torch
        if _interpreted() or not torch.cuda.is_available():
            return None
        return _Capability(torch.cuda.get_device_capability(device_id))

    @classmethod
    def is_cuda(cls) -> bool:
        import torch
        return cls.get_device_capability() is not None and torch.version.hip is None

    is_cuda_alike = is_cuda

    @staticmethod
    def is_cpu() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False

    @classmethod
    def is_device_capability(cls, capability, device_id: int = 0) -> bool:
        have = cls.get_device_capability(device_id)
        want = tuple(capability) if isinstance(capability, tuple) else divmod(capability, 10)
        return have is not None and tuple(have) == want

    @classmethod
    def has_device_capability(cls, capability, device_id: int = 0) -> bool:
        have = cls.get_device_capability(device_id)
        want = tuple(capability) if isinstance(capability, tuple) else divmod(capability, 10)
        return have is not None and tuple(have) >= want

    @classmethod
    def is_arch_support_pdl(cls) -> bool:
        """Programmatic dependent launch from sm90 on, as vLLM decides it; PEERS_VLLM_PDL=0 turns it off."""
        have = cls.get_device_capability()
        return have is not None and have[0] >= 9 and os.environ.get("PEERS_VLLM_PDL", "1") != "0"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        import torch
        return "cpu" if cls.get_device_capability(device_id) is None else torch.cuda.get_device_name(device_id)


class _LogOnce(logging.LoggerAdapter):
    """vllm.logger's loggers also have info_once / warning_once / debug_once (with a `scope` keyword)."""

    _said: set = set()

    def _once(self, level: int, msg, *args, **kwargs) -> None:
        kwargs.pop("scope", None)
        if (level, msg, args) not in self._said:
            self._said.add((level, msg, args))
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)


class _NoCompiledOps(types.ModuleType):
    """vllm._custom_ops without the compiled ops: asking for one raises NotImplementedError. A dunder name is the
    module protocol, not an op (inspect.getmodule asks every module in sys.modules for __file__, as fla's import
    does): AttributeError, as for any module without it."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"vllm._custom_ops.{name}: a compiled vLLM op; the peers hold only vLLM's Triton ops")


def _vllm_envs_getattr(name: str):
    """Every VLLM_* setting the ops read: the environment's value, else unset (None)."""
    if name.startswith("VLLM_"):
        return os.environ.get(name)
    raise AttributeError(name)


def _install_vllm_stand_ins(ops_dir: Path, version: str) -> None:
    if _ours("vllm"):
        loaded = sys.modules["vllm"].__version__
        if loaded != version:
            raise RuntimeError(f"vllm {loaded}'s ops are already loaded in this process: one vLLM release a process")
        return
    import triton
    import triton.language as tl
    try:
        from triton.language.extra import libdevice
    except ImportError:
        libdevice = None

    _module("vllm", package=True, **{_MARK: True, "__version__": version})
    _module("vllm.envs", __getattr__=_vllm_envs_getattr,
            VLLM_TUNED_CONFIG_FOLDER=os.environ.get("VLLM_TUNED_CONFIG_FOLDER"))
    _module("vllm.logger", init_logger=lambda name: _LogOnce(logging.getLogger(name), {}))
    _module("vllm.platforms", package=True, current_platform=_CudaPlatform, Platform=_CudaPlatform)
    _module("vllm.triton_utils", HAS_TRITON=True, triton=triton, tl=tl, tldevice=libdevice)
    custom_ops = _NoCompiledOps("vllm._custom_ops")
    sys.modules["vllm._custom_ops"] = custom_ops
    sys.modules["vllm"]._custom_ops = custom_ops
    for package in ("vllm.utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends",
                    "vllm.attention", "vllm.attention.backends",
                    "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba"):
        _module(package, package=True)
    # where releases before the V1 engine (0.7.3, 0.10.2) import the padding slot from: the same value
    _module("vllm.attention.backends.utils", PAD_SLOT_ID=-1)
    _module("vllm.utils.platform_utils", get_device_name_as_file_name=lambda device_id=0: re.sub(
        r"[\s/]+", "_", _CudaPlatform.get_device_name(device_id)))
    # as in vllm/v1/attention/backends/utils.py of 0.33.0: padding rows carry slot -1; conv block 0 is the null block
    _module("vllm.v1.attention.backends.utils", PAD_SLOT_ID=-1, NULL_BLOCK_ID=0)
    _module("vllm.model_executor.layers.mamba.ops", ops_dir)


def load_vllm(version: str = VLLM_VERSION) -> types.SimpleNamespace:
    """vLLM `version`'s Triton ops (one of VLLM_RELEASES). The current pin gets the named functions the benchmarks
    call; every release gets `modules`, {file stem: module} for the files it has (0.7.3 has no layernorm_gated, and
    its causal_conv1d wraps compiled CUDA ops)."""
    if version not in VLLM_RELEASES:
        raise ValueError(f"vllm {version}: not a fetched release; expected one of {', '.join(VLLM_RELEASES)}")
    ops_dir = vendor_dir() / f"vllm_mamba_ops-{version}" / "ops"
    _need(ops_dir / "ssd_combined.py", f"vllm {version}")
    _install_vllm_stand_ins(ops_dir, version)
    package = "vllm.model_executor.layers.mamba.ops"
    if version != VLLM_VERSION:
        stems = sorted(p.stem for p in ops_dir.glob("*.py") if p.stem != "__init__")
        return types.SimpleNamespace(name=f"vllm-{version}", version=version,
                                     modules={stem: importlib.import_module(f"{package}.{stem}") for stem in stems})
    ops = {name: importlib.import_module(f"{package}.{name}")
           for name in ("ssd_combined", "mamba_ssm", "causal_conv1d", "layernorm_gated")}
    return types.SimpleNamespace(
        name=f"vllm-{VLLM_VERSION}", version=VLLM_VERSION,
        mamba_chunk_scan_combined_varlen=ops["ssd_combined"].mamba_chunk_scan_combined_varlen,
        selective_state_update=ops["mamba_ssm"].selective_state_update,
        causal_conv1d_fn=ops["causal_conv1d"].causal_conv1d_fn,
        causal_conv1d_update=ops["causal_conv1d"].causal_conv1d_update,
        rms_norm_gated=ops["layernorm_gated"].rms_norm_gated,
        chunk_metadata=vllm_chunk_metadata,
        conv1d_metadata=vllm_conv1d_metadata,
        modules=ops,
    )


def vllm_chunk_metadata(cu_seqlens, chunk_size: int, device=None):
    """The chunk tables vLLM's varlen scan takes, as its Mamba2 metadata builder makes them for fresh prefills:
    each sequence cut into chunks of `chunk_size` tokens from its own first token (no chunk spans two sequences).

    cu_seqlens (B+1,). Returns int32 tensors on `device`: cu_chunk_seqlens (n_chunks+1,) token offsets of the chunks,
    last_chunk_indices (B,) each sequence's last chunk (-1 for an empty one), seq_idx (n_chunks,) each chunk's
    sequence."""
    import torch
    offsets = [int(v) for v in torch.as_tensor(cu_seqlens).tolist()]
    bounds, owner, last = [0], [], []
    for seq, (start, stop) in enumerate(zip(offsets, offsets[1:])):
        for chunk_start in range(start, stop, chunk_size):
            bounds.append(min(chunk_start + chunk_size, stop))
            owner.append(seq)
        last.append(len(owner) - 1 if stop > start else -1)
    device = device if device is not None else getattr(cu_seqlens, "device", "cpu")
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (bounds, last, owner))


def vllm_conv1d_metadata(query_start_loc, device=None, block_m: int = 8):
    """What vLLM 0.33 prepares on the host for `causal_conv1d_fn(..., metadata=...)` (compute_causal_conv1d_metadata):
    for every program the sequence it works on (`batch_ptr`) and which BLOCK_M-token block of it
    (`token_chunk_offset_ptr`), padded with -1, and `nums_dict[block_m]` with the same tables. Without it the
    wrapper builds them inside its grid callback, which needs a device-to-host copy (and which Triton's CPU
    interpreter cannot run)."""
    import torch
    starts = torch.as_tensor(query_start_loc).detach().to("cpu", torch.int64)      # (B+1,)
    device = device if device is not None else getattr(query_start_loc, "device", "cpu")
    blocks = (starts.diff() + block_m - 1) // block_m                             # (B,) blocks per sequence
    seq_of_program = torch.repeat_interleave(torch.arange(len(blocks)), blocks).to(torch.int32)
    block_of_program = torch.cat([torch.arange(int(n)) for n in blocks] or [torch.zeros(0)]).to(torch.int32)
    width = 2 * max(1024, len(seq_of_program))
    batch_ptr = torch.full((width,), -1, dtype=torch.int32, device=device)
    offset_ptr = torch.full((width,), -1, dtype=torch.int32, device=device)
    batch_ptr[:len(seq_of_program)] = seq_of_program.to(device)
    offset_ptr[:len(block_of_program)] = block_of_program.to(device)
    tables = dict(nums=blocks, tot=int(blocks.sum()), mlist=seq_of_program, mlist_len=len(seq_of_program),
                  offsetlist=block_of_program, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)
    return types.SimpleNamespace(nums_dict={block_m: tables}, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)


# ---- fla ---------------------------------------------------------------------------------------------------------

def load_fla() -> types.SimpleNamespace:
    """fla-core's ops. `chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=None, output_final_state=True,
    cu_seqlens=None)` computes the SSD recurrence as scalar-gated linear attention in layout (B, T, H, K/V): q = C and
    k = B expanded to every head (fla has no groups), v = x·Δ, g = Δ·A (fp32 log decay per token and head); D·x is
    added afterwards; cu_seqlens (int64, B = 1) for packed sequences. Needs einops."""
    root = vendor_dir() / "fla_core"
    _need(root / "fla" / "__init__.py", f"fla-core {FLA_VERSION}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    simple_gla = importlib.import_module("fla.ops.simple_gla")
    return types.SimpleNamespace(name=f"fla-core-{FLA_VERSION}", chunk_simple_gla=simple_gla.chunk_simple_gla)


# ---- CPU smoke runs (TRITON_INTERPRET=1) ---------------------------------------------------------------------------

def patch_torch_for_interpreter() -> None:
    """Let the peers' wrappers run on CPU tensors under the Triton interpreter. They enter
    `torch.cuda.device(t.device.index)` (or torch.accelerator.device_index) around each launch, which a CPU-only torch
    refuses for index None: make that a no-op. And vLLM's causal_conv1d_fn grid callback stores tensors into the
    argument dict it is handed, which the interpreter then launches with: hand it a copy, as compiled Triton does."""
    import torch
    if getattr(torch.cuda, _MARK, False):
        return

    def tolerate_none(enter):
        return lambda index: contextlib.nullcontext() if index is None else enter(index)

    torch.cuda.device = tolerate_none(torch.cuda.device)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "device_index"):
        accelerator.device_index = tolerate_none(accelerator.device_index)
    setattr(torch.cuda, _MARK, True)

    from triton.runtime import interpreter
    original_init = interpreter.GridExecutor.__init__

    def init(self, fn, arg_names, grid, *args, **kwargs):
        if callable(grid):
            grid = (lambda callback: lambda meta: callback(dict(meta)))(grid)
        original_init(self, fn, arg_names, grid, *args, **kwargs)

    interpreter.GridExecutor.__init__ = init


def prune_autotune_for_interpreter(*modules) -> int:
    """Keep only the first config of every autotuned kernel in `modules` (the interpreter would time them all);
    returns how many kernels were pruned."""
    from triton.runtime.autotuner import Autotuner
    pruned = 0
    for module in modules:
        for kernel in vars(module).values():
            if isinstance(kernel, Autotuner) and len(kernel.configs) > 1:
                kernel.configs, kernel.cache = kernel.configs[:1], {}
                pruned += 1
    return pruned
