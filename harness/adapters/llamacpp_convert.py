"""Runs llama.cpp's own converter (convert_hf_to_gguf.py, from the llama-cpp-python sdist the engine was built from)
on a Hugging Face checkpoint, inside the llama.cpp virtualenv, for harness/adapters/llamacpp.py.

    <llama.cpp venv>/bin/python llamacpp_convert.py LLAMA_CPP_DIR CHECKPOINT OUTFILE OUTTYPE
        [--pre-tokenizer NAME] [--patch FILE [--patch-arg KEY=VALUE ...]]

Without options this is exactly `python LLAMA_CPP_DIR/convert_hf_to_gguf.py CHECKPOINT --outfile OUTFILE --outtype
OUTTYPE`: the converter is part of the system under test, so nothing of ours touches what it writes. Two opt-ins:

- --pre-tokenizer NAME: where the converter refuses a tokenizer whose pre-tokenizer it does not recognise (it knows
  tokenizers by the hash of how they split a test string, so every tokenizer trained for a small model is unknown),
  the name to write instead (llama.cpp's documented way out: name the pre-tokenizer the model's is like, e.g.
  "gpt-2"). Only the tokenizer's metadata changes: token ids, and so every logprob the harness judges, do not
  depend on it. A recognised tokenizer keeps its own name.
- --patch FILE[::FUNCTION]: a Python file defining `apply(conversion, **patch_args)` (or FUNCTION), called with the
  converter's `conversion` package after it is imported and before the converter runs: a finding's proof of cause
  (findings/llamacpp_*.py), applied only in that finding's test.

The converter prints its log to stderr; its exit status is this script's.
"""

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_cpp_dir", type=Path)
    parser.add_argument("checkpoint")
    parser.add_argument("outfile")
    parser.add_argument("outtype")
    parser.add_argument("--pre-tokenizer")
    parser.add_argument("--patch")
    parser.add_argument("--patch-arg", action="append", default=[])
    args = parser.parse_args()

    script = args.llama_cpp_dir / "convert_hf_to_gguf.py"
    # As when the converter is run as a script: its folder first on sys.path (it finds its `conversion` package and
    # its built-in vocabularies, models/ggml-vocab-*.gguf, through sys.path[0]).
    sys.path[0] = str(args.llama_cpp_dir)
    sys.path.insert(1, str(args.llama_cpp_dir / "gguf-py"))
    import conversion

    if args.pre_tokenizer:
        base = conversion.TextModel
        recognised = base.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer, _recognised=recognised, _name=args.pre_tokenizer):
            try:
                return _recognised(self, tokenizer)
            except NotImplementedError:
                print(f"llamacpp_convert: pre-tokenizer not recognised; writing {_name!r} (--pre-tokenizer)",
                      file=sys.stderr)
                return _name

        base.get_vocab_base_pre = get_vocab_base_pre
    if args.patch:
        path, _, function = str(args.patch).partition("::")
        spec = importlib.util.spec_from_file_location("finding_patch", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        getattr(module, function or "apply")(conversion, **dict(pair.split("=", 1) for pair in args.patch_arg))
    sys.argv = [str(script), args.checkpoint, "--outfile", args.outfile, "--outtype", args.outtype]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
