"""glassformer.train: the loop as named phases (loop.py), one optimizer step (step.py), the run's
state (runstate.py), set-up, optimizer and schedule, evaluation, metrics, many processes."""

from .loop import train
from .step import train_step

__all__ = ["train", "train_step"]
