"""The tool's own error type and its exit codes.

Every failure a user can cause (bad input, refused layout, existing output) raises
``Int4packError`` with a message that names the file or tensor and a hint that says
what to do. The CLI prints it without a traceback (unless ``--debug``) and exits
with ``exit_code``.
"""

from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_INTERNAL",
    "EXIT_USAGE",
    "EXIT_INPUT",
    "EXIT_REFUSED",
    "EXIT_OUTPUT",
    "EXIT_VERIFY",
    "Int4packError",
    "InputError",
    "RefusedError",
    "OutputError",
    "VerifyFailed",
    "report_to",
    "SourceBytesVanished",
]

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug in int4pack: report_to() says where
EXIT_USAGE = 2  # bad command line (typer uses 2 as well)
EXIT_INPUT = 3  # the source checkpoint is unreadable or malformed
EXIT_REFUSED = 4  # the source is well formed but a layout we will not convert
EXIT_OUTPUT = 5  # the output cannot be written (exists, disk full, inside source)
EXIT_VERIFY = 6  # verify found a layer outside its tolerance


class Int4packError(Exception):
    """Base error: ``str(err)`` is the one-line message, ``hint`` what to do."""

    exit_code = EXIT_INTERNAL
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None, path: str | None = None,
                 tensor: str | None = None):
        super().__init__(message)
        self.hint = hint
        self.path = path
        self.tensor = tensor

    def to_dict(self) -> dict:
        return {
            "error": self.kind,
            "message": str(self),
            "hint": self.hint,
            "path": self.path,
            "tensor": self.tensor,
            "exit_code": self.exit_code,
        }


class UsageError(Int4packError):
    exit_code = EXIT_USAGE
    kind = "usage"


class InputError(Int4packError):
    exit_code = EXIT_INPUT
    kind = "input"


class RefusedError(Int4packError):
    exit_code = EXIT_REFUSED
    kind = "refused"


class OutputError(Int4packError):
    exit_code = EXIT_OUTPUT
    kind = "output"


class VerifyFailed(Int4packError):
    exit_code = EXIT_VERIFY
    kind = "verify"


__all__.append("UsageError")


_TRACKER_LABELS = ("issues", "bug tracker", "bug reports", "tracker")


def report_to() -> str:
    """Where a user sends a bug report or a request for a model: the issue tracker that the installed
    package's metadata names (pyproject's ``[project.urls]``, label "Issues" or "Bug Tracker"). A
    build whose metadata names none says so rather than point at a tracker it cannot name."""
    from importlib import metadata  # only on the way out with an error: not on every start

    try:
        urls = metadata.metadata("int4pack").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in _TRACKER_LABELS and url.strip():
            return url.strip()
    return "whoever distributes your int4pack (this build's package metadata names no issue tracker)"


class SourceBytesVanished(RuntimeError):
    """A C++ kernel's input bytes vanished under it (csrc/fault_guard.h): a page of a mapped file that
    was cut while the kernel read it. Not a user-facing error: the code that mapped the file turns it
    into the InputError naming it (``Checkpoint.faults_named``). ``address``: where the read faulted."""

    def __init__(self, address: int):
        super().__init__(f"input bytes vanished under a C++ kernel (SIGBUS reading address {address:#x})")
        self.address = address
