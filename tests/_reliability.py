"""Helpers of the reliability tests (test_bad_inputs, test_resume, test_fuzz_readers): the
bad-input corpus builder, the CLI in a subprocess, and a disk with a budget."""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from typer.testing import CliRunner

from int4pack.output_folder import writer


ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("make_bad_inputs", ROOT / "tests" / "make_bad_inputs.py")
mbi = importlib.util.module_from_spec(_spec)
sys.modules["make_bad_inputs"] = mbi
_spec.loader.exec_module(mbi)
tree_hash = mbi.tree_hash

# cases that also run through the real entry point in a subprocess (one per kind of failure)
SUBPROCESS = ["truncated_shard", "scales_nan", "hub_offline_no_cache", "hub_partial_cache", "disk_full"]
TMPFS_SIZE = "400k"  # the gptq_q3_sym output is ~1.4 MB
runner = CliRunner()


# --------------------------------------------------------------------------- helpers

def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "INT4PACK_TEST_"))}
    env["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env.update(extra or {})
    return env


def _cli(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "int4pack", *args], capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=ROOT)


def _looks_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def _guarded(case, dest: Path) -> Path:
    """The folder whose bytes must not change: the source (the HF cache for hub ids)."""
    return dest / case.name / "hf" if case.hub and (dest / case.name / "hf").exists() else \
        (dest / case.src if not case.hub else dest / case.name)


def _problems(case, dest: Path, code: int, stderr: str, before: dict, debug: bool = False) -> list[str]:
    """Everything wrong with how one bad case failed (empty list: it failed cleanly)."""
    out = case.out_path(dest)
    bad = []
    if code != case.exit:
        bad.append(f"exit {code}, expected {case.exit}")
    if "internal error" in stderr:
        bad.append("not an Int4packError (internal error)")
    if ("Traceback" in stderr) != debug:
        bad.append("traceback shown without --debug" if not debug else "no traceback with --debug")
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    hints = [ln for ln in stderr.splitlines() if ln.startswith("hint:")]
    if len(errors) != 1:
        bad.append(f"{len(errors)} 'error:' lines")
    if len(hints) != 1:
        bad.append(f"{len(hints)} 'hint:' lines")
    if errors and not any(m in errors[0] for m in case.mention):
        bad.append(f"error line names none of {case.mention}: {errors[0]!r}")
    if tree_hash(_guarded(case, dest)) != before["src"]:
        bad.append("source changed")
    if before["out"] == "absent":
        if os.path.lexists(out):
            bad.append(f"OUT {out} was created")
    elif tree_hash(out) != before["out"]:
        bad.append("the existing OUT was modified")
    if before["out"] == "absent" and _looks_complete(out):
        bad.append("an output that looks complete was left")
    return bad


def _snapshot(case, dest: Path) -> dict:
    return {"src": tree_hash(_guarded(case, dest)), "out": tree_hash(case.out_path(dest))}


class _DiskBudget:
    """A 'disk' with ``budget`` bytes left for shard data: past it, OSError(ENOSPC)."""

    used = 0
    budget = 0


def _limit_disk(monkeypatch, budget: int) -> None:
    """Page-cache writes past the budget raise ENOSPC; a direct write past it writes the pages that
    fit and comes back short, as Linux does on a full file system (tmpfs and ext4 alike)."""
    orig, orig_direct = writer.ShardFile._pwrite, writer.ShardFile._pwrite_direct
    lock = threading.Lock()

    def pwrite(self, buf, offset):
        n = memoryview(buf).nbytes
        with lock:  # workers write in parallel
            if _DiskBudget.used + n > _DiskBudget.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _DiskBudget.used += n
        return orig(self, buf, offset)

    def pwrite_direct(self, buf, offset):
        with lock:
            fits = min(len(buf), max(0, _DiskBudget.budget - _DiskBudget.used)) // 4096 * 4096
            _DiskBudget.used += fits
        if fits == len(buf):
            return orig_direct(self, buf, offset)
        if fits:
            orig_direct(self, buf[:fits], offset)
        self._direct = False  # what the real method does on a short write
        return fits

    _DiskBudget.used, _DiskBudget.budget = 0, budget
    monkeypatch.setattr(writer.ShardFile, "_pwrite", pwrite)
    monkeypatch.setattr(writer.ShardFile, "_pwrite_direct", pwrite_direct)


def _try_mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    return r.returncode == 0


def _spy_shard_writes(monkeypatch) -> list[str]:
    seen: list[str] = []
    orig = writer.ShardFile.__init__

    def init(self, path, *a, **kw):
        seen.append(Path(path).name)
        orig(self, path, *a, **kw)

    monkeypatch.setattr(writer.ShardFile, "__init__", init)
    return seen


def _same_files(a: Path, b: Path) -> bool:
    fa = sorted(p.name for p in a.iterdir())
    fb = sorted(p.name for p in b.iterdir())
    return fa == fb and all((a / n).read_bytes() == (b / n).read_bytes() for n in fa)


def stop_after_jobs(monkeypatch, n: int):
    """Make a convert raise KeyboardInterrupt once more than ``n`` jobs have started, whether they run
    one by one (convert.run_job) or in C++ batches (batch.run_batch): a Ctrl-C mid-run."""
    import importlib  # noqa: PLC0415

    from int4pack import batch  # noqa: PLC0415
    conv = importlib.import_module("int4pack.convert")  # int4pack.convert is the function
    calls = {"n": 0}
    real_job, real_batch = conv.run_job, batch.run_batch

    def counted(run, jobs: int):
        def stop(unit, *a, **k):
            calls["n"] += jobs if jobs else len(unit.jobs)
            if calls["n"] > n:
                raise KeyboardInterrupt
            return run(unit, *a, **k)
        return stop

    monkeypatch.setattr(conv, "run_job", counted(real_job, 1))
    monkeypatch.setattr(batch, "run_batch", counted(real_batch, 0))
