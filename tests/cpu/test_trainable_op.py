"""`TrainableOp`, the autograd glue every differentiable op uses, on CPU tensors with a torch
forward and backward standing in for kernels: gradients in eager, and no silent second order."""
import pytest
import torch

from tiletune.torch_op import TrainableOp

_scale3 = TrainableOp(
    "tiletune_test::scale3", forward=lambda x: x * 3,
    forward_schema="(Tensor x) -> Tensor", forward_fake=lambda x: torch.empty_like(x),
    backward=lambda needs, dy, x: (dy * 3,),
    backward_schema="(bool[] needs, Tensor dy, Tensor x) -> Tensor[]",
    backward_fake=lambda needs, dy, x: [torch.empty_like(x)])


def test_plain_call_and_gradient():
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(_scale3(x), x * 3)
    x.requires_grad_()
    y = _scale3(x)
    assert y.requires_grad
    (g,) = torch.autograd.grad((y * y).sum(), x)
    torch.testing.assert_close(g, 18 * x.detach())


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    """The backward runs kernels outside autograd: with create_graph=True the first-order
    gradient comes back, and a loss built on it (a gradient penalty) raises on backward instead
    of silently losing its second-order term."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = _scale3(x).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.testing.assert_close(g.detach(), 18 * x.detach())
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (y + g.pow(2).sum()).backward()          # a gradient penalty
