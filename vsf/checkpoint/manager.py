"""``CheckpointManager``: numbered checkpoints in one directory, with an interval and retention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vsf.checkpoint import commit, group as group_mod
from vsf.errors import NotACheckpointError
from vsf.checkpoint.loading import load
from vsf.checkpoint.saving import start_save, wait_pending

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Save every ``save_interval_steps`` steps into ``directory/<step>``, keep the newest ``max_to_keep``.

    Only committed checkpoints count: a step whose save was interrupted is never listed or restored.
    Retention runs on rank 0 right after each commit and never deletes the step just written.

    Example::

        >>> mngr = vsf.checkpoint.CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100)
        >>> state = mngr.restore(target=abstract_state) if mngr.latest_step() is not None else init()
        >>> for step in range(start, steps):
        ...     state = train_step(state)
        ...     mngr.save(step, state, blocking=False)   # a no-op unless step % 100 == 0
        >>> mngr.wait()
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        progress: bool | None = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}")
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.progress = progress

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep!r}, "
            f"save_interval_steps={self.save_interval_steps!r})"
        )

    def step_path(self, step: int) -> Path:
        """The directory of ``step``'s checkpoint."""
        return self.directory / str(step)

    def should_save(self, step: int) -> bool:
        """True when ``step`` falls on the save interval."""
        return step % self.save_interval_steps == 0

    def save(self, step: int, tree: Any, *, force: bool = False, blocking: bool = True) -> bool:
        """Save ``tree`` as ``step`` if the step is on the interval (or ``force``); return whether it did.

        With ``blocking=False`` the write continues in the background (see :func:`vsf.checkpoint.save`).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not (force or self.should_save(step)):
            return False
        start_save(
            self.step_path(step), tree, blocking=blocking, progress=self.progress, on_commit=lambda: self._prune(step)
        )
        return True

    def wait(self) -> None:
        """Wait for a save still being written in the background (raising its error)."""
        wait_pending(group_mod.current())

    def all_steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and commit.is_committed(p))

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Load ``step`` (default: the latest committed one); ``target`` as in :func:`vsf.checkpoint.load`."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NotACheckpointError(f"{self.directory} holds no committed checkpoint to restore")
        return load(self.step_path(step), target, progress=self.progress)

    def _prune(self, just_saved: int) -> None:
        if self.max_to_keep is None:
            return
        doomed = [s for s in self.all_steps() if s != just_saved]
        for step in doomed[: max(0, len(doomed) + 1 - self.max_to_keep)]:
            commit.remove(self.step_path(step))
