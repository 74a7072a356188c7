"""The daemon's settings: defaults < TOML file < GRADLOC_AGENT_* environment < flags; validated once."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.config import AgentConfig, load_config
from gradloc.errors import ConfigError


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('[agent]\nhttp = "127.0.0.1:1111"\nstraggler_deadline_s = 3.5\nqueue_size = 7\n')
    env = {"GRADLOC_AGENT_STRAGGLER_DEADLINE_S": "4.5", "GRADLOC_AGENT_OTLP_INSECURE": "false"}
    cfg = load_config(str(f), env, {"queue_size": 9})
    assert cfg.http == "127.0.0.1:1111"  # file
    assert cfg.straggler_deadline_s == 4.5 and cfg.otlp_insecure is False  # env over file
    assert cfg.queue_size == 9  # flag over file
    assert cfg.ingest == AgentConfig().ingest  # default


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "a.toml"
    f.write_text('db = "none"\n')
    assert load_config(None, {"GRADLOC_AGENT_CONFIG": str(f)}).db == "none"


@pytest.mark.parametrize("source,match", [
    ({"env": {"GRADLOC_AGENT_QUEUE_SIZE": "many"}}, "queue_size must be int"),
    ({"env": {"GRADLOC_AGENT_NO_SUCH": "1"}}, "unknown setting GRADLOC_AGENT_NO_SUCH"),
    ({"flags": {"ingest": "localhost"}}, "ingest: expected host:port"),
    ({"flags": {"straggler_deadline_s": 0}}, "straggler_deadline_s must be > 0"),
    ({"flags": {"log_level": "loud"}}, "log_level"),
    ({"file": 'nope = 1\n'}, "unknown setting"),
    ({"file": 'queue_size = [\n'}, "config file"),
])
def test_bad_settings_are_clear_errors(tmp_path: Path, source: dict, match: str) -> None:
    path = None
    if "file" in source:
        path = tmp_path / "bad.toml"
        path.write_text(source["file"])
    with pytest.raises(ConfigError, match=match):
        load_config(str(path) if path else None, source.get("env", {}), source.get("flags"))


def test_serve_reports_a_bad_flag_without_a_traceback() -> None:
    res = CliRunner().invoke(main, ["serve", "--ingest", "nowhere", "--db", "none"])
    assert res.exit_code == 2 and "ingest: expected host:port" in res.output and "Traceback" not in res.output


def test_the_daemon_never_imports_torch() -> None:
    """Its memory budget (300 MB) cannot afford torch; the agent side must stay torch-free."""
    code = ("import sys, gradloc.agent.cli, gradloc.agent.daemon, gradloc.transport.server, "
            "gradloc.exporters.otlp, gradloc.agent.correlator; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
