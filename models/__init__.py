"""Flax NNX models trained with nsp (installed as ``nsp.models``; no nsp imports here)."""
