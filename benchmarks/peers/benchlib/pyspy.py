"""Optional py-spy profile of one extra load point (run.py --py-spy): where a server's Python
threads spend their time. The measured points are never profiled; this is a separate point of
the same length, so sampling cannot disturb the req/s and CPU figures.

py-spy writes collapsed stacks (``--format raw --threads``), one line per distinct stack:
``thread (TID): NAME;frame (file:line);...;leaf (file:line) COUNT``. Idle samples are left out
(no ``--idle``), so a thread's samples / (rate x seconds) is roughly its busy share of the time.
"""
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field

_LINE = re.compile(r"^thread \((\d+)\): ([^;]*);?(.*) (\d+)$")
_LINENO = re.compile(r":\d+\)$")  # "func (file.py:123)" -> "func (file.py)"


@dataclass
class Profile:
    """Summary of one py-spy record file.

    Attributes:
        rate_hz: sampling rate asked of py-spy.
        seconds: how long it sampled.
        threads: thread label ("NAME (tid)") -> samples in which that thread was busy.
        leaves: (thread label, "function (file)") -> samples with that function on top of the
            stack (self time), all its lines together.
        path: the raw file.
    """

    rate_hz: int
    seconds: float
    path: str
    threads: Counter = field(default_factory=Counter)
    leaves: Counter = field(default_factory=Counter)

    def busy_pct(self, samples: int) -> float:
        """Samples as a percentage of the wall time sampled (100 = busy all the time)."""
        return 100.0 * samples / max(1.0, self.rate_hz * self.seconds)


def find_py_spy(python: str) -> str | None:
    """py-spy next to the bench venv's python, else on PATH, else None."""
    here = os.path.join(os.path.dirname(python), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def start(py_spy: str, pid: int, seconds: float, rate_hz: int, out: str, preexec_fn=None) -> subprocess.Popen:
    """Start ``py-spy record`` on pid for `seconds` (non-blocking sampling: the target is not
    paused per sample). Returns the py-spy process; wait for it, then call :func:`summarise`."""
    cmd = [py_spy, "record", "--pid", str(pid), "--threads", "--nonblocking", "--format", "raw",
           "--rate", str(rate_hz), "--duration", str(max(1, int(round(seconds)))), "--output", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec_fn)


def summarise(path: str, rate_hz: int, seconds: float) -> Profile:
    """Read a raw collapsed-stack file written with ``--threads``."""
    prof = Profile(rate_hz=rate_hz, seconds=seconds, path=path)
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            tid, name, stack, count = m.group(1), m.group(2), m.group(3), int(m.group(4))
            label = f"{name or 'thread'} ({tid})"
            prof.threads[label] += count
            leaf = stack.rsplit(";", 1)[-1] if stack else "(no Python frame)"
            prof.leaves[(label, _LINENO.sub(")", leaf))] += count  # one row per function
    return prof


def to_json(prof: Profile, top: int = 15) -> dict:
    """JSON-ready form for results/<tag>.json."""
    return {"rate_hz": prof.rate_hz, "seconds": prof.seconds, "raw": prof.path,
            "threads": dict(prof.threads.most_common()),
            "top_leaves": [{"thread": t, "function": f, "samples": n}
                           for (t, f), n in prof.leaves.most_common(top)]}


def markdown(title: str, prof: dict, requests: int | None) -> list[str]:
    """Report lines for one profile (the dict from :func:`to_json`)."""
    wall = max(1.0, prof["rate_hz"] * prof["seconds"])
    total = sum(prof["threads"].values()) or 1
    L = [f"### {title}\n"]
    if requests:
        L.append(f"{requests} requests in the profiled point; py-spy at {prof['rate_hz']} Hz for "
                 f"{prof['seconds']:g} s (raw stacks: `{prof['raw']}`).\n")
    L.append("| thread | busy samples | busy % of wall |")
    L.append("|---|---|---|")
    for t, n in prof["threads"].items():
        L.append(f"| {t} | {n} | {100.0 * n / wall:.0f} |")
    L.append("")
    L.append("| thread | top-of-stack function (self) | samples | % of busy samples |")
    L.append("|---|---|---|---|")
    for row in prof["top_leaves"]:
        L.append(f"| {row['thread']} | `{row['function']}` | {row['samples']} | "
                 f"{100.0 * row['samples'] / total:.1f} |")
    L.append("")
    return L
