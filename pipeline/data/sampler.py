"""The resumable global sampler: which blocks each rank trains on at each step, whatever the world size."""

from __future__ import annotations

import numpy as np

from pipeline.errors import UserError


class BlockSampler:
    """One global permutation of the training blocks per epoch, from (seed, epoch).

    Each optimizer step consumes a global batch of world x batch x grad_accum blocks, taken in permutation order
    and dealt to (micro-step, rank) slots. The state is (epoch, blocks consumed), independent of the world
    size, so a resume continues at the same global position with any number of processes. A last global batch
    that would be incomplete is dropped.
    """

    def __init__(self, n_blocks: int, seed: int, world_size: int, rank: int, batch_size: int, grad_accum: int):
        self.n_blocks, self.seed = n_blocks, seed
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.epoch = 0
        self.consumed = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return self.n_blocks // self.global_batch

    def has_next(self) -> bool:
        return self.consumed + self.global_batch <= self.n_blocks

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)
            self._perm_epoch = epoch
        return self._perm

    def upcoming(self) -> np.ndarray:
        """Every rank's block indices of the next optimizer step (the same on every rank)."""
        return self.permutation(self.epoch)[self.consumed: self.consumed + self.global_batch]

    def next_step(self) -> list[np.ndarray]:
        """This rank's block indices for each micro-step of the next optimizer step."""
        if not self.has_next():
            raise StopIteration
        perm = self.permutation(self.epoch)
        micro = []
        for m in range(self.grad_accum):
            start = self.consumed + (m * self.world_size + self.rank) * self.batch_size
            micro.append(perm[start: start + self.batch_size])
        self.consumed += self.global_batch
        return micro

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "n_blocks": self.n_blocks, "seed": self.seed,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state["n_blocks"] != self.n_blocks or state["seed"] != self.seed:
            raise UserError(f"the data changed since the checkpoint: {state['n_blocks']} training blocks with seed "
                            f"{state['seed']} then, {self.n_blocks} with seed {self.seed} now")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
