"""FlexibleArgumentParser (vLLM's `vllm.utils.argparse_utils`), and the flags of a knob dataclass.

Owns reading knobs from text: a field's parser from its type (or its `parse` metadata) and one
--flag per field. Knows nothing of the engine or the server; EngineArgs.add_cli_args and the
server's CLI (api/cli.py) are built from it.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup


def parse_bool(text: str) -> bool:
    """
    >>> parse_bool("yes"), parse_bool("0")
    (True, False)
    """
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false)")


def parser_for(hint: Any) -> Callable[[str], Any]:
    """int, float, str or bool from a field's type (`X | None` counts as X); TypeError otherwise."""
    kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    kind = kinds[0]
    if len(kinds) != 1 or kind not in (int, float, str, bool):
        raise TypeError(f"no text parser for {hint}: give the knob a parse=")
    return parse_bool if kind is bool else kind


def field_parsers(args_class: type) -> dict[str, Callable[[str], Any]]:
    """Each field's text parser: its `parse` metadata, else one from its type."""
    hints = typing.get_type_hints(args_class)
    return {f.name: f.metadata.get("parse") or parser_for(hints[f.name]) for f in fields(args_class)}


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with argparse's error type, so a bad flag says why it is bad."""
    if parse in (int, float, str):
        return parse

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
    return convert


def add_dataclass_args(container: ArgumentContainer, args_class: type) -> ArgumentContainer:
    """One flag per field of `args_class` (`--max-model-len`; booleans `--x/--no-x`), its default the
    field's, so `args_class(**vars(parser.parse_args()))` round-trips. Returns `container`."""
    parsers = field_parsers(args_class)
    for f in fields(args_class):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata.get("help")
        if parsers[f.name] is parse_bool:
            container.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            container.add_argument(flag, type=argparse_type(parsers[f.name]), default=f.default,
                                   metavar=f.name.upper(), help=help_text)
    return container


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse as vLLM's scripts use it: a flag may be spelt with underscores (`--max_model_len 64`
    is `--max-model-len 64`), with its value after `=` or not.

    >>> parser = FlexibleArgumentParser()
    >>> _ = parser.add_argument("--max-model-len", type=int)
    >>> parser.parse_args(["--max_model_len=64"]).max_model_len
    64
    """

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """`--max_model_len=64` -> `--max-model-len=64`; values and short options are left alone."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value
