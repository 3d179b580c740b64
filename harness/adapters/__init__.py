"""The registry of engines. Adapters are imported lazily: an engine whose module or dependencies are missing is
listed as unavailable with the reason, and only `get_engine` of that very engine fails."""

from __future__ import annotations

import importlib
import importlib.util

from ..engine import Engine

# name -> (module, class). vendored and vllm adapters land with their own issues; until their modules exist they
# are listed as unavailable.
_ADAPTERS: dict[str, tuple[str, str]] = {
    "reference": ("harness.adapters.reference", "ReferenceEngine"),
    "transformers": ("harness.adapters.transformers", "TransformersEngine"),
    "vendored": ("harness.adapters.vendored", "VendoredEngine"),
    "vllm": ("harness.adapters.vllm", "VllmEngine"),
    "server": ("harness.adapters.server", "ServerEngine"),
    "llamacpp": ("harness.adapters.llamacpp", "LlamaCppEngine"),
}


class UnknownEngine(ValueError):
    """A name that is not in the registry."""


class EngineUnavailable(RuntimeError):
    """A registered engine whose adapter or dependencies cannot be imported here."""


def engine_names() -> list[str]:
    return list(_ADAPTERS)


def _load(name: str) -> type[Engine] | str:
    """The engine class, or the reason it cannot be loaded."""
    module_name, class_name = _ADAPTERS[name]
    if importlib.util.find_spec(module_name) is None:
        return f"not implemented yet: {module_name.replace('.', '/')}.py does not exist"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return f"cannot import {module_name}: {err}"
    return getattr(module, class_name)


def available_engines() -> dict[str, str | None]:
    """Every registered engine -> None if it can be used here, else the reason it cannot."""
    out = {}
    for name in _ADAPTERS:
        loaded = _load(name)
        out[name] = loaded if isinstance(loaded, str) else loaded.dependency_problem()
    return out


def get_engine(name: str) -> type[Engine]:
    """The engine class registered as `name`; UnknownEngine or EngineUnavailable (with the reason) otherwise."""
    if name not in _ADAPTERS:
        raise UnknownEngine(f"unknown engine {name!r}: expected one of {', '.join(_ADAPTERS)}")
    loaded = _load(name)
    if isinstance(loaded, str):
        raise EngineUnavailable(f"engine {name!r} is unavailable: {loaded}")
    problem = loaded.dependency_problem()
    if problem:
        raise EngineUnavailable(f"engine {name!r} is unavailable: {problem}")
    return loaded
