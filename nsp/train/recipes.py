"""Published training recipes: the peak learning rate and warm-up each named model was trained with.

``nsp train`` takes a model's recipe when ``--lr`` or ``--warmup-steps`` is not given; models without one (the toy
sizes, GPT-2, whose paper gives no learning rates) take ``TrainConfig``'s generic defaults.

GPT-3 (Brown et al. 2020, Table 2.1 and Appendix B): the peak learning rates below, a linear warm-up over the
first 375 million tokens of a 300-billion-token run, then cosine decay to 10%. A run of ``steps`` steps gets the
same shape: its warm-up is the same fraction of its steps (at least one step), so a short run warms up briefly
instead of spending its steps near zero (375M tokens at batch 1 x 128 would be 2.9 million steps).

    >>> recipe = RECIPES["gpt3-2.7b"]
    >>> recipe.lr, recipe.warmup_steps(3), recipe.warmup_steps(2_000_000)
    (0.00016, 1, 2500)
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

    def warmup_steps(self, steps: int) -> int:
        """Warm-up steps for a run of ``steps`` steps: the recipe's fraction of them, at least one."""
        return max(1, math.ceil(self.warmup_fraction * steps))


RECIPES: dict[str, Recipe] = {
    name: Recipe(lr, GPT3_WARMUP_FRACTION, GPT3)
    for name, lr in {"gpt3-125m": 6.0e-4, "gpt3-350m": 3.0e-4, "gpt3-760m": 2.5e-4, "gpt3-1.3b": 2.0e-4,
                     "gpt3-2.7b": 1.6e-4, "gpt3-6.7b": 1.2e-4, "gpt3-13b": 1.0e-4, "gpt3-175b": 0.6e-4}.items()
}
