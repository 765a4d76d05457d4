"""The optimizer contract: which updates nsp runs, which states each keeps, their defaults, and how a spec is
handed to the C++ kernels.

Everything else reads these from here: the kernels' Python wrappers (``nsp.primitives``), the stores
(``nsp.storage``, which record the spec in ``nsp_store.json``), the optax transforms (``nsp.optim``) and the
trainer's config. The C++ side has the same kinds in ``ffi/kernels/update_kernel.h`` (``OptimizerKind``) and the same
hyperparameter names in ``ffi/kernels/hyper_params.h``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: The update kinds and their codes in the C++ kernels (ffi/kernels/update_kernel.h: OptimizerKind).
KINDS: dict[str, int] = {"adam": 0, "adamw": 1, "sgd": 2, "adagrad": 3}

#: The kinds' default eps, as optax's: 1e-8 for Adam/AdamW, 1e-7 for AdaGrad (SGD has none).
DEFAULT_EPS: dict[str, float] = {"adam": 1e-8, "adamw": 1e-8, "sgd": 0.0, "adagrad": 1e-7}

#: The states a store keeps per parameter, in the kernels' order.
STATES: tuple[str, str, str] = ("param", "mu", "nu")


def check_kind(kind: str) -> None:
    """Raises ValueError naming the known kinds unless ``kind`` is one."""
    if kind not in KINDS:
        raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {sorted(KINDS)}")


def uses_mu(kind: str, momentum: float = 0.0) -> bool:
    """Whether optimizer ``kind`` keeps a first-moment (momentum) state."""
    return kind in ("adam", "adamw") or (kind == "sgd" and momentum != 0.0)


def uses_nu(kind: str) -> bool:
    """Whether optimizer ``kind`` keeps a second-moment (accumulator) state."""
    return kind in ("adam", "adamw", "adagrad")


def hyper_attrs(kind: str, b1: float, b2: float, eps: float, weight_decay: float, momentum: float,
                nesterov: bool, lazy: bool) -> dict:
    """The hyperparameters of an update other than lr and step, as the one dictionary the C++ side decodes
    (ffi/kernels/hyper_params.h names the keys): the ``hyper`` attribute of the FFI update calls, and the ``hyper``
    argument of the storage engine's ``step``. ``kind`` is one of ``KINDS``' names."""
    return dict(kind=np.int32(KINDS[kind]), b1=np.float64(b1), b2=np.float64(b2), eps=np.float64(eps),
                weight_decay=np.float64(weight_decay), momentum=np.float64(momentum), nesterov=bool(nesterov),
                lazy=bool(lazy))


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which update a store runs and with which (static) hyperparameters.

    ``lr`` and ``step`` are not here: they are given to every update, so schedules work.
    """

    kind: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None  # None: the kind's default (DEFAULT_EPS)
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    lazy: bool = False  # entries with a zero gradient keep param and state (see nsp.primitives.fused_update)
    initial_nu: float = 0.0  # AdaGrad's initial accumulator (optax: 0.1)

    def __post_init__(self):
        check_kind(self.kind)
        if self.eps is None:
            object.__setattr__(self, "eps", DEFAULT_EPS[self.kind])

    def states_used(self) -> tuple[bool, bool, bool]:
        """Which of ``STATES`` the update keeps."""
        return (True, uses_mu(self.kind, self.momentum), uses_nu(self.kind))

    def hyper_attrs(self) -> dict:
        """This spec's hyperparameters as the C++ side takes them (``hyper_attrs``)."""
        return hyper_attrs(self.kind, self.b1, self.b2, self.eps, self.weight_decay, self.momentum, self.nesterov,
                           self.lazy)
