"""Input checks shared by the op wrappers: clear TypeError/ValueError naming the argument."""
import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tensor(op, name, t, device=None, dtypes=FLOAT_DTYPES):
    """`t` is a CUDA tensor (on `device` if given) of one of `dtypes`; returns it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other inputs are on {device}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} dtype {t.dtype} is not supported ({names})")
    return t


def eps(op, value):
    if isinstance(value, bool) or not isinstance(value, (float, int)):
        raise TypeError(f"{op}: eps must be a float, got {type(value).__name__}")
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {value}")
    return float(value)
