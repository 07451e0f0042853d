"""`import shardcore` (and its core modules) pulls in neither torch nor numpy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import json, sys
import shardcore, shardcore.cli, shardcore.plan, shardcore.views.picture, shardcore.views.tables
shardcore.plan_layout(16, "tp=4,pp=2+tp=2,dp=4").groups_of(9)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "numpy"})
print(json.dumps({"heavy": heavy, "file": shardcore.__file__}))
"""


def test_import_shardcore_is_light() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert Path(result["file"]).resolve().parent == ROOT / "shardcore"
    assert result["heavy"] == []
