"""Reproduce a finding against the peers' kernels (tests/kernels/peer_findings.py) by running the tests it pins, not
as expected failures: exit status 1 while the finding holds. `make fetch-peers` first.

    .venv/bin/python findings/vllm_kernels.py KEY          # e.g. vllm-0.7.3-16bit-chunk-states
    .venv/bin/python findings/vllm_kernels.py --list
    python3 findings/vllm_kernels.py vllm-fp32-scan-tf32-dots   # a finding that shows on a CUDA device only
"""

import fnmatch
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from tests.kernels.peer_findings import FINDINGS
    by_key = {f.key: f for f in FINDINGS}
    if not argv or argv[0] == "--list" or argv[0] not in by_key:
        for f in FINDINGS:
            print(f"{f.key}: {', '.join(f.providers)}: {f.number}")
        return 0 if argv[:1] == ["--list"] else 2
    finding = by_key[argv[0]]
    import torch
    patterns = finding.patterns(cuda=torch.cuda.is_available())
    if not patterns:
        print(f"{finding.key}: shows on a CUDA device only ({', '.join(finding.cuda_tests)})")
        return 2
    held = False
    for provider in finding.providers:
        ids = [p.replace("[[]", "[").replace("[]]", "]") for p in patterns]
        selection = " or ".join(i.split("::")[1].split("[")[0] for i in ids)
        files = sorted({i.split("::")[0] for i in ids})
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--runxfail",
                               *files, "--ops", provider, "-k", selection],
                              cwd=ROOT, capture_output=True, text=True)
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")
                  and any(fnmatch.fnmatchcase(line.split()[1], p) for p in patterns)]
        print(f"{provider}: {len(failed)} of the pinned tests fail")
        for line in failed:
            print("  " + line[:220])
        held |= bool(failed)
    print(f"{finding.key}: {finding.number}; {finding.cause}")
    return 1 if held else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
