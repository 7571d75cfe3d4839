#!/usr/bin/env python
"""Train a small reference classifier (ViT, Swin or ResNet from ``transformers`` configs) on CPU.

Trains on the benchmark's ``train`` split only (55,000 Fashion-MNIST images for ``fmnist-ood``),
reports ``validation`` accuracy each epoch and ``test`` accuracy once at the end, and writes to
``--output-dir``:

* ``config.json`` + ``model.safetensors`` (``save_pretrained``; ``config.id2label`` = class names),
* ``preprocessor_config.json`` (a ViT image processor with the exact normalisation used here, so
  ``AutoImageProcessor.from_pretrained(output_dir)`` reproduces the training-time transform),
* ``training_results.json`` (arch, config summary, seed, epochs, train time, accuracies, versions).

Example (what produced the shipped checkpoints, one at a time on 2 shared CPU cores)::

    python scripts/train_reference_models.py --arch resnet --output-dir hf_gsc/reference_models/resnet
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm import tqdm
from transformers import (
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

from hf_gsc.data.benchmarks import GENERATED_BENCHMARKS


IMAGE_SIZE = 28
#: Mean / std of the 55,000 Fashion-MNIST train images in [0, 1] (0.2862 / 0.3531); stored in the
#: saved image processor so inference uses the same normalisation as training.
IMAGE_MEAN = 0.286
IMAGE_STD = 0.353

#: Per-architecture defaults, sized so that one model trains in <= 15 minutes on 2 CPU cores.
#: ``crop_pad`` 0 = horizontal flips only: with the few epochs a shared CPU allows, random crops
#: slowed convergence more than they regularised.
ARCH_DEFAULTS: dict[str, dict] = {
    "vit": {"epochs": 12, "lr": 2e-3, "weight_decay": 0.05, "batch_size": 64, "crop_pad": 0},
    "swin": {"epochs": 10, "lr": 3e-3, "weight_decay": 0.05, "batch_size": 64, "crop_pad": 0},
    "resnet": {"epochs": 12, "lr": 4e-3, "weight_decay": 5e-4, "batch_size": 64, "crop_pad": 0},
}


def build_model(arch: str, label_names: tuple[str, ...]) -> PreTrainedModel:
    """A freshly initialised 1-channel 28x28 classifier with ``len(label_names)`` outputs."""
    labels = {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
    }
    if arch == "vit":
        # 4x4 = 16 patches of 7x7 pixels + [CLS]: 4x cheaper per image than 4x4-pixel patches,
        # which buys the epochs a ViT needs from scratch within the CPU budget.
        config = ViTConfig(
            image_size=IMAGE_SIZE, patch_size=7, num_channels=1, hidden_size=64,
            num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, **labels,
        )
        return ViTForImageClassification(config)
    if arch == "swin":
        # 4x4 patches -> 7x7 tokens, padded to 2x2 windows of 4x4 (shifted by 2 every other
        # block); one merge -> 4x4 tokens = one window. 2x2 patches with 7x7 windows trained
        # 4.5x slower per image, too slow for the CPU budget.
        config = SwinConfig(
            image_size=IMAGE_SIZE, patch_size=4, num_channels=1, embed_dim=32, depths=[2, 2],
            num_heads=[2, 4], window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, **labels,
        )
        return SwinForImageClassification(config)
    if arch == "resnet":
        # The HF stem (7x7 stride-2 conv + stride-2 max-pool) leaves 7x7 maps at 28x28 input.
        config = ResNetConfig(
            num_channels=1, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1],
            layer_type="basic", **labels,
        )
        return ResNetForImageClassification(config)
    raise ValueError(f"unknown arch {arch!r}; expected vit, swin or resnet")


def build_image_processor() -> ViTImageProcessorPil:
    """The processor saved next to the model: 28x28, rescale 1/255, normalise, no RGB conversion
    (the models take 1 channel). ``AutoImageProcessor`` reloads it without torchvision."""
    return ViTImageProcessorPil(
        do_resize=True, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[IMAGE_MEAN], image_std=[IMAGE_STD], do_convert_rgb=False,
    )


def to_pixel_values(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> normalised float32 (N, 1, 28, 28), identical to the saved processor."""
    x = torch.from_numpy(images).float().unsqueeze(1) / 255.0
    return (x - IMAGE_MEAN) / IMAGE_STD


def augment(x: torch.Tensor, generator: torch.Generator, pad: int = 2) -> torch.Tensor:
    """Random crop with ``pad`` pixels of background padding (none when ``pad`` is 0) plus
    horizontal flip, in torch ops.

    x: (B, 1, H, W) normalised; padding uses the normalised value of a black pixel.
    """
    b, _, h, w = x.shape
    if pad > 0:
        background = -IMAGE_MEAN / IMAGE_STD
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), value=background)
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        # Per-sample crops by advanced indexing instead of a Python loop over the batch.
        rows = dy[:, None] + torch.arange(h)[None, :]  # (B, H)
        cols = dx[:, None] + torch.arange(w)[None, :]  # (B, W)
        x = padded[torch.arange(b)[:, None, None], 0, rows[:, :, None], cols[:, None, :]].unsqueeze(1)
    flip = torch.rand(b, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def learning_rate(peak: float, progress: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to 0."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (1.0 - warmup)))


@torch.no_grad()
def accuracy(model: PreTrainedModel, pixel_values: torch.Tensor, labels: torch.Tensor,
             batch_size: int = 512) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = model(pixel_values=pixel_values[start:start + batch_size]).logits
        correct += int((logits.argmax(-1) == labels[start:start + batch_size]).sum())
    return correct / len(labels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCH_DEFAULTS))
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--benchmark", default="fmnist-ood", choices=sorted(GENERATED_BENCHMARKS))
    parser.add_argument("--epochs", type=int, help="default: per arch (see ARCH_DEFAULTS)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--crop-pad", type=int, help="random-crop padding in pixels (0: flips only)")
    parser.add_argument("--seed", type=int, default=0)
    # One thread by default: on cores shared with other jobs, two OpenMP threads spin-wait on each
    # other and ran 2-10x slower per step than one thread (measured on the project machines).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--time-budget-min", type=float,
                        help="stop after this many minutes, compressing the LR schedule to fit")
    parser.add_argument("--max-train-samples", type=int, help="use the first N train images (smoke tests)")
    parser.add_argument("--max-eval-samples", type=int,
                        help="use the first N validation and test images (smoke tests)")
    args = parser.parse_args(argv)
    hp = {**ARCH_DEFAULTS[args.arch]}
    for key in ("epochs", "lr", "batch_size", "crop_pad"):
        if getattr(args, key) is not None:
            hp[key] = getattr(args, key)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    spec = GENERATED_BENCHMARKS[args.benchmark]
    arrays = spec.id_arrays()
    train = arrays["train"]
    train_images, train_labels = train.images, train.labels
    if args.max_train_samples:
        train_images, train_labels = train_images[: args.max_train_samples], train_labels[: args.max_train_samples]
    x_train, y_train = to_pixel_values(train_images), torch.from_numpy(train_labels)
    n_eval = args.max_eval_samples
    x_val = to_pixel_values(arrays["validation"].images[:n_eval])
    y_val = torch.from_numpy(arrays["validation"].labels[:n_eval])
    x_test = to_pixel_values(arrays["test"].images[:n_eval])
    y_test = torch.from_numpy(arrays["test"].labels[:n_eval])

    model = build_model(args.arch, spec.label_names)
    num_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = math.ceil(len(y_train) / hp["batch_size"])
    total_steps = hp["epochs"] * steps_per_epoch
    budget_s = args.time_budget_min * 60 if args.time_budget_min else math.inf
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    print(f"{args.arch}: {num_params:,} parameters, {len(y_train):,} train images, {hp}, "
          f"time budget {args.time_budget_min} min", flush=True)

    history = []
    step = 0
    progress = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(hp["epochs"]):
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{hp['epochs']}", mininterval=10)
        for batch in bar:
            # Progress through the schedule: by steps, or by wall time when that runs out first,
            # so a slow (shared) CPU still gets a full warm-up + cosine decay inside the budget.
            progress = max(step / total_steps, (time.perf_counter() - start) / budget_s)
            if progress >= 1.0:
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(hp["lr"], progress)
            idx = order[batch * hp["batch_size"]:(batch + 1) * hp["batch_size"]]
            loss = model(pixel_values=augment(x_train[idx], generator, hp["crop_pad"]), labels=y_train[idx]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if batch % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.close()
        val_acc = accuracy(model, x_val, y_val)
        elapsed = time.perf_counter() - start
        history.append({"epoch": epoch + 1, "steps": step, "validation_accuracy": val_acc,
                        "elapsed_s": round(elapsed, 1)})
        print(f"epoch {epoch + 1}: step {step}, validation accuracy {val_acc:.4f} ({elapsed:.0f}s)", flush=True)
        if progress >= 1.0:
            break
    train_time = time.perf_counter() - start
    train_cpu = time.process_time() - cpu_start
    test_acc = accuracy(model, x_test, y_test)
    print(f"test accuracy {test_acc:.4f}; training took {train_time:.0f}s wall, {train_cpu:.0f}s CPU", flush=True)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output_dir, safe_serialization=True)
    build_image_processor().save_pretrained(args.output_dir)
    results = {
        "arch": args.arch,
        "benchmark": args.benchmark,
        "model_class": type(model).__name__,
        "num_parameters": num_params,
        "config": {k: v for k, v in model.config.to_diff_dict().items() if k not in ("id2label", "label2id")},
        "seed": args.seed,
        "threads": args.threads,
        "hyperparameters": hp,
        "train_images": len(y_train),
        "validation_images": len(y_val),
        "test_images": len(y_test),
        "train_time_s": round(train_time, 1),
        "train_cpu_time_s": round(train_cpu, 1),
        "steps": step,
        "epochs_completed": round(step / steps_per_epoch, 2),
        "time_budget_min": args.time_budget_min,
        "validation_accuracy": history[-1]["validation_accuracy"],
        "test_accuracy": test_acc,
        "history": history,
        "command": "python scripts/train_reference_models.py " + " ".join(
            argv if argv is not None else __import__("sys").argv[1:]),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    (args.output_dir / "training_results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
