"""A checkpoint that differs from another only in config.json fields, without copying its weights.

A finding's cause is shown by changing one thing and watching the disagreement go: the oracle given the field value
an engine computes with (partial_rotary_factor 1 where the engine rotates the whole head), or the engine given the
checkpoint in another spelling (layer_types as Granite 4.0-H is published). `variant_checkpoint` writes such a
directory: every file of the source linked, config.json rewritten.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any


def variant_checkpoint(src: str | Path, dst: str | Path | None = None, **fields: Any) -> Path:
    """`src` with `fields` set in its config.json (None removes a field) in `dst` (default: a new temporary
    directory). A field that config.json also holds inside rope_parameters (partial_rotary_factor, rope_theta) is set
    there too, so that no reader of either place sees the old value. Returns the directory."""
    src = Path(src).resolve()
    dst = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix=f"{src.name}-variant-"))
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    unknown_rope = {k for k in fields if k in (config.get("rope_parameters") or {})}
    for key, value in fields.items():
        for holder in [config] + ([config["rope_parameters"]] if key in unknown_rope else []):
            if value is None:
                holder.pop(key, None)
            else:
                holder[key] = value
    for path in src.iterdir():
        if path.name != "config.json" and not (dst / path.name).exists():
            (dst / path.name).symlink_to(path)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst
