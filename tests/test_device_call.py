"""benchmarks/device_call.sh, the common start of a device call's script: the deadline helpers and the
results packed into one file when the script ends (also when it fails)."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = f"set -u\nsource benchmarks/device_call.sh demo\n{body}\n"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DL": "100", "HOME": str(tmp_path)}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_deadline_helpers_and_packing(tmp_path):
    r = _run(tmp_path, 'echo "$(cap 5) $(cap 100000) $(left)"; t; echo $HBM; echo hi > "$R/x.txt"')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[:2] == ["5", "100"] and 99 <= int(lines[2]) <= 100 and lines[3].startswith("t=")
    assert lines[4] in ("4.8", "3.35")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.tgz"]  # the folder packed, then removed
    with tarfile.open(tmp_path / "demo.tgz") as tar:
        assert {"demo/x.txt", "demo/host.txt"} <= set(tar.getnames())


def test_results_packed_when_the_script_fails(tmp_path):
    r = _run(tmp_path, 'echo partial > "$R/y.txt"; exit 3')
    assert r.returncode == 3
    with tarfile.open(tmp_path / "demo.tgz") as tar:
        assert "demo/y.txt" in tar.getnames()


def test_name_required(tmp_path):
    script = "source benchmarks/device_call.sh"
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "usage: source benchmarks/device_call.sh NAME" in r.stderr


def test_out_required(tmp_path):
    r = subprocess.run(["bash", "-c", "source benchmarks/device_call.sh demo"], cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "OUT: the folder that comes back" in r.stderr
