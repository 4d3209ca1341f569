"""htslib's messages, captured: what pysam's C library writes to standard error while genolong reads
or writes a VCF becomes genolong's own lines, or nothing where genolong already checks the matter.

htslib writes straight to file descriptor 2 (``[W::vcf_parse] Contig '20' is not defined in the
header. (Quick workaround: index the file with tabix.)``), so Python's ``sys.stderr`` cannot catch
it: :func:`htslib_messages` points descriptor 2 at a temporary file for the duration and hands back
the lines. :func:`report` then drops the messages genolong makes moot (:data:`MOOT`: a contig
missing from the header is checked against the FASTA instead, with a line of genolong's own if the
FASTA lacks it; a missing index is not needed for a full read) and prints the rest once each,
prefixed with the command and the file, so nothing reaches the terminal unexplained.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence

__all__ = ["MOOT", "htslib_messages", "report"]

#: htslib messages genolong makes moot (matched against each line): the contigs are checked
#: against the reference FASTA (a missing ``##contig`` line changes nothing), and a whole file is
#: read without its index.
MOOT = (
    re.compile(r"Contig '[^']*' is not defined in the header"),
    re.compile(r"Missing headers may cause later processing to fail"),  # htslib's sequel to the line above
    re.compile(r"Could not retrieve index file"),
    re.compile(r"^\s*$"),
)


@contextlib.contextmanager
def htslib_messages() -> Iterator[list[str]]:
    """Capture everything written to file descriptor 2 inside the block.

    Yields:
        A list that holds the captured lines (newlines stripped) once the block has ended, also
        when it ends by an exception (read it after the ``with``).
    """
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def report(lines: Sequence[str], where: str, command: str = "genolong variants") -> list[str]:
    """Print the captured messages that matter, once each, as genolong's lines on stderr.

    Args:
        lines: from :func:`htslib_messages`.
        where: the file they are about (named in each line).
        command: the prefix (default ``genolong variants``).

    Returns:
        The messages kept (without the prefix), in order of first appearance.
    """
    kept = [line.strip() for line in dict.fromkeys(lines) if not any(p.search(line) for p in MOOT)]
    for line in kept:
        print(f"{command}: htslib, reading {where}: {line}", file=sys.stderr)
    return kept
