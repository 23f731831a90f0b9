"""The README's embedding example runs as written (on the host backend, with the shipped
checkpoint), so it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_batch_embedding_example_runs(capsys, monkeypatch):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Embedding it: drafting for a batch", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3  # one continuation per sequence, each longer than its prompt
    for line, prompt in zip(lines, ("def main(argv):", "import os", "class Parser:")):
        assert line.startswith(repr(prompt)[:-1]) and len(line) > len(repr(prompt)) + 8
