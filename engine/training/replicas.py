"""This trainer process's place among the ranks of a run, and the few collectives it needs.

A lone trainer (``gpus=1``) is :data:`SOLO`: no process group, every helper
is the identity and the loop is the single-process one. Under accelerate
(:mod:`engine.training.launch`) each rank holds one :class:`Replicas` around
its ``Accelerator``:

* the denoiser is wrapped by ``accelerator.prepare`` (DDP): gradients are
  averaged across ranks in ``accelerator.backward``;
* the global batch (``batch_size`` per rank x ranks) is one list of images,
  the same on every rank (same seeded epoch order); rank ``r`` trains on its
  slice, and each example's noise and timestep come from a generator seeded
  by (seed, step, slot in the global batch), so a 2-rank run sees exactly
  the examples, noise and timesteps of a 1-rank run with the same global
  batch, and its loss curve matches it;
* each node's first rank reads its engine's stop requests; :meth:`stop` gathers
  the answers, so every rank on every node leaves the loop at the same step;
* a failure inside a collective is a :class:`PeerLost` (a consequence of
  another rank's failure), so the launcher can name the rank that failed first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.training.rendezvous import JOIN_TIMEOUT_S

#: Returns None to go on, or "save", "discard" or "cancel": how a trainer asks whether to stop.
StopCheck = Callable[[], "str | None"]


class PeerLost(RuntimeError):
    """A collective failed: another rank died (or the link between ranks broke).

    A consequence, not a cause: the launcher reports the rank whose own error
    (or death) came first, and this only when there is none.
    """


@dataclass(frozen=True)
class Replicas:
    """Rank ``rank`` of ``world``; ``accelerator`` is None for a lone trainer."""

    rank: int = 0
    world: int = 1
    accelerator: Any = None
    #: This node's first rank: it talks to its node's engine (progress, stop requests).
    #: On one node that is rank 0; on the others, their local rank 0 (see ``train --nodes``).
    speaker: bool = True

    @property
    def main(self) -> bool:
        """Rank 0: the one that talks to the engine and writes the LoRA, checkpoints and samples."""
        return self.rank == 0

    def shard(self, batch: list[int], per_rank: int) -> tuple[list[tuple[int, int]], float]:
        """This rank's ``(slot in the global batch, image)`` pairs, and the loss weight.

        DDP averages gradients over ranks; weighting each rank's mean loss by
        ``its examples x world / global examples`` makes that average the
        gradient of the global batch's mean, also for the last, short batch
        of an epoch. A rank left with no example (a batch shorter than the
        ranks) trains on the batch's first example at weight 0: DDP needs
        every rank in every backward.
        """
        slots = list(enumerate(batch))[self.rank * per_rank:(self.rank + 1) * per_rank]
        if not slots:
            return [(0, batch[0])], 0.0
        return slots, len(slots) * self.world / len(batch)

    def prepare(self, model: Any) -> Any:
        """The model as the loop calls it: wrapped for gradient sync under accelerate."""
        if self.accelerator is None:
            return model
        with self.collective():
            return self.accelerator.prepare(model)

    def backward(self, loss: Any) -> None:
        if self.accelerator is None:
            loss.backward()
            return
        with self.collective():
            self.accelerator.backward(loss)

    def no_sync(self, model: Any, last: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient all-reduce on the micro-batches before the last of a step (accumulation)."""
        if self.accelerator is None or last:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def total(self, value: float) -> float:
        """The sum of ``value`` over ranks (each rank's share of the global batch mean)."""
        if self.accelerator is None:
            return value
        import torch

        with self.collective():
            tensor = torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)
            return float(self.accelerator.reduce(tensor, reduction="sum").item())

    def stop(self, should_stop: StopCheck) -> StopCheck:
        """The speakers' stop decision (rank 0's first), on every rank: each call gathers every
        rank's answer, so a stop asked of any node's engine stops every rank on every node."""
        if self.accelerator is None:
            return should_stop
        from accelerate.utils import gather_object

        def decide() -> str | None:
            mine = should_stop() if self.speaker else None
            with self.collective():
                answers = gather_object([mine])
            return next((answer for answer in answers if answer), None)

        return decide

    def digests(self, params: dict[str, Any]) -> list[str]:
        """SHA-256 of the trainable weights on each rank, rank 0 first (equal when in sync)."""
        digest = hashlib.sha256()
        for name in sorted(params):
            digest.update(name.encode())
            digest.update(params[name].detach().to("cpu").contiguous().float().numpy().tobytes())
        if self.accelerator is None:
            return [digest.hexdigest()]
        from accelerate.utils import gather_object

        with self.collective():
            return [str(d) for d in gather_object([digest.hexdigest()])]

    def in_sync(self, params: dict[str, Any]) -> dict[str, object]:
        """Every rank's LoRA digest (rank 0 first) for the terminal event; ``{}`` for one process.

        :raises EngineError: ``ranks_diverged`` when they differ. DDP keeps
            the replicas equal; one that drifted (a kernel that is not
            deterministic across devices, a bug) must not be saved unnoticed.
        """
        if self.world == 1:
            return {}
        digests = self.digests(params)
        if len(set(digests)) > 1:
            from engine.errors import EngineError

            raise EngineError(
                f"the ranks' LoRA weights differ after training ({', '.join(d[:12] for d in digests)}); "
                "the run is not saved. Train again, or with --gpus 1 to rule the multi-GPU setup out",
                code="ranks_diverged",
            )
        return {"ranks": {"world": self.world, "lora_sha256": digests}}

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Mark a failure in here as :class:`PeerLost` (see the module docstring)."""
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, PeerLost) or type(exc).__name__ == "OutOfMemoryError":
                raise  # already marked, or this rank's own failure
            raise PeerLost(f"rank {self.rank} lost its peers in a collective: {exc}") from exc


SOLO = Replicas()


def join(device: str, join_timeout: float = JOIN_TIMEOUT_S) -> Replicas:
    """This rank's :class:`Replicas`: the process group joined within ``join_timeout`` seconds
    on the main address only (:mod:`engine.training.rendezvous`), then an ``Accelerator`` built
    from the launcher's environment (``RANK``, ``WORLD_SIZE``...), which takes that group and
    sets up the device.

    accelerate keeps out of precision (the trainer owns dtypes and loss
    scaling) and DDP does not sync buffers at each forward: the base is
    frozen, so buffers are equal on every rank, and a forward with no
    collective in it fails only for its own reasons.
    """
    import warnings

    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from engine.training.rendezvous import rendezvous

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        rendezvous("gloo" if device == "cpu" else "nccl", join_timeout)

    # torch 2.13 renames the flag; accelerate 1.15 only passes the old name, which means the same here.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="no",
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    return Replicas(accelerator.process_index, accelerator.num_processes, accelerator,
                    speaker=accelerator.local_process_index == 0)


def example_generators(seed: int, step: int, slots: list[int]) -> list[Any]:
    """One generator per example, seeded by (seed, step, slot in the global batch).

    An example's noise and timestep so depend only on where it sits in the
    global batch, never on which rank trains it or how many ranks there are;
    and, being pure, a resumed run draws them again exactly.
    """
    import torch

    generators = []
    for slot in slots:
        digest = hashlib.blake2b(f"{seed}:{step}:{slot}".encode(), digest_size=8).digest()
        generators.append(torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1))
    return generators
