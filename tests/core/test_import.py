import json
import subprocess
import sys

FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax")


def test_import_mpx_loads_no_framework():
    code = (
        "import json, sys, mpx, mpx.cli; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_names_from_design_exist():
    import mpx

    for name in (
        "Policy", "get_policy", "dtype_info", "ScalerConfig", "ScalerState", "scaler_init",
        "scaler_update", "LossScaler", "OpClass", "OP_TABLE", "OpTable", "classify",
        "result_dtype", "MPXError", "PolicyError", "ScalerConfigError", "StateDictError",
    ):  # fmt: skip
        assert name in mpx.__all__ and hasattr(mpx, name), name
    assert issubclass(mpx.MPXError, ValueError)
    for err in (mpx.PolicyError, mpx.ScalerConfigError, mpx.StateDictError, mpx.DTypeError):
        assert issubclass(err, mpx.MPXError)
