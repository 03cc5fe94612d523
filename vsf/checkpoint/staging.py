"""Host copies of the local shards, taken before a background save returns.

Freshly allocated host memory is slow to fill the first time (page faults), so the buffers of
one background save are kept and refilled by the next one with the same leaves. A group holds
one :class:`Staging`; its buffers are reused only after the save that used them has finished
(every save first waits for the previous one). The cost is one host copy of this rank's shards,
kept between background saves, as DCP's own cached staging does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat

__all__ = ["Staging"]


class Staging:
    """Reusable host buffers, keyed like the DCP state dict.

    Example::

        >>> staged = Staging().stage({"w": dtensor})   # a DTensor over a host copy of the local shard
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor of ``state`` to host buffers now; DTensors keep their layout."""
        buffers, staged = {}, {}
        for key, x in state.items():
            local = x.to_local() if isinstance(x, DTensor) else x
            buf = self._buffers.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
            buf.copy_(local.detach())
            buffers[key] = buf
            staged[key] = _compat.dtensor_like(buf, x) if isinstance(x, DTensor) else buf
        self._buffers = buffers
        return staged
