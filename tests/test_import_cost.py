"""What ``from hf_gsc import AutoOODDetector`` imports beyond transformers' models: every method, not
``transformers.pipelines`` (its tokenizers and processors), which is imported, and the ``ood-image-classification``
task registered, only when a pipeline is built. Measured with
``python -X importtime -c "from hf_gsc import AutoOODDetector"`` (the report names the numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
from hf_gsc import AutoOODDetector, DETECTORS
before = "transformers.pipelines" in sys.modules
import transformers
from transformers.pipelines import PIPELINE_REGISTRY
print(json.dumps({"pipelines_with_the_import": before, "methods": len(DETECTORS),
                  "registered": "ood-image-classification" in PIPELINE_REGISTRY.get_supported_tasks()}))
"""


def test_the_public_names_import_no_pipeline_module_and_the_task_still_registers():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["pipelines_with_the_import"] is False
    assert seen["registered"] is True and seen["methods"] > 10
