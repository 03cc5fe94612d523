"""Hugging Face checkpoints: safetensors directories read straight into shards, and written back.

A directory ``save_pretrained`` wrote holds ``model.safetensors``, or
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> file) and the files it
names. :func:`vsf.checkpoint.load` reads one (:func:`load_hf`) when ``path`` holds no vsf
checkpoint: each tensor leaf of ``target`` is the tensor its key path names (the keys of
``vsf.tree.from_module(model)`` are the module's parameter names, which are the checkpoint's),
laid out as the leaf says, and each process reads only the slices its ranks hold
(safetensors' ``safe_open(..., backend="pread").get_slice(name)[index]`` through
:func:`vsf.make_array_from_callback`: each slice read with ``pread`` into a tensor of its own, no
file mapped), so a process's resident memory grows by its share of the checkpoint, not the
whole (``benchmarks/bench_checkpoint.py``: 2 processes loading 512 MiB grew by 256 MiB each,
320 at most while reading). No communication. Tensors the target does not name are not read.
safetensors is imported only here (pyproject's ``hf`` extra).

:func:`save_hf` writes a tree of tensors as such a directory, which ``from_pretrained`` reads.

Loading a pretrained model sharded, its module built on the meta device (no memory for its
weights; :func:`vsf.checkpoint.materialize_buffers` recomputes the buffers it computes at init,
such as Llama's rotary frequencies, which no checkpoint holds)::

    import torch, vsf, transformers
    from vsf import P

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    vsf.checkpoint.materialize_buffers(model)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))                   # under torchrun --nproc-per-node 4
    shapes = vsf.tree.from_module(model)                           # meta tensors: shapes and dtypes
    specs = vsf.sharding.match(shapes, [(r".*(q|k|v|gate|up)_proj\\.weight", P("tp", "fsdp")),
                                        (r".*(o|down)_proj\\.weight", P("fsdp", "tp")), (r".*", P())])
    target = vsf.tree.map(lambda t, s: vsf.ShapeDtypeStruct(t.shape, t.dtype, vsf.NamedSharding(mesh, s)), shapes, specs)
    params = vsf.checkpoint.load(path, target)                     # each process reads its slices
    logits = vsf.tree.apply(model, params, input_ids).logits
    vsf.checkpoint.save_hf("export", params, config=config)        # from_pretrained("export") reads it
"""

from __future__ import annotations

import contextlib
import difflib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import tree
from vsf.abstract import ShapeDtypeStruct
from vsf.checkpoint import commit, group as group_mod
from vsf.sharding.make_array import make_array_from_callback
from vsf.sharding.put import device_get

__all__ = ["INDEX", "SINGLE", "is_hf_directory", "load_hf", "save_hf"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def is_hf_directory(path: str | Path) -> bool:
    """Does ``path`` hold a Hugging Face safetensors checkpoint (one file or a sharded index)?"""
    path = Path(path)
    return (path / SINGLE).is_file() or (path / INDEX).is_file()


def weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to ``path``) of a Hugging Face directory."""
    path = Path(path)
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    with _safe_open(path / SINGLE) as f:
        return dict.fromkeys(f.keys(), SINGLE)


def load_hf(path: str | Path, target: Any = None) -> Any:
    """Read the Hugging Face checkpoint at ``path`` into ``target``'s layouts (call on every rank;
    :func:`vsf.checkpoint.load` calls it for such a directory).

    ``target`` is a tree whose tensor leaves (:class:`vsf.ShapeDtypeStruct`, or live tensors /
    DTensors whose layout is taken) are named by their key paths; each comes back as a DTensor
    laid out as its sharding says (a whole plain tensor without one), its shape the stored one
    and its dtype the target's (cast from the stored dtype, as ``from_pretrained(dtype=...)``
    does). ``None`` leaves stay ``None``. Without ``target``, every tensor comes back whole, in
    a dict by name. Each process reads only the slices its ranks hold.

    Example::

        >>> params = vsf.checkpoint.load("llama-hf", target)     # target: ShapeDtypeStructs by parameter name
    """
    path = Path(path)
    where = weight_map(path)
    pairs, treedef = tree.flatten_with_path(
        dict.fromkeys(where) if target is None else target, is_leaf=lambda x: x is None
    )
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}

        def stored(name: str) -> Any:
            if where[name] not in opened:
                opened[where[name]] = stack.enter_context(_safe_open(path / where[name]))
            return opened[where[name]].get_slice(name)

        leaves = []
        for key, leaf in pairs:
            name = tree.keystr(key)
            if leaf is None and target is not None:
                leaves.append(None)
            elif name not in where:
                raise ValueError(
                    f"the target has a leaf at {name} that the checkpoint {path} lacks{_similar(name, where)}"
                )
            else:
                leaves.append(_whole(stored(name)) if target is None else _read(name, stored(name), leaf, path))
    return tree.unflatten(treedef, leaves)


def _whole(stored: Any) -> torch.Tensor:
    return stored[tuple(slice(0, n) for n in stored.get_shape())]


def _read(name: str, stored: Any, leaf: Any, path: Path) -> torch.Tensor:
    """One target leaf from its stored tensor: this process's slices, laid out as the leaf says."""
    if not isinstance(leaf, (torch.Tensor, ShapeDtypeStruct)):
        raise TypeError(
            f"{name}: a Hugging Face checkpoint holds tensors only, but the target has a {type(leaf).__name__} ({leaf!r})"
        )
    want = ShapeDtypeStruct.like(leaf)
    shape = tuple(stored.get_shape())
    if shape != want.shape:
        raise ValueError(
            f"{name}: the checkpoint {path} holds shape {shape} ({stored.get_dtype()}), but the target asks for {want.shape}"
        )
    if want.sharding is None:
        device = (
            leaf.device
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and not leaf.is_meta
            else torch.device("cpu")
        )
        return _whole(stored).to(device=device, dtype=want.dtype)
    return make_array_from_callback(shape, want.sharding, lambda index: stored[index], dtype=want.dtype)


def _similar(name: str, where: dict[str, str]) -> str:
    close = difflib.get_close_matches(name, list(where), n=3)
    return f" (it holds {len(where)} tensors{'; similar names: ' + ', '.join(close) if close else ''})"


@contextlib.contextmanager
def _safe_open(file: Path) -> Iterator[Any]:
    from safetensors import safe_open  # the HF path's own dependency (pyproject's "hf" extra)

    with safe_open(
        str(file), framework="pt", backend="pread"
    ) as f:  # (a memory map would count the pages read as resident, and hand out views to copy)
        yield f


def save_hf(path: str | Path, tree_: Any, *, config: Any = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the tensors of ``tree_`` as a Hugging Face safetensors directory at ``path`` (call on
    every rank), which ``from_pretrained(path)`` reads.

    Tensors are named by their key paths (``vsf.tree.from_module(model)``'s keys are the module's
    parameter names) and written in files of at most about ``max_shard_bytes`` (a
    ``model.safetensors.index.json`` lists them when there are several, as ``save_pretrained``
    writes them). DTensors are gathered one file's worth at a time (every rank holds that much
    while it is written; ranks take turns writing the files). ``config`` (an object with
    ``save_pretrained``, e.g. the model's ``PretrainedConfig``) is written beside them. The
    directory appears only once complete; ``path`` must not exist.

    Example::

        >>> vsf.checkpoint.save_hf("export", params, config=model.config)
        >>> transformers.AutoModelForCausalLM.from_pretrained("export")
    """
    final = Path(path)
    if final.exists():
        raise FileExistsError(
            f"{final} already exists; vsf.checkpoint never overwrites (delete it or choose another path)"
        )
    pairs, _ = tree.flatten_with_path(tree_)
    names = [tree.keystr(p) for p, _ in pairs]
    for name, (_, leaf) in zip(names, pairs):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"save_hf writes tensors only, but {name} is a {type(leaf).__name__} ({leaf!r})")
    if len(set(names)) != len(names):
        raise ValueError(
            f"save_hf needs one name per tensor, but {sorted({n for n in names if names.count(n) > 1})} name several"
        )
    files = _files([leaf for _, leaf in pairs], max_shard_bytes)
    group = group_mod.current()
    if group.rank == 0:
        commit.remove_stale(final)
    staging = commit.staging_path(final, group.broadcast(uuid.uuid4().hex[:12] if group.rank == 0 else None))
    staging.mkdir(parents=True, exist_ok=True)
    file_names = (
        [SINGLE]
        if len(files) == 1
        else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    for k, members in enumerate(files):
        whole = device_get({names[i]: pairs[i][1] for i in members})  # collective: every rank, in order
        if group.rank == k % group.size:
            _write(staging / file_names[k], whole)
        del whole
    failure = None
    if group.rank == 0:
        try:
            if len(files) > 1:
                total = sum(leaf.numel() * leaf.element_size() for _, leaf in pairs)
                mapping = {names[i]: file_names[k] for k, members in enumerate(files) for i in members}
                (staging / INDEX).write_text(
                    json.dumps({"metadata": {"total_size": total}, "weight_map": mapping}, indent=2) + "\n"
                )
            if config is not None:
                config.save_pretrained(staging)
        except Exception as e:  # noqa: BLE001  (told to every rank below)
            failure = e
    group.all_gather(None)  # every file is written
    if group.rank == 0 and failure is None:
        commit.move_into_place(staging, final)
    message = group.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"writing {final} failed on rank 0: {message}")


def _files(leaves: list[torch.Tensor], limit: int) -> list[list[int]]:
    """Consecutive leaves grouped into files of at most ``limit`` bytes (a larger leaf alone)."""
    files: list[list[int]] = [[]]
    size = 0
    for i, leaf in enumerate(leaves):
        n = leaf.numel() * leaf.element_size()
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
    return files


def _write(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():  # two names of one tensor (tied weights) get a copy each
        t = t.detach().contiguous().cpu()
        out[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t
        seen.add(t.untyped_storage().data_ptr())
    save_file(out, str(file), metadata={"format": "pt"})
