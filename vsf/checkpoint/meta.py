"""Modules built on the meta device: recompute the buffers they compute at init.

A model built under ``torch.device("meta")`` costs no memory and gives its params' shapes and
dtypes, the target to load a checkpoint into (:mod:`vsf.checkpoint.hf`). Its buffers stay on
meta too, and the ones no checkpoint holds (non-persistent ones, such as Llama's rotary
``inv_freq``, computed from the config in ``__init__``) make its first forward fail ("Cannot copy
out of meta tensor"). :func:`materialize_buffers` recomputes them the way the module itself
would, for Hugging Face models and plain torch modules alike: for each submodule holding a meta
buffer, a copy of just that submodule is made on a real device and initialised by

* its own ``reset_parameters()`` (torch's convention for meta-device init: FSDP's default
  ``param_init_fn`` calls it for params and buffers), or else
* the ``_init_weights`` of the Hugging Face model around it (what ``from_pretrained`` runs for
  weights a checkpoint lacks: it recomputes rotary frequencies, norms' buffers ...),

and its buffers are taken when the initialiser set every element of them (it runs twice, on
buffers first filled with 0 and with 1, and both must give the same values); params stay on
meta. A buffer neither initialiser sets is an error naming it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

__all__ = ["materialize_buffers"]


def materialize_buffers(module: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Recompute, on ``device``, every buffer of ``module`` still on the meta device (in place;
    returns ``module``). Params are left as they are.

    Example (see :mod:`vsf.checkpoint.hf` for the sharded load around it)::

        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(config)
        >>> vsf.checkpoint.materialize_buffers(model).model.rotary_emb.inv_freq.device
        device(type='cpu')
    """
    device = torch.device(device)
    hf_models = {
        name: m
        for name, m in module.named_modules()
        if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")
    }
    for name, sub in module.named_modules():
        meta = [b for b, t in sub.named_buffers(recurse=False) if t.is_meta]
        if not meta:
            continue
        owner = max((n for n in hf_models if n == "" or name == n or name.startswith(n + ".")), key=len, default=None)
        inits: list[tuple[str, Callable[[torch.nn.Module], None]]] = []
        if callable(getattr(sub, "reset_parameters", None)):
            inits.append((f"{type(sub).__name__}.reset_parameters()", lambda twin: twin.reset_parameters()))
        if owner is not None:
            inits.append((f"{type(hf_models[owner]).__name__}._init_weights", hf_models[owner]._init_weights))
        values = next((v for _, init in inits if (v := _recomputed(sub, meta, init, device)) is not None), None)
        if values is None:
            where = f"{name}." if name else ""
            tried = (
                f" ({', '.join(t for t, _ in inits)} left {'them' if len(meta) > 1 else 'it'} unset)" if inits else ""
            )
            raise ValueError(
                f"cannot recompute the meta buffer{'s' if len(meta) > 1 else ''} {', '.join(where + b for b in meta)} of "
                f"{type(sub).__name__}{tried}: give {type(sub).__name__} a reset_parameters() that computes its buffers "
                f"(torch's convention for modules built on the meta device), or build the model on a real device"
            )
        for b, v in values.items():
            setattr(sub, b, v)
    return module


def _recomputed(
    sub: torch.nn.Module, names: list[str], init: Callable[[torch.nn.Module], None], device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The buffers ``names`` of a real copy of ``sub`` after ``init``, or None unless ``init``
    sets every element (the same values from buffers filled with 0 and with 1)."""
    runs = []
    for fill in (0, 1):
        twin = copy.deepcopy(sub).to_empty(device=device, recurse=False)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for b in names:
                getattr(twin, b).fill_(fill)
            init(twin)
        runs.append({b: getattr(twin, b) for b in names})
    same = all(torch.equal(runs[0][b], runs[1][b]) or _equal_nan(runs[0][b], runs[1][b]) for b in names)
    return runs[0] if same else None


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
