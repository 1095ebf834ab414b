"""Every file a quick start writes in the repository is one git ignores.

The README's and the docs' commands write their inputs and outputs in the folder they are run
from, the repository root for a new user (``cat > input.jsonl``, ``-o output.jsonl``, the Python
clients' ``output_file_path=``, the server's default storage folder). Each such path must be
ignored, so that trying the quick starts leaves ``git status`` clean. Paths outside the
repository (``/tmp/...``) and placeholders (``OUT``, ``PATH``) are not files a user writes there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from batchgen.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
NAME = r"([A-Za-z0-9_.][A-Za-z0-9_./-]*)"
#: The ways a shell command in a code block writes a file.
SHELL_WRITES = [
    re.compile(rf"(?:^|[\s;|&])>>?\s*{NAME}"),  # a redirection: > FILE, >> FILE, cat > FILE
    re.compile(rf"(?:^|\s)(?:-o|--output|--error-output)[\s=]+{NAME}"),  # -o FILE
    re.compile(rf"\btee\s+(?:-a\s+)?{NAME}"),
]
#: The ways Python code in a code block writes a file.
PYTHON_WRITES = [
    re.compile(rf"(?:output|error)_file_path\s*=\s*[\"']{NAME}[\"']"),  # the batchgen client
    re.compile(rf"open\(\s*[\"']{NAME}[\"']\s*,\s*[\"'][wax]"),
]
WRITES = {"bash": SHELL_WRITES, "sh": SHELL_WRITES, "console": SHELL_WRITES, "python": PYTHON_WRITES}


def written_files(text: str) -> set[str]:
    """Relative paths that the shell and Python code blocks in ``text`` write (placeholders left out)."""
    found: set[str] = set()
    for language, block in FENCE.findall(text):
        for pattern in WRITES.get(language.strip(), []):
            for name in pattern.findall(block):
                if not name.isupper() and name != "dev/null":
                    found.add(name)
    return found


def test_the_scanner_finds_each_way_of_writing_a_file() -> None:
    text = (
        "```bash\ncat > a.jsonl <<'X'\nX\ncurl -s URL -o b.jsonl\nprintf x > c.jsonl\n"
        "batchgen download ID -o OUT\necho 1 >> d.log\nx | tee e.txt\ncurl x > /tmp/f.json\n```\n"
        '```python\nclient.submit_batch(output_file_path="g.jsonl")\nopen("h.jsonl", "wb")\n```\n'
        "outside a block: cat > z.jsonl\n"
    )
    assert written_files(text) == {"a.jsonl", "b.jsonl", "c.jsonl", "d.log", "e.txt", "g.jsonl", "h.jsonl"}


QUICK_START_FILES = sorted(
    {name for document in DOCUMENTS for name in written_files(document.read_text(encoding="utf-8"))}
)


def test_the_readme_quick_starts_are_scanned() -> None:
    assert {"input.jsonl", "output.jsonl", "embeddings.jsonl"} <= set(QUICK_START_FILES)


@pytest.mark.live  # runs git
@pytest.mark.parametrize("name", [*QUICK_START_FILES, f"{ServerSettings().storage_path}/metadata.sqlite3"])
def test_a_file_a_quick_start_writes_is_ignored_by_git(name: str) -> None:
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--quiet", name], cwd=ROOT, capture_output=True, timeout=30
    )
    assert result.returncode == 0, f"{name} is written by a quick start but not ignored by .gitignore"
