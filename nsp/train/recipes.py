"""Published training recipes: the peak learning rate and warm-up each named model was trained with.

``nsp train`` takes a model's recipe when ``--lr`` or ``--warmup-steps`` is not given; models without one (the toy
sizes, GPT-2, whose paper gives no learning rates) take ``TrainConfig``'s generic defaults.

GPT-3 (Brown et al. 2020, Table 2.1 and Appendix B): the peak learning rates below, at the batch sizes below (0.5M
to 3.2M tokens), a linear warm-up over the first 375 million tokens of a 300-billion-token run, then cosine decay to
10%.

A run with smaller batches than the published ones takes a smaller peak: the published one times the square root
of the batch ratio (the square-root scaling rule for Adam, Malladi et al. 2022, "On the SDEs and Scaling Rules for
Adaptive Gradient Algorithms"), never more than the published one. The same rule keeps a run's course in tokens,
not steps, so the warm-up stays 375M tokens at any batch size: ``ceil(375M / batch tokens)`` steps, or the whole
run when the run is shorter than that. A run of a few steps at 1 x 128 tokens therefore spends all of them
warming up: 0, peak/3, 2 peak/3 for 3 steps.

Measured on this repository's default data (batch 1 x 128 tokens, ``--bf16 --f32-accum --bf16-params``; held-out
loss on 2 fixed batches after each step). Adam's first updates are sign-like (every parameter moves by about the
learning rate), so at these widths and depths one update can overshoot the batch it was computed on:
- gpt3-2.7b, 3 steps at 0, 6.0e-7, 1.2e-6 (this rule): 5.78, 4.41, 6.50 (``bench/train_big.py``'s record).
- gpt3-2.7b with a one-step warm-up (the earlier rule: GPT-3's fraction of the run, at least a step), 0, 1.81e-6,
  1.0e-6: 5.78, 7.40, 6.05.
- gpt3-1.3b, 4 steps at 0, 7.5e-7, 1.5e-6, 2.26e-6: 5.84, 4.82, 5.61, 4.58.
- gpt3-1.3b, 4 steps at 0, 5.7e-7, 1.1e-6, 1.7e-6 (this rule): 5.84, 5.01, 5.17, 4.80; on 16 held-out batches
  instead of 2: 5.79, 4.98, 5.03, 4.86. With the rest of Malladi et al.'s rule as well (1 - b1, 1 - b2 scaled by the
  batch ratio from GPT-3's 0.9 and 0.95, eps divided by its square root, so that the moments' horizons also stay
  in tokens): 5.84, 5.04, 5.17, 5.26. nsp scales the peak only.
- gpt3-760m, 5 steps with a one-step warm-up to its scaled peak (4.0e-6): 5.92, 5.53, 4.09, 3.91, 3.82.
- gpt3-2.7b at GPT-3's own peak (1.6e-4, not scaled for the batch): the first real update sent the training loss
  from 6.2 to 18.2.

    >>> recipe = RECIPES["gpt3-2.7b"]
    >>> recipe.lr, recipe.warmup_steps(3, batch_tokens=128), recipe.warmup_steps(300_000, batch_tokens=1_000_000)
    (0.00016, 3, 375)
    >>> f"{recipe.lr_for(128):.3g}", recipe.lr_for(2_000_000)
    ('1.81e-06', 0.00016)
"""

from __future__ import annotations

import dataclasses
import math

GPT3 = "GPT-3 (Brown et al. 2020), Table 2.1; warm-up 375M of 300B tokens, Appendix B"
GPT3_WARMUP_TOKENS = 375e6


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a named model was trained: peak learning rate, warm-up in tokens, and where from."""

    lr: float  # peak learning rate (after warm-up; then cosine decay)
    warmup_tokens: float  # tokens the linear warm-up lasts
    source: str  # the publication and table the numbers come from
    batch_tokens: float = 0.0  # tokens per batch the peak was published for (0: unknown, the peak is not scaled)

    def warmup_steps(self, steps: int, batch_tokens: int) -> int:
        """Warm-up steps for a run of ``steps`` steps of ``batch_tokens`` tokens: the recipe's warm-up tokens in
        steps of that batch, or all ``steps`` when the run is shorter; at least one."""
        return max(1, min(steps, math.ceil(self.warmup_tokens / batch_tokens)))

    def lr_for(self, batch_tokens: int) -> float:
        """Peak learning rate for batches of ``batch_tokens`` tokens: the published peak times
        ``sqrt(batch_tokens / self.batch_tokens)`` for smaller batches (Adam's square-root rule), else the
        published peak."""
        if not self.batch_tokens or batch_tokens >= self.batch_tokens:
            return self.lr
        return self.lr * math.sqrt(batch_tokens / self.batch_tokens)


RECIPES: dict[str, Recipe] = {
    name: Recipe(lr, GPT3_WARMUP_TOKENS, GPT3, batch)
    for name, (lr, batch) in {
        "gpt3-125m": (6.0e-4, 0.5e6), "gpt3-350m": (3.0e-4, 0.5e6), "gpt3-760m": (2.5e-4, 0.5e6),
        "gpt3-1.3b": (2.0e-4, 1e6), "gpt3-2.7b": (1.6e-4, 1e6), "gpt3-6.7b": (1.2e-4, 2e6),
        "gpt3-13b": (1.0e-4, 2e6), "gpt3-175b": (0.6e-4, 3.2e6),
    }.items()
}
# Not a row of GPT-3's table (models/gpt.py): 6.7B's width at 23 layers, so its peak lies between 2.7B's and 6.7B's
# (1.4e-4), at 6.7B's batch. Without a recipe it took TrainConfig's generic peak (6e-4 at any batch), and at
# 1 x 128 tokens its third step sent the loss from 5.6 to 44.8.
RECIPES["gpt3-4.8b"] = Recipe(1.4e-4, GPT3_WARMUP_TOKENS, GPT3 + " (interpolated: not a size of the table)", 2e6)
