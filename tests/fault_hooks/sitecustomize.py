"""Test-only fault hook, imported at start-up by every Python process whose PYTHONPATH holds this folder.

With FT_ACCUM_FREEZE_BEFORE_PUBLISHING=.tmp-step_000045 set, the process that is about to rename that
half-published checkpoint folder into place writes FT_ACCUM_FROZEN_MARKER and stops itself (SIGSTOP)
instead. The test then SIGKILLs it: a kill inside the checkpoint write, every time. Polling for the
folder instead missed the write's few milliseconds on a loaded 2-core CI machine.
"""

import os
import signal
from pathlib import Path

_FOLDER = os.environ.get("FT_ACCUM_FREEZE_BEFORE_PUBLISHING")

if _FOLDER:
    _replace = os.replace

    def _freezing_replace(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(src)) == _FOLDER:
            Path(os.environ["FT_ACCUM_FROZEN_MARKER"]).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return _replace(src, dst, *args, **kwargs)

    os.replace = _freezing_replace
