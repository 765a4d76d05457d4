"""Which update a store runs: the optimizer kind and its static hyperparameters, recorded in ``nsp_store.json``."""

from __future__ import annotations

import dataclasses

from nsp.primitives.fused_update import KINDS, _DEFAULT_EPS


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which update the store runs and with which (static) hyperparameters.

    ``lr`` and ``step`` are not here: they are given to every update, so schedules work.
    """

    kind: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    lazy: bool = False  # entries with a zero gradient keep param and state (see nsp.primitives.fused_update)
    initial_nu: float = 0.0  # AdaGrad's initial accumulator (optax: 0.1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown optimizer kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if self.eps is None:
            object.__setattr__(self, "eps", _DEFAULT_EPS[self.kind])

    def states_used(self) -> tuple[bool, bool, bool]:
        mu = self.kind in ("adam", "adamw") or (self.kind == "sgd" and self.momentum != 0.0)
        nu = self.kind in ("adam", "adamw", "adagrad")
        return (True, mu, nu)
