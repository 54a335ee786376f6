"""Every Python block in README.md runs as written; a ```text block right after one is its exact stdout."""
import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def readme_blocks():
    """[(heading, python source, expected stdout or None)] in README order."""
    text = README.read_text()
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        heading = re.findall(r"^#+ (.+)$", text[:m.start()], re.M)[-1]
        expected = None
        if i + 1 < len(fences) and fences[i + 1].group(1) == "text":
            between = text[m.end():fences[i + 1].start()]
            # Only prose that introduces the output (one short paragraph) may sit in between.
            if between.strip().count("\n") == 0:
                expected = fences[i + 1].group(2)
        blocks.append((heading, m.group(2), expected))
    return blocks


BLOCKS = readme_blocks()


def test_readme_has_the_blocks_it_promises():
    headings = [h for h, _, _ in BLOCKS]
    for h in ("Pure training step", "Running a saved step: `torch_ext.load_step`", "Memory planning",
              "Reactive sweeps", "IR and executor"):
        assert h in headings, headings
    assert any(expected for _, _, expected in BLOCKS), "the IR example's printed form is checked"


@pytest.mark.parametrize("heading,source,expected", BLOCKS, ids=[f"{i}-{h}" for i, (h, _, _) in enumerate(BLOCKS)])
def test_readme_block_runs(heading, source, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write step.pt2, heatmap.png, ...
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, f"README.md ({heading})", "exec"), {"__name__": "__readme__"})
    if expected is not None:
        assert out.getvalue().rstrip("\n") == expected.rstrip("\n")
