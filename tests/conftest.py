"""Suite-wide settings."""

import atexit
import os
import shutil
import tempfile

# The record of files a probe passed (dumpfile/read/probed_files.py) lives in the user's
# cache by default: the suite keeps one of its own, so that no run trusts a file a run
# before it probed, and none writes into the home of whoever runs it. (Subprocesses the
# tests start inherit it.)
_record_dir = tempfile.mkdtemp(prefix="accucmp-probe-record-")
os.environ["ACCUCMP_PROBE_RECORD"] = os.path.join(_record_dir, "probed-files")
atexit.register(shutil.rmtree, _record_dir, True)
