#!/usr/bin/env python
"""Throughput of the evaluation's data pipeline against the single-core floor of decoding and preprocessing.

Makes ``--num-images`` 500x375 JPEGs (crops of the real photographs shipped by scikit-image and Debian's
``opencv-doc``, resized), preprocesses them to 224 px with the image processor the evaluation loads
(``hf_gsc.evaluation.models.load_model``: transformers' default backend, torchvision-backed when installed,
else PIL), scores them by MSP of a random-weight ViT (``--model``: ``cheap-vit``, one layer, so that the
measurement is of the data pipeline; ``vit-b16-random``, ViT-B/16) on ``--device``, and measures images/s
(``--measure`` picks a subset), writing JSON:

* ``floor_single_core``: **the floor**, one process on one core doing the least the job needs with PIL + numpy:
  ``Image.open`` + ``convert("RGB")``, ``Image.resize`` to the processor's output size with its filter (center
  crop if it crops), the batch stacked into one uint8 array, then float32 ``(x * rescale_factor - mean) / std`` and
  channels-first, as a torch tensor (:func:`floor_batch`). Its pixels differ from the processor's by float
  rounding only (``floor_max_abs_difference_from_processor``);
* ``processor_single_core``: decoding + the whole image processor (rescale and normalize included, float32 out)
  by the loop's own collate function, the reference the loop used to be judged against;
  ``processor_single_core_without_normalization``: the same stopping before rescale + normalize;
* ``worker_single_core``: one DataLoader worker's work as the loop runs it (decoding + ``ImageTransform.prepare``:
  uint8 out, normalization deferred to the model's device), without the DataLoader;
  every image decoded at full size, as every entry point of hf_gsc decodes it (:func:`hf_gsc.utils.images.decode`);
  ``worker_single_core_jpeg_draft``: the same work with JPEG draft mode, which hf_gsc does not use (a JPEG at least
  twice the processor's resize on each side decoded at 1/2, 1/4 or 1/8 scale by the decoder, :func:`jpeg_draft`):
  what the reduced decode would save; ``jpeg_draft`` in the JSON says whether it applied (``--photo-size``) and how
  far the first batch's uint8 pixels would move;
* ``model_only``: the model alone on preprocessed batches already on its device;
* ``workers_0``, ``workers_N``: the evaluation's loop as it runs (``image_transform`` + ``make_dataloader`` +
  ``score_split``) with 0 and N DataLoader workers (``--workers``; default 2 on a CPU, the evaluation's default on
  CUDA), and ``sweep_workers_<n>`` for each count of ``--worker-counts``; ``pixel_values_equal_to_baseline`` checks that one batch reaches the model with the processor's values;
  ``workers_N_normalization_in_workers``: the loop with N workers that run the whole processor and send float32.

Every single-core rate runs in a forked process with one torch thread, as a DataLoader worker does.

Timings on a shared machine drift over minutes, so ``--repeats`` rounds each measure everything once, in an order
rotated from round to round (no rate always runs first or after the same neighbour). The JSON lists every rate
per round and its median (``images_per_second``), and each ratio per round (both rates of a ratio come from the
same round, seconds apart) and the median of those. ``target``: on a CPU ``workers_N / floor_single_core`` at
least 1.5 (2 workers on 2 cores), on CUDA ``workers_N / model_only`` at least 0.8 (ViT-B/16); ``met`` is
judged on the median ratio, with the rounds at or above the threshold counted.

Where the time goes, less sensitive to other jobs than wall time: ``cpu_ms_per_image``, the CPU time per image of
each rate's processes (a single-core rate's process; a loop's main process and its workers, the main process's
share under ``cpu_ms_per_image_main_process``), and on a CPU ``target.ceiling_from_cpu_time``, the ratio the loop
would reach with all the cores it can use (workers + main process, at most the machine's) busy on its work alone:
those cores times the floor's CPU time per image over the loop's. The load average at the start
and at each round is recorded: figures meant for the docs come from a machine at rest (load average below 0.3).
A run is a whole pass over the images, the workers' start included: ``workers_N_first_batch_seconds`` (median)
is the time from a new loader to its first batch, a fixed cost per split that a real split (10^4 images or
more) amortises.

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
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hf_gsc.utils.images import decode, to_model_image


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


def make_jpegs(folder: Path, count: int, seed: int = 0, size: tuple[int, int] = SIZE) -> list[str]:
    """``count`` JPEGs of ``size`` (default 500x375): random 4:3 crops (at least half the photo's side) of the
    photographs, resized."""
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
        image = photo.crop((left, top, left + crop_w, top + crop_h)).resize(size, Image.BICUBIC)
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




class Floor:
    """The floor's settings, read off an image processor: what :func:`floor_batch` needs to do the processor's job.

    Supports the sizes the benchmark's models use: ``{"height", "width"}``, or ``{"shortest_edge"}`` with the longer
    side scaled as transformers does (``int(shortest_edge * long / short)``), then an optional center crop.
    """

    def __init__(self, processor) -> None:
        settings = {name: getattr(processor, name, None) for name in processor._valid_kwargs_names}
        settings = processor._standardize_kwargs(**settings)
        size = settings["size"]
        if not settings.get("do_resize") or not (size.shortest_edge or (size.height and size.width)) or (
                size.longest_edge or size.max_height):
            raise SystemExit(f"{type(processor).__name__}: the floor supports resizing to height x width or to a "
                             f"shortest edge, got do_resize={settings.get('do_resize')} size={dict(size)}")
        self.size, self.resample = size, int(settings["resample"] if settings["resample"] is not None else 2)
        crop = settings["crop_size"] if settings.get("do_center_crop") else None
        self.crop = (crop.height, crop.width) if crop is not None else None
        self.scale = np.float32(settings["rescale_factor"] if settings.get("do_rescale") else 1.0)
        mean, std = (settings["image_mean"], settings["image_std"]) if settings.get("do_normalize") else (0.0, 1.0)
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1)
        self.std = np.asarray(std, dtype=np.float32).reshape(-1)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the resize."""
        if self.size.height and self.size.width:
            return self.size.width, self.size.height
        short, long = sorted((width, height))
        new_short, new_long = self.size.shortest_edge, int(self.size.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)


def floor_batch(paths: list[str], floor: Floor) -> torch.Tensor:
    """The floor's work on one batch: decode, resize (and crop), stack, normalise: float32 ``(B, 3, H, W)``."""
    from PIL import Image

    arrays = []
    for path in paths:
        image = Image.open(path).convert("RGB")
        image = image.resize(floor.output_size(*image.size), resample=floor.resample)
        if floor.crop is not None:
            height, width = floor.crop
            left, top = (image.width - width) // 2, (image.height - height) // 2
            image = image.crop((left, top, left + width, top + height))
        arrays.append(np.asarray(image))
    batch = np.stack(arrays).astype(np.float32)  # (B, H, W, C): normalised in place, channels last
    batch *= floor.scale
    batch -= floor.mean
    batch /= floor.std
    return torch.from_numpy(np.ascontiguousarray(batch.transpose(0, 3, 1, 2)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", choices=sorted(MODELS), default="cheap-vit")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers of the loop (default: 2 on cpu, the evaluation's default on cuda)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                        help="the model (alone and in the loop) under torch.autocast in bf16, as a served model runs")
    parser.add_argument("--worker-counts", default="",
                        help="comma list of worker counts: the loop is also measured with each (workers_<n>)")
    parser.add_argument("--photo-size", default="500x375",
                        help="WxH of the JPEGs made; worker_single_core_jpeg_draft decodes a photo at least twice the "
                             "model's input on each side at a reduced scale (JPEG draft mode, not used by hf_gsc)")
    parser.add_argument("--measure", default=",".join(MEASUREMENTS),
                        help=f"comma list of what to measure (default: all): {','.join(MEASUREMENTS)}")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds, each measuring everything once; the JSON reports each round and the median")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.num_images < args.batch_size or args.batch_size < 1 or args.repeats < 1:
        parser.error("--num-images must be >= --batch-size >= 1 and --repeats >= 1")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    measure = [name for name in args.measure.split(",") if name]
    if unknown := sorted(set(measure) - set(MEASUREMENTS)):
        parser.error(f"--measure: unknown {unknown}; choose from {','.join(MEASUREMENTS)}")
    measure = [name for name in MEASUREMENTS if name in measure]  # each round's base order
    try:
        sweep = sorted({int(n) for n in args.worker_counts.split(",") if n})
        photo_size = tuple(int(side) for side in args.photo_size.lower().split("x"))
    except ValueError:
        parser.error("--worker-counts is a comma list of ints, --photo-size WxH")
    if any(n < 0 for n in sweep) or len(photo_size) != 2 or min(photo_size) < 32:
        parser.error("--worker-counts must be >= 0, --photo-size two sides of at least 32")
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
    from hf_gsc.evaluation.accelerator import make_accelerator
    from hf_gsc.evaluation.loaders import IndexedImages, default_num_workers, make_dataloader, model_pixel_values
    from hf_gsc.evaluation.loop import score_split
    from hf_gsc.evaluation.models import image_backend_of, image_transform, load_model
    from hf_gsc.utils.scores import ood_score

    workers = args.workers or (2 if args.device == "cpu" else default_num_workers("cuda"))
    device = torch.device(args.device)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_jpegs(Path(tmp), args.num_images, size=photo_size)
        model, processor, _, _ = load_model(str(save_model(args.model, Path(tmp) / "model")))
        model.to(device)
        dataset = datasets.Dataset.from_dict({"image": paths, "label": [0] * len(paths)}).cast_column("image", datasets.Image())
        transform = image_transform(processor, model)  # as the evaluation makes it: normalization deferred
        if transform.normalization is None:
            raise SystemExit(f"{type(processor).__name__}: normalization cannot be deferred; the benchmark measures "
                             "the loop with it deferred")
        channels = num_channels(model.config)
        whole_processor = ImageTransform(processor, channels, defer_normalization=False)
        processor_deferred = ImageTransform(processor, channels)
        processor_deferred.pil_preparation = None  # the processor itself up to rescale + normalize
        floor = Floor(processor)
        min_side = resize_min_side(processor)
        batches = [list(range(i, min(i + args.batch_size, len(paths)))) for i in range(0, len(paths), args.batch_size)]
        collates = {name: IndexedImages(dataset, how, "benchmark") for name, how in (
            ("processor_single_core", whole_processor), ("worker_single_core", transform),
            ("processor_single_core_without_normalization", processor_deferred))}

        def one_core_work(name: str) -> int:  # the work of one process; returns the number of images
            if name == "floor_single_core":
                return sum(floor_batch([paths[i] for i in batch], floor).shape[0] for batch in batches)
            if name == "worker_single_core_jpeg_draft":
                return sum(draft_batch([paths[i] for i in batch], transform, min_side).shape[0] for batch in batches)
            return sum(collates[name](batch)["pixel_values"].shape[0] for batch in batches)

        def timed(run, on_gpu: bool = device.type == "cuda") -> dict[str, float]:
            """One call of ``run`` (which returns the number of images), waiting for the GPU's work: images/s, and
            CPU milliseconds per image of this process and of its children that ended meanwhile (a loop's workers)."""
            begin, main, children = time.perf_counter(), cpu_seconds(), cpu_seconds(resource.RUSAGE_CHILDREN)
            count = run()
            if on_gpu:
                torch.cuda.synchronize()
            return {"rate": count / (time.perf_counter() - begin), "main": (cpu_seconds() - main) * 1e3 / count,
                    "workers": (cpu_seconds(resource.RUSAGE_CHILDREN) - children) * 1e3 / count}

        def in_a_fork(queue, name: str) -> None:  # a forked process, one thread, as a DataLoader worker runs
            queue.put(timed(lambda: one_core_work(name), on_gpu=False))  # a forked process can't use CUDA

        def single_core(name: str) -> dict[str, float]:
            context = multiprocessing.get_context("fork")
            queue = context.Queue()
            process = context.Process(target=in_a_fork, args=(queue, name))
            process.start()
            measured = queue.get()
            process.join()
            return measured

        # Preprocessed batches for the model alone, already on its device.
        # Decoded as the loop decodes them (at full size), so that the loop's pixels can be compared with these bit
        # for bit.
        pixel_batches = [whole_processor([decode(paths[i], transform.mode) for i in batch]).to(device)
                         for batch in batches]

        autocast_dtype = {"no": None, "bf16": torch.bfloat16}[args.mixed_precision]

        def msp(pixel_values: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
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
            iterator = iter(make_dataloader(dataset, transform, args.batch_size, workers, accelerator.device))
            next(iterator)
            seconds = time.perf_counter() - begin
            del iterator  # its workers end (and are reaped) now, not during a later measurement
            return seconds

        run = {  # name -> a function measuring images/s once
            **{name: (lambda name=name: single_core(name)) for name in SINGLE_CORE},
            "model_only": lambda: timed(model_alone),
            "workers_0": lambda: timed(lambda: scoring_loop(0)),
            "workers_N": lambda: timed(lambda: scoring_loop(workers)),
            "workers_N_normalization_in_workers": lambda: timed(lambda: scoring_loop(workers, defer=False)),
            **{f"sweep_workers_{n}": (lambda n=n: timed(lambda: scoring_loop(n))) for n in sweep},
        }
        measure = measure + [f"sweep_workers_{n}" for n in sweep]
        timed(model_alone)  # warm-up: CUDA context, kernels (and the allocator on a CPU)
        rates: dict[str, list[float]] = {name: [] for name in measure}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in measure}
        first_batch, load_per_round = [], []
        for round_index in range(args.repeats):
            load_per_round.append(round(os.getloadavg()[0], 2))
            shift = round_index % len(measure)
            for name in measure[shift:] + measure[:shift]:  # rotated: no rate always first
                measured = run[name]()
                rates[name].append(measured.pop("rate"))
                cpu[name].append(measured)
            first_batch.append(first_batch_seconds())
        # The loop's output is the baseline's: the same pixel values reach the model.
        first = next(iter(make_dataloader(dataset, transform, args.batch_size)))
        same_pixels = torch.equal(model_pixel_values(first, device), pixel_batches[0])
        floor_difference = float((floor_batch([paths[i] for i in batches[0]], floor) - pixel_batches[0].cpu()).abs().max())
        # What JPEG draft mode would change: the worker's uint8 pixels of the first batch with it and without it.
        full = collates["worker_single_core"](batches[0])["pixel_values"].float()
        drafted = draft_batch([paths[i] for i in batches[0]], transform, min_side).float()
        draft_result = {"min_side": min_side, "used_by_hf_gsc": False,
                        "applies": min_side is not None and min(photo_size) >= 2 * min_side,
                        "max_abs_difference_uint8": float((drafted - full).abs().max()),
                        "mean_abs_difference_uint8": round(float((drafted - full).abs().mean()), 3)}

    def key(name: str) -> str:  # JSON name: workers_N -> workers_2 etc.
        return name.replace("workers_N", f"workers_{workers}")

    def ratio(numerator: str, denominator: str) -> dict:
        per_round = [a / b for a, b in zip(rates[numerator], rates[denominator])]
        return {"per_round": [round(value, 2) for value in per_round], "median": round(median(per_round), 2)}

    ratios = {f"{key('workers_N')} / {key(name)}": ratio("workers_N", name) for name in RATIO_DENOMINATORS
              if name in rates and "workers_N" in rates}
    numerator, denominator, threshold = target
    target_ratio = ratios[f"{key(numerator)} / {key(denominator)}"]
    # CPU time per image (median over rounds): a single-core rate's process; a loop's main process + its workers.
    cpu_total = {name: median([part["main"] + part["workers"] for part in parts]) for name, parts in cpu.items()}
    cpu_main = {name: median([part["main"] for part in parts]) for name, parts in cpu.items() if name.startswith("workers")}
    target_result = {"ratio": f"{key(numerator)} / {key(denominator)}", "at_least": threshold,
                     "median": target_ratio["median"], "met": target_ratio["median"] >= threshold,
                     "rounds_at_least": sum(value >= threshold for value in target_ratio["per_round"])}
    if args.device == "cpu":
        # What the ratio would be with every core the loop can use (its workers and main process) busy all the time
        # on its work alone: the floor's CPU time per image over the loop's, times those cores.
        cores = min(os.cpu_count() or 1, workers + 1)
        target_result["ceiling_from_cpu_time"] = round(cores * cpu_total[denominator] / cpu_total[numerator], 2)
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "images": {"count": args.num_images, "size": list(photo_size), "format": "JPEG quality 90",
                   "source": "crops of scikit-image and opencv-doc photographs"},
        "model": MODELS[args.model],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "image_backend": image_backend_of(processor),
        "batch_size": args.batch_size,
        "mixed_precision": args.mixed_precision,
        "workers": workers,
        "repeats": args.repeats,
        "images_per_second": {key(name): round(median(values), 2) for name, values in rates.items()},
        "images_per_second_per_round": {key(name): [round(v, 2) for v in values] for name, values in rates.items()},
        "target": target_result,
        "ratios": ratios,
        "cpu_ms_per_image": {key(name): round(value, 3) for name, value in cpu_total.items()},
        "cpu_ms_per_image_main_process": {key(name): round(value, 3) for name, value in cpu_main.items()},
        f"workers_{workers}_first_batch_seconds": round(median(first_batch), 3),
        "pixel_values_equal_to_baseline": same_pixels,
        "jpeg_draft": draft_result,
        "floor_max_abs_difference_from_processor": floor_difference,
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": [round(v, 2) for v in load_before],
                    "load_average_per_round": load_per_round,
                    "load_average_after": [round(v, 2) for v in os.getloadavg()], "torch_threads": 1,
                    "python": platform.python_version(), "torch": torch.__version__},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def resize_min_side(image_processor) -> int | None:
    """The side below which the processor's resize would upsample an image: both sides of a JPEG may be decoded down
    to it by :func:`jpeg_draft`. ``{"height", "width"}``: the larger; ``{"shortest_edge"}``: that edge (over
    ``crop_pct`` where the processor resizes to it before cropping); ``None`` for a processor that does not resize."""
    import math

    size = getattr(image_processor, "size", None)
    if not getattr(image_processor, "do_resize", False) or size is None:
        return None
    side = {name: size.get(name) if isinstance(size, dict) else getattr(size, name, None)
            for name in ("height", "width", "shortest_edge")}
    if side["height"] and side["width"]:
        return int(max(side["height"], side["width"]))
    crop_pct = getattr(image_processor, "crop_pct", None)
    return int(math.ceil(side["shortest_edge"] / crop_pct)) if side["shortest_edge"] and crop_pct else side["shortest_edge"]


def jpeg_draft(image, min_side: int | None):
    """``image`` (opened, not yet decoded) set to decode a JPEG at 1/2, 1/4 or 1/8 scale where both sides stay at
    least ``min_side`` (PIL's ``draft``: the reduction happens inside the JPEG decoder). hf_gsc does not decode this
    way (:func:`hf_gsc.utils.images.decode` says why); measured here as the alternative."""
    if min_side is not None and image.format == "JPEG" and min(image.size) >= 2 * min_side:
        image.draft(image.mode, (min_side, min_side))
    return image


def draft_batch(paths: list[str], transform, min_side: int | None) -> torch.Tensor:
    """A worker's work on one batch with JPEG draft decoding: :func:`jpeg_draft`, the EXIF turn and 8-bit rule of
    :func:`hf_gsc.utils.images.to_model_image`, then ``transform.prepare`` (uint8 out)."""
    from PIL import Image

    return transform.prepare([to_model_image(jpeg_draft(Image.open(path), min_side), transform.mode)
                              for path in paths])


def median(values: list[float]) -> float:
    return float(np.median(values))


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


#: Rates measured by one process on one core (a forked process, as a DataLoader worker).
SINGLE_CORE = ("floor_single_core", "processor_single_core", "processor_single_core_without_normalization",
               "worker_single_core", "worker_single_core_jpeg_draft")
#: What can be measured (``--measure``), in each round's base order; ``workers_N`` is written with N.
MEASUREMENTS = (*SINGLE_CORE, "model_only", "workers_0", "workers_N", "workers_N_normalization_in_workers")
#: The ratios reported, ``workers_N`` over each of these (those measured).
RATIO_DENOMINATORS = ("floor_single_core", "processor_single_core", "model_only")
#: Per device: (numerator, denominator, at least): the targets.
TARGETS = {"cpu": ("workers_N", "floor_single_core", 1.5), "cuda": ("workers_N", "model_only", 0.8)}


if __name__ == "__main__":
    sys.exit(main())
