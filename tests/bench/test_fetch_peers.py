"""bench/fetch_peers.py without the network: its arguments, its dry run, and unpacking an archive it already has."""

import hashlib
import subprocess
import zipfile

import pytest

from bench import fetch_peers
from bench.fetch_peers import PEERS, FetchError, Peer, download, main, parse_args, pip_command, select, unpack


def _no_network(*args, **kwargs):
    raise AssertionError(f"the test tried to run {args[0] if args else kwargs}")


@pytest.fixture(autouse=True)
def no_subprocess(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_network)


def test_every_peer_is_pinned_and_fetched_without_dependencies(tmp_path):
    assert [p.name for p in PEERS] == ["vllm", "mamba_ssm", "fla", "vllm-0.10.2", "vllm-0.7.3"]
    for peer in PEERS:
        assert "==" in peer.requirement and len(peer.sha256) == 64
        if peer.url:
            # an sdist pip cannot save without building it: fetched from PyPI's file host, still sha256-checked
            assert peer.url.startswith("https://files.pythonhosted.org/packages/")
            assert peer.url.endswith(peer.archive) and peer.folder.endswith(peer.name.partition("-")[2])
            continue
        command = pip_command(peer, tmp_path)
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        assert command[-2:] == ["--dest", str(tmp_path)]


def test_only_selects_peers_in_their_order_and_refuses_unknown_names(capsys):
    assert [p.name for p in select("fla, vllm")] == ["vllm", "fla"]
    assert select("") == list(PEERS)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--only", "vllm,flash"])
    assert exit_info.value.code == 2
    assert "unknown peer 'flash'" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    dest = tmp_path / "peers"
    assert main(["--dest", str(dest), "--dry-run", "--only", "mamba_ssm"]) == 0
    out = capsys.readouterr().out
    assert "MAMBA_SKIP_CUDA_BUILD=TRUE" in out and "mamba-ssm==2.3.2.post1" in out and "vllm==" not in out
    assert f"{dest}/peer_loader.py" in out
    assert not dest.exists()


def _wheel(path, files: dict[str, bytes]) -> Peer:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    keep = (("toy/ops/*.py", "ops"), ("toy/ops/configs/**", "ops/configs"), ("toy-1.0.dist-info/LICENSE", ""))
    return Peer("toy", "toy==1.0", path.name, hashlib.sha256(path.read_bytes()).hexdigest(), "toy_ops", keep)


def test_unpack_keeps_only_the_matching_files_below_their_pattern(tmp_path):
    archive = tmp_path / "toy-1.0-py3-none-any.whl"
    peer = _wheel(archive, {"toy/ops/scan.py": b"scan", "toy/ops/cpu/scan.py": b"cpu", "toy/model.py": b"model",
                            "toy/ops/configs/a/b.json": b"{}", "toy-1.0.dist-info/LICENSE": b"license"})
    vendor = tmp_path / "vendor"
    (vendor / "toy_ops" / "stale.py").parent.mkdir(parents=True)
    (vendor / "toy_ops" / "stale.py").write_text("from an older fetch")
    assert download(peer, tmp_path) == archive            # already there with the pinned checksum: no pip
    assert unpack(peer, archive, vendor) == 3
    kept = sorted(str(p.relative_to(vendor)) for p in vendor.rglob("*") if p.is_file())
    assert kept == ["toy_ops/LICENSE", "toy_ops/SOURCE.txt", "toy_ops/ops/configs/a/b.json", "toy_ops/ops/scan.py"]
    assert (vendor / "toy_ops" / "ops" / "scan.py").read_bytes() == b"scan"


def test_a_pattern_that_matches_nothing_is_an_error(tmp_path):
    archive = tmp_path / "toy-1.0-py3-none-any.whl"
    peer = _wheel(archive, {"toy/ops/scan.py": b"scan"})
    with pytest.raises(FetchError, match="nothing in toy-1.0-py3-none-any.whl matches 'toy/ops/configs/"):
        unpack(peer, archive, tmp_path / "vendor")


def test_an_archive_with_another_checksum_is_refused(tmp_path, monkeypatch):
    archive = tmp_path / "toy-1.0-py3-none-any.whl"
    peer = _wheel(archive, {"toy/ops/scan.py": b"scan"})
    archive.write_bytes(b"something else")
    monkeypatch.setattr(fetch_peers.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    with pytest.raises(FetchError, match=f"sha256 {hashlib.sha256(b'something else').hexdigest()}, expected"):
        download(peer, tmp_path)
