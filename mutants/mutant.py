"""One mutant: a header (bug class, the public bug it reproduces, the tests expected to catch it) and structured
edits against the tree, each an exact anchor text that must occur exactly once in its file and its replacement.

Anchors, not line numbers, so a mutant survives unrelated edits to the file, and an edit that no longer applies
fails loudly instead of planting something else. File format (TOML; ''' strings keep the code verbatim):

    class = "conv state read from the previous tenant"      # a class of docs/bug-classes.md, or "classic: ..."
    bug = "one line: what the public engine got wrong"
    selection = ["tests/kernels/test_causal_conv1d.py::test_one_sequence"]   # run in this order with -x
    gpu = false                                              # true: needs CUDA (make mutants-gpu)
    ci = false                                               # true: one of the fast subset run by .ci/run
    engine = "llamacpp"                                      # an opt-in engine its tests need (run with --engine)
    ops = "vllm"                                             # a peer's kernels (tests/kernels --ops; run with --ops):
                                                             # its edits are to the peer's vendored copy in .peers

    [[edit]]
    file = "vendored/ops/causal_conv1d_kernels.py"
    anchor = '''...exact text...'''
    replacement = '''...'''
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFS = Path(__file__).resolve().parent / "defs"
_KEYS = {"class", "bug", "selection", "gpu", "ci", "engine", "ops", "edit"}
_EDIT_KEYS = {"file", "anchor", "replacement"}


class MutantError(ValueError):
    """A mutant file that is malformed, or an edit that does not apply to the tree."""


@dataclass(frozen=True)
class Edit:
    file: str                   # relative to the tree's root
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Mutant:
    name: str                   # the file's stem, e.g. "ssd-initial-state-first-sequence-only"
    bug_class: str
    bug: str
    selection: tuple[str, ...]  # pytest node ids, run in this order
    edits: tuple[Edit, ...]
    gpu: bool = False
    ci: bool = False
    engine: str | None = None   # an opt-in engine (Engine.opt_in) whose pytest cases the selection is: --engine
    ops: str | None = None      # a peer whose vendored kernels (.peers) the edits and the selection (--ops) are for

    @classmethod
    def load(cls, path: Path) -> "Mutant":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise MutantError(f"{path.name}: not valid TOML: {err}") from err
        unknown = set(data) - _KEYS
        missing = {"class", "bug", "selection", "edit"} - set(data)
        if unknown or missing:
            raise MutantError(f"{path.name}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        if not data["selection"] or not all(isinstance(s, str) and s.startswith("tests/") for s in data["selection"]):
            raise MutantError(f"{path.name}: selection: expected a non-empty list of node ids under tests/, "
                              f"got {data['selection']!r}")
        edits = []
        for i, e in enumerate(data["edit"]):
            if set(e) != _EDIT_KEYS:
                raise MutantError(f"{path.name}: edit {i}: expected keys {sorted(_EDIT_KEYS)}, got {sorted(e)}")
            if e["anchor"] == e["replacement"]:
                raise MutantError(f"{path.name}: edit {i}: the replacement equals the anchor (no mutation)")
            edits.append(Edit(e["file"], e["anchor"], e["replacement"]))
        return cls(path.stem, data["class"], data["bug"], tuple(data["selection"]), tuple(edits),
                   bool(data.get("gpu", False)), bool(data.get("ci", False)), data.get("engine"), data.get("ops"))

    def mutated_sources(self, root: Path) -> dict[str, str]:
        """The new text of every file the mutant edits, from the files under `root` (nothing is written).
        Raises MutantError when an anchor occurs other than exactly once, or a Python file no longer compiles."""
        texts: dict[str, str] = {}
        for i, edit in enumerate(self.edits):
            if edit.file not in texts:
                path = root / edit.file
                if not path.is_file():
                    raise MutantError(f"{self.name}: edit {i}: {edit.file} does not exist")
                texts[edit.file] = path.read_text()
            count = texts[edit.file].count(edit.anchor)
            if count != 1:
                raise MutantError(f"{self.name}: edit {i}: anchor occurs {count} times in {edit.file}, expected "
                                  f"exactly once: {edit.anchor.strip().splitlines()[0][:80]!r}")
            texts[edit.file] = texts[edit.file].replace(edit.anchor, edit.replacement)
        for file, text in texts.items():
            if file.endswith(".py"):
                try:
                    compile(text, file, "exec")
                except SyntaxError as err:
                    raise MutantError(f"{self.name}: {file} does not compile after the edits: {err}") from err
        return texts

    def apply(self, root: Path) -> None:
        """Write the mutated files into the tree at `root` (a scratch copy: never the working tree)."""
        for file, text in self.mutated_sources(root).items():
            (root / file).write_text(text)


def load_all(directory: Path = DEFS) -> list[Mutant]:
    """Every mutant under `directory`, by name."""
    mutants = [Mutant.load(p) for p in sorted(directory.glob("*.toml"))]
    if not mutants:
        raise MutantError(f"{directory}: no mutants (*.toml)")
    return mutants
