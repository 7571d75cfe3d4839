#!/usr/bin/env python
"""Throughput of the evaluation's data pipeline: does scoring keep up with decoding and preprocessing?

Makes ``--num-images`` 500x375 JPEGs (crops of the real photographs shipped by scikit-image and Debian's
``opencv-doc``, resized), preprocesses them to 224 px with the image processor the evaluation loads
(``hf_gsc.evaluation.models.load_model``: transformers' default backend, torchvision-backed when installed,
else PIL), scores them by MSP of a random-weight ViT (``--model``: ``cheap-vit``, one layer, so that the
measurement is of the data pipeline; ``vit-b16-random``, ViT-B/16) on ``--device``, and measures (``--measure``
picks a subset), writing JSON:

* ``decode_preprocess_single_core``: images/s of decoding + the whole image processor (rescale and normalize
  included, float32 out) in one process, one thread, by the loop's own collate function (``IndexedImages``) in a
  forked process, as a DataLoader worker runs it: one worker's work without the DataLoader. Outside
  ``images_per_second``: ``..._without_normalization``, the same stopping before rescale + normalize (what a
  worker does in the loop);
* ``model_only``: images/s of the model alone on preprocessed batches already on its device;
* ``workers_0``, ``workers_N``: images/s of the evaluation's loop as it runs (``image_transform`` +
  ``make_dataloader`` + ``score_split``) with 0 and N DataLoader workers (``--workers``; default 2 on a CPU, the
  evaluation's default on CUDA). The workers stop before rescale + normalize and send uint8 batches, which are
  normalized on the model's device (``hf_gsc.data.normalization``); the model gets the baseline's pixel values
  (``pixel_values_equal_to_baseline`` checks one batch);
* for reference, outside ``images_per_second``: ``workers_N_normalization_in_workers``, the loop with N workers
  that run the whole processor and send float32;
* ``target``: on a CPU ``workers_N / decode_preprocess_single_core`` (at least 1.5 with 2 workers on 2 cores), on
  CUDA ``workers_N / model_only`` (at least 0.8 for ViT-B/16): the best rates' ratio, and the ratio per round.

``--repeats`` rounds each measure everything once, in turn (the machine's speed drifts over minutes when other
jobs run; interleaving gives every rate the same conditions); each rate is the best of its rounds. A run is a
whole pass over the images, the workers' start included: ``workers_N_first_batch_seconds`` (median) is the time
from a new loader to its first batch, a fixed cost per split that a real split (10^4 images or more) amortises and
a short pass does not. The load average before and after is recorded with the numbers.

    python scripts/benchmark_data_loading.py --output docs/results/data_loading/cpu2.json
    python scripts/benchmark_data_loading.py --model vit-b16-random --device cuda --batch-size 64 \\
        --measure model_only,workers_N --repeats 2 --output gpu.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PHOTO_DIRS = ("/usr/share/doc/opencv-doc/examples/data",)
PHOTO_NAMES = ("baboon.jpg", "building.jpg", "fruits.jpg", "lena.jpg", "orange.jpg", "butterfly.jpg", "aero1.jpg",
               "board.jpg", "home.jpg", "starry_night.jpg", "apple.jpg", "messi5.jpg", "pic1.png", "pic3.png")
SIZE = (500, 375)


def photographs() -> list:
    """Real photographs as RGB PIL images: scikit-image's and opencv-doc's (those present)."""
    from PIL import Image
    from skimage import data

    photos = [Image.fromarray(getattr(data, name)()).convert("RGB")
              for name in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "motorcycle_left")
              if hasattr(data, name)]
    for folder in PHOTO_DIRS:
        for name in PHOTO_NAMES:
            if (Path(folder) / name).is_file():
                photos.append(Image.open(Path(folder) / name).convert("RGB"))
    return photos


def make_jpegs(folder: Path, count: int, seed: int = 0) -> list[str]:
    """``count`` 500x375 JPEGs: random 4:3 crops (at least half the photo's side) of the photographs, resized."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = photographs()
    paths = []
    for index in range(count):
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w = int(rng.uniform(0.5, 1.0) * min(width, height * 4 / 3))
        crop_h = int(crop_w * 3 / 4)
        left, top = rng.integers(0, width - crop_w + 1), rng.integers(0, height - crop_h + 1)
        image = photo.crop((left, top, left + crop_w, top + crop_h)).resize(SIZE, Image.BICUBIC)
        path = folder / f"{index:05d}.jpg"
        image.save(path, quality=90)
        paths.append(str(path))
    return paths


MODELS = {
    "cheap-vit": "random-weight ViT (1 layer, width 32, 32 px patches), 224 px, MSP",
    "vit-b16-random": "random-weight ViT-B/16 (transformers' default ViTConfig), 224 px, MSP",
}


def save_model(name: str, folder: Path) -> Path:
    """A random-weight ViT of :data:`MODELS` and a 224 px image processor, saved to ``folder``. ``cheap-vit`` is
    cheap, so that the measurement is of the data pipeline; ``vit-b16-random`` is the GPU target's model."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    torch.manual_seed(0)
    config = ViTConfig(num_labels=1000) if name == "vit-b16-random" else ViTConfig(
        image_size=224, patch_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=10)
    ViTForImageClassification(config).save_pretrained(folder)
    # Saved as the PIL class; the evaluation loads it with transformers' default backend choice.
    ViTImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", choices=sorted(MODELS), default="cheap-vit")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers of the loop (default: 2 on cpu, the evaluation's default on cuda)")
    parser.add_argument("--measure", default=",".join(MEASUREMENTS),
                        help=f"comma list of what to measure (default: all): {','.join(MEASUREMENTS)}")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each rate is the best of its rounds")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.num_images < args.batch_size or args.batch_size < 1 or args.repeats < 1:
        parser.error("--num-images must be >= --batch-size >= 1 and --repeats >= 1")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    measure = [name for name in args.measure.split(",") if name]
    if unknown := sorted(set(measure) - set(MEASUREMENTS)):
        parser.error(f"--measure: unknown {unknown}; choose from {','.join(MEASUREMENTS)}")
    target = TARGETS[args.device]
    if not set(target[:2]) <= set(measure):
        parser.error(f"--measure must include {target[0]} and {target[1]} (the {args.device} target's ratio)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # the accelerator's device, even where a GPU exists
    torch.set_num_threads(1)
    import datasets

    from hf_gsc.data import ImageTransform, num_channels
    from hf_gsc.evaluation.loop import (IndexedImages, default_num_workers, make_accelerator, make_dataloader,
                                        model_pixel_values, score_split)
    from hf_gsc.evaluation.models import image_backend_of, image_transform, load_model
    from hf_gsc.scores import ood_score

    workers = args.workers or (2 if args.device == "cpu" else default_num_workers("cuda"))
    device = torch.device(args.device)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_jpegs(Path(tmp), args.num_images)
        model, processor, _, _ = load_model(str(save_model(args.model, Path(tmp) / "model")))
        model.to(device)
        dataset = datasets.Dataset.from_dict({"image": paths, "label": [0] * len(paths)}).cast_column("image", datasets.Image())
        transform = image_transform(processor, model)  # as the evaluation makes it: normalization deferred
        if transform.normalization is None:
            raise SystemExit(f"{type(processor).__name__}: normalization cannot be deferred; the benchmark measures "
                             "the loop with it deferred")
        whole_processor = ImageTransform(processor, num_channels(model.config), defer_normalization=False)
        batches = [list(range(i, min(i + args.batch_size, len(paths)))) for i in range(0, len(paths), args.batch_size)]
        collate = IndexedImages(dataset, whole_processor, "benchmark")
        collate_deferred = IndexedImages(dataset, transform, "benchmark")

        def decode_and_preprocess(deferred: bool = False) -> int:  # what a DataLoader worker does per batch
            return sum((collate_deferred if deferred else collate)(batch)["pixel_values"].shape[0] for batch in batches)

        def timed(run, on_gpu: bool = device.type == "cuda") -> float:
            """images/s of one call of ``run`` (which returns the number of images), waiting for the GPU's work."""
            begin = time.perf_counter()
            count = run()
            if on_gpu:
                torch.cuda.synchronize()
            return count / (time.perf_counter() - begin)

        def as_a_worker(queue, deferred: bool) -> None:  # in a forked process, as a DataLoader worker runs
            queue.put(timed(lambda: decode_and_preprocess(deferred), on_gpu=False))  # a forked process can't use CUDA

        def single_core_as_a_worker(deferred: bool = False) -> float:
            context = multiprocessing.get_context("fork")
            queue = context.Queue()
            process = context.Process(target=as_a_worker, args=(queue, deferred))
            process.start()
            rate = queue.get()
            process.join()
            return rate

        # Preprocessed batches for the model alone, already on its device.
        pixel_batches = [whole_processor(dataset[batch]["image"]).to(device) for batch in batches]

        def msp(pixel_values: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return ood_score(model(pixel_values=pixel_values).logits, "msp")

        def model_alone() -> int:
            return sum(msp(pixel_values).shape[0] for pixel_values in pixel_batches)

        accelerator = make_accelerator("no")

        def scoring_loop(num_workers: int, defer: bool = True) -> int:
            loader = make_dataloader(dataset, transform if defer else whole_processor, args.batch_size, num_workers,
                                     accelerator.device)
            return score_split(accelerator, loader, {"msp": msp})["msp"].numel()

        def first_batch_seconds() -> float:  # the fixed cost of a pass: workers start, first batch decoded
            begin = time.perf_counter()
            next(iter(make_dataloader(dataset, transform, args.batch_size, workers, accelerator.device)))
            return time.perf_counter() - begin

        run = {  # name -> a function measuring images/s once
            "decode_preprocess_single_core": single_core_as_a_worker,
            "decode_preprocess_single_core_without_normalization": lambda: single_core_as_a_worker(deferred=True),
            "model_only": lambda: timed(model_alone),
            "workers_0": lambda: timed(lambda: scoring_loop(0)),
            "workers_N": lambda: timed(lambda: scoring_loop(workers)),
            "workers_N_normalization_in_workers": lambda: timed(lambda: scoring_loop(workers, defer=False)),
        }
        timed(model_alone)  # warm-up: CUDA context, kernels (and the allocator on a CPU)
        # Rounds, each measuring everything once in turn: the machine's speed drifts over minutes (other jobs), so
        # every rate sees the same conditions, and each round gives a ratio measured minutes apart at most.
        rates: dict[str, list[float]] = {name: [] for name in measure}
        first_batch = []
        for _ in range(args.repeats):
            for name in measure:
                rates[name].append(run[name]())
            first_batch.append(first_batch_seconds())
        # The loop's output is the baseline's: the same pixel values reach the model.
        first = next(iter(make_dataloader(dataset, transform, args.batch_size)))
        same_pixels = torch.equal(model_pixel_values(first, device), pixel_batches[0])

    def key(name: str) -> str:  # JSON name: workers_N -> workers_2 etc.
        return name.replace("workers_N", f"workers_{workers}")

    best_rates = {key(name): round(max(values), 2) for name, values in rates.items()}
    numerator, denominator, threshold = (key(name) if isinstance(name, str) else name for name in target)
    ratio = best_rates[numerator] / best_rates[denominator]
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "images": {"count": args.num_images, "size": list(SIZE), "format": "JPEG quality 90",
                   "source": "crops of scikit-image and opencv-doc photographs"},
        "model": MODELS[args.model],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "image_backend": image_backend_of(processor),
        "batch_size": args.batch_size,
        "workers": workers,
        "repeats": args.repeats,
        "images_per_second": {name: value for name, value in best_rates.items() if name in PRIMARY or
                              name == key("workers_N")},
        **{name: value for name, value in best_rates.items() if name not in PRIMARY and name != key("workers_N")},
        f"workers_{workers}_first_batch_seconds": round(sorted(first_batch)[len(first_batch) // 2], 3),
        "pixel_values_equal_to_baseline": same_pixels,
        "target": {"ratio": f"{numerator} / {denominator}", "value": round(ratio, 2), "at_least": threshold,
                   "met": ratio >= threshold,
                   "per_round": [round(a / b, 2) for a, b in zip(rates[target[0]], rates[target[1]])]},
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": [round(v, 2) for v in load_before],
                    "load_average_after": [round(v, 2) for v in os.getloadavg()], "torch_threads": 1,
                    "python": platform.python_version(), "torch": torch.__version__},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


#: What can be measured (``--measure``), in the order each round runs them; ``workers_N`` is written with N.
MEASUREMENTS = ("decode_preprocess_single_core", "decode_preprocess_single_core_without_normalization",
                "model_only", "workers_0", "workers_N", "workers_N_normalization_in_workers")
#: Rates listed under ``images_per_second`` (with ``workers_N``); the others are references.
PRIMARY = ("decode_preprocess_single_core", "model_only", "workers_0")
#: Per device: (numerator, denominator, at least): the issue's targets.
TARGETS = {"cpu": ("workers_N", "decode_preprocess_single_core", 1.5), "cuda": ("workers_N", "model_only", 0.8)}


if __name__ == "__main__":
    sys.exit(main())
