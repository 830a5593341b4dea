"""The container's install steps (docker/install.sh) in a clean virtual environment: the tritonserver base
image cannot be pulled here, so this is how CI knows that what the Dockerfile runs works: the package and
its dependencies install, numpy stays < 2 for the 24.10 stub, the toy checkpoint is written and generates."""

import os
import subprocess
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_install_script_in_a_clean_venv(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        OURO_TOY_DIR=str(tmp_path / "toy"),
        # The CPU build this machine has on disk (a plain "torch" would download the CUDA build).
        OURO_TORCH_SPEC=f"torch=={_torch_version()}",
        PYTHONPATH="",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    env.pop("VIRTUAL_ENV", None)
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "docker", "install.sh"), ROOT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "install.sh: ok" in r.stdout
    # Installed into the venv, not found through this checkout or the test environment.
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import ouro_backend; print(ouro_backend.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(env_dir)), where
    assert os.path.isfile(tmp_path / "toy" / "config.json")


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
