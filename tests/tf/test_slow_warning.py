import warnings

import keras

import mpx
import mpx.advice
import mpx_tf


def test_float16_on_cpu_warns_once(warnings_on):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mpx_tf.policy_scope("mixed_float16"):
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        mpx_tf.apply_policy(model, "mixed_float16")
    slow = [w for w in caught if issubclass(w.category, mpx.SlowPolicyWarning)]
    assert len(slow) == 1 and "float16" in str(slow[0].message)


def test_bfloat16_does_not_warn_and_the_switch_silences(warnings_on, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx.SlowPolicyWarning)
        mpx_tf.set_global_policy("mixed_bfloat16")
        monkeypatch.setenv("MPX_NO_SLOW_WARNING", "1")
        mpx_tf.set_global_policy("mixed_float16")
