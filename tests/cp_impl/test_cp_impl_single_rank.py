"""Single-rank (mesh=None) unit tests of cp_impl's transport functions and shifted loss.

With no mesh no collective may run; the functions must still validate their
arguments, keep dtype and device, and carry gradients.  Multi-rank behaviour
is checked through the harness's rank pool, not here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_impl import inkling2, mistral_large4


class TwoDMesh:
    ndim = 2
    mesh_dim_names = ("dp", "cp")
    device_type = "cpu"

    def size(self):
        return 4

    def get_group(self):
        return None

    def get_local_rank(self):
        return 0


def test_gathers_return_the_input_itself_without_mesh():
    x = torch.randn(2, 3, 4)
    assert inkling2.gather_sequence(x, None, True) is x
    assert inkling2.gather_sequence(x, None, False) is x
    assert mistral_large4.gather_tokens(x, None, True) is x


@pytest.mark.parametrize(
    "call,error,text",
    [
        (lambda: inkling2.gather_sequence(torch.zeros(3), None, True), ValueError, "value"),
        (lambda: mistral_large4.gather_tokens(torch.tensor(1.0), None, True), ValueError, "value"),
        (lambda: inkling2.gather_sequence([1, 2], None, True), TypeError, "value"),
        (lambda: inkling2.gather_sequence(torch.zeros(1, 2), None, 1), TypeError, "differentiable"),
        (lambda: inkling2.gather_sequence(torch.zeros(1, 2), TwoDMesh(), True), ValueError, "mesh"),
        (lambda: inkling2.convolution_history(torch.zeros(1, 2, 3), TwoDMesh(), 2), ValueError, "mesh"),
        (lambda: inkling2.convolution_history(torch.zeros(1, 2, 3), None, 0), ValueError, "width"),
        (lambda: inkling2.convolution_history(torch.zeros(1, 2, 3), None, True), TypeError, "width"),
        (lambda: inkling2.convolution_history(torch.zeros(1, 2, 3), None, 2.0), TypeError, "width"),
        (lambda: inkling2.convolution_history(torch.zeros(1, 0, 3), None, 2), ValueError, "masked"),
        (lambda: inkling2.convolution_history(torch.zeros(2, 3), None, 2), ValueError, "masked"),
    ],
)
def test_argument_errors(call, error, text):
    with pytest.raises(error, match=text):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 2, 5])
def test_convolution_history_without_mesh_prepends_zeros(dtype, width):
    x = torch.randn(2, 3, 4).to(dtype).requires_grad_(True)
    out = inkling2.convolution_history(x, None, width)
    assert out.dtype == dtype and out.shape == (2, 3 + width - 1, 4)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(out[:, : width - 1], torch.zeros(2, width - 1, 4, dtype=dtype))
    assert torch.equal(out[:, width - 1:], x.detach())
    grad = torch.arange(out.numel(), dtype=dtype).view_as(out)
    out.backward(grad)
    assert torch.equal(x.grad, grad[:, width - 1:])


def direct_shifted_loss(logits, labels, keep):
    """HF shifted CE on one device: position t predicts labels[t+1]."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    counted = keep[:, :-1] & keep[:, 1:] & (labels[:, 1:] != -100)
    if not counted.any():
        return logits.sum() * 0
    lp = torch.log_softmax(logits[:, :-1].to(compute), dim=-1)
    picked = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    return -(picked[counted]).sum() / counted.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shifted_loss_without_mesh_matches_direct_formula(dtype):
    g = torch.Generator().manual_seed(0)
    B, L, V = 3, 6, 11
    logits = torch.randn(B, L, V, generator=g).to(dtype)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, 2] = -100
    keep = torch.rand(B, L, generator=g) < 0.8
    keep[1] = False
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    loss = mistral_large4.shifted_cp_loss(a, labels, keep.reshape(-1), None)
    ref = direct_shifted_loss(b, labels, keep)
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    loss.backward()
    ref.backward()
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)
    assert not a.grad[1].any()


def test_shifted_loss_matches_cross_entropy_over_shifted_labels():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    keep = torch.ones(2, 5, dtype=torch.bool)
    loss = mistral_large4.shifted_cp_loss(logits, labels, keep.reshape(-1), None)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-13, atol=0)


def test_shifted_loss_without_targets_is_a_finite_zero_with_zero_gradients():
    logits = torch.full((2, 3, 4), float("inf")).requires_grad_(True)  # never read: no target anywhere
    labels = torch.full((2, 3), -100)
    loss = mistral_large4.shifted_cp_loss(logits, labels, torch.ones(6, dtype=torch.bool), None)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_shifted_loss_ignores_labels_at_padding_but_rejects_bad_real_labels():
    logits = torch.zeros(1, 3, 4)
    keep = torch.tensor([True, True, False])
    mistral_large4.shifted_cp_loss(logits, torch.tensor([[0, 1, 99]]), keep, None)  # 99 sits at padding
    with pytest.raises(ValueError, match=r"labels\[0, 1\] = 99"):
        mistral_large4.shifted_cp_loss(logits, torch.tensor([[0, 99, 1]]), keep, None)


@pytest.mark.parametrize(
    "logits,labels,valid,error,text",
    [
        (torch.zeros(1, 3, 4), torch.zeros(1, 3), torch.ones(3, dtype=torch.bool), TypeError, "labels"),
        (torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), ValueError, "valid"),
        (torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long), torch.ones(3), TypeError, "valid"),
        (torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(2, dtype=torch.bool), ValueError, "labels"),
        (torch.zeros(1, 3, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), torch.ones(3, dtype=torch.bool), TypeError, "logits"),
    ],
)
def test_shifted_loss_argument_errors(logits, labels, valid, error, text):
    with pytest.raises(error, match=text):
        mistral_large4.shifted_cp_loss(logits, labels, valid, None)


def test_cp_batch_alias_and_api_signatures():
    import inspect

    assert inkling2.CPBatch == dict[str, torch.Tensor | list[torch.Tensor] | str | None]
    assert mistral_large4.CPBatch == inkling2.CPBatch
    expect = {
        inkling2.convolution_history: ["masked", "mesh", "width"],
        inkling2.gather_sequence: ["value", "mesh", "differentiable"],
        inkling2.prepare_cp_inputs: ["batch", "num_chunks"],
        inkling2.unpack_row_layout: ["batch"],
        inkling2.validate_document_positions: ["keep", "positions"],
        mistral_large4.gather_tokens: ["value", "mesh", "differentiable"],
        mistral_large4.prepare_cp_inputs: ["batch", "num_chunks", "shard_primary"],
        mistral_large4.prepare_packed_cp_inputs: ["batch", "num_chunks", "shard_primary"],
        mistral_large4.shifted_cp_loss: ["logits", "labels", "valid", "mesh"],
    }
    for fn, names in expect.items():
        assert list(inspect.signature(fn).parameters) == names, fn.__name__
        assert fn.__doc__
    assert inspect.signature(inkling2.prepare_cp_inputs).parameters["num_chunks"].default == 1
    params = inspect.signature(mistral_large4.prepare_cp_inputs).parameters
    assert params["num_chunks"].default == 1 and params["shard_primary"].default is True


def test_cp_impl_imports_neither_oracle_nor_harness():
    import ast
    import pathlib

    import cp_impl

    for path in pathlib.Path(cp_impl.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("oracle", "cp_harness") for n in names), path
