"""The evaluation's fit (:func:`hf_gsc.evaluation.fitting.fit_detectors`) of one detector of each kind of fit, on the
processes it is launched on: ``python fit_on_processes.py OUT`` or ``accelerate launch ... fit_on_processes.py OUT``.

Data: :data:`NUM_IMAGES` 16x16 images (one of them unreadable, left out) cut into batches of :data:`BATCH_SIZE`, an
odd number of batches, so that 2 processes get uneven shares. Methods: KNN (a bank), Mahalanobis (float64 class sums
and a Gram matrix), ReAct (a percentile), AdaSCALE-A (per-sample statistics and a seeded subsample of them) and GSC
with the Fisher selection (a reduced float64 sum), on a tiny float64 ViT. Each process writes its fitted states
(``OUT/state-{rank}.safetensors``) and, on the main process, the fit outcome (``OUT/outcome.json``); the fits
themselves are saved in ``OUT/run`` as the evaluation saves them. Then the same data fitted with unreadable images
raising: each process writes the error it raised (``OUT/raised-{rank}.txt``, empty if none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, when launched as a script

NUM_IMAGES = 27
BATCH_SIZE = 4  # 7 batches: 4 on the first process, 3 on the second
BROKEN_ROW = 9
METHODS = {"knn": {"k": 3}, "mahalanobis": {}, "react": {}, "adascale_a": {"num_samples": 10},
           "gsc": {"selection": "fisher"}, "nac": {}}


def to_pixels(images: list) -> torch.Tensor:
    """16x16 RGB images -> ``(B, 3, 16, 16)`` float64 in [0, 1]."""
    return torch.stack([torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0).permute(2, 0, 1)
                        for image in images])


def fit_data():
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [{"bytes": None, "path": None} for _ in range(NUM_IMAGES)]
    for index in range(NUM_IMAGES):
        image = Image.fromarray(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8), "RGB")
        images[index] = image
    images[BROKEN_ROW] = {"bytes": b"not an image", "path": None}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=5)})
    return datasets.Dataset.from_dict({"image": images, "label": [i % 5 for i in range(NUM_IMAGES)]},
                                      features=features)


def main(out: Path) -> None:
    from conftest import make_tiny_model
    from safetensors.torch import save_file

    from hf_gsc.data.decoding import UndecodableImageError
    from hf_gsc.detectors import get_detector
    from hf_gsc.evaluation.accelerator import make_accelerator
    from hf_gsc.evaluation.context import RunContext
    from hf_gsc.evaluation.fitting import fit_detectors

    accelerator = make_accelerator("no")
    model = make_tiny_model("vit")
    detectors = {name: get_detector(name, model, **settings) for name, settings in METHODS.items()}
    data = fit_data()
    context = RunContext(accelerator, to_pixels, BATCH_SIZE, on_error="skip", seed=0, output_dir=out / "run",
                         source="fit_on_processes")
    outcome = fit_detectors(context, detectors, list(METHODS), {name: data for name in METHODS},
                            {name: f"fingerprint-{name}" for name in METHODS})
    save_file({f"{name}.{key}": value.detach().cpu().contiguous() for name, detector in detectors.items()
               for key, value in detector.fitted_state().items()}, str(out / f"state-{accelerator.process_index}.safetensors"))
    # Unreadable images raise: on every process, also on the one whose share holds none, naming the row.
    try:
        fit_detectors(context.replace(output_dir=None, on_error="raise"), {"knn": get_detector("knn", model, k=3)},
                      ["knn"], {"knn": data}, {})
        raised = ""
    except UndecodableImageError as error:
        raised = str(error)
    (out / f"raised-{accelerator.process_index}.txt").write_text(raised)
    if accelerator.is_main_process:
        (out / "outcome.json").write_text(json.dumps({"failed": outcome.failed, "passes": outcome.passes,
                                                      "images_per_process": outcome.images_per_process}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
