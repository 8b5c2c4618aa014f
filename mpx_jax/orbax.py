"""orbax checkpoints that keep each loss scale's config, and refuse a target built from another one.

An :class:`mpx_jax.LossScale` is a pytree whose leaves are its five state
arrays and whose config is static metadata, so orbax's ``StandardSave`` writes
the state and not the config: a restore with a target silently adopts the
target's config (a saved ``growth_interval`` of 2 comes back as 2000), and a
restore without one gives plain dicts.

This module is orbax's standard pytree checkpoint plus the neutral
``mpx.scaler/1`` state dict (config and state) of every ``LossScale`` in the
tree, written in the same checkpoint (in its pytree metadata, so orbax's
atomic finalize covers both: a checkpoint that exists holds both, a save
killed midway leaves only a temporary directory that orbax never restores):

* ``StandardSave(item)`` / ``StandardRestore(item=None)``: drop-in
  replacements for ``ocp.args.StandardSave`` / ``ocp.args.StandardRestore``,
  registered with :class:`StandardCheckpointHandler`, so they work in
  ``ocp.CheckpointManager`` (async saves included), ``ocp.Checkpointer`` and
  ``ocp.args.Composite``;
* :class:`StandardCheckpointer`: ``ocp.StandardCheckpointer`` with this handler.

``item`` is any pytree orbax's standard handler saves: an optax state, a
linen ``TrainState``, and Flax NNX objects (``nnx.Optimizer``, modules: pytrees
in Flax 0.12; save the objects rather than ``nnx.state(...)``, which drops the
``LossScale`` and with it its config).

Restoring:

* with a target: every ``LossScale`` in the target must sit where the
  checkpoint has one, with the same config; otherwise
  :class:`mpx.StateDictError` names the place and the fields that differ,
  and nothing is restored.  A place where the checkpoint holds a loss scale
  and the target does not (an ``nnx.State``, a dict) is an error too: its
  config could not be checked.  The restored state arrays are then checked
  against the saved state dict;
* without a target: the tree comes back as orbax's nested dicts, with each
  loss scale rebuilt as a ``LossScale`` from its saved state dict.

>>> import tempfile, mpx, mpx_jax, orbax.checkpoint as ocp
>>> ls = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=2)).update(True)
>>> path = tempfile.mkdtemp() + "/ckpt"
>>> with StandardCheckpointer() as ckptr:
...     ckptr.save(path, {"loss_scale": ls})
...     ckptr.wait_until_finished()
...     back = ckptr.restore(path)["loss_scale"]
>>> back.config.growth_interval, back.state.growth_tracker
(2, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

import mpx
from mpx.versions import require_version
from mpx_jax.loss_scale import (
    GROWTH_FIELDS,
    HISTORY_FIELDS,
    STATE_FIELDS,
    LossScale,
    config_difference,
    plain_loss_scale,
)

require_version("orbax-checkpoint", ocp.__version__)

__all__ = [
    "METADATA_KEY",
    "StandardCheckpointHandler",
    "StandardCheckpointer",
    "StandardRestore",
    "StandardSave",
    "saved_loss_scales",
]

#: The key of the pytree checkpoint's custom metadata that holds the loss scales:
#: a list of ``{"path": [...], "where": "...", "state_dict": {mpx.scaler/1}}``.
METADATA_KEY = "mpx.loss_scales"


def _is_loss_scale(x: Any) -> bool:
    return isinstance(x, LossScale)


def _key(entry: Any) -> str | int:
    """One pytree key as orbax names it in a restore without target (a str, or an int for sequences)."""
    if isinstance(entry, jax.tree_util.SequenceKey):
        return entry.idx
    if isinstance(entry, jax.tree_util.DictKey):
        return entry.key if isinstance(entry.key, (str, int)) else str(entry.key)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return entry.key
    return str(entry)


def _loss_scales(tree: Any) -> dict[str, tuple[list[str | int], LossScale]]:
    """Every LossScale in ``tree``: ``{where (jax keystr): (path keys, loss scale)}``."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_loss_scale)[0]
    return {
        jax.tree_util.keystr(path) or "(root)": ([_key(k) for k in path], leaf)
        for path, leaf in found
        if _is_loss_scale(leaf)
    }


def _entries(tree: Any) -> list[dict[str, Any]]:
    """The metadata entries of the loss scales in ``tree`` (reads their state: a host sync per scale)."""
    return [
        {"path": path, "where": where, "state_dict": plain_loss_scale(ls).state_dict()}
        for where, (path, ls) in _loss_scales(tree).items()
    ]


@dataclasses.dataclass
class _Saved:
    where: str
    path: list[str | int]
    config: mpx.ScalerConfig
    state: mpx.ScalerState
    state_dict: dict[str, Any]


def _read_entries(custom: Any, directory: Any) -> list[_Saved] | None:
    """The saved loss scales of a checkpoint's custom metadata, validated (None: saved without mpx)."""
    if not isinstance(custom, Mapping) or METADATA_KEY not in custom:
        return None
    entries = custom[METADATA_KEY]
    if not isinstance(entries, Sequence):
        raise mpx.StateDictError(
            f"{directory}: {METADATA_KEY}: expected a list, got {type(entries).__name__}"
        )
    out = []
    for entry in entries:
        if not isinstance(entry, Mapping) or not {"path", "where", "state_dict"} <= set(entry):
            raise mpx.StateDictError(
                f"{directory}: {METADATA_KEY}: each entry has path, where and state_dict, got {entry!r}"
            )
        where = str(entry["where"])
        try:
            config, state = mpx.load_state_dict(entry["state_dict"])
        except mpx.StateDictError as exc:
            raise mpx.StateDictError(f"{where}: the saved loss scale: {exc}") from None
        out.append(_Saved(where, list(entry["path"]), config, state, dict(entry["state_dict"])))
    return out


def _check_target(saved: list[_Saved] | None, target: Any, directory: Any) -> None:
    """Raise StateDictError unless every loss scale of ``target`` matches the checkpoint's, config included."""
    wanted = _loss_scales(target)
    by_where = {s.where: s for s in saved or ()}
    problems = []
    for where, (_, ls) in wanted.items():
        s = by_where.get(where)
        if s is None:
            how = (
                "was saved without mpx's loss-scale metadata (save with mpx_jax.orbax.StandardSave)"
                if saved is None
                else "holds no loss scale there"
            )
            problems.append(f"{where}: the target holds a LossScale, but the checkpoint {how}")
            continue
        diff = config_difference(s.config, ls.config)
        if diff:
            problems.append(
                f"{where}: the saved config differs from the target's in {diff} (saved vs target)"
            )
    for where in by_where.keys() - wanted.keys():
        problems.append(
            f"{where}: the checkpoint holds an mpx loss scale here, but the target holds no LossScale there, "
            "so its config cannot be checked; pass a target that holds it (the optax state, the "
            "nnx.Optimizer, the TrainState, not nnx.state(...)), or restore without a target"
        )
    if problems:
        raise mpx.StateDictError(
            f"{directory}: cannot restore into this target: " + "; ".join(problems) + "."
        )


def _check_restored(saved: Sequence[_Saved], restored: dict[str, LossScale], directory: Any) -> None:
    for s in saved:
        got = restored[s.where].state
        if got != s.state:
            raise mpx.StateDictError(
                f"{directory}: {s.where}: the restored loss-scale arrays ({got}) differ from the saved state "
                f"dict ({s.state}); the checkpoint is inconsistent."
            )


def _field(node: Any, name: str) -> Any:
    value = node[name]
    if isinstance(value, Mapping) and set(value) == {"value"}:  # an NNX variable restored without target
        value = value["value"]
    return value


def _rebuild(raw: Any, saved: Sequence[_Saved], directory: Any) -> Any:
    """``raw`` (a restore without target) with each saved loss scale rebuilt at its path."""
    rebuilt = {}
    for s in saved:
        if not s.path:
            node = raw
        else:
            parent = raw
            for key in s.path[:-1]:
                parent = parent[key if isinstance(parent, Sequence) else str(key)]
            last = s.path[-1]
            node = parent[last if isinstance(parent, Sequence) else str(last)]
        if not isinstance(node, Mapping) or set(node) - {*HISTORY_FIELDS, *GROWTH_FIELDS} != set(STATE_FIELDS):
            raise mpx.StateDictError(
                f"{directory}: {s.where}: expected the five loss-scale arrays {', '.join(STATE_FIELDS)} "
                f"(and the history ring's, while recording), found {type(node).__name__}"
            )
        growth = {name: _field(node, name) if name in node else None for name in GROWTH_FIELDS}
        arrays = LossScale(**{name: _field(node, name) for name in STATE_FIELDS}, config=s.config, **growth)
        rebuilt[s.where] = arrays
        ring = {name: _field(node, name) if name in node else None for name in HISTORY_FIELDS}
        # a loss scale saved while recording records on, into its restored ring
        ls = dataclasses.replace(LossScale.from_state_dict(s.state_dict), **ring)
        if not s.path:
            raw = ls
        else:
            parent[last if isinstance(parent, Sequence) else str(last)] = ls
    _check_restored(saved, rebuilt, directory)
    return raw


class StandardCheckpointHandler(ocp.StandardCheckpointHandler):
    """orbax's ``StandardCheckpointHandler`` that also writes and checks each loss scale's config.

    Takes :class:`StandardSave` / :class:`StandardRestore` (and orbax's own
    ``StandardSave``/``StandardRestore`` args, read the same way).  The loss
    scales' state dicts go in the pytree checkpoint's ``custom_metadata``
    under :data:`METADATA_KEY`, next to any custom metadata you pass.
    """

    async def async_save(
        self,
        directory: Any,
        item: Any = None,
        save_args: Any = None,
        args: ocp.args.StandardSave | None = None,
    ) -> Any:
        """Save ``args.item`` (orbax's async save; each loss scale's state is read now, on the host)."""
        if args is None:
            args = ocp.args.StandardSave(item, save_args)
        custom = dict(args.custom_metadata or {})
        custom[METADATA_KEY] = _entries(args.item)
        return await super().async_save(
            directory, args=ocp.args.StandardSave(args.item, args.save_args, custom_metadata=custom)
        )

    def restore(self, directory: Any, item: Any = None, args: ocp.args.StandardRestore | None = None) -> Any:
        """Restore into ``args.item`` (checked, see the module docs) or, without one, rebuild the loss scales.

        Raises:
            mpx.StateDictError: for a target whose loss scales do not match the
                checkpoint's (naming the place and the fields), or an
                inconsistent checkpoint; nothing is restored.
        """
        if args is None:
            args = ocp.args.StandardRestore(item)
        saved = _read_entries(self.metadata(directory).custom_metadata, directory)
        target = args.item
        if target is not None:
            _check_target(saved, target, directory)
        plain = ocp.args.StandardRestore(
            target,
            strict=args.strict,
            support_layout=args.support_layout,
            fallback_sharding=args.fallback_sharding,
        )
        restored = super().restore(directory, args=plain)
        if not saved:
            return restored
        if target is None:
            return _rebuild(restored, saved, directory)
        _check_restored(saved, {w: ls for w, (_, ls) in _loss_scales(restored).items()}, directory)
        return restored


@ocp.args.register_with_handler(StandardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StandardSave(ocp.args.StandardSave):
    """``ocp.args.StandardSave`` (``item``, ``save_args``, ``custom_metadata``) that also saves the
    config and state of every ``LossScale`` in ``item`` (:class:`StandardCheckpointHandler`)."""


@ocp.args.register_with_handler(StandardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StandardRestore(ocp.args.StandardRestore):
    """``ocp.args.StandardRestore`` (``item`` the target or None, ``strict``...) that checks the target's
    loss-scale configs against the checkpoint's, or rebuilds the loss scales without a target."""


class StandardCheckpointer(ocp.AsyncCheckpointer):
    """``ocp.StandardCheckpointer`` with :class:`StandardCheckpointHandler`: saves asynchronously.

    ``save(directory, state)`` and ``restore(directory, target=None)`` as
    orbax's; keyword arguments go to ``ocp.AsyncCheckpointer`` (``async_options``...).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(StandardCheckpointHandler(), **kwargs)

    def save(  # type: ignore[override]
        self, directory: Any, state: Any, *, save_args: Any = None, force: bool = False, **kwargs: Any
    ) -> None:
        """Save ``state`` to ``directory`` (asynchronously; ``wait_until_finished()`` to block)."""
        super().save(directory, args=StandardSave(state, save_args), force=force, **kwargs)

    def restore(self, directory: Any, target: Any = None, *, strict: bool = True) -> Any:  # type: ignore[override]
        """Restore from ``directory`` into ``target`` (checked) or, without one, as nested dicts with
        the loss scales rebuilt."""
        return super().restore(directory, args=StandardRestore(target, strict=strict))


def saved_loss_scales(directory: Any) -> dict[str, LossScale]:
    """The loss scales saved in the checkpoint item at ``directory`` (``{where: LossScale}``), read from
    its metadata alone (no arrays restored); empty for a checkpoint saved without this module.

    ``directory``: the item's directory (for a ``CheckpointManager`` step, ``<root>/<step>/default``).
    """
    from etils import epath

    directory = epath.Path(directory)
    saved = _read_entries(StandardCheckpointHandler().metadata(directory).custom_metadata, directory)
    return {s.where: LossScale.from_state_dict(s.state_dict) for s in saved or ()}
