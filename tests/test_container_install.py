"""The container's install steps (docker/install.sh) in a clean virtual environment: the tritonserver base
image cannot be pulled here, so this is how CI knows that what the Dockerfile runs works: the package and
its dependencies install, numpy stays < 2 for the 24.10 stub, the demo model ships inside the installed
package and generates, and with the image's environment (the Dockerfile's ENV) `ouro-serve` without
--model serves that demo model, not some other checkpoint."""

import json
import os
import re
import shlex
import subprocess
import venv
from pathlib import Path

from ouro_backend.entrypoints.serve import resolve_model
from ouro_backend.models import DEMO_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")


def dockerfile_env() -> dict[str, str]:
    """The variables the Dockerfile's ENV instructions set (KEY=VALUE form, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    env: dict[str, str] = {}
    for line in text.splitlines():
        if re.match(r"ENV\s", line):
            for item in shlex.split(line[3:], comments=True):
                key, sep, value = item.partition("=")
                assert sep, f"docker/Dockerfile: ENV {item}: write ENV KEY=VALUE"
                env[key] = value
    return env


def test_image_serves_the_demo_model_without_model():
    """`docker run ouro-triton` with no --model: ouro-serve's choice under the image's ENV is the demo model
    (the README's default), not a random-weight toy or a path the image does not have."""
    env = dockerfile_env()
    assert env.get("OURO_MODEL_REPOSITORY") == "/opt/ouro/model_repository", env
    model, demo = resolve_model(None, env)
    assert demo and Path(model) == DEMO_MODEL, (env, model)


def test_install_script_in_a_clean_venv(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        # The CPU build this machine has on disk (a plain "torch" would download the CUDA build).
        OURO_TORCH_SPEC=f"torch=={_torch_version()}",
        PYTHONPATH="",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        # Not the image's settings: skip byte-compiling (most of the CPU time) and use pip's cache (setup.sh
        # filled it); the Dockerfile runs install.sh with PIP_NO_CACHE_DIR=1.
        PIP_NO_COMPILE="1",
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
    # With the Dockerfile's ENV (its model repository path aside), what ouro-serve would serve: the demo
    # model of the installed package, complete.
    image_env = {k: v for k, v in dockerfile_env().items() if k != "OURO_MODEL_REPOSITORY"}
    chosen = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import json, sys; from ouro_backend.entrypoints.serve import resolve_model; "
            "print(json.dumps(resolve_model(None, json.loads(sys.argv[1]))))",
            json.dumps(image_env),
        ],
        env={k: v for k, v in env.items() if k != "OURO_MODEL_PATH"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    model, demo = json.loads(chosen.stdout)
    assert demo and model.startswith(str(env_dir)) and Path(model).name == DEMO_MODEL.name, model
    shipped = {p.name for p in DEMO_MODEL.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= shipped
    assert shipped <= {p.name for p in Path(model).iterdir()}, "files of the demo model missing from the install"
    assert "demo model" in r.stdout


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
