#!/usr/bin/env python3
"""Find (or fetch) a runnable `perf_analyzer` and the environment it needs.

    python client/perf_analyzer/locate.py            # prints shell exports: PERF_ANALYZER, LD_LIBRARY_PATH
    python client/perf_analyzer/locate.py --check    # also runs `perf_analyzer --version`

Order: $PERF_ANALYZER, `perf_analyzer` on PATH (the tritonserver SDK container), the cache
($OURO_CACHE_DIR or ~/.cache/ouro-triton/perf_analyzer), else `pip download tritonclient==2.50.0` (the last
manylinux wheel that ships perf_analyzer for glibc < 2.38) and extract
`tritonclient-2.50.0.data/data/bin/perf_analyzer` into the cache. Its two missing libraries are linked into
the cache's lib dir: `libb64.so.0d` (the system's from Debian `libb64-0d` when installed, else the copy inside
the nvidia-pytriton wheel) and `libcudart.so.12` (nvidia-pytriton's).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_VERSION = "2.50.0"
MEMBER = f"tritonclient-{WHEEL_VERSION}.data/data/bin/perf_analyzer"


class PerfAnalyzerUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("OURO_CACHE_DIR") or os.path.join("~", ".cache", "ouro-triton")
    return Path(root).expanduser() / "perf_analyzer"


def _pytriton_libs() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]).parent / "nvidia_pytriton.libs"
    return libs if libs.is_dir() else None


def _link_libs(lib_dir: Path) -> None:
    lib_dir.mkdir(parents=True, exist_ok=True)
    libs = _pytriton_libs()
    wanted = {
        "libb64.so.0d": ["/usr/lib/x86_64-linux-gnu/libb64.so.0d", "/usr/lib/libb64.so.0d"]
        + (sorted(glob.glob(str(libs / "libb64-*.so.0d"))) if libs else []),
        "libcudart.so.12": sorted(glob.glob(str(libs / "libcudart-*.so.12*"))) if libs else [],
    }
    for name, candidates in wanted.items():
        link = lib_dir / name
        if link.exists():
            continue
        src = next((c for c in candidates if os.path.exists(c)), None)
        if src is None:
            continue  # maybe the system has it; `ldd` will tell
        if link.is_symlink():
            link.unlink()
        link.symlink_to(src)


def _download(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux1_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "--python-version",
            "3",
            "-d",
            tmp,
            f"tritonclient=={WHEEL_VERSION}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, f"tritonclient-{WHEEL_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise PerfAnalyzerUnavailable(
                f"pip download tritonclient=={WHEEL_VERSION} failed: {(r.stderr or r.stdout).strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                data = z.read(MEMBER)
            except KeyError:
                raise PerfAnalyzerUnavailable(f"{wheels[0]} has no {MEMBER}") from None
    (dest / "bin").mkdir(exist_ok=True)
    binary = dest / "bin" / "perf_analyzer"
    tmp_bin = binary.with_suffix(f".tmp{os.getpid()}")
    tmp_bin.write_bytes(data)
    tmp_bin.chmod(0o755)
    os.replace(tmp_bin, binary)
    return binary


def locate(download: bool = True) -> tuple[str, dict[str, str]]:
    """(perf_analyzer path, environment to run it with)."""
    env = dict(os.environ)
    explicit = os.environ.get("PERF_ANALYZER")
    if explicit:
        return explicit, env
    on_path = shutil.which("perf_analyzer")
    if on_path:
        return on_path, env
    root = cache_dir()
    binary = root / "bin" / "perf_analyzer"
    if not binary.is_file():
        if not download:
            raise PerfAnalyzerUnavailable(f"perf_analyzer not found (looked at $PERF_ANALYZER, PATH, {binary})")
        if sys.platform != "linux" or os.uname().machine != "x86_64":
            raise PerfAnalyzerUnavailable("the tritonclient 2.50.0 perf_analyzer is built for linux x86_64 only")
        binary = _download(root)
    _link_libs(root / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(root / "lib"), env.get("LD_LIBRARY_PATH", "")] if p)
    return str(binary), env


def check(binary: str, env: dict[str, str]) -> None:
    """Raise PerfAnalyzerUnavailable unless the binary starts (all libraries found)."""
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PerfAnalyzerUnavailable(f"{binary} does not run: {e}") from None
    out = r.stdout + r.stderr
    if "error while loading shared libraries" in out or r.returncode not in (0, 1):
        raise PerfAnalyzerUnavailable(f"{binary} does not run (exit {r.returncode}): {out.strip()[-400:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="run `perf_analyzer --version` too")
    p.add_argument("--no-download", action="store_true")
    args = p.parse_args(argv)
    try:
        binary, env = locate(download=not args.no_download)
        if args.check:
            check(binary, env)
    except PerfAnalyzerUnavailable as e:
        print(f"perf_analyzer unavailable: {e}", file=sys.stderr)
        return 1
    print(f"export PERF_ANALYZER={binary}")
    if env.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH"):
        print(f"export LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
