"""Fetch the peers: the public Mamba2 Triton ops that bench/ times ours against, from pinned PyPI releases.

    make fetch-peers                                         # = .venv/bin/python -m bench.fetch_peers --dest .peers
    .venv/bin/python -m bench.fetch_peers --dry-run          # what it would download and write; touches nothing

Run it on a machine with access to PyPI (the GPU image has none), then carry DEST to the GPU beside the tree:
`make bench-kernels` reads `--peers .peers`. DEST is git-ignored and never committed. It ends up holding

    DEST/peer_loader.py                     bench/peer_loader.py, which the benchmarks import from --peers DEST
    DEST/vendor/vllm_mamba_ops-0.33.0/ops/  vllm 0.33.0 (wheel): vllm/model_executor/layers/mamba/ops/*.py, configs/
    DEST/vendor/vllm_mamba_ops-0.10.2/ops/  vllm 0.10.2 (sdist), the same folder: a release between the two
    DEST/vendor/vllm_mamba_ops-0.7.3/ops/   vllm 0.7.3 (sdist), the same folder: the first release with Bamba
    DEST/vendor/mamba_ssm_ops/              mamba-ssm 2.3.2.post1 (sdist): mamba_ssm/ops/triton/*.py,
                                            mamba_ssm/utils/{determinism,torch}.py
    DEST/vendor/fla_core/fla/               fla-core 0.6.0 (wheel): the whole fla package (pure Python + Triton)

each peer's files unmodified, with its LICENSE and a SOURCE.txt naming the archive; about 7 MB in all.

Three vLLM releases, for tests/kernels' conformance table (`pytest tests/kernels --ops vllm-0.7.3`): 0.7.3 is the first
release whose wheel has vllm/model_executor/models/bamba.py (0.7.2 has neither it nor the SSD scan ops), 0.10.2 one
in between (the V1 engine, chunk_indices/chunk_offsets in the scan, Triton causal conv), 0.33.0 the current pin.
The two older ones come as sdists (5 and 10 MB, where their wheels are 250 and 420 MB): `pip download` cannot save
an sdist without building its metadata, which for vLLM means its CUDA build, so those are fetched by their PyPI file
address, pinned beside the sha256.

Each archive is fetched with `pip download --no-deps` and checked against the sha256 pinned below before anything is
unpacked. mamba-ssm publishes only an sdist, and pip learns an sdist's metadata by running its setup.py, which
imports torch: so pip runs with this interpreter (the project's .venv has torch), without build isolation, and with
MAMBA_SKIP_CUDA_BUILD=TRUE so that nothing is compiled. vLLM's wheel is ~330 MB, of which ~1 MB is kept.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

LOADER = Path(__file__).resolve().parent / "peer_loader.py"


@dataclass(frozen=True)
class Peer:
    """One pinned release and the files of it that the benchmarks need.

    keep: (pattern inside the archive, folder under DEST/vendor/<folder>) pairs; a pattern is an fnmatch pattern whose
    `*` stays within one path component, and each matched file keeps its path below the pattern's fixed prefix."""

    name: str                       # the --only name, and the benchmarks' name for it
    requirement: str                # what pip downloads
    archive: str                    # the file pip saves
    sha256: str
    folder: str                     # DEST/vendor/<folder>
    keep: tuple[tuple[str, str], ...]
    pip_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""                   # fetched from this address (PyPI's file host) instead of by pip


VLLM_VERSION, MAMBA_SSM_VERSION, FLA_VERSION = "0.33.0", "2.3.2.post1", "0.6.0"
_VLLM_OPS = "vllm/model_executor/layers/mamba/ops"
_PYPI_FILES = "https://files.pythonhosted.org/packages"


def _vllm_sdist(version: str, sha256: str, path: str) -> Peer:
    """An older vLLM release from its sdist at PyPI's `path`: the Triton ops folder and the LICENSE."""
    root = f"vllm-{version}"
    return Peer(f"vllm-{version}", f"vllm=={version}", f"vllm-{version}.tar.gz", sha256,
                f"vllm_mamba_ops-{version}",
                keep=((f"{root}/{_VLLM_OPS}/*.py", "ops"), (f"{root}/LICENSE", "")),
                url=f"{_PYPI_FILES}/{path}/vllm-{version}.tar.gz")

_MAMBA_ROOT = f"mamba_ssm-{MAMBA_SSM_VERSION}"

PEERS: tuple[Peer, ...] = (
    Peer("vllm", f"vllm=={VLLM_VERSION}", f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl",
         "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa", f"vllm_mamba_ops-{VLLM_VERSION}",
         keep=((f"{_VLLM_OPS}/*.py", "ops"), (f"{_VLLM_OPS}/configs/**", "ops/configs"),
               (f"vllm-{VLLM_VERSION}.dist-info/licenses/LICENSE", "")),
         # the wheel for the GPU image's platform, whatever machine fetches it
         pip_args=("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                   "--platform", "manylinux_2_28_x86_64")),
    Peer("mamba_ssm", f"mamba-ssm=={MAMBA_SSM_VERSION}", f"mamba_ssm-{MAMBA_SSM_VERSION}.tar.gz",
         "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028", "mamba_ssm_ops",
         keep=((f"{_MAMBA_ROOT}/mamba_ssm/ops/triton/*.py", "ops/triton"),
               (f"{_MAMBA_ROOT}/mamba_ssm/utils/determinism.py", "utils"),
               (f"{_MAMBA_ROOT}/mamba_ssm/utils/torch.py", "utils"),
               (f"{_MAMBA_ROOT}/LICENSE", "")),
         pip_args=("--no-binary", ":all:", "--no-build-isolation"),
         env={"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "FALSE"}),
    Peer("fla", f"fla-core=={FLA_VERSION}", f"fla_core-{FLA_VERSION}-py3-none-any.whl",
         "b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd", "fla_core",
         keep=(("fla/**", "fla"), (f"fla_core-{FLA_VERSION}.dist-info/licenses/LICENSE", "")),
         pip_args=("--only-binary=:all:",)),
    _vllm_sdist("0.10.2", "57608f44cf61f5d80fb182c98e06e524cb2925bb528258a7b247c8e43a52d13e",
                "7d/0a/278d7bbf454f7de5322a5007427eed3e8b34ed6c2802491b56bbdfd7bbb4"),
    _vllm_sdist("0.7.3", "841cc30bd4ffbc037e8b8bf6dbacbedc60cc0b2abb60366873b185159a1204e6",
                "f5/73/87825ee293f0e721eb8aadbd0cf9c3436d4e3b3458322878f1f6e7398a0d"),
)


class FetchError(RuntimeError):
    """A download that failed, an archive whose checksum differs from the pin, or a pattern that matched nothing."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fetch_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default=".peers", help="folder to fill (default .peers, git-ignored)")
    p.add_argument("--only", default="", help=f"comma-separated peers (default: all of {', '.join(_names())})")
    p.add_argument("--downloads", default=None,
                   help="folder for the downloaded archives, kept afterwards (default: a temporary one, removed)")
    p.add_argument("--dry-run", action="store_true", help="print the pip commands and the files to write; do nothing")
    a = p.parse_args(argv)
    try:
        a.peers = select(a.only)
    except ValueError as err:
        p.error(str(err))
    return a


def _names() -> list[str]:
    return [peer.name for peer in PEERS]


def select(spec: str) -> list[Peer]:
    """The peers named in a comma-separated `spec` (empty: all), in PEERS order; ValueError for an unknown name."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in _names()]
    if unknown:
        raise ValueError(f"--only: unknown peer {unknown[0]!r}: expected one of {', '.join(_names())}")
    return [peer for peer in PEERS if not names or peer.name in names]


def pip_command(peer: Peer, downloads: Path) -> list[str]:
    """The `pip download` that saves `peer.archive` into `downloads`."""
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *peer.pip_args, peer.requirement,
            "--dest", str(downloads)]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(peer: Peer, downloads: Path) -> Path:
    """Fetch the archive (unless a copy with the pinned checksum is already there) and check its sha256."""
    archive = downloads / peer.archive
    if not (archive.is_file() and sha256_of(archive) == peer.sha256) and peer.url:
        try:
            with urllib.request.urlopen(peer.url, timeout=120) as response, archive.open("wb") as f:
                shutil.copyfileobj(response, f)
        except OSError as err:
            raise FetchError(f"{peer.name}: download {peer.url}: {err}") from err
    elif not (archive.is_file() and sha256_of(archive) == peer.sha256):
        done = subprocess.run(pip_command(peer, downloads), env=os.environ | peer.env)
        if done.returncode != 0:
            raise FetchError(f"{peer.name}: pip download {peer.requirement} exited with {done.returncode}")
        if not archive.is_file():
            raise FetchError(f"{peer.name}: pip download left no {peer.archive} in {downloads}")
    actual = sha256_of(archive)
    if actual != peer.sha256:
        raise FetchError(f"{peer.name}: {peer.archive}: sha256 {actual}, expected {peer.sha256}")
    return archive


def _matches(name: str, pattern: str) -> str | None:
    """The path of archive member `name` below the fixed prefix of `pattern`, or None if it does not match.
    `dir/**` matches everything below dir; elsewhere `*` matches within one path component."""
    if pattern.endswith("/**"):
        prefix = pattern[:-2]
        return name[len(prefix):] if name.startswith(prefix) and len(name) > len(prefix) else None
    parts, pattern_parts = name.split("/"), pattern.split("/")
    if len(parts) != len(pattern_parts) or not all(fnmatch.fnmatchcase(n, p) for n, p in zip(parts, pattern_parts)):
        return None
    return parts[-1]


def members(archive: Path) -> dict[str, bytes]:
    """Every regular file of a wheel (zip) or sdist (tar.gz): archive path -> contents."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
    with tarfile.open(archive, "r:gz") as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def plan_files(peer: Peer, names: list[str]) -> dict[str, str]:
    """archive member -> destination path relative to DEST/vendor/<peer.folder>; FetchError if a pattern matches
    nothing (the release is not laid out as pinned)."""
    out: dict[str, str] = {}
    for pattern, folder in peer.keep:
        hits = {n: rel for n in names if (rel := _matches(n, pattern)) is not None}
        if not hits:
            raise FetchError(f"{peer.name}: nothing in {peer.archive} matches {pattern!r}")
        out.update({n: str(Path(folder) / rel) for n, rel in hits.items()})
    return out


def unpack(peer: Peer, archive: Path, vendor: Path) -> int:
    """Replace DEST/vendor/<folder> with the kept files; returns how many were written."""
    contents = members(archive)
    files = plan_files(peer, sorted(contents))
    target = vendor / peer.folder
    if target.exists():
        shutil.rmtree(target)
    for name, rel in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(contents[name])
    (target / "SOURCE.txt").write_text(f"{peer.requirement} ({peer.archive}, sha256 {peer.sha256}): "
                                       f"{', '.join(p for p, _ in peer.keep)}; unmodified\n")
    return len(files)


def main(argv=None) -> int:
    a = parse_args(argv)
    dest = Path(a.dest)
    vendor = dest / "vendor"
    if a.dry_run:
        downloads = Path(a.downloads) if a.downloads else Path("<temporary folder>")
        for peer in a.peers:
            env = " ".join(f"{k}={v}" for k, v in peer.env.items())
            how = f"GET {peer.url}" if peer.url else shlex.join(pip_command(peer, downloads))
            print(f"{peer.name}: {(env + ' ') if env else ''}{how}")
            print(f"  check sha256 {peer.sha256} of {peer.archive}")
            for pattern, folder in peer.keep:
                print(f"  keep {pattern} -> {vendor / peer.folder / folder}")
        print(f"copy {LOADER} -> {dest / 'peer_loader.py'}")
        return 0
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        downloads = Path(a.downloads or tmp)
        downloads.mkdir(parents=True, exist_ok=True)
        try:
            for peer in a.peers:
                print(f"{peer.name}: {peer.requirement}", flush=True)
                count = unpack(peer, download(peer, downloads), vendor)
                print(f"  {count} files -> {vendor / peer.folder}", flush=True)
        except FetchError as err:
            print(f"fetch_peers: error: {err}", file=sys.stderr)
            return 1
    shutil.copyfile(LOADER, dest / "peer_loader.py")
    print(f"wrote {dest / 'peer_loader.py'}; run the benchmarks with --peers {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
