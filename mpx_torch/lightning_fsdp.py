"""mpx's Lightning plugins for sharded training: FSDP2 (``ModelParallelStrategy``) and FSDP1 (``FSDPStrategy``).

Lightning gives each sharding strategy its own precision shape, and mpx follows it:

* ``ModelParallelStrategy`` (FSDP2, Trainer and Fabric) takes any precision
  plugin; the sharding (and so FSDP2's ``MixedPrecisionPolicy`` of every unit)
  is the user's: ``configure_model`` (Trainer) or ``parallelize_fn`` (Fabric).
  :class:`MPXModelParallelPrecision` and :class:`MPXFabricModelParallelPrecision`
  are mpx's plugins plus a check that every FSDP2 unit all-gathers in its
  policy's compute dtype and reduces in its ``reduce_dtype``
  (:func:`mpx_torch.distributed.check_fsdp_units`), which
  ``mpx_torch.fully_shard(module, policy, mesh=mesh["data_parallel"])`` does.
* ``FSDPStrategy`` (FSDP1) accepts only subclasses of Lightning's
  ``FSDPPrecision``: :class:`MPXFSDPPrecision` (Trainer) and
  :class:`MPXFabricFSDPPrecision` (Fabric) are, and map the policy onto FSDP1's
  ``MixedPrecision`` (:func:`fsdp1_mixed_precision`: parameters in the compute
  dtype, gradients reduced in ``reduce_dtype``, buffers as stored).  FSDP1 has
  one ``MixedPrecision`` for every unit, so a policy that keeps norms in float32
  computes them in float32 from weights all-gathered in the compute dtype.

Everything else is :class:`mpx_torch.lightning.MPXPrecision`'s: the forward under
the policy, the loss scaled, clipping on unscaled gradients, one skip decision on
every rank (the scaler all-reduces its found-inf flag), the scale in the checkpoint.
Without a GPU, Lightning refuses ``FSDPStrategy`` whatever the precision plugin
(the Trainer: "The strategy `fsdp` requires a GPU accelerator", Fabric: "FSDP is
only available on GPU"), so the FSDP1 plugins are tested for their mapping and
shape on a CPU, and the FSDP2 ones run on two gloo processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as FabricFSDPPrecision
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.nn import Module

from mpx import OpTable, Policy, PolicySpec, ScalerConfig, get_policy
from mpx_torch.autocast import to_torch_dtype
from mpx_torch.distributed import check_fsdp_units
from mpx_torch.lightning import MPXFabricPrecision, MPXPrecision

__all__ = [
    "MPXFSDPPrecision",
    "MPXFabricFSDPPrecision",
    "MPXFabricModelParallelPrecision",
    "MPXModelParallelPrecision",
    "fsdp1_mixed_precision",
]

_ScalerSpec = ScalerConfig | Mapping[str, Any] | PolicySpec | None


def fsdp1_mixed_precision(policy: PolicySpec) -> Any:
    """FSDP1's ``torch.distributed.fsdp.MixedPrecision`` for ``policy``.

    ``param_dtype``: the compute dtype (the all-gather dtype); ``reduce_dtype``:
    ``policy.reduce_dtype``; ``buffer_dtype``: None (buffers stay as
    :func:`mpx_torch.prepare` stores them).

    >>> mp = fsdp1_mixed_precision("mixed_bfloat16")
    >>> mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype
    (torch.bfloat16, torch.float32, None)
    """
    from torch.distributed.fsdp import MixedPrecision

    pol = get_policy(policy)
    return MixedPrecision(
        param_dtype=to_torch_dtype(pol.compute_dtype), reduce_dtype=to_torch_dtype(pol.reduce_dtype)
    )


class MPXModelParallelPrecision(MPXPrecision):
    """:class:`mpx_torch.lightning.MPXPrecision` for ``ModelParallelStrategy`` (FSDP2) in the ``Trainer``.

    Same arguments.  Shard in ``configure_model`` with
    ``mpx_torch.fully_shard(self.net, self.trainer.precision_plugin.policy,
    mesh=self.device_mesh["data_parallel"])``; a unit sharded with another
    ``MixedPrecisionPolicy`` raises :class:`mpx.MPXError` when the strategy
    sets the model up (``configure_model`` runs before).  ``gradient_clip_val``
    clips the unscaled sharded gradients (``torch.nn.utils.clip_grad_norm_``
    over DTensors: the global norm).  The scaler state is saved with the
    (distributed) checkpoint and restored on resume.
    """

    def convert_module(self, module: Module) -> Module:
        """Prepare ``module`` under the policy and check its FSDP2 units' dtypes against it."""
        prepared = super().convert_module(module)
        check_fsdp_units(prepared, self.policy)
        return prepared


class MPXFabricModelParallelPrecision(MPXFabricPrecision):
    """:class:`mpx_torch.lightning.MPXFabricPrecision` for Fabric's ``ModelParallelStrategy`` (FSDP2).

    Same arguments.  Fabric converts the module before the strategy's
    ``parallelize_fn`` shards it (in place), so shard there with
    ``mpx_torch.fully_shard(module, policy, mesh=mesh["data_parallel"])``;
    the FSDP2 units of the modules this plugin converted are checked against
    the policy at the first ``fabric.backward`` (:class:`mpx.MPXError` for a mismatch).
    """

    def convert_module(self, module: Module) -> Module:
        """Prepare ``module`` under the policy; its FSDP2 units are checked at the next backward."""
        prepared = super().convert_module(module)
        self.__dict__.setdefault("_unchecked", []).append(prepared)
        return prepared

    def backward(self, tensor: torch.Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        """Check the converted modules' FSDP2 units (once), then backward of the scaled loss."""
        for module in self.__dict__.pop("_unchecked", []):
            check_fsdp_units(module, self.policy)
        super().backward(tensor, model, *args, **kwargs)


class _FSDP1:
    policy: Policy

    def _fsdp1_setup(self) -> None:
        self._desired_input_dtype = to_torch_dtype(self.policy.param_dtype)

    @property
    def mixed_precision_config(self) -> Any:
        """FSDP1's ``MixedPrecision`` for the policy (:func:`fsdp1_mixed_precision`); the strategy reads it."""
        return fsdp1_mixed_precision(self.policy)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Tensors made under the strategy's init context take the policy's param dtype."""
        return _DtypeContextManager(self._desired_input_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Modules made under the strategy's init context take the policy's param dtype."""
        return _DtypeContextManager(self._desired_input_dtype)

    def convert_input(self, data: Any) -> Any:
        """Inputs as given (mpx's autocast casts per op, as with :class:`mpx_torch.lightning.MPXPrecision`)."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Outputs as the model returns them (in the policy's ``output_dtype``)."""
        return data


class MPXFSDPPrecision(_FSDP1, MPXPrecision, FSDPPrecision):
    """:class:`mpx_torch.lightning.MPXPrecision` for the Trainer's ``FSDPStrategy`` (FSDP1).

    Same arguments as :class:`MPXPrecision`.  An ``FSDPPrecision`` (the only
    kind ``FSDPStrategy`` accepts), whose ``mixed_precision_config`` is
    :func:`fsdp1_mixed_precision` of the policy.  Clipping by norm raises, as
    Lightning's ``FSDPPrecision`` does (FSDP1 needs the root module's
    ``clip_grad_norm_``); clipping by value clips the unscaled gradients.
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: _ScalerSpec = None,
        *,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        MPXPrecision.__init__(self, policy, config, device_type=device_type, op_table=op_table)
        self._fsdp1_setup()

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss once (``FSDPPrecision`` would scale it again with its own scaler)."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return Precision.pre_backward(self, tensor, module)


class MPXFabricFSDPPrecision(_FSDP1, MPXFabricPrecision, FabricFSDPPrecision):
    """:class:`mpx_torch.lightning.MPXFabricPrecision` for Fabric's ``FSDPStrategy`` (FSDP1).

    Same arguments; ``fabric.clip_gradients`` unscales first (by norm, Fabric
    calls the root FSDP module's ``clip_grad_norm_``: the global norm of the
    unscaled sharded gradients).
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: _ScalerSpec = None,
        *,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        MPXFabricPrecision.__init__(self, policy, config, device_type=device_type, op_table=op_table)
        self._fsdp1_setup()

    def backward(self, tensor: torch.Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss, scaled once."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        FabricPrecision.backward(self, tensor, model, *args, **kwargs)
