"""Options shared by every command, and the error boundary that turns errors into exit codes."""

from __future__ import annotations

import gc
import importlib
import inspect
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from typer.core import TyperCommand, TyperGroup, TyperOption

from .._lazy import gc_paused
from ..errors import EXIT_INTERNAL, Int4packError, report_to
from ..output import Output

__all__ = ["JsonOpt", "VerboseOpt", "QuietOpt", "DebugOpt", "ThreadsOpt", "make_output", "error_boundary",
           "library", "own_process", "help_text", "examples", "Command", "Group", "tensor_parallel_line"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout, for scripts.")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True,
                                         help="Show more detail; repeat it for even more.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print errors only.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", "-j", min=1, metavar="N",
    help="How many threads to use (by default one per available core; convert runs at most 16 jobs at once).")]


def tensor_parallel_line(tp) -> str | None:
    """The line inspect and verify print for a packed output stored split for tensor parallel ranks."""
    if not isinstance(tp, int) or tp <= 1:
        return None
    return (f"  tensor parallel: stored for {tp} ranks; serve with --tensor-parallel-size {tp} (the plugin "
            "refuses any other size)")


def _untyped(param) -> None:
    """A flag or a counter takes no value: no <bool>/<int> after it in the help."""
    if isinstance(param, TyperOption) and (param.is_flag or param.count) and param.metavar is None:
        param.metavar = ""


class _FlagsAsFlags:
    """Mixed into typer's command and group: flags shown as flags in --help (typer >= 0.2x prints
    their type)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.params:
            _untyped(p)

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        _untyped(opt)
        return opt


class Command(_FlagsAsFlags, TyperCommand):
    """typer's command, with flags shown as flags in --help."""


class Group(_FlagsAsFlags, TyperGroup):
    """The app's group, with the same flag display as Command."""


_process = {"owned": False}  # True once main() runs: the process is the command's alone


def own_process() -> None:
    """Called by the console script: process-wide settings (GC freeze) are then the CLI's to make."""
    from .._lazy import freeze_after_import

    _process["owned"] = True
    freeze_after_import()  # torch, imported when a command's work starts


def library(name: str):
    """The library function ``int4pack.<name>``, imported when its command runs (so ``--help``
    never imports torch; convert imports it after printing its plan: ``_lazy.py``).

    The GC pauses for the import. When the process is the command's own (the console script, not
    a test calling the app), everything imported then is frozen too: it lives as long as the
    process, and later collections need not scan it (``_lazy.load_torch`` does the same for torch).
    """
    with gc_paused():
        module = importlib.import_module(f"int4pack.{name}")
    if _process["owned"]:
        gc.freeze()
    return getattr(module, name)


def help_text(doc: str) -> str:
    """A docstring as typer's rich help shows it well: each paragraph one line, wrapped by the terminal."""
    return "\n\n".join(" ".join(par.split()) for par in inspect.cleandoc(doc).split("\n\n"))


def examples(*pairs: tuple[str, str]) -> str:
    """A command's epilog: each example a sentence, then the command line, indented."""
    # \b: click keeps the paragraph's lines as they are (a command line is never rewrapped)
    return "\n\n".join(["Examples", *(f"\b\n{what}\n  {cmd}" for what, cmd in pairs)])


def make_output(json_mode: bool, verbose: int, quiet: bool, debug: bool) -> Output:
    return Output(json_mode=json_mode, verbosity=-1 if quiet else verbose, debug=debug)


@contextmanager
def error_boundary(out: Output, interrupted: Callable[[], str] | None = None):
    """Known errors: message + hint, their exit code. Anything else: a bug (traceback with --debug).

    ``interrupted`` says, on Ctrl-C, what the command left behind and how to go on (each command
    knows its own: convert keeps a partial folder, verify and inspect write nothing)."""
    try:
        yield
    except Int4packError as e:
        if out.debug:
            out.err.print(traceback.format_exc())
        out.error(_naming_its_file(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        try:
            what = interrupted() if interrupted else "nothing was written"
        except Exception as e:  # the message must not hide the interrupt
            what = f"({type(e).__name__} while looking at what was left: {e})"
        out.err.print(f"[yellow]interrupted[/yellow]: {what}")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as e:  # a bug: say so plainly
        if out.debug:
            out.err.print(traceback.format_exc())
        err = Int4packError(f"internal error: {type(e).__name__}: {e}",
                            hint=None if out.debug else f"A bug in int4pack: re-run with --debug and send the "
                                                        f"command and its traceback to {report_to()}.")
        out.error(err)
        raise typer.Exit(EXIT_INTERNAL) from None


def _naming_its_file(e: Int4packError) -> Int4packError:
    """Readers often set only ``path`` (e.g. config.json) on config errors: put it in the message."""
    msg = str(e)
    if e.path and Path(e.path).name not in msg:
        e.args = (f"{e.path}: {msg}", *e.args[1:])
    return e
