"""The evaluation's loop on its own: every batch reaches the accelerator's device, outputs of any shape,
streamed data split over processes, loader options per device.

The device checks run on any machine: a stand-in accelerator whose device is ``meta`` (a real torch device
that holds no data) receives the batches, so a batch that is not moved to ``accelerator.device`` shows
up as a CPU tensor, exactly as it would reach a CUDA model as a CPU tensor.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_gsc.data.decoding import UndecodableImageError
from hf_gsc.evaluation import fitting, loaders, loop, score_cache
from hf_gsc.evaluation.accelerator import make_accelerator


META = torch.device("meta")


class MetaAccelerator:
    """Stands in for an ``accelerate.Accelerator`` on another device: one process, device ``meta``.

    ``gather_for_metrics`` records the devices of what it is handed and returns zeros of the same shape on
    the host (a real accelerator gathers across processes; meta tensors hold no values to gather), except
    for the ``decoded`` flags: ones, every image of these datasets is readable.
    """

    device = META
    num_processes, process_index = 1, 0
    is_main_process = is_local_main_process = True

    def __init__(self) -> None:
        self.gathered_devices: set[str] = set()

    def prepare(self, dataloader):
        return dataloader

    def autocast(self):
        return contextlib.nullcontext()

    def gather_for_metrics(self, values):
        self.gathered_devices.update(value.device.type for value in values.values())
        return {key: (torch.ones if key == "decoded" else torch.zeros)(value.shape, dtype=value.dtype)
                for key, value in values.items()}

    def wait_for_everyone(self) -> None:
        pass


def _dataset(n: int = 7) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L") for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(n)]}, features=features)


def _to_tensor(images: list) -> torch.Tensor:
    return torch.stack([torch.as_tensor(np.array(image), dtype=torch.float32)[None] / 255 for image in images])


def test_scoring_batches_reach_the_accelerator_device() -> None:
    accelerator = MetaAccelerator()
    seen = []

    def scorer(pixel_values: torch.Tensor) -> torch.Tensor:
        seen.append(pixel_values.device.type)
        return pixel_values.flatten(1).sum(dim=1)

    outputs = loop.score_split(accelerator, loaders.make_dataloader(_dataset(), _to_tensor, 3), {"s": scorer})
    assert seen == ["meta"] * 3
    assert accelerator.gathered_devices == {"meta"}  # scores and labels
    assert outputs["s"].shape == (7,) and outputs["s"].dtype == torch.float64 and outputs["labels"].dtype == torch.int64


class _FitRecorder:
    """A detector that needs a fit and records the device of every fitting batch."""

    name, needs_fit, fit_split = "recorder", True, "train"

    def __init__(self) -> None:
        self.devices: list[tuple[str, str]] = []

    def fitted_state(self) -> dict:
        return {}


def test_fitting_batches_reach_the_accelerator_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit DataLoader used to be neither prepared nor moved: on a GPU, ReAct failed at its first batch."""
    import hf_gsc.detectors

    detector = _FitRecorder()

    def fit_together(detectors, batches, name="", errors=None, **kwargs):  # the shared fit loop, recording what reaches it
        for member in detectors:
            member.devices += [(x.device.type, y.device.type) for x, y in batches]

    monkeypatch.setattr(hf_gsc.detectors, "fit_together", fit_together)
    from hf_gsc.evaluation.context import RunContext

    fitting.fit_detectors(RunContext(MetaAccelerator(), _to_tensor, 4, seed=0, output_dir=tmp_path),
                          {"recorder": detector}, ["recorder"], {"recorder": _dataset()}, {"recorder": "fp"})
    assert detector.devices == [("meta", "meta")] * 2
    assert fitting.saved_fit_info(tmp_path, "recorder") == {"num_samples": 7, "num_skipped": 0}


def _with_unreadable_row(row: int, n: int = 7) -> datasets.Dataset:
    """``_dataset(n)`` whose image ``row`` is bytes that no decoder reads."""
    rows = _dataset(n).cast_column("image", datasets.Image(decode=False)).to_list()
    rows[row]["image"] = {"bytes": b"not an image", "path": f"broken_{row}.png"}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_list(rows, features=features)


def test_unreadable_image_raises_naming_dataset_row_and_file() -> None:
    loader = loaders.make_dataloader(_with_unreadable_row(5), _to_tensor, 3, dataset_name="ood_x")
    with pytest.raises(UndecodableImageError, match=r"^cannot decode the image of dataset 'ood_x', row 5, file broken_5.png: "):
        loop.score_split(make_accelerator(), loader, {"s": lambda x: x.flatten(1).sum(dim=1)})
    with pytest.raises(UndecodableImageError, match="row 5"):
        list(loaders.device_batches(loader, "cpu"))


def test_unreadable_image_is_left_out_in_order() -> None:
    """``on_error="skip"``: one output per readable image, in dataset order, and the count of the others."""
    scorer = lambda x: x.flatten(1).sum(dim=1)  # noqa: E731
    loader = loaders.make_dataloader(_with_unreadable_row(4), _to_tensor, 3)
    outputs = loop.score_split(make_accelerator(), loader, {"s": scorer}, on_error="skip")
    expected = loop.score_split(make_accelerator(), loaders.make_dataloader(_dataset(), _to_tensor, 3), {"s": scorer})
    kept = [0, 1, 2, 3, 5, 6]
    torch.testing.assert_close(outputs["s"], expected["s"][kept])
    torch.testing.assert_close(outputs["labels"], expected["labels"][kept])
    assert int(outputs[score_cache.NUM_SKIPPED_KEY]) == 1 and int(expected[score_cache.NUM_SKIPPED_KEY]) == 0
    fitted = torch.cat([x for x, _ in loaders.device_batches(loader, "cpu", on_error="skip")])
    torch.testing.assert_close(fitted, _to_tensor(_dataset()["image"])[kept])


def test_scorers_may_return_rows_and_mappings() -> None:
    """A scorer returns ``(B, ...)`` or ``{key: (B, ...)}``; the analyses collect matrices and several outputs."""
    outputs = loop.score_split(make_accelerator(), loaders.make_dataloader(_dataset(), _to_tensor, 3), {
        "matrix": lambda x: x.flatten(1)[:, :4],
        "several": lambda x: {"mean": x.mean(dim=(1, 2, 3)), "argmax": x.flatten(1).argmax(dim=1)},
    })
    expected = _to_tensor(_dataset()["image"])
    torch.testing.assert_close(outputs["matrix"], expected.flatten(1)[:, :4].double())
    torch.testing.assert_close(outputs[("several", "mean")], expected.mean(dim=(1, 2, 3)).double())
    assert outputs[("several", "argmax")].dtype == torch.int64
    with pytest.raises(RuntimeError, match=r"returned shape \(2,\) for a batch of 3"):
        loop.score_split(make_accelerator(), loaders.make_dataloader(_dataset(), _to_tensor, 3), {"bad": lambda x: x[:2, 0, 0, 0]})


def test_streamed_split_is_shared_between_processes_without_overlap() -> None:
    """Each process reads its own part of a streamed split (``split_dataset_by_node``); together, every row once."""
    streamed = _dataset(11).to_iterable_dataset(num_shards=4)
    rows = []
    for rank in range(2):
        loader = loaders.make_dataloader(streamed, _to_tensor, 3, process_index=rank, num_processes=2)
        rows.append(torch.cat([batch["pixel_values"].flatten(1) for batch in loader]))
    everything = _to_tensor(_dataset(11)["image"]).flatten(1)
    assert rows[0].shape[0] + rows[1].shape[0] == 11
    together = torch.cat(rows)
    assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, everything.tolist()))


def test_streamed_and_map_style_scores_agree() -> None:
    def scorer(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).std(dim=1)

    accelerator = make_accelerator()
    mapped = loop.score_split(accelerator, loaders.make_dataloader(_dataset(10), _to_tensor, 4), {"s": scorer})
    streamed = loop.score_split(accelerator, loaders.make_dataloader(_dataset(10).to_iterable_dataset(num_shards=2),
                                                                   _to_tensor, 4), {"s": scorer})
    torch.testing.assert_close(streamed["s"], mapped["s"])
    torch.testing.assert_close(streamed["labels"], mapped["labels"])


def test_streamed_split_is_scored_as_it_is_read() -> None:
    """Bounded memory: the first batch is scored before the stream has produced more than a batch or two,
    so a split is never held whole (as a list of images or decoded tensors)."""
    produced = []

    def rows():
        for index, row in enumerate(_dataset(40)):
            produced.append(index)
            yield row

    stream = datasets.IterableDataset.from_generator(rows, features=_dataset(1).features)
    read_at_first_batch = []

    def scorer(x: torch.Tensor) -> torch.Tensor:
        read_at_first_batch.append(len(produced))
        return x.flatten(1).sum(dim=1)

    outputs = loop.score_split(make_accelerator(), loaders.make_dataloader(stream, _to_tensor, 4), {"s": scorer})
    assert outputs["s"].shape == (40,)
    assert read_at_first_batch[0] <= 8 < 40


def test_loader_options_per_device() -> None:
    cpu = loaders.make_dataloader(_dataset(), _to_tensor, 3, num_workers=2, device="cpu")
    assert (cpu.num_workers, cpu.pin_memory, cpu.prefetch_factor, cpu.persistent_workers) == (2, False, 2, False)
    cuda = loaders.make_dataloader(_dataset(), _to_tensor, 3, num_workers=2, device="cuda")
    assert (cuda.pin_memory, cuda.prefetch_factor) == (True, loaders.CUDA_PREFETCH_FACTOR)


def test_default_workers_share_the_available_cpus(monkeypatch) -> None:
    """On CUDA each process takes its share of the CPUs it may run on, one left for itself; on a CPU, none."""
    monkeypatch.setattr(loaders, "available_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loaders.default_num_workers("cpu") == 0
    assert loaders.default_num_workers("cuda") == 15
    assert loaders.default_num_workers("cuda", local_processes=4) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert loaders.default_num_workers("cuda") == 1
    monkeypatch.setattr(loaders, "available_cpus", lambda: 2)
    assert loaders.default_num_workers("cuda", local_processes=4) == 1
    monkeypatch.undo()
    assert loaders.available_cpus() == len(__import__("os").sched_getaffinity(0))


def test_workers_score_as_the_main_process() -> None:
    """Worker processes score exactly as the main process does."""
    accelerator = make_accelerator()

    def scorer(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).sum(dim=1)

    with_workers, without = (loop.score_split(accelerator, loaders.make_dataloader(_dataset(), _to_tensor, 3, num_workers=w),
                                              {"s": scorer}) for w in (2, 0))
    assert torch.equal(with_workers["s"], without["s"]) and torch.equal(with_workers["labels"], without["labels"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scoring_on_cuda_with_workers_and_pinned_memory() -> None:
    accelerator = make_accelerator()
    seen = []

    def scorer(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.device.type)
        return x.flatten(1).sum(dim=1)

    loader = loaders.make_dataloader(_dataset(), _to_tensor, 3, num_workers=2, device=accelerator.device)
    outputs = loop.score_split(accelerator, loader, {"s": scorer})
    assert seen == ["cuda"] * 3
    # A float32 sum on the GPU adds in another order than the CPU's: equal to float32's rounding, not bit for bit
    # (measured on an H200: 1.3e-7 relative).
    torch.testing.assert_close(outputs["s"], _to_tensor(_dataset()["image"]).flatten(1).sum(dim=1).double(),
                               rtol=1e-6, atol=0)
