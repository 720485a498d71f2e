"""The wheel, as a user installs it: one top-level name, run-time files inside, and it works beside
Hugging Face's `kernels` package from any directory."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"


def _uv() -> str:
    uv = shutil.which("uv", path=os.path.dirname(sys.executable))
    if uv is None:
        pytest.skip("uv is not installed in this environment (the Makefile installs it)")
    return uv


def _run(cmd, cwd, env=None, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "laneplay"
    # Build from a copy of the tracked tree, as a clean clone would (no .venv, no build leftovers).
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    _run([_uv(), "build", "--wheel", "--out-dir", out, src], src, env=dict(os.environ, UV_NATIVE_TLS="1"))
    (whl,) = out.glob("laneplay-*.whl")
    return whl


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name_and_carries_its_run_time_files(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"laneplay"}, top
    for part in ("engine", "kernels", "storage", "evals", "app", "bench"):
        assert f"laneplay/{part}/__init__.py" in names
    assert "laneplay/cli.py" in names
    assert "laneplay/storage/migrations/script.py.mako" in names
    assert any(n.startswith("laneplay/storage/migrations/versions/0001_") for n in names)
    static = sorted(p.name for p in (ROOT / "static").glob("*") if p.is_file()) if (ROOT / "static").is_dir() else []
    for name in static:
        assert f"laneplay/static/{name}" in names
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_the_wheel_works_beside_transformers_and_kernels_from_any_directory(wheel, tmp_path):
    uv = _uv()
    venv = tmp_path / "venv"
    # PYTHONDONTWRITEBYTECODE: this throwaway venv's modules are not added to the run's bytecode cache
    env = dict(os.environ, UV_NATIVE_TLS="1", VIRTUAL_ENV=str(venv), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    _run([uv, "venv", "--python", sys.executable, venv], tmp_path, env=env)
    py = venv / "bin" / "python"
    links = [a for d in os.environ.get("PIP_FIND_LINKS", "").split() for a in ("--find-links", d)]
    # The wheel's requirements resolve to the pinned set the Makefile installs (torch's CPU build, ...)...
    plan = _run([uv, "pip", "install", "--dry-run", "--python", py, *links, "-c", LOCK, wheel, "transformers"],
                tmp_path, env=env)
    planned = {line[3:].strip().lower() for line in plan.stderr.splitlines() if line.startswith(" + ")}
    locked = {line.strip().lower() for line in LOCK.read_text().splitlines() if "==" in line}
    assert any(p.startswith("laneplay @ file:") for p in planned), planned
    assert {p for p in planned if "==" in p} <= locked and any(p.startswith("torch==") for p in planned), \
        sorted(planned - locked)
    # ...which this environment holds: the venv gets the wheel alone and finds those packages (and the
    # embedded model's wheel) in this environment's site-packages through a path file. Only plain folders
    # are added that way (path files inside them are not read), so this checkout's editable install of
    # `laneplay` stays out of the venv.
    _run([uv, "pip", "install", "--python", py, "--no-deps", wheel], tmp_path, env=env)
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    (next((venv / "lib").glob("python*/site-packages")) / "locked-deps.pth").write_text(f"{site}\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    laneplay = venv / "bin" / "laneplay"
    assert "generate" in _run([laneplay, "--help"], elsewhere, env=env).stdout
    probe = ("import kernels, transformers, laneplay.engine, laneplay.storage, laneplay.evals.sandbox, "
             "laneplay.evals.passk; print(kernels.__file__); print(laneplay.engine.__file__)")
    hf_kernels, ours = _run([py, "-c", probe], elsewhere, env=env).stdout.split()
    assert ours.startswith(str(venv)), ours  # our package from the wheel...
    assert "site-packages" in hf_kernels and Path(hf_kernels).parent != ROOT / "kernels", hf_kernels  # ...beside HF's
    gen = _run([laneplay, "generate", "--prompt", "def add(a, b):", "--max-tokens", "8", "--no-compile"], elsewhere,
               env=env)
    *body, last = gen.stdout.rstrip("\n").split("\n")
    assert "tokens/s" in last and "".join(body).strip(), gen.stdout
    db = _run([laneplay, "db", "upgrade", "--url", f"sqlite:///{tmp_path / 'x.db'}"], elsewhere, env=env)
    assert db.returncode == 0


@pytest.mark.parametrize("name", ["kernels"])
def test_the_repository_folders_do_not_shadow_installed_packages(name):
    # The suite runs with the repository root off sys.path: `import kernels` is Hugging Face's package.
    import importlib

    mod = importlib.import_module(name)
    assert "site-packages" in (mod.__file__ or ""), mod.__file__
    assert importlib.import_module(f"laneplay.{name}").__file__.startswith(str(ROOT))
