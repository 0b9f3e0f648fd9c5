"""Command line: ``python -m dsv4_jax {generate,convert} ...``.

Nothing here imports JAX before a command runs, so ``--help`` answers at once; the converter's
arguments (``dsv4_jax.checkpoints`` imports JAX) are read only for ``convert``.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m dsv4_jax",
                                     description="DeepSeek-V4 inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    from dsv4_jax import cli_chat, cli_generate
    generate_parser = sub.add_parser(
        "generate", help="generate text (default: the embedded tiny model, no download)")
    cli_generate.add_arguments(generate_parser)
    cli_chat.add_arguments(generate_parser)
    convert_parser = sub.add_parser(
        "convert", help="write an orbax checkpoint from an official HF directory")
    convert, convert_error = None, None
    if argv[:1] == ["convert"]:
        try:
            from dsv4_jax.checkpoints import convert
            convert.add_arguments(convert_parser)
        except ImportError as e:        # keep `generate` usable if the loader cannot import
            convert_error = e
    args = parser.parse_args(argv)
    if args.command == "generate":
        return (cli_chat.main if cli_chat.wants_chat(args) else cli_generate.main)(args)
    if convert is None:
        print(f"error: the checkpoint converter is unavailable: {convert_error}", file=sys.stderr)
        return 2
    return convert.main(args)


if __name__ == "__main__":
    sys.exit(main())
