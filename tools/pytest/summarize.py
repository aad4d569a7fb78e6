"""Prints 'N passed, N failed, N skipped' for one `bazel test` run.

Bazel's own summary counts targets; this counts pytest test cases. It reads the targets
that the run reported (its log) and, for each, the JUnit XML pytest wrote in this run (or
the cached run Bazel reports). An XML older than the run's start is a leftover of an
earlier run and is not read: a target without a fresh, readable XML (crash, timeout, build
failure) counts as one failed test.
Usage: summarize.py BAZEL_LOG TESTLOGS_DIR [RUN_START_EPOCH_SECONDS]
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

_LINE = re.compile(
    r"^(//[^\s:]*:\S+)\s+(\(cached\)\s+)?"
    r"(PASSED|FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE|FAILED TO BUILD)\b"
)


def _counts(xml_path):
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    tests = failed = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def _verdict(xml_path, cached, start):
    """(passed, failed, skipped) from the XML if it belongs to this run, else zeros."""
    try:
        if not cached and start is not None and os.path.getmtime(xml_path) < start:
            return 0, 0, 0
        return _counts(xml_path)
    except (OSError, ET.ParseError, ValueError):
        return 0, 0, 0


def main(log_path, testlogs, start=None):
    passed = failed = skipped = 0
    seen = set()
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line.strip())
            if not m or m.group(1) in seen:
                continue
            seen.add(m.group(1))
            label, cached, status = m.groups()
            pkg, name = label[2:].split(":")
            xml_path = os.path.join(testlogs, pkg, name, "test.xml")
            p, fl, s = _verdict(xml_path, bool(cached), start)
            if status not in ("PASSED", "FLAKY") and fl == 0:
                fl = 1  # crashed, timed out or did not build: no pytest verdict
            passed, failed, skipped = passed + p, failed + fl, skipped + s
    print(f"{passed} passed, {failed} failed, {skipped} skipped")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else None)
