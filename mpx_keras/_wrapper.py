"""``InnerWrapper``: the plumbing every mpx_keras optimizer that wraps another Keras optimizer shares.

:class:`mpx_keras.LossScaleOptimizer` and :class:`mpx_keras.optim.PolicyOptimizer` each hold an
``inner_optimizer`` and add variables of their own.  This mixin (listed before the Keras base class) gives
both the same:

* ``variables``: the wrapper's own variables, then the inner optimizer's (what Keras saves), then any a
  subclass threads through a stateless step without saving (:meth:`InnerWrapper._unsaved_variables`);
* ``iterations`` and ``learning_rate``: the inner optimizer's (the wrapper's own learning rate is unused);
* building on the first ``apply`` (:meth:`InnerWrapper._build_for`) and ``apply_gradients``;
* ``get_config`` (``name`` and the serialized ``inner_optimizer``; a subclass adds its own keys) and
  ``from_config`` (the inner optimizer deserialized, every other key passed to the constructor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import keras

from mpx_keras import _compat

__all__ = ["InnerWrapper"]

_W = TypeVar("_W", bound="InnerWrapper")


class InnerWrapper:
    """A mixin for a ``keras.optimizers.Optimizer`` subclass that wraps ``self.inner_optimizer``."""

    inner_optimizer: keras.optimizers.Optimizer
    # Set by keras.optimizers.Optimizer (the class this mixin is combined with).
    _variables: list[keras.Variable]
    built: bool
    name: str
    build: Any
    apply: Any

    @property
    def variables(self) -> list[keras.Variable]:
        """This optimizer's own variables, then the inner optimizer's, then :meth:`_unsaved_variables`."""
        return self._saved_variables() + self._unsaved_variables()

    def _saved_variables(self) -> list[keras.Variable]:
        """The variables Keras saves: this optimizer's own, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    def _unsaved_variables(self) -> list[keras.Variable]:
        """Variables listed after the saved ones and never saved (none here; a subclass may add some)."""
        return []

    @property
    def iterations(self) -> Any:
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (setting it sets the inner one's)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def _build_for(self, trainable_variables: list[Any] | None) -> list[Any]:
        """Build on the first call; the variables the gradients belong to (the built ones for None).

        Raises:
            ValueError: for None before the optimizer is built.
        """
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "apply() without trainable_variables needs a built optimizer; pass the variables "
                    "on the first call or call optimizer.build(model.trainable_variables) first"
                )
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if trainable_variables is not None:
            return trainable_variables
        return list(_compat.optimizer_member(self, "_trainable_variables"))

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """Keras's form of ``apply``: ``(gradient, variable)`` pairs; returns :attr:`iterations`."""
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(list(grads), list(trainable_variables))
        return self.iterations

    def get_config(self) -> dict[str, Any]:
        """``name`` and the serialized ``inner_optimizer``; a subclass adds its own keys."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls: type[_W], config: Mapping[str, Any], custom_objects: Any = None) -> _W:
        """The optimizer of a :meth:`get_config` dict: the inner optimizer deserialized, the rest passed on."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)  # type: ignore[call-arg]
