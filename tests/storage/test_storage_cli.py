"""`laneplay db upgrade` / `laneplay db current`, through the real dispatcher."""
import pytest

from laneplay.cli import main

from laneplay import storage


def test_db_upgrade_and_current(db_url, capsys):
    assert main(["db", "current", "--url", db_url]) == 1  # empty: not at head
    assert "(empty)" in capsys.readouterr().out
    assert main(["db", "upgrade", "--url", db_url, "--revision", "0001"]) == 0
    assert "0001" in capsys.readouterr().out
    assert main(["db", "upgrade", "--url", db_url]) == 0
    assert "revision 0007" in capsys.readouterr().out
    assert main(["db", "current", "--url", db_url]) == 0
    assert storage.current(db_url) == "0007"


def test_db_upgrade_uses_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LANEPLAY_DATABASE_URL", raising=False)
    monkeypatch.setenv("LANEPLAY_DATA_DIR", str(tmp_path / "d"))
    assert main(["db", "upgrade"]) == 0
    assert (tmp_path / "d" / "laneplay.db").is_file()
    assert "laneplay.db" in capsys.readouterr().out


def test_db_needs_an_action(capsys):
    with pytest.raises(SystemExit):
        main(["db"])
