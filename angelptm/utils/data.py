"""``deepspeed.utils.RepeatingLoader``: a loader restarted whenever it runs out."""

from __future__ import annotations

from typing import Any, Iterable


class RepeatingLoader:
    """Iterate ``loader`` forever, starting a new pass when one ends (DeepSpeed's class).

    Args:
        loader: any iterable (a DataLoader, or the loader :func:`angelptm.initialize` returns).
    """

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
