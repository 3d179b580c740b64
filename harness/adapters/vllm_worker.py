"""The process that runs vLLM for harness/adapters/vllm.py, inside vLLM's own virtualenv.

Run as a script (`<vllm venv>/bin/python vllm_worker.py`): it imports only the standard library and vllm, never the
harness, whose pins conflict with vLLM's. Protocol: one JSON object per line.

Commands come on stdin, one a line:
- {"cmd": "load", "kwargs": {...}, "env": {...}}: set the environment variables, build `vllm.LLM(**kwargs)`, answer
  {"event": "ready", "vllm_version", "effective": {...}}, where `effective` is the configuration vLLM settled on
  (it may override what was asked: the adapter checks).
- {"cmd": "run", "requests": [{"id", "prompt", "max_new_tokens", "logprobs", "arrival_step"}]} →
  {"event": "result", "results": [{"id", "prompt_logprobs", "output_ids", "output_logprobs"}]}, where each logprobs
  entry is one position's [[token ids], [logprobs]] in rank order (None for the first prompt token).
- {"cmd": "unload"}: free the engine (→ {"event": "unloaded"}), so that the process, with vllm imported once, can
  load the next configuration (importing vLLM is most of its start-up time). {"cmd": "exit"} ends the worker.
- Anything that goes wrong: {"event": "error", "message", "traceback"}; the worker then exits.

The protocol has the original stdout to itself: file descriptor 1 is pointed at stderr before vllm is imported, so
whatever vLLM and its children print lands in the log, which the adapter tails when something fails.
"""

import json
import os
import sys
import traceback

# This script sits beside harness/adapters/vllm.py, which must not shadow the vllm package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

# The protocol channel, taken before anything can print: fd 1 then becomes stderr for everything else.
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def send(message: dict) -> None:
    _PROTOCOL.write(json.dumps(message) + "\n")
    _PROTOCOL.flush()


def position_entries(entry) -> list | None:
    """One position's {token id: Logprob} as [[ids], [logprobs]], ids in rank order."""
    if entry is None:
        return None
    items = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    return [[int(t) for t, _ in items], [float(lp.logprob) for _, lp in items]]


def run_requests(engine, requests: list[dict]) -> list[dict]:
    """Feed the requests to the engine step by step (a request enters at its arrival step) until all finish."""
    from vllm import SamplingParams

    def add(req: dict) -> None:
        # temperature 0: greedy; above 0, sampled with the request's seed. vLLM returns the model's own logprobs
        # of whatever it chose (its default logprobs_mode, raw_logprobs: before temperature).
        sampled = req.get("temperature", 0.0) > 0
        params = SamplingParams(temperature=req.get("temperature", 0.0), seed=req.get("seed") if sampled else None,
                                max_tokens=max(req["max_new_tokens"], 1), logprobs=req["logprobs"],
                                prompt_logprobs=req["logprobs"], detokenize=False, ignore_eos=True)
        engine.add_request(req["id"], {"prompt_token_ids": req["prompt"]}, params)

    pending = sorted(requests, key=lambda r: r["arrival_step"])
    finished: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival_step"] <= step:
            add(pending.pop(0))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
    results = []
    for req in requests:
        output = finished[req["id"]]
        completion = output.outputs[0]
        n = req["max_new_tokens"]
        results.append({
            "id": req["id"],
            "prompt_logprobs": [position_entries(e) for e in output.prompt_logprobs],
            "output_ids": [int(t) for t in completion.token_ids[:n]],
            "output_logprobs": [position_entries(e) for e in (completion.logprobs or [])[:n]],
        })
    return results


def effective_config(llm) -> dict:
    """What vLLM settled on for the knobs the adapter checks (it may override what was asked)."""
    config = llm.llm_engine.vllm_config
    return {
        "architecture": config.model_config.architecture,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "mamba_ssm_cache_dtype": config.cache_config.mamba_ssm_cache_dtype,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "long_prefill_token_threshold": config.scheduler_config.long_prefill_token_threshold,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "enforce_eager": config.model_config.enforce_eager,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size,
        "device": str(config.device_config.device_type),
    }


def unload(llm) -> None:
    """Free the engine so that the next `load` starts from a clean distributed state."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def main() -> None:
    llm = None
    try:
        import vllm
        from vllm import LLM

        for line in sys.stdin:
            command = json.loads(line)
            cmd = command["cmd"]
            if cmd == "exit":
                break
            if cmd == "load":
                if llm is not None:
                    raise RuntimeError("load: an engine is already loaded (unload it first)")
                os.environ.update(command.get("env", {}))
                llm = LLM(**command["kwargs"])
                send({"event": "ready", "vllm_version": vllm.__version__, "effective": effective_config(llm)})
            elif cmd == "unload":
                if llm is not None:
                    unload(llm)
                    llm = None
                send({"event": "unloaded"})
            elif cmd == "run":
                if llm is None:
                    raise RuntimeError("run: no engine loaded")
                send({"event": "result", "results": run_requests(llm.llm_engine, command["requests"])})
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except BaseException as err:  # noqa: BLE001 - every failure must reach the adapter as a message
        send({"event": "error", "message": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        raise


if __name__ == "__main__":
    main()
