"""Resumable batch samplers and the pretraining DataLoader, as in Megatron.

Both samplers start at `consumed_samples` (saved in every checkpoint), so a resumed run
reads exactly the samples it would have read had it not stopped, whatever the gradient
accumulation: each data-parallel rank takes its own slice of every global micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class _ResumableSampler:
    """What both samplers share: validated arguments and the global micro-batch size."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} of {data_parallel_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.global_micro_batch = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples


class MegatronPretrainingSampler(_ResumableSampler):
    """Sequential micro-batches of sample indices for one data-parallel rank."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        super().__init__(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        if consumed_samples >= total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} but the dataset has {total_samples} "
                "samples; the run has used them all (raise --train-iters/--train-samples)"
            )
        self.drop_last = drop_last

    def _slice(self, batch: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro_batch:
                yield self._slice(batch)
                batch = []
        if batch and not self.drop_last and self._slice(batch):
            yield self._slice(batch)  # ranks past the end of a partial batch get none


class MegatronPretrainingRandomSampler(_ResumableSampler):
    """Micro-batches reshuffled every epoch (`--dataloader-type cyclic`), resumable too."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        super().__init__(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        if total_samples < self.global_micro_batch:
            raise ValueError(
                f"{total_samples} samples cannot fill one global micro-batch of "
                f"{self.global_micro_batch}"
            )
        self.last_batch_size = total_samples % self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        active_total = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total
        consumed_in_epoch = self.consumed_samples % active_total
        if consumed_in_epoch % self.global_micro_batch:
            raise ValueError(
                f"consumed_samples={self.consumed_samples} is not a whole number of global "
                f"micro-batches ({self.global_micro_batch} samples)"
            )
        # Each rank owns a contiguous bucket and shuffles inside it with the epoch as seed.
        bucket_size = (self.total_samples // self.global_micro_batch) * self.micro_batch_size
        bucket_offset = consumed_in_epoch // self.data_parallel_size
        start = self.data_parallel_rank * bucket_size
        generator = torch.Generator()
        generator.manual_seed(epoch)
        order = torch.randperm(bucket_size, generator=generator).tolist()
        batch: list[int] = []
        for idx in order[bucket_offset:]:
            batch.append(start + idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.global_micro_batch
                yield batch
                batch = []


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 2,
    dataloader_type: str = "single",
) -> torch.utils.data.DataLoader | None:
    """A DataLoader that yields this rank's micro-batches from `consumed_samples` on."""
    if dataset is None:
        return None
    args = (
        len(dataset),
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
    )
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(*args)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(*args)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type}: choose single or cyclic")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        # Its own generator: creating the iterator draws a seed, and drawing it from the
        # global one would shift dropout after a resume (the RNG is restored before).
        generator=torch.Generator(),
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
