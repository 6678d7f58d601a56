"""The compiler the doctor drives: a command that gets a StableHLO file's path as its last argument and exits
non-zero when the compile fails. Each compile runs in a fresh folder holding only its input, so that whatever the
command writes there (a NEFF, a serialized executable) is the artefact it measures; its log is stdout + stderr.

Error codes: the Neuron compiler's `NCC_XXXX999` codes (e.g. NCC_IINL902) when the log names one, else `timeout`,
`signal N` or `exit N`. Several compiles of one program give its crash rate: neuronx-cc is nondeterministic on
some graphs, so a program "passes" only with the number of clean compiles next to it."""

from __future__ import annotations

import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

__all__ = ["CompileAttempt", "ProgramCompile", "Compiler", "error_code", "LOG_HEAD_LINES"]

LOG_HEAD_LINES = 12
_NCC_CODE = re.compile(r"\bNCC_[A-Z]{4}\d{3}\b")
_ERROR_LINE = re.compile(r"error|exception|fail|abort|NCC_", re.IGNORECASE)


def error_code(returncode: int | None, log: str) -> str | None:
    """None for a clean compile; else the first NCC code in the log, or timeout / signal N / exit N."""
    if returncode == 0:
        return None
    m = _NCC_CODE.search(log)
    if m:
        return m.group(0)
    if returncode is None:
        return "timeout"
    return f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"


def _log_head(log: str) -> list[str]:
    """The log's first error lines (the ones that name the problem), else its first lines."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    return (errors or lines)[:LOG_HEAD_LINES]


@dataclass
class CompileAttempt:
    """One compile: ok, exit status (None: timed out), wall seconds, bytes the command wrote, error code, log head."""
    ok: bool
    returncode: int | None
    seconds: float
    artifact_bytes: int
    error_code: str | None
    log_head: list[str]


@dataclass
class ProgramCompile:
    """Every compile of one program."""
    name: str
    attempts: list[CompileAttempt] = field(default_factory=list)

    @property
    def passes(self) -> int:
        return sum(a.ok for a in self.attempts)

    @property
    def failures(self) -> int:
        return len(self.attempts) - self.passes

    @property
    def crash_rate(self) -> float:
        return self.failures / len(self.attempts) if self.attempts else 0.0

    @property
    def median_seconds(self) -> float:
        return statistics.median(a.seconds for a in self.attempts) if self.attempts else 0.0

    @property
    def max_artifact_bytes(self) -> int:
        return max((a.artifact_bytes for a in self.attempts), default=0)

    @property
    def error_codes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.attempts:
            if a.error_code:
                out[a.error_code] = out.get(a.error_code, 0) + 1
        return out

    def to_json(self) -> dict:
        return {"passes": self.passes, "failures": self.failures, "crash_rate": self.crash_rate,
                "median_seconds": round(self.median_seconds, 3), "max_artifact_bytes": self.max_artifact_bytes,
                "error_codes": self.error_codes, "attempts": [asdict(a) for a in self.attempts]}


def _written_bytes(folder: str, skip: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            if path != skip and not os.path.islink(path):
                total += os.path.getsize(path)
    return total


class Compiler:
    """argv + [file] run as a subprocess; `timeout_s` per compile (a hung compile counts as a failure)."""

    def __init__(self, argv: list[str], timeout_s: float = 3600.0):
        if not argv:
            raise ValueError("the compiler command is empty")
        # compiles run in fresh folders: a relative path to a file that exists here is made absolute
        self.argv = [os.path.abspath(a) if not os.path.isabs(a) and os.sep in a and os.path.exists(a) else a
                     for a in argv]
        self.timeout_s = timeout_s

    @classmethod
    def default(cls, platform: str, generation: str = "trn2") -> "Compiler":
        """neuronx-cc through jdeep's wrapper on a Neuron host (StableHLO -> HLO -> NEFF with jdeep's flags),
        XLA:CPU standing in for the device elsewhere."""
        if platform == "neuron":
            return cls([sys.executable, "-m", "jdeep.tools.dev.doctor.neuron_cc", "--target", generation])
        return cls([sys.executable, "-m", "jdeep.tools.dev.doctor.xla_cpu_cc"])

    @classmethod
    def from_string(cls, cmd: str | None, platform: str, generation: str = "trn2") -> "Compiler":
        """A user's --compiler-cmd (shell words), or the platform's default."""
        return cls.default(platform, generation) if not cmd else cls(shlex.split(cmd))

    def command_line(self, path: str) -> str:
        return shlex.join(self.argv + [path])

    def compile(self, text: str, workdir: str, filename: str = "program.mlir") -> CompileAttempt:
        """Compile `text` once in a fresh folder under workdir."""
        os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=workdir) as folder:
            path = os.path.join(folder, filename)
            with open(path, "w") as f:
                f.write(text)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(self.argv + [path], cwd=folder, capture_output=True, text=True,
                                      timeout=self.timeout_s, errors="replace")
                returncode, log = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                returncode = None
                log = f"compile did not finish in {self.timeout_s:g} s\n" + "".join(
                    s if isinstance(s, str) else (s or b"").decode(errors="replace") for s in (e.stdout, e.stderr))
            except OSError as e:                 # the command itself cannot run: every compile fails the same way
                returncode, log = 127, f"cannot run {self.argv[0]!r}: {e}"
            seconds = time.perf_counter() - t0
            code = error_code(returncode, log)
            return CompileAttempt(ok=code is None, returncode=returncode, seconds=round(seconds, 3),
                                  artifact_bytes=_written_bytes(folder, path), error_code=code,
                                  log_head=_log_head(log) if code else [])

    def compile_repeated(self, name: str, text: str, repeat: int, workdir: str) -> ProgramCompile:
        """`repeat` independent compiles of one program."""
        result = ProgramCompile(name)
        for _ in range(repeat):
            result.attempts.append(self.compile(text, workdir))
        return result

    def fails(self, text: str, workdir: str, error_code: str | None = None, tries: int = 1) -> bool:
        """True if one of `tries` compiles fails (with `error_code` when given: another failure is another bug)."""
        for _ in range(tries):
            a = self.compile(text, workdir)
            if not a.ok and (error_code is None or a.error_code == error_code):
                return True
        return False
