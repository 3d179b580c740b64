"""One layer's weights read as the streamed oracle reads them, converted to fp64 on the GPU two ways."""
import sys, time, json
import torch
from reference.checkpoint import LazyWeights
from reference.config import ModelConfig
from reference.model import _converted
path = sys.argv[1]
cfg = ModelConfig.from_json(f"{path}/config.json")
store = LazyWeights(path, cfg)
keys = [k for k in store.keys() if k.startswith("model.layers.5.")]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
def timed(fn):
    out = []
    for _ in range(4):
        sync(); t = time.perf_counter()
        held = {k: fn(store.load(k)) for k in keys}
        sync(); out.append(time.perf_counter() - t)
        nbytes = sum(v.numel() * v.element_size() for v in held.values()); del held
    return out, nbytes
read = []
for _ in range(4):
    t = time.perf_counter(); x = {k: store.load(k) for k in keys}; read.append(time.perf_counter() - t); del x
one, nb = timed(lambda w: w.to(device=dev, dtype=torch.float64))
two, _ = timed(lambda w: _converted(w, dev, torch.float64))
same = all(torch.equal(store.load(k).to(device=dev, dtype=torch.float64), _converted(store.load(k), dev, torch.float64)) for k in keys)
print(json.dumps({"layer": 5, "tensors": len(keys), "fp64_bytes": nb, "read_only_s": read,
                  "to_device_and_dtype_at_once_s": one, "moved_then_converted_s": two, "bit_identical": same}, indent=1))
