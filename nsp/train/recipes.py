"""Published training recipes: the peak learning rate and warm-up each named model was trained with.

``nsp train`` takes a model's recipe when ``--lr`` or ``--warmup-steps`` is not given; models without one (the toy
sizes, GPT-2, whose paper gives no learning rates) take ``TrainConfig``'s generic defaults.

GPT-3 (Brown et al. 2020, Table 2.1 and Appendix B): the peak learning rates below, at the batch sizes below (0.5M
to 3.2M tokens), a linear warm-up over the first 375 million tokens of a 300-billion-token run, then cosine decay to
10%. A run of ``steps`` steps gets the same shape: its warm-up is the same fraction of its steps (at least one
step), so a short run warms up briefly instead of spending its steps near zero (375M tokens at batch 1 x 128 would
be 2.9 million steps).

A run with smaller batches than the published ones takes a smaller peak: the published one times the square root
of the batch ratio (the square-root scaling rule for Adam, Malladi et al. 2022, "On the SDEs and Scaling Rules for
Adaptive Gradient Algorithms"), never more than the published one. Measured on this repository's default data
(batch 1 x 128 tokens, ``--bf16-params``; the first update runs at learning rate 0, the start of the warm-up): at
GPT-3's own peak the 2.7B's first real update sent the loss from 6.2 to 18.2; at the scaled peak (4.0e-6) the
760M's held-out loss fell 5.92, 5.53, 4.09, 3.91, 3.82 over 5 steps; the 2.7B's at its scaled peak (1.81e-6) went
5.78, 7.40, 6.05 over 3 steps (the first real update, Adam's sign-like first step, still overshoots at that width
and depth; the next one, at half the peak, recovers most of it).

    >>> recipe = RECIPES["gpt3-2.7b"]
    >>> recipe.lr, recipe.warmup_steps(3), recipe.warmup_steps(2_000_000)
    (0.00016, 1, 2500)
    >>> f"{recipe.lr_for(128):.3g}", recipe.lr_for(2_000_000)
    ('1.81e-06', 0.00016)
"""

from __future__ import annotations

import dataclasses
import math

GPT3 = "GPT-3 (Brown et al. 2020), Table 2.1; warm-up 375M of 300B tokens, Appendix B"
GPT3_WARMUP_FRACTION = 375e6 / 300e9


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a named model was trained: peak learning rate, warm-up as a fraction of the run, and where from."""

    lr: float  # peak learning rate (after warm-up; then cosine decay)
    warmup_fraction: float  # warm-up steps as a fraction of the run's steps
    source: str  # the publication and table the numbers come from
    batch_tokens: float = 0.0  # tokens per batch the peak was published for (0: unknown, the peak is not scaled)

    def warmup_steps(self, steps: int) -> int:
        """Warm-up steps for a run of ``steps`` steps: the recipe's fraction of them, at least one."""
        return max(1, math.ceil(self.warmup_fraction * steps))

    def lr_for(self, batch_tokens: int) -> float:
        """Peak learning rate for batches of ``batch_tokens`` tokens: the published peak times
        ``sqrt(batch_tokens / self.batch_tokens)`` for smaller batches (Adam's square-root rule), else the
        published peak."""
        if not self.batch_tokens or batch_tokens >= self.batch_tokens:
            return self.lr
        return self.lr * math.sqrt(batch_tokens / self.batch_tokens)


RECIPES: dict[str, Recipe] = {
    name: Recipe(lr, GPT3_WARMUP_FRACTION, GPT3, batch)
    for name, (lr, batch) in {
        "gpt3-125m": (6.0e-4, 0.5e6), "gpt3-350m": (3.0e-4, 0.5e6), "gpt3-760m": (2.5e-4, 0.5e6),
        "gpt3-1.3b": (2.0e-4, 1e6), "gpt3-2.7b": (1.6e-4, 1e6), "gpt3-6.7b": (1.2e-4, 2e6),
        "gpt3-13b": (1.0e-4, 2e6), "gpt3-175b": (0.6e-4, 3.2e6),
    }.items()
}
