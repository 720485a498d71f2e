"""The evals tests run generated code only inside the sandbox: without bubblewrap they fail loudly."""
import os

import pytest

from laneplay.evals import sandbox


@pytest.fixture
def sandboxed(monkeypatch):
    """Makes sure this test really goes through bubblewrap (no unsafe opt-out from the environment)."""
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    ok, reason = sandbox.sandbox_available()
    if not ok:
        pytest.fail(f"the sandbox is required for this test: {reason}")
    return sandbox


@pytest.fixture
def data_dir_tmp():
    """A temp dir under ./data (where the app keeps its database), i.e. outside the sandbox's private /tmp."""
    import shutil
    import tempfile
    from pathlib import Path

    data = Path.cwd() / "data"
    created = not data.exists()
    data.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="laneplay-evals-test-", dir=data))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if created:
            try:
                os.rmdir(data)
            except OSError:
                pass
