"""The ``int4pack`` command line: a typer app whose commands each call one library function."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .._version import __version__
from ._common import Command, Group, help_text, own_process
from .convert import EXAMPLES as CONVERT_EXAMPLES
from .convert import convert_cmd
from .inspect import EXAMPLES as INSPECT_EXAMPLES
from .inspect import inspect_cmd
from .verify import EXAMPLES as VERIFY_EXAMPLES
from .verify import verify_cmd

__all__ = ["app", "main"]

app = typer.Typer(
    name="int4pack",
    help="Convert MoE checkpoints (GPTQ, AWQ, AutoRound, compressed-tensors, GGUF, MLX, FP8, FP4, bf16) "
         "into the W4A8 layout that Arm CPUs run fast (KleidiAI, vLLM's CPU W4A8 MoE backend).",
    epilog="Exit codes: 0 ok, 1 internal error (a bug), 2 usage error, 3 bad input, 4 refused layout, "
           "5 output problem, 6 verification failed, 130 interrupted. Run int4pack COMMAND --help for a "
           "command's options and examples.",
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: options and their text wrap at the terminal's width, no boxed panels
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 160},
    cls=Group,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"int4pack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """int4pack: convert, verify and inspect int4 MoE checkpoints."""


for _name, _cmd, _examples in (("convert", convert_cmd, CONVERT_EXAMPLES), ("verify", verify_cmd, VERIFY_EXAMPLES),
                                ("inspect", inspect_cmd, INSPECT_EXAMPLES)):
    app.command(_name, help=help_text(_cmd.__doc__), epilog=_examples, no_args_is_help=True, cls=Command)(_cmd)


def main() -> None:
    """The console script (and ``python -m int4pack``): the process is the command's own."""
    own_process()
    app()
