"""Training: AdamW + schedule (optim), TrainState (state), jitted steps (step), loop (run)."""

from zaya_jax.train.loop import run
from zaya_jax.train.optim import decay_mask, make_optimizer, make_schedule
from zaya_jax.train.state import TrainState, abstract_train_state, init_train_state
from zaya_jax.train.step import cross_entropy, eval_step, make_eval_step, make_train_step, train_step

__all__ = [
    "TrainState",
    "abstract_train_state",
    "cross_entropy",
    "decay_mask",
    "eval_step",
    "init_train_state",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "run",
    "train_step",
]
