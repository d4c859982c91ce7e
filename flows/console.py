"""What a pipeline run shows on its console: Prefect's lines, a progress bar per running stage, the stages' own
warnings and the eval table. Everything else a stage prints (vLLM's and Ray's actor logs, DeepSpeed's INFO lines,
library warnings, the ranks' progress bars) goes to the stage's log file, ``<run folder>/task/stage.log``, named in
the error when the stage fails. ``RLHF_VERBOSE=1`` (``python -m flows.full_rlhf --verbose``) or ``LOG_LEVEL=DEBUG``
puts all of it on the console again, as before.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

VERBOSE_ENV = "RLHF_VERBOSE"
# a stage's own warnings and errors: its tagged lines ("[rl] WARNING: no learning signal at step 2 ...")
RELAYED = re.compile(r"^\[[a-z][\w-]*\] .*\b(WARNING|ERROR)\b")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0") or os.environ.get("LOG_LEVEL", "").upper() == "DEBUG"


class StageConsole:
    """One running stage on the console (quiet mode): a progress bar from its progress reports, and the warnings its
    log file gains, relayed as the task's own lines (``print``: Prefect logs them)."""

    def __init__(self, name: str, log: Path):
        from tqdm import tqdm

        self.name, self.log, self.offset = name, log, 0
        self.bar = tqdm(total=100, desc=name, unit="%", file=sys.stderr, dynamic_ncols=True, leave=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}")

    def update(self, pct: float | None, summary: str = "") -> None:
        if pct is not None:
            self.bar.n = pct
            self.bar.set_postfix_str(summary.split(";")[0], refresh=False)
            self.bar.refresh()
        self.relay()

    def relay(self) -> None:
        """Print the log's new complete lines that are the stage's own warnings."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for raw in chunk[:end].decode(errors="replace").splitlines():
            line = raw.rsplit("\r", 1)[-1]
            if RELAYED.match(line):
                print(line)

    def close(self) -> None:
        self.relay()
        self.bar.close()
