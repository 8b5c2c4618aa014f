"""mpx_torch._compat: every torch internal behind one gate; a missing one gives the one clear error (#22).

Mutation checks: each test takes one private name away (monkeypatch) and drives the public path
that uses it; the error must be the one :class:`mpx.FrameworkVersionError` naming that name.
"""

import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import mpx
import mpx_torch
from mpx_torch import _compat, _compile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _names(info, qualname):
    text = str(info.value)
    assert f"torch {torch.__version__} has no {qualname}, which mpx uses for" in text, text
    assert "mpx is tested with torch >= 2.13.0" in text
    assert isinstance(info.value, ImportError) and isinstance(info.value, mpx.MPXError)


def _scaled_step(scaler):
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * 2).sum()).backward()
    scaler.step(opt)
    return opt


def test_every_private_torch_name_in_mpx_torch_goes_through_compat():
    """No module but _compat touches torch's underscore names (the gate is the only door)."""
    private = re.compile(
        r"\btorch\._[A-Za-z]|\bnn\.modules\.\w+\._[A-Za-z]|\._values\(|\._parameters|\._buffers"
    )
    offenders = []
    for path in sorted((ROOT / "mpx_torch").glob("*.py")):
        if path.name == "_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if private.search(code) and "``" not in code:  # ``...``: a name in a docstring
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_unscale_kernel_missing_names_it(monkeypatch):
    scaler = mpx_torch.GradScaler()
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    with pytest.raises(mpx.FrameworkVersionError) as info:
        _scaled_step(scaler)
    _names(info, "torch._amp_foreach_non_finite_check_and_unscale_")


def test_default_device_context_missing_names_it(monkeypatch):
    monkeypatch.delattr(torch, "_GLOBAL_DEVICE_CONTEXT")
    with pytest.raises(mpx.FrameworkVersionError) as info:
        _compat.global_device_context()
    _names(info, "torch._GLOBAL_DEVICE_CONTEXT")


@pytest.mark.parametrize(
    ("module", "name", "qualname"),
    [
        ("torch._dynamo.eval_frame", "skip_code", "torch._dynamo.eval_frame.skip_code"),
        ("torch._dynamo.decorators", "skip", "torch._dynamo.decorators.skip"),
        (
            "torch._C._dynamo.eval_frame",
            "get_eval_frame_callback",
            "torch._C._dynamo.eval_frame.get_eval_frame_callback",
        ),
    ],
    ids=["skip_code", "skip", "eval_frame_callback"],
)
def test_dynamo_internal_missing_names_it(monkeypatch, module, name, qualname):
    """make_eager (run by GradScaler()) marks the scaler's methods for compiled callers."""
    monkeypatch.setattr(_compile, "_EAGER", [])  # a fresh registry: this test's method only
    monkeypatch.delattr(module + "." + name)

    @_compile.eager_under_dynamo(recursive=False)
    def method():
        return 1

    with pytest.raises(mpx.FrameworkVersionError) as info:
        _compile.make_eager()
    _names(info, qualname)


@pytest.mark.parametrize(
    ("owner", "name", "qualname", "get"),
    [
        (nn.modules.batchnorm, "_NormBase", "torch.nn.modules.batchnorm._NormBase", _compat.norm_base),
        (nn.modules.loss, "_Loss", "torch.nn.modules.loss._Loss", _compat.loss_base),
        (nn.modules.batchnorm, "_NormBase", "torch.nn.modules.batchnorm._NormBase", _compat.category_classes),
        (nn.modules.loss, "_Loss", "torch.nn.modules.loss._Loss", _compat.category_classes),
    ],
    ids=["norm_base", "loss_base", "table-norm", "table-loss"],
)
def test_category_base_class_missing_names_it(monkeypatch, owner, name, qualname, get):
    monkeypatch.delattr(owner, name)
    with pytest.raises(mpx.FrameworkVersionError) as info:
        get()
    _names(info, qualname)


def test_category_table_has_the_private_bases():
    classes = _compat.category_classes()
    assert nn.modules.batchnorm._NormBase in classes["normalization"]
    assert classes["loss"] == (nn.modules.loss._Loss,)


def test_sparse_values_missing_names_it():
    class TensorWithoutValues:  # a torch whose sparse tensors lost _values()
        is_sparse = True

    with pytest.raises(mpx.FrameworkVersionError) as info:
        _compat.sparse_values(TensorWithoutValues())
    _names(info, "torch.Tensor._values")


def test_sparse_gradients_unscale_through_compat():
    emb = nn.Embedding(4, 2, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=4.0))
    scaler.scale(emb(torch.tensor([1])).sum()).backward()
    scaler.unscale_(opt)
    assert emb.weight.grad.is_sparse
    assert emb.weight.grad.to_dense()[1].tolist() == [1.0, 1.0]


def test_old_torch_is_refused_at_import():
    """An older torch version string: importing mpx_torch raises the version error, naming both versions."""
    code = "import torch; torch.__version__ = '2.3.1'; import mpx_torch"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )  # a hang guard only
    assert proc.returncode != 0
    assert "mpx.errors.FrameworkVersionError: torch 2.3.1 is older than mpx supports (torch >= 2.13.0" in (
        proc.stderr
    ), proc.stderr


def test_version_floor_is_checked_by_require_version():
    with pytest.raises(mpx.FrameworkVersionError, match=r"torch 2\.12\.9 is older than mpx supports"):
        mpx.versions.require_version("torch", "2.12.9")
    mpx.versions.require_version("torch", torch.__version__)
