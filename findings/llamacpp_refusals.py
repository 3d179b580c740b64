"""Findings: checkpoints llama.cpp cannot run at all (llama-cpp-python 0.3.36, llama.cpp 0c1e57098).

Each line of harness/llamacpp_cases.REFUSALS is a checkpoint (a bundled tiny model, or a config-zoo entry as
transformers saves it) and what llama.cpp says: its converter refuses it (the pre-tokenizer of a model's own
tokenizer, mamba_d_head 'auto', a Bamba without attention layers), converts it into a file its loader refuses (a
head_dim other than hidden / heads, bias tensors, a dense GraniteMoeHybrid, a vocabulary padded only in the token
list, transformers 5's layer names), or converts it and then dies loading it (conv width 2: SIGSEGV; an expansion
other than 2: GGML_ASSERT abort). docs/llamacpp.md has the table with causes.

Reproduce (make llamacpp-venv; prints each refusal, exit status 1 while any still holds):

    .venv/bin/python findings/llamacpp_refusals.py
"""

import re
import sys
import tempfile
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import REFUSALS, refusal

    root, held = Path(tempfile.mkdtemp()), 0
    for case in REFUSALS:
        said = refusal(case.checkpoint(root), **dict(case.engine_args))
        matches = bool(said and re.search(case.says, said))
        held += matches
        print(f"{case.finding:20s} {case.about}: {'REFUSED' if matches else 'runs' if said is None else 'OTHER'}"
              f"\n    {said.splitlines()[0][:300] if said else ''}")
    return 1 if held else 0


if __name__ == "__main__":
    sys.exit(main())
