"""GRPO (with DAPO's and Dr. GRPO's variants), as TRL's GRPOTrainer computes it, over completions the training
processes generate themselves.

A step: `prepare` completes each micro-batch's prompts G times with the policy as it is (pipeline/rl/rollout.py),
scores them, and turns the rewards into advantages within each group (a group lives on one rank, so only
--scale-rewards batch communicates); then the trainer calls the objective once per micro-batch, which scores the
completions' tokens under the policy with autograd and returns its share of the clipped-surrogate loss
(pipeline/objectives/grpo_losses.py). With one iteration per batch (TRL's num_iterations 1) the old policy is the
current one, so the ratio is 1 in value and the loss's gradient is the policy gradient.

Validation (the trainer's held-out pass): each held-out prompt completed greedily once, its mean reward the figure;
the pass's "loss" is minus that mean, so --save-best keeps the best reward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config_grpo import GRPOConfig
from pipeline.data.batches import Batch
from pipeline.distributed.runtime import Dist
from pipeline.model.head import Head
from pipeline.model.packed_rows import Costs
from pipeline.objectives.grpo_losses import (
    GRPOLossSettings,
    StepCounts,
    advantages,
    bessel_std,
    masked_mean,
    micro_loss,
    token_terms,
    zero_std_groups,
)
from pipeline.objectives.objective import HeldOut, Prepared, StepSource
from pipeline.rl.figures import Figures
from pipeline.rl.generation import Sampling, seeded
from pipeline.rl.packing import pack, row_entropy, token_logps
from pipeline.rl.rewards import RewardState
from pipeline.rl.rollout import Roller, Rollout
from pipeline.rl.target_logps import target_logps

log = logging.getLogger("pipeline")

PACKING_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.1, torch.float16: 0.05}
"""The largest difference of a token's log-probability between packed and plain rows that is rounding, by the
compute dtype: the same keys, values and positions reach each token in both, summed in another order."""


@dataclasses.dataclass(frozen=True)
class KLReference:
    """The model the KL penalty is measured against: its head, and the context it runs in (the policy's with its
    adapters switched off; a frozen copy's gathered for the pass, then released)."""

    head: Head
    running: Callable[[], contextlib.AbstractContextManager]


TOOL_FIGURES = ("tools/call_frequency", "tools/failure_frequency", "tools/parse_failure_frequency",
                "tools/timeout_frequency", "episodes/mean_turns", "episodes/mean_length")
"""With --tools: TRL's names where TRL has the figure (calls per completion, failures per call), ours beside them."""

class GRPOObjective:
    counted = "completions"
    shown = (("reward", "reward"), ("completions/mean_length", "len"), ("completions/clipped_ratio", "clipped"))
    generates = True
    phase = "generate"

    def __init__(self, head: Head, g: GRPOConfig, roller: Roller, d: Dist, seed: int, release: Callable[[], None],
                 gathered: Callable[[], contextlib.AbstractContextManager],
                 reference: KLReference | None = None, max_steps: int = 0, costs: Costs | None = None,
                 compute_dtype: torch.dtype = torch.float32):
        self.head, self.g, self.roller, self.dist, self.seed, self.release = head, g, roller, d, seed, release
        self.gathered, self.max_steps = gathered, max_steps
        """The strategy's: the parameters gathered once for the many forwards of a generation (Strategy.gathered)."""
        self.reference = reference
        """The KL penalty's reference (--grpo-beta > 0): the base with the adapters off, or a frozen copy."""
        self.settings = GRPOLossSettings(g.loss_type, g.epsilon, g.clip_high, g.grpo_beta, g.max_completion_length,
                                         sequence_level=g.importance_sampling_level == "sequence")
        if g.importance_sampling_level == "sequence" and g.loss_type != "grpo" and d.is_main:
            log.warning("--importance-sampling-level sequence with --loss-type %s sums the completions' tokens, so "
                        "each completion weighs by its length rather than as one sequence; --loss-type grpo is the "
                        "GSPO paper's objective (as TRL warns)", g.loss_type)
        self.sampling = Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        self.greedy = Sampling(g.max_completion_length, greedy=True)
        self.cycle: list[Rollout] = []
        """The rollouts of the last generation, trained on for --num-iterations steps."""
        self.rollouts: list[Rollout] = []
        """This step's, in micro-step order (__call__ takes them one by one)."""
        self.counts: StepCounts | None = None
        self.batch_std: torch.Tensor | None = None
        """--scale-rewards batch: the std of every rank's rewards of the last generation."""
        names = roller.rewards.names
        self.figures = self._figures(names)
        self.last_samples: list[dict] = []
        self.costs = costs
        """The model's forward costs, to choose packed rows where they cost less (None: the model takes none)."""
        self.packing = "unchecked"
        """Scoring packed rows: "unchecked" until the first scoring compares them with plain rows, then "on" or
        "off"."""
        self.packing_agreed = False
        """Whether this process's ranks have settled the packing decision together (_settle_packing)."""
        self.compute_dtype = compute_dtype
        """The forward's dtype: the packed rows' additive mask is in it."""
        self.said_unscored = False
        """Whether a window that no reward scored was warned of (once a run)."""
        self.said_clipped = False
        """Whether a window whose completions mostly hit the length limit was warned of (once a run)."""

    def _figures(self, names: list[str]) -> Figures:
        means = ["reward", *(f"rewards/{n}/mean" for n in names), "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", *(["kl"] if self.g.grpo_beta else []),
                 *(TOOL_FIGURES if self.roller.turns is not None else ())]
        return Figures(means, ["reward_std", *(f"rewards/{n}/std" for n in names)], peaks=["completions/max_length"],
                       troughs=["completions/min_length"])

    # ------------------------------------------------------------------------------------------ a step's rollouts

    def prepare(self, source: StepSource, step: int) -> Prepared:
        """The step's rollouts: every --num-iterations steps new ones, G completions per prompt of each micro-batch
        the source draws (drawn only then), scored, with their advantages (with a KL penalty, the reference's
        log-probabilities; with more than one iteration, the generating policy's); between, the same ones again. The
        micro-steps train on them in order (the batches are its, not the sampler's), a mean over their completions
        over every rank. A collective."""
        if step % self.g.num_iterations == 0 or not self.cycle:
            self._generate([source.make(rows) for rows in source.draw()], step)
        self.rollouts = list(self.cycle)
        for r in self.rollouts:
            self._rollout_figures(r)
        self.last_samples = self._samples(self.rollouts[0])
        return Prepared(range(len(self.cycle)), lambda i: None, self.counts.sequences)

    def _generate(self, batches: list[Batch], step: int) -> None:
        model = self.head.model
        training = model.training
        model.eval()  # no dropout while generating: the completions are the policy's own
        try:
            with self.gathered():
                state = RewardState(step, self.max_steps)
                self.cycle = [self.roller.roll(b, self.g.num_generations, self.sampling,
                                               seeded(self.seed, step, self.dist.rank, m), state)
                              for m, b in enumerate(batches)]
                self.figures.log(self.roller.rewards.take_metrics())
                if self.g.num_iterations > 1:  # the ratio of later iterations is against the generating policy
                    with torch.no_grad():
                        for r in self.cycle:
                            r.old_logps = self.logps(self.head, r, entropy=False)[0]
            self.batch_std = self._batch_std() if self.g.scale_rewards == "batch" else None
            for r in self.cycle:
                r.advantages = advantages(r.rewards, self.g.num_generations, self.g.scale_rewards,
                                          self.batch_std).to(self.dist.device)
                if self.reference is not None:
                    with self.reference.running(), torch.no_grad():
                        r.ref_logps = self.logps(self.reference.head, r, entropy=False)[0]
        finally:
            self.release()  # the root stays gathered after a forward without backward
            model.train(training)
        tokens = torch.tensor([float(sum(int(self._loss_mask(r).sum()) for r in self.cycle))])
        if self.dist.world_size > 1:
            dist.all_reduce(tokens)  # CPU tensor: gloo, no device sync
        rows = sum(len(r.rewards) for r in self.cycle) * self.dist.world_size
        self.counts = StepCounts(int(tokens.item()), rows, len(batches), self.dist.world_size)

    def state_dict(self) -> dict | None:
        """The packed-rows decision (a resumed run scores as the uninterrupted one did: compared again on a trained
        model, the two could differ by a last bit and decide otherwise); and this rank's rollouts while
        --num-iterations reuses them (a checkpoint between two generations resumes with them, as the policy that
        generated them is gone)."""
        state: dict = {"packing": self.packing}
        if self.g.num_iterations > 1 and self.cycle:
            state |= {"cycle": [dataclasses.asdict(r) for r in self.cycle], "counts": dataclasses.asdict(self.counts)}
        return state

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.packing = state.get("packing", self.packing)  # a checkpoint of a run before the decision was kept
        if "cycle" in state:
            self.cycle = [Rollout(**r) for r in state["cycle"]]
            self.counts = StepCounts(**state["counts"])

    def _batch_std(self) -> torch.Tensor:
        """The std of every rank's rewards of the step (--scale-rewards batch): an all-gather, every rank the same
        count."""
        mine = torch.cat([r.rewards for r in self.cycle])
        if self.dist.world_size > 1:
            every = [torch.zeros_like(mine) for _ in range(self.dist.world_size)]
            dist.all_gather(every, mine)
            mine = torch.cat(every)
        return bessel_std(mine)

    def _rollout_figures(self, r: Rollout) -> None:
        f, group = self.figures, self.g.num_generations
        f.add("reward", r.rewards)  # TRL's reward and reward_std: over the step's scored completions, every rank's
        f.add("reward_std", r.rewards)
        for j, name in enumerate(self.roller.rewards.names):
            f.add(f"rewards/{name}/mean", r.per_reward[:, j])
            f.add(f"rewards/{name}/std", r.per_reward[:, j])
        f.add("frac_reward_zero_std", zero_std_groups(r.rewards, group, self.batch_std).float())
        lengths = r.lengths.float()
        for name in ("completions/mean_length", "completions/max_length", "completions/min_length"):
            f.add(name, lengths)
        f.add("completions/clipped_ratio", r.clipped.float())
        if r.episodes:
            self._episode_figures(r.episodes)

    def _episode_figures(self, e: dict[str, torch.Tensor]) -> None:
        """TRL's tool figures (calls per completion; failed calls per call), and the episodes' own: parse failures
        and timeouts per completion, the model's turns and the episode's length in tokens."""
        f = self.figures
        f.add("tools/call_frequency", e["calls"])
        calls = int(e["calls"].sum())
        # one value per call (1: failed), so that the window's mean is failures over calls, as TRL divides them
        f.add("tools/failure_frequency", torch.cat([torch.ones(int(e["failures"].sum())),
                                                     torch.zeros(calls - int(e["failures"].sum()))]))
        f.add("tools/parse_failure_frequency", e["parse_failures"])
        f.add("tools/timeout_frequency", e["timeouts"])
        f.add("episodes/mean_turns", e["turns"])
        f.add("episodes/mean_length", e["length"])

    def _samples(self, r: Rollout) -> list[dict]:
        n = min(self.g.log_completions, len(r.texts))
        names = self.roller.rewards.names
        return [{"prompt": _shown(r.prompts[i]), "completion": r.texts[i], "reward": float(r.rewards[i]),
                 "rewards": {name: None if torch.isnan(v) else float(v) for name, v in zip(names, r.per_reward[i],
                                                                                            strict=True)},
                 **({"extra": {c: values[i] for c, values in r.extra.items()}} if r.extra else {})}
                for i in range(n)]

    def samples(self) -> list[dict]:
        """The last step's first completions with their rewards, for the samples log; then none until the next."""
        out, self.last_samples = self.last_samples, []
        return out

    # --------------------------------------------------------------------------------------------------- the loss

    def logps(self, head: Head, r: Rollout, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each completion token's log-probability under the model the head runs (logits over the temperature, as
        TRL scores them), [rows, C], and each token's entropy (no gradient) when asked. Packed rows (each prompt
        once, its completions after it: pipeline/rl/packing.py) where the model takes them, else plain ones; the
        first call compares the two (a collective)."""
        if self.costs is None:
            return self._plain_logps(head, r, entropy)
        if not self.packing_agreed:
            self._settle_packing(head, r)
        # long completions: one dense row would cost more. Decided per rollout and rank: no collective follows it
        if self.packing == "on" and self.costs.packing_pays(r.prompt_ids.shape[1], r.completion_ids.shape[1],
                                                            self.g.num_generations):
            return self._packed_logps(head, r, entropy)
        return self._plain_logps(head, r, entropy)

    def _settle_packing(self, head: Head, r: Rollout) -> None:
        """At this process's first scoring, on every rank whatever its rollout's widths (a collective): packed rows
        compared with plain ones unless every rank holds a decision already (a resumed run's, from its checkpoint; a
        rank that another world size adds has none, and then every rank compares again)."""
        undecided = torch.tensor([float(self.packing == "unchecked")])
        if self.dist.world_size > 1:
            dist.all_reduce(undecided, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, no device sync
        if undecided.item():
            self._check_packing(head, r)
        self.packing_agreed = True

    def _forward(self, head: Head, ids: torch.Tensor, **inputs) -> torch.Tensor:
        with head.autocasting(ids.device):
            logits = head.model(input_ids=ids, use_cache=False, **inputs).logits
        logits = logits.float()
        return logits / self.g.temperature if self.g.temperature != 1 else logits

    def _plain_logps(self, head: Head, r: Rollout, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
        mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        n, width = r.completion_ids.shape
        logits = self._forward(head, ids, attention_mask=mask, position_ids=positions, logits_to_keep=width + 1)
        # each row's last kept position predicts nothing: left out by index, not by a slice (a slice's copy, and its
        # gradient, would be another [rows, tokens, vocab]); the entropy without autograd, a few positions at a time
        rows = (torch.arange(n, device=ids.device)[:, None] * (width + 1) + torch.arange(width, device=ids.device))
        # reuse: these logits are read no more once the loss's backward runs (one buffer, not two, through it)
        picked = target_logps(logits.flatten(0, 1), rows.flatten(), r.completion_ids.flatten(), reuse=True)
        return picked.view(n, width), row_entropy(logits)[:, :-1] if entropy else None

    def _packed_logps(self, head: Head, r: Rollout, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = pack(r.prompt_ids, r.prompt_mask, r.completion_ids, self.g.num_generations, self.compute_dtype)
        logits = self._forward(head, rows.input_ids, attention_mask=rows.mask, position_ids=rows.positions,
                               logits_to_keep=rows.keep)
        return token_logps(logits, r.completion_ids, rows, entropy, reuse=True)

    def _check_packing(self, head: Head, r: Rollout) -> None:
        """Packed rows on, if on this first rollout they give every completion token the plain rows' log-probability
        (within the compute dtype's rounding); else off for the run, said once. Every rank decides alike: the largest
        difference is all-reduced (a collective every rank reaches: every rank scores its first rollout here). In eval
        mode: dropout (--lora-dropout) would draw other masks for the two, and draw from the RNG a resumed run does not
        draw from at that point."""
        training = head.model.training
        head.model.eval()
        try:
            with torch.no_grad():
                plain = self._plain_logps(head, r, entropy=False)[0]
                packed = self._packed_logps(head, r, entropy=False)[0]
        finally:
            head.model.train(training)
        real = r.completion_mask.bool()
        worst = (plain - packed).abs()[real].max() if real.any() else plain.new_zeros(())
        worst = worst.reshape(1).float()
        if self.dist.world_size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        limit = PACKING_TOLERANCE.get(self.compute_dtype, PACKING_TOLERANCE[torch.bfloat16])
        self.packing = "on" if float(worst) <= limit else "off"
        if not self.dist.is_main:
            return
        if self.packing == "on":
            log.info("GRPO scores each prompt once with its %d completions after it (packed rows: the same "
                     "log-probabilities as plain rows, largest difference %.3g)", self.g.num_generations, float(worst))
        else:
            log.warning("GRPO: rows that hold each prompt once gave other log-probabilities than plain rows (largest "
                        "difference %.3g, above %.3g): scoring plain rows", float(worst), limit)

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        """Training: the next prepared rollout's share of the step's loss (batch and num_items unused: the rollouts
        are prepare's, in micro-step order, and so are the step's counts). Validation (the model in eval mode): minus
        the summed reward of the batch's prompts' greedy completions."""
        if not self.head.model.training:
            return self._validate(batch)
        r = self.rollouts.pop(0)
        logps, entropy = self.logps(self.head, r)
        old = logps.detach() if r.old_logps is None else r.old_logps  # on-policy: the ratio is 1, its gradient not
        mask = self._loss_mask(r).to(logps.dtype)
        terms = token_terms(logps, old, r.advantages, self.settings, r.ref_logps, mask)
        f = self.figures
        for name, flags in (("low", terms.low_clipped), ("high", terms.high_clipped), ("region", terms.region_clipped)):
            # per sequence under GSPO (one flag each, over every row, as TRL's metric), else per counted token
            share = flags.float().mean() if self.settings.sequence_level else masked_mean(flags.float(), mask)
            f.add(f"clip_ratio/{name}_mean", share.reshape(1))
        f.add("entropy", entropy[mask.bool()])
        if terms.kl is not None:
            f.add("kl", terms.kl.detach()[mask.bool()])
        return micro_loss(terms.loss, mask, self.settings, self.counts)

    def _loss_mask(self, r: Rollout) -> torch.Tensor:
        """The tokens that train: the completions' own (an episode's tool turns, which the template wrote, left out),
        those of completions cut at --max-completion-length left out under --mask-truncated-completions (TRL zeroes
        their completion mask: no loss, nor a count in dapo's denominator)."""
        mask = r.completion_mask if r.tool_mask is None else r.completion_mask * r.tool_mask
        if not self.g.mask_truncated_completions:
            return mask
        return mask * (~r.clipped).to(mask.device)[:, None]

    def _validate(self, batch: Batch) -> torch.Tensor:
        with self.gathered():
            r = self.roller.roll(batch, 1, self.greedy, None)
        self.figures.log(self.roller.rewards.take_metrics())
        valid = r.valid
        r.rewards = torch.nan_to_num(r.rewards, nan=0.0)  # validation's mean counts an unscored completion as 0
        self.figures.add("reward", r.rewards[valid])
        for j, name in enumerate(self.roller.rewards.names):
            self.figures.add(f"rewards/{name}/mean", r.per_reward[valid, j])
        self.figures.add("completions/mean_length", r.lengths[valid.to(r.lengths.device)].float())
        return -r.rewards[valid].sum().to(self.dist.device)

    # ---------------------------------------------------------------------------------------- what the trainer reads

    def items(self, ids: np.ndarray, flags: np.ndarray | None, valid_rows: int | None = None) -> int:
        """Validation's items: the batch's prompts (training counts its completions in prepare)."""
        return len(ids) if valid_rows is None else valid_rows

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        """The window's figures; a window whose completions no reward scored (every function abstained on all of
        them: all advantages 0, nothing trained) is one warning, once (the same on every rank: read over all)."""
        out = self.figures.read(reduce)
        if out.get("completions/clipped_ratio", 0) > 0.5 and not self.said_clipped:
            self.said_clipped = True
            if self.dist.is_main:
                log.warning("%.0f%% of this window's completions reached --max-completion-length %d without ending: "
                            "%s; raise --max-completion-length%s", 100 * out["completions/clipped_ratio"],
                            self.g.max_completion_length,
                            "they train nothing (--mask-truncated-completions), so little trains" if
                            self.g.mask_truncated_completions else "their rewards judge cut-off text",
                            "" if self.g.mask_truncated_completions else
                            ", or pass --mask-truncated-completions to train on finished ones only")
        if "completions/mean_length" in out and "reward" not in out and not self.said_unscored:
            self.said_unscored = True
            if self.dist.is_main:
                log.warning("no reward scored any completion of this window: every reward (%s) abstained (returned "
                            "None) on each, so every advantage is 0 and nothing trains; check the columns they read",
                            ", ".join(self.roller.rewards.names))
        return out

    @contextlib.contextmanager
    def window_apart(self) -> Iterator[None]:
        kept, self.figures = self.figures, self._figures(self.roller.rewards.names)
        try:
            yield
        finally:
            self.figures = kept

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        return f"mean reward {0.0 - base.loss:.4f} -> {0.0 - final.loss:.4f} over {final.tokens} prompts"


def _shown(prompt: str | list) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
