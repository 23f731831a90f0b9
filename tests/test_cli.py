"""The command line: user errors are one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_default_is_lossless():
    r = run("generate", "-q", "--max-new-tokens", "24", "--check-lossless")
    assert r.returncode == 0, r.stderr
    assert '"lossless": true' in r.stderr
    assert r.stdout.startswith("def fibonacci(n):")


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", ""], "prompt is empty"),
    (["generate", "--prompt", "x" * 3000], "exceeds the served context"),
    (["generate", "--checkpoint", "/nonexistent"], "does not exist"),
    (["generate", "--checkpoint", "."], "not a usable checkpoint"),
])
def test_user_errors_are_one_line(args, msg, capsys):
    assert main(args + ["-q"]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_unknown_backend_is_refused_without_traceback():
    r = run("generate", "--backend", "tpu")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


def test_help_explains_every_option():
    r = run("generate", "--help")
    assert r.returncode == 0
    for opt in ("--checkpoint", "--backend", "-k", "--max-context", "--refeed-target-hidden",
                "--prompt", "--max-new-tokens", "--check-lossless"):
        assert opt in r.stdout
