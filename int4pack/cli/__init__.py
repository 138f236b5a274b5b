"""The ``int4pack`` command line: a typer app whose commands each call one library function."""

from __future__ import annotations

import gc
from typing import Annotated, Optional

import typer

from .._version import __version__
from .convert import EXAMPLES as CONVERT_EXAMPLES
from .convert import convert_cmd
from .inspect import EXAMPLES as INSPECT_EXAMPLES
from .inspect import inspect_cmd
from .verify import EXAMPLES as VERIFY_EXAMPLES
from .verify import verify_cmd

__all__ = ["app", "main"]

app = typer.Typer(
    name="int4pack",
    help="Convert int4 MoE checkpoints (GPTQ, AWQ, compressed-tensors) into the W4A8 layout that "
         "Arm CPUs run fast (KleidiAI, vLLM's CPU W4A8 MoE backend).",
    epilog="Exit codes: 0 ok, 1 internal error (a bug), 2 usage, 3 bad input, 4 refused layout, "
           "5 output problem, 6 verification failed, 130 interrupted.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
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


app.command("convert", epilog=CONVERT_EXAMPLES, no_args_is_help=True)(convert_cmd)
app.command("verify", epilog=VERIFY_EXAMPLES, no_args_is_help=True)(verify_cmd)
app.command("inspect", epilog=INSPECT_EXAMPLES, no_args_is_help=True)(inspect_cmd)


def main() -> None:
    # everything imported so far lives as long as the process: later collections need not scan it
    gc.freeze()
    app()
