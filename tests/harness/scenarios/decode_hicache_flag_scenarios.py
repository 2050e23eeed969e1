"""Server-argument resolution of PD decode HiCache command lines, for tests.

``resolve_command_lines`` is run by ``harness.compare`` against pristine
upstream and the patched tree: each command line is parsed through upstream's
argparse path (``ServerArgs.add_cli_args`` + ``from_cli_args``) and resolved by
the full resolution pipeline (``ServerArgs.resolve_once``) on CPU, with a tiny
local model config so that the pipeline does not stop at the dummy-model return
(``write_model_config``). Each case yields every resolved field and the
declarations that resolution recorded, or the error it raised.
"""

from __future__ import annotations

import json
from pathlib import Path

# A two-layer Llama: enough for model-config-dependent resolution, no weights.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


def write_model_config(directory) -> str:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _plain(value):
    """A picklable, comparable form of a resolved value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"{type(value).__name__}:{value!r}"


def resolve_command_line(argv: list[str]) -> dict:
    import argparse

    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        server_args.resolve_once()
    except Exception as exc:  # the error is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    view = resolved_view(server_args)
    return {
        "fields": {
            f.name: _plain(getattr(view, f.name))
            for f in record_fields(type(server_args))
        },
        "declarations": [
            [source, _plain(declared)]
            for source, declared in server_args._resolved_overrides
        ],
    }


def resolve_command_lines(rank, world_size, *, model_dir, cases):
    """``{name: resolve_command_line(["--model-path", model_dir, "--device",
    "cpu", *argv])}`` for each ``name: argv`` of ``cases``."""
    import sglang

    out = {"sglang": {"version": sglang.__version__, "file": sglang.__file__}}
    out["cases"] = {
        name: resolve_command_line(
            ["--model-path", model_dir, "--device", "cpu", *argv]
        )
        for name, argv in cases.items()
    }
    return out
