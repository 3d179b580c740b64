"""The process that runs llama.cpp for harness/adapters/llamacpp.py, inside its own virtualenv (.venv-llamacpp).

Run as a script (`<llama.cpp venv>/bin/python llamacpp_worker.py`): it imports only the standard library, numpy and
llama_cpp (llama-cpp-python's ctypes binding of llama.h), never the harness. Protocol: one JSON object per line.

Commands come on stdin, one a line:
- {"cmd": "load", "gguf": PATH, "context": {...}}: load the GGUF and make a context whose llama_context_params take
  the given fields (n_ctx, n_batch, n_ubatch, n_seq_max, n_threads, flash_attn, type_k, type_v); answer
  {"event": "ready", "effective": {...}} with what the context settled on (llama_n_ctx, llama_n_batch, ...) and the
  model's vocabulary size.
- {"cmd": "run", "requests": [{"prompt", "max_new_tokens", "slot"}], "steps": [[[request, start, stop], ...], ...],
  "roundtrip": bool}: execute the step plan. Each step is one llama_batch holding, for every piece, the tokens at
  positions start..stop-1 of its request (prompt, then the tokens generated so far) in sequence `slot`, with a
  logits row asked for every token, and one llama_decode call. A piece that starts at 0 starts the sequence afresh:
  whatever the slot held (an earlier tenant, or the request itself before it was preempted) is removed first. A
  piece that ends on the request's last known token yields its next token: the most likely one, the lowest id among
  equals. With "roundtrip", after every step each sequence that goes on is saved with llama_state_seq_get_data,
  removed, and restored with llama_state_seq_set_data (a server's swap of a slot to host memory and back).
  Answer {"event": "result", "results": [{"output_ids", "logits"}]}: logits are the rows of positions
  0..T+n-2 (row i predicts the token at position i+1), float32, base64, row after row.
- {"cmd": "exit"} ends the worker. Anything that goes wrong: {"event": "error", "message", "traceback"}; the worker
  then exits.

The protocol has the original stdout to itself: file descriptor 1 is pointed at stderr before llama_cpp is imported,
so whatever llama.cpp prints lands in the log, which the adapter tails when something fails.
"""

import base64
import ctypes
import json
import os
import sys
import traceback

# This script sits beside harness/adapters/llamacpp.py, which must not shadow anything it imports.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402

import llama_cpp as ll  # noqa: E402

FLASH_ATTN = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}
CACHE_TYPES = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16}


def send(message: dict) -> None:
    _PROTOCOL.write(json.dumps(message) + "\n")
    _PROTOCOL.flush()


class Session:
    """One model and one context."""

    def __init__(self, gguf: str, context: dict) -> None:
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file({gguf}) failed (the log says why)")
        cparams = ll.llama_context_default_params()
        for key in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            setattr(cparams, key, int(context[key]))
        cparams.n_threads = cparams.n_threads_batch = int(context["n_threads"])
        cparams.flash_attn_type = FLASH_ATTN[context["flash_attn"]]
        cparams.type_k = CACHE_TYPES[context["type_k"]]
        cparams.type_v = CACHE_TYPES[context["type_v"]]
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed (the log says why)")
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.n_batch = ll.llama_n_batch(self.ctx)
        self.n_seq_max = int(context["n_seq_max"])
        self.batch = ll.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        self.effective = {"n_ctx": ll.llama_n_ctx(self.ctx), "n_batch": self.n_batch,
                          "n_ubatch": ll.llama_n_ubatch(self.ctx), "n_seq_max": ll.llama_n_seq_max(self.ctx),
                          "n_vocab": self.n_vocab, "system_info": ll.llama_print_system_info().decode()}

    def decode(self, entries: list) -> np.ndarray:
        """One llama_decode of (token, position, slot) entries, a logits row for each: (len(entries), V) float32."""
        if len(entries) > self.n_batch:
            raise RuntimeError(f"a step of {len(entries)} tokens exceeds n_batch = {self.n_batch}")
        batch = self.batch
        for i, (token, pos, slot) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = 1
        batch.n_tokens = len(entries)
        status = ll.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} on a batch of {len(entries)} tokens")
        logits = ll.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(logits, shape=(len(entries), self.n_vocab)).copy()

    def roundtrip(self, slot: int) -> None:
        """Save sequence `slot`'s state, remove the sequence, and restore it from the saved bytes."""
        size = ll.llama_state_seq_get_size(self.ctx, slot)
        buffer = (ctypes.c_uint8 * size)()
        written = ll.llama_state_seq_get_data(self.ctx, buffer, size, slot)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes for sequence {slot}")
        ll.llama_memory_seq_rm(self.memory, slot, -1, -1)
        read = ll.llama_state_seq_set_data(self.ctx, buffer, size, slot)
        if read != size:
            raise RuntimeError(f"llama_state_seq_set_data read {read} of {size} bytes for sequence {slot}")

    def run(self, requests: list[dict], steps: list, roundtrip: bool) -> list[dict]:
        tokens = [list(r["prompt"]) for r in requests]
        rows: list[dict[int, np.ndarray]] = [{} for _ in requests]
        generated = [0] * len(requests)
        for step in steps:
            entries, owners = [], []
            for request, start, stop in step:
                slot = requests[request]["slot"]
                if start == 0:
                    ll.llama_memory_seq_rm(self.memory, slot, -1, -1)
                for pos in range(start, stop):
                    entries.append((tokens[request][pos], pos, slot))
                    owners.append((request, pos))
            logits = self.decode(entries)
            for (request, pos), row in zip(owners, logits):
                rows[request][pos] = row
            for request, start, stop in step:
                req = requests[request]
                if stop == len(tokens[request]) and generated[request] < req["max_new_tokens"]:
                    row = rows[request][stop - 1]
                    tokens[request].append(int(np.flatnonzero(row == row.max())[0]))
                    generated[request] += 1
                if roundtrip and stop < len(req["prompt"]) + req["max_new_tokens"] - 1:
                    self.roundtrip(req["slot"])
        out = []
        for request, req in enumerate(requests):
            n_rows = len(req["prompt"]) - 1 + req["max_new_tokens"]
            missing = [p for p in range(n_rows) if p not in rows[request]]
            if missing:
                raise RuntimeError(f"request {request}: the plan computed no row for positions {missing[:4]}")
            matrix = np.stack([rows[request][p] for p in range(n_rows)]) if n_rows else \
                np.zeros((0, self.n_vocab), np.float32)
            out.append({"output_ids": tokens[request][len(req["prompt"]):],
                        "logits": base64.b64encode(matrix.astype(np.float32).tobytes()).decode()})
        return out


def main() -> None:
    session = None
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        try:
            if message["cmd"] == "load":
                session = Session(message["gguf"], message["context"])
                send({"event": "ready", "effective": session.effective})
            elif message["cmd"] == "run":
                send({"event": "result", "results": session.run(message["requests"], message["steps"],
                                                                bool(message.get("roundtrip")))})
            elif message["cmd"] == "exit":
                return
            else:
                raise ValueError(f"unknown command {message['cmd']!r}")
        except Exception as err:  # noqa: BLE001 - every failure goes back to the adapter with its traceback
            send({"event": "error", "message": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
            return


if __name__ == "__main__":
    main()
