"""``hf-gsc docs``: the installed pages read whole (the API pages' generator lines become each object's signature
and docstring) and a reader that closes the pipe early (``| head``) ends the output quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]


def test_a_closed_pipe_ends_the_output_quietly():
    for page in ("evaluation", "api/pipeline"):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line (head -0)
        done = subprocess.run([sys.executable, "-m", "hf_gsc", "docs", page], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=REPO_ROOT, timeout=120)
        os.close(write)
        assert done.returncode == 0 and done.stderr == "", (page, done.stderr)


def test_api_pages_print_each_objects_reference(capsys):
    from hf_gsc.utils.docs import docs_main

    assert docs_main(["api/pipeline"]) == 0
    text = capsys.readouterr().out
    assert ":::" not in text
    assert "### `hf_gsc.OODImageClassificationPipeline(" in text and "(`help(hf_gsc.OODImageClassificationPipeline)`" in text
    import hf_gsc

    first_line = hf_gsc.OODImageClassificationPipeline.__doc__.strip().splitlines()[0]
    assert first_line in text
    # The other pages print as they are.
    assert docs_main(["evaluation"]) == 0
    assert capsys.readouterr().out == (REPO_ROOT / "docs" / "evaluation.md").read_text()
