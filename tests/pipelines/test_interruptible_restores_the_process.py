"""What ``interruptible()`` (the context ``relaunch run`` and ``relaunch tune`` run in) leaves of the
process that entered it, with real processes: inside, the process adopts the orphans of what it starts
(a child subreaper); after, it is again what it was, and the adopted orphans that ended are reaped. A
caller that goes on (a test suite, a notebook) must not keep adopting, and never reaping, the orphans
of what it starts later: a zombie per orphan, for as long as it lives (the Ray head's group was found
"still present" 30 s after its stop in a test process that had run ``relaunch run`` before)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers and /proc are Linux's")

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from relaunch.pipelines.local.interrupt import interruptible, is_subreaper, stop_descendants
    from relaunch.components.core.store.procfs import stat_fields

    def orphan() -> int:
        # a child that leaves a short-lived grandchild behind and exits: the grandchild is orphaned
        out = subprocess.run(["sh", "-c", "sleep 0.3 & echo $!"], capture_output=True, text=True, check=True)
        return int(out.stdout)

    def parent_and_state(pid):
        fields = stat_fields(pid)
        return None if fields is None else [int(fields[1]), fields[0].decode()]

    report = {"me": os.getpid(), "before": is_subreaper()}
    earlier = subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"])  # the caller's own child, waited for later
    with interruptible():
        report["inside"] = is_subreaper()
        adopted = orphan()
        report["adopted_running"] = parent_and_state(adopted)
        time.sleep(0.8)  # it ends: a zombie of this process
        report["adopted_ended"] = parent_and_state(adopted)
        stop_descendants(5)  # as on Ctrl-C: it reaps what ended, but not the caller's own earlier child
    report["after"] = is_subreaper()
    report["adopted_after"] = parent_and_state(adopted)
    report["earlier_code"] = earlier.wait()
    later = orphan()
    report["later_running"] = parent_and_state(later)
    print(json.dumps(report))
""")


def test_interruptible_adopts_orphans_inside_and_leaves_the_process_as_it_was_with_the_adopted_reaped():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    me = report["me"]
    assert report["before"] is False and report["inside"] is True
    assert report["adopted_running"][0] == me  # an orphan of the run is this process's child inside
    assert report["adopted_ended"] == [me, "Z"]  # ended: a zombie only its adopter can reap
    assert report["after"] is False  # as it was
    assert report["adopted_after"] is None  # reaped on the way out
    assert report["earlier_code"] == 3  # a child started before kept its status for its own Popen (a stop too)
    assert report["later_running"] is None or report["later_running"][0] != me  # no longer adopted
