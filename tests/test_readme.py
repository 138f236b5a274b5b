"""Every command in the README's code blocks runs as written on the test fixtures and exits 0, and
where the README shows output, the real output has those lines (numbers within 10 %, timings free).

Placeholders are the README's own: SRC is tests/fixtures/gptq_q3_sym, OUT a fresh folder, ./out and
/tmp/out the folder the shown convert writes. Commands that need the hub, vLLM or a package index are
skipped by the list below, each with its reason; any other command line must run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# command prefix -> why it cannot run in the offline suite
SKIPPED = {
    "int4pack convert Qwen/": "downloads a hub repo",
    "int4pack verify ./qwen3-w4a8 --against Qwen/": "checks the hub repo's conversion",
    "vllm serve": "needs vLLM on an Arm host",
    "pip install": "installs from a package index",
    "python -m pytest": "the test suite itself and its opt-in QEMU lanes",
}


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _commands(body: str) -> list[str]:
    """Command lines of a bash block, continuations joined, comments dropped."""
    lines = body.replace("\\\n", " ").splitlines()
    return [" ".join(shlex.split(x, comments=True)) for x in lines if shlex.split(x, comments=True)]


def _shown(body: str) -> list[tuple[str, list[str]]]:
    """The '$ command' lines of a text block, each with the output lines shown under it."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and line.strip():
            out[-1][1].append(line)
    return out


def _skip_reason(cmd: str) -> str | None:
    return next((why for pre, why in SKIPPED.items() if cmd.startswith(pre)), None)


def _plan() -> list[tuple[str, str, list[str]]]:
    """(kind, command or code, shown lines) in README order; kind is cmd, python or skip:<reason>."""
    steps = []
    for lang, body in _blocks(README.read_text()):
        if lang == "bash":
            for c in _commands(body):
                why = _skip_reason(c)
                steps.append((f"skip:{why}" if why else "cmd", c, []))
        elif lang == "python":
            steps.append(("python", body, []))
        elif lang == "text":
            steps += [("cmd", c, shown) for c, shown in _shown(body)]
    return steps


def _norm(line: str, tmp: Path) -> list[str]:
    line = line.replace(str(tmp / "out"), "/tmp/out")
    line = re.sub(r"\bin \d+(\.\d+)? s\b", "in <t> s", line)
    return line.split()


def _same(shown: list[str], real: list[str]) -> bool:
    if len(shown) != len(real):
        return False
    for a, b in zip(shown, real):
        if a == b:
            continue
        fa, fb = _float(a), _float(b)
        if fa is None or fb is None or abs(fa - fb) > 0.1 * max(abs(fa), abs(fb)):
            return False
    return True


def _float(tok: str) -> float | None:
    """A measured figure (0.0134, 1e-05); counts and other integers must match exactly."""
    tok = tok.strip("()")
    if not re.fullmatch(r"-?\d*\.\d+(e-?\d+)?|-?\d+e-?\d+", tok):
        return None
    return float(tok)


def _check_shown(shown: list[str], output: str, tmp: Path) -> list[str]:
    """Shown lines that are not in the real output, in order ('[...]' stands for lines left out)."""
    real = [_norm(x, tmp) for x in output.splitlines() if x.strip()]
    missing, i = [], 0
    for line in shown:
        if line.strip() == "[...]":
            continue
        want = _norm(line, tmp)
        j = next((j for j in range(i, len(real)) if _same(want, real[j])), None)
        if j is None:
            missing.append(line)
        else:
            i = j + 1
    return missing


def _run(cmd: str, tmp: Path) -> subprocess.CompletedProcess:
    subst = {"SRC": "tests/fixtures/gptq_q3_sym", "OUT": str(tmp / "packed"), "./out": str(tmp / "out"),
             "/tmp/out": str(tmp / "out")}
    argv = [subst.get(a, a) for a in shlex.split(cmd)]
    if argv[0] == "int4pack":
        argv = [sys.executable, "-m", "int4pack", *argv[1:]]
    elif argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)


def test_every_readme_command_runs_and_shows_what_the_readme_says(tmp_path):
    steps = _plan()
    ran = [s for s in steps if not s[0].startswith("skip:")]
    assert len(ran) >= 10, "the README's commands were not found"
    problems = []
    for kind, what, shown in steps:
        if kind.startswith("skip:"):
            continue
        if kind == "python":
            code = what.replace("/tmp/out-py", str(tmp_path / "out-py"))
            r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=600)
        else:
            assert what.split()[0] in ("int4pack", "python"), f"neither run nor skipped with a reason: {what}"
            r = _run(what, tmp_path)
        if r.returncode != 0:
            problems.append(f"{what!r} exited {r.returncode}:\n{r.stdout[-2000:]}")
            continue
        missing = _check_shown(shown, r.stdout, tmp_path)
        if missing:
            problems.append(f"{what!r}: the README shows lines the output lacks:\n" + "\n".join(missing)
                            + f"\n--- real output ---\n{r.stdout}")
    assert not problems, "\n\n".join(problems)


def test_every_skip_is_used_and_the_rest_runs():
    steps = _plan()
    used = {k[5:] for k, _, _ in steps if k.startswith("skip:")}
    assert used == set(SKIPPED.values()), set(SKIPPED.values()) - used
    for kind, what, _ in steps:
        if kind == "cmd":
            assert what.split()[0] in ("int4pack", "python"), what


def test_the_shown_output_check_can_fail(tmp_path):
    out = "PASS: structure ok, 2 MoE layer(s) (worst layer rel_l2 0.0134)\nwrote /x in 3.2 s\n"
    assert _check_shown(["PASS: structure ok, 2 MoE layer(s) (worst layer rel_l2 0.0136)", "[...]",
                         "wrote /x in 0.1 s"], out, tmp_path) == []
    assert _check_shown(["PASS: structure ok, 3 MoE layer(s) (worst layer rel_l2 0.0134)"], out, tmp_path)
    assert _check_shown(["wrote /y in 3.2 s"], out, tmp_path)
    assert _check_shown(["PASS: structure ok, 2 MoE layer(s) (worst layer rel_l2 0.02)"], out, tmp_path)
    assert _check_shown(["wrote /x in 0.1 s", "PASS: structure ok, 2 MoE layer(s) (worst layer rel_l2 0.0134)"],
                        out, tmp_path)  # order matters
