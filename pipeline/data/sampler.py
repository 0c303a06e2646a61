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


class MixtureSampler(BlockSampler):
    """Blocks of several sources (pipeline/data/mixture.py's MixedBlocks: source k's rows after source k-1's) drawn in
    proportion to their weights.

    The run's blocks form one sequence, whatever the world size: position p goes to the source whose next block is
    due first, source k's j-th block being due at (j + 0.5) / share_k (ties to the first source; Sainte-Lague's
    rule), so after any p blocks each of two sources has given its share of p to within one block (more sources:
    within a few). A source's blocks come in one permutation of
    them per epoch of that source, from (seed, source, its epoch). A run's epoch is as many blocks as all sources
    hold; the sequence runs on across epochs, so nothing is dropped at their ends. The state adds each source's
    blocks drawn so far to BlockSampler's.
    """

    def __init__(self, sizes: list[int], weights: list[float], seed: int, world_size: int, rank: int,
                 batch_size: int, grad_accum: int):
        super().__init__(sum(sizes), seed, world_size, rank, batch_size, grad_accum)
        self.sizes = list(sizes)
        total = sum(weights)
        self.shares = [w / total for w in weights]
        self.offsets = np.cumsum([0, *sizes])[:-1]
        self.drawn = [0] * len(sizes)
        """Blocks drawn from each source since the run began."""
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _source_perm(self, k: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(k)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, k, epoch]).permutation(self.sizes[k]))
            self._perms[k] = cached
        return cached[1]

    def _draw(self, count: int) -> tuple[np.ndarray, list[int]]:
        """The next count blocks of the sequence (global rows) and each source's drawn count after them."""
        drawn = list(self.drawn)
        rows = np.empty(count, dtype=np.int64)
        for p in range(count):
            k = min(range(len(drawn)), key=lambda s: ((drawn[s] + 0.5) / self.shares[s], s))
            epoch, at = divmod(drawn[k], self.sizes[k])
            rows[p] = self.offsets[k] + self._source_perm(k, epoch)[at]
            drawn[k] += 1
        return rows, drawn

    def upcoming(self) -> np.ndarray:
        return self._draw(self.global_batch)[0]

    def next_step(self) -> list[np.ndarray]:
        if not self.has_next():
            raise StopIteration
        rows, self.drawn = self._draw(self.global_batch)
        self.consumed += self.global_batch
        return [rows[(m * self.world_size + self.rank) * self.batch_size:][:self.batch_size]
                for m in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sizes": self.sizes, "shares": self.shares, "drawn": list(self.drawn)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("sizes") != self.sizes or state.get("shares") != self.shares or state["seed"] != self.seed:
            raise UserError(f"the data changed since the checkpoint: sources of {state.get('sizes')} training blocks "
                            f"in shares {state.get('shares')} with seed {state['seed']} then, {self.sizes} in "
                            f"{self.shares} with seed {self.seed} now")
        super().load_state_dict(state)
        self.drawn = [int(n) for n in state["drawn"]]
