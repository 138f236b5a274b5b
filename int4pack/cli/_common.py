"""Options shared by every command, and the error boundary that turns errors into exit codes."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from ..errors import EXIT_INTERNAL, Int4packError
from ..output import Output

__all__ = ["JsonOpt", "VerboseOpt", "QuietOpt", "DebugOpt", "ThreadsOpt", "make_output", "error_boundary"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (for machines).")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More detail (repeatable).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", "-j", min=1,
                                                help="Worker threads (default: up to 4, the cores available).")]


def make_output(json_mode: bool, verbose: int, quiet: bool, debug: bool) -> Output:
    return Output(json_mode=json_mode, verbosity=-1 if quiet else verbose, debug=debug)


@contextmanager
def error_boundary(out: Output):
    """Known errors: message + hint, their exit code. Anything else: a bug (traceback with --debug)."""
    try:
        yield
    except Int4packError as e:
        if out.debug:
            out.err.print(traceback.format_exc())
        out.error(_naming_its_file(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        out.err.print("[yellow]interrupted[/yellow]: nothing that looks complete was left; "
                      "re-run with --resume to continue")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as e:  # a bug: say so plainly
        if out.debug:
            out.err.print(traceback.format_exc())
        err = Int4packError(f"internal error: {type(e).__name__}: {e}",
                            hint=None if out.debug else "Re-run with --debug for the traceback, and please report it.")
        out.error(err)
        raise typer.Exit(EXIT_INTERNAL) from None


def _naming_its_file(e: Int4packError) -> Int4packError:
    """Readers often set only ``path`` (e.g. config.json) on config errors: put it in the message."""
    msg = str(e)
    if e.path and Path(e.path).name not in msg:
        e.args = (f"{e.path}: {msg}", *e.args[1:])
    return e
