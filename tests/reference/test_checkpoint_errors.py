"""A truncated or corrupt safetensors file is reported with its path, by the oracle's loader and by the engine's.

safetensors' own message ("Error while deserializing header: incomplete metadata, file not fully covered") does
not say which file it read: with a sharded checkpoint the broken shard would be left to guess.
"""

from __future__ import annotations

import json
import shutil

import pytest

from reference.checkpoint import CheckpointError, read_safetensors
from tests.helpers import random_bamba_checkpoint
from vendored.engine.weights import LoadError, read_tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("ckpt-errors"), seed=4)


def _damaged(checkpoint, tmp_path, damage: str):
    """A copy of the checkpoint whose model.safetensors is truncated (the last 100 bytes gone, or all but the first
    4 bytes of its header length) or overwritten with bytes that are no safetensors at all."""
    copy = tmp_path / "damaged"
    shutil.copytree(checkpoint, copy)
    file = copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated-data": data[:-100], "truncated-header": data[:4],
                      "garbage": b"not a safetensors file " * 10}[damage])
    return copy, file


DAMAGES = ["truncated-data", "truncated-header", "garbage"]
READERS = {"reference": (read_safetensors, CheckpointError), "vendored": (read_tensors, LoadError)}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_damaged_file_is_named(reader, damage, checkpoint, tmp_path):
    read, error = READERS[reader]
    copy, file = _damaged(checkpoint, tmp_path, damage)
    with pytest.raises(error) as caught:
        read(copy)
    assert str(file) in str(caught.value)
    assert "truncated or corrupt" in str(caught.value)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_the_damaged_shard_of_a_sharded_checkpoint_is_named(reader, checkpoint, tmp_path):
    """Two shards, the second truncated: the message names that one."""
    from safetensors.torch import save_file

    read, error = READERS[reader]
    tensors = read_safetensors(checkpoint)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    broken = tmp_path / "model-00002-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:-10])
    with pytest.raises(error, match="model-00002-of-00002.safetensors: cannot read it as safetensors"):
        read(tmp_path)


def test_the_engine_error_names_the_file(checkpoint, tmp_path):
    from vendored.engine import EngineError, LLMEngine

    copy, file = _damaged(checkpoint, tmp_path, "truncated-data")
    with pytest.raises(EngineError, match=f"{file}: cannot read it as safetensors"):
        LLMEngine(copy)
