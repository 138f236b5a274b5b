"""The one output sink: human (rich) or JSON, with progress on stderr.

Data goes to stdout, diagnostics (progress, warnings, errors) to stderr. In JSON mode stdout
carries exactly one JSON object: the command's result, or ``{"ok": false, "error": {...}}``.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from .errors import Int4packError

__all__ = ["Output", "RichProgress", "VerifyProgress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


WARNING_CHARS = 3 * 80 - len("warning: ")  # a warning's three lines at 80 columns
_MORE = " ... (-v: the rest)"


def short_warning(msg: str) -> str:
    """A warning as three lines of 80 columns show it: whole where it fits, else cut after its last
    sentence or clause that fits (``; `` or ``. ``, else ``: ``, else ``, ``, else a word), leaving
    room to say that -v prints the rest."""
    if len(msg) <= WARNING_CHARS:
        return msg
    room = WARNING_CHARS - len(_MORE)
    for seps in (("; ", ". "), (": ",), (", ", " ")):
        cut = max(msg.rfind(sep, 0, room) for sep in seps)
        if cut >= room // 2:
            break
    return msg[:cut if cut > 0 else room].rstrip(" ,;:.") + _MORE


class Output:
    def __init__(self, *, json_mode: bool = False, verbosity: int = 0, debug: bool = False):
        self.json = json_mode
        self.verbosity = verbosity  # -1 quiet, 0 normal, 1+ verbose
        self.debug = debug
        self.out = Console(soft_wrap=True, highlight=False)
        self.err = Console(stderr=True, soft_wrap=True, highlight=False)

    # -- human-only pieces (silent in JSON mode) --------------------------------------
    def text(self, msg: str, *, level: int = 0) -> None:
        if not self.json and self.verbosity >= level:
            self.out.print(msg)

    def table(self, title: str, columns: list[str], rows: list[list], *, level: int = 0) -> None:
        if self.json or self.verbosity < level:
            return
        # no rules, one space between columns, and only the first column (names) may fold: the
        # tables fit an 80-column terminal without breaking a value in two
        t = Table(title=title, title_justify="left", box=None, pad_edge=False, collapse_padding=True,
                  header_style="bold")
        for i, c in enumerate(columns):
            t.add_column(c, no_wrap=i > 0, overflow="fold" if i == 0 else "ellipsis")
        for r in rows:
            t.add_row(*[str(x) for x in r])
        self.out.print(t)

    def warning(self, msg: str) -> None:
        if self.verbosity >= 0:
            self.err.print(f"[yellow]warning:[/yellow] {msg if self.verbosity >= 1 else short_warning(msg)}")

    def info(self, msg: str) -> None:
        if self.verbosity >= 1:
            self.err.print(f"[dim]{msg}[/dim]")

    # -- results and errors ----------------------------------------------------------
    def result(self, data: dict) -> None:
        if self.json:
            sys.stdout.write(json.dumps({"ok": True, **data}, indent=2, sort_keys=True, default=str) + "\n")
            sys.stdout.flush()

    def error(self, err: Int4packError) -> None:
        if self.json:
            sys.stdout.write(json.dumps({"ok": False, "error": err.to_dict()}, indent=2) + "\n")
            sys.stdout.flush()
        self.err.print(f"[bold red]error:[/bold red] {err}", markup=True)
        if err.hint:
            self.err.print(f"[cyan]hint:[/cyan] {err.hint}")

    @contextmanager
    def progress(self, description: str):
        """A RichProgress on stderr, or a silent one in JSON/quiet mode or when stderr is no terminal."""
        show = not self.json and self.verbosity >= 0
        p = RichProgress(description, self.err if show else None)
        try:
            yield p
        finally:
            p.stop()

    @contextmanager
    def verify_progress(self):
        """A VerifyProgress on stderr when it is a terminal; silent in JSON or quiet mode."""
        p = VerifyProgress(self.err if not self.json and self.verbosity >= 0 else None)
        try:
            yield p
        finally:
            p.stop()


class VerifyProgress:
    """Implements verify's progress protocol (phase/start/advance/stop): layers, experts, dense linears
    and the elapsed time, on a terminal only (a log gets the report, not a redrawn bar)."""

    def __init__(self, console: Console | None):
        self.console = console if console is not None and console.is_terminal else None
        self._p: Progress | None = None
        self._task = None
        self.n = {"layers": 0, "experts": 0, "dense": 0}
        self.total = {"layers": 0, "experts": 0, "dense": 0}

    def _open(self, description: str, total: int | None) -> None:
        if self.console is None:
            return
        if self._p is None:
            self._p = Progress(TextColumn("{task.description}"), BarColumn(bar_width=16),
                               TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                               TextColumn("[dim]{task.fields[what]}"), console=self.console, transient=True)
            self._p.start()
            self._task = self._p.add_task(description, total=total, counts="", what="")
        else:
            self._p.update(self._task, description=description, total=total, completed=0)

    def phase(self, what: str) -> None:
        self._open(what, None)

    def start(self, layers: int, experts: int, dense: int) -> None:
        self.total = {"layers": layers, "experts": experts, "dense": dense}
        self._open("verify", experts + dense)
        self._show()

    def advance(self, *, layers: int = 0, experts: int = 0, dense: int = 0, what: str = "") -> None:
        self.n["layers"] += layers
        self.n["experts"] += experts
        self.n["dense"] += dense
        self._show(experts + dense, what)

    def _show(self, step: int = 0, what: str = "") -> None:
        if self._p is None:
            return
        n, t = self.n, self.total
        counts = f"layers {n['layers']}/{t['layers']}  experts {n['experts']}/{t['experts']}"
        if t["dense"]:
            counts += f"  dense {n['dense']}/{t['dense']}"
        fields = {"counts": counts, **({"what": what} if what else {})}
        self._p.update(self._task, advance=step, **fields)

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


class RichProgress:
    """Implements convert's progress protocol (start/advance/stop) with a rich bar."""

    def __init__(self, description: str, console: Console | None):
        self.description = description
        self.console = console
        self._p: Progress | None = None
        self._task = None
        self.tensors_total = 0
        self.tensors_done = 0

    def start(self, total_bytes: int, total_tensors: int, skipped_bytes: int = 0) -> None:
        if self.console is None:
            return
        self.tensors_total = total_tensors
        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._p.start()
        self._task = self._p.add_task(self.description, total=total_bytes, completed=skipped_bytes,
                                      tensors=f"0/{total_tensors} tensors")

    def advance(self, nbytes: int, ntensors: int) -> None:
        if self._p is None:
            return
        self.tensors_done += ntensors
        self._p.update(self._task, advance=nbytes, tensors=f"{self.tensors_done}/{self.tensors_total} tensors")

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None
