"""The README runs as written: its Python examples, and its shell commands in order in an empty
folder. The ```python examples of ``docs/*.md`` run too (```py blocks are illustrations that need
GPUs or several processes and are not run)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: A shell line carrying this comment is skipped where no CUDA GPU is present.
NEEDS_GPU = "# needs a GPU"


def _python_blocks(path: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _shell_lines(path: Path = README) -> list[str]:
    """The lines of every ```bash block, in order, with continuation lines joined."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        pending = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            lines.append(pending + line)
            pending = ""
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _runnable(line: str) -> bool:
    """Whether the test runs ``line``: ``placement ...`` and ``python -c ...`` commands.

    The two ``bash scripts/...`` commands are what runs this test (setup, the suite, the demo)."""
    return line.split()[0] in ("placement", "python")


def test_readme_has_examples():
    assert _python_blocks() and any(_runnable(line) for line in _shell_lines())


def test_readme_shell_lines_are_known():
    """Every shell line is either run by the test below or one of the two setup commands."""
    for line in _shell_lines():
        assert _runnable(line) or line.startswith("bash scripts/"), line


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_blocks()[index], f"README.md[python block {index}]", "exec"), {})


_DOC_BLOCKS = [(path.name, i) for path in sorted(DOCS.glob("*.md")) for i in range(len(_python_blocks(path)))]


@pytest.mark.parametrize(("page", "index"), _DOC_BLOCKS, ids=[f"{p}-{i}" for p, i in _DOC_BLOCKS])
def test_docs_example_runs(page, index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_blocks(DOCS / page)[index], f"docs/{page}[python block {index}]", "exec"), {})


def _outputs(argv: list[str]) -> list[str]:
    """The files a command line says it writes (``-o``/``--output``)."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("-o", "--output")]


def _run_line(line: str, tmp_path: Path, capsys: pytest.CaptureFixture, *, dry_launch: bool) -> None:
    """Run one README shell line in ``tmp_path`` and check it wrote what it says it writes."""
    from placement.cli import main

    argv = shlex.split(line, comments=True)
    launch = argv[:2] == ["placement", "launch"]
    if argv[0] == "python":
        done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, check=False)
        assert done.returncode == 0, (line, done.stderr[-2000:])
    else:
        status = main(argv[1:] + (["--dry-run"] if launch and dry_launch else []))
        captured = capsys.readouterr()
        assert status == 0, (line, captured.err[-2000:], captured.out[-2000:])
        if launch and dry_launch:
            assert "-m placement.launch" in captured.out, captured.out
            return
    for written in _outputs(argv):
        made = tmp_path / written
        assert made.exists() or made.with_suffix(".dot").exists(), (line, written)


def _lines_to_run() -> list[str]:
    import torch

    gpu = torch.cuda.is_available()
    return [line for line in filter(_runnable, _shell_lines()) if gpu or NEEDS_GPU not in line]


def _is_launch(line: str) -> bool:
    return line.startswith("placement launch")


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    """Each ``placement`` line through the CLI's entry point, each ``python -c`` line in a fresh
    interpreter, in README order in one empty folder (later commands read earlier ones' files).
    ``placement launch`` lines run with ``--dry-run`` here (the model is loaded, the ranks counted
    and the torchrun command built); ``test_readme_launch_commands_run`` runs them for real."""
    monkeypatch.chdir(tmp_path)
    lines = _lines_to_run()
    for line in lines:
        _run_line(line, tmp_path, capsys, dry_launch=True)
    assert len(lines) >= 10


@pytest.mark.slow
def test_readme_launch_commands_run(tmp_path, monkeypatch, capsys):
    """The README's ``placement launch`` lines for real (torchrun, 2 processes each), after only the
    earlier lines that write the files they read."""
    monkeypatch.chdir(tmp_path)
    lines = _lines_to_run()
    launches = [line for line in lines if _is_launch(line)]
    assert launches
    reads = {_file_of(arg) for line in launches for arg in shlex.split(line, comments=True)[2:]}
    for line in lines:
        if _is_launch(line) or _writes(line) & reads:
            _run_line(line, tmp_path, capsys, dry_launch=False)
    for line in launches:
        for written in _outputs(shlex.split(line, comments=True)):
            assert (tmp_path / written).exists(), line


def _file_of(arg: str) -> str:
    """``idx=idx.npy`` -> ``idx.npy``; any other argument as it is."""
    return arg.partition("=")[2] if "=" in arg and not arg.startswith("-") else arg


def _writes(line: str) -> set[str]:
    """Files a line writes: its ``-o``/``--output`` and the names a ``python -c`` line saves."""
    argv = shlex.split(line, comments=True)
    return set(_outputs(argv)) | set(re.findall(r"np\.save\('([^']+)'", line))
