"""Facts about the CUDA device a tensor lives on, cached per device index, and the CUDA
context a backward thread needs current."""
import ctypes
import functools
import threading

import torch


@functools.lru_cache(maxsize=None)
def _props(index):
    return torch.cuda.get_device_properties(index)


def _index(device):
    if isinstance(device, torch.Tensor):
        device = device.device
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _arch_of_index(index):
    p = _props(index)
    return f"sm_{p.major}{p.minor}"


def arch(device=None):
    """`"sm_90"` etc. for a tensor's device (or a device / index; default: the current device)."""
    return _arch_of_index(_index(device if device is not None else torch.cuda.current_device()))


def major(arch_name):
    """The compute capability's major number of an arch string ("sm_90" -> 9; 0 if unknown)."""
    digits = arch_name[3:]
    return int(digits) // 10 if arch_name.startswith("sm_") and digits.isdigit() else 0


OLDEST_MAJOR = 8        # cuTile compiles for compute capability 8.0 and newer


def check_supported(op, device):
    """A ValueError naming `op` where `device` (as `arch` takes it) is older than cuTile compiles
    for (Volta, Turing): refused on a miss, not left to every config's failed compile."""
    name = arch(device)
    if major(name) < OLDEST_MAJOR:
        raise ValueError(f"{op}: cuTile kernels need a GPU of compute capability "
                         f"{OLDEST_MAJOR}.0 or newer; device {device} ({gpu_name(device)}) is "
                         f"{name}")


_SM_COUNT = {}


def sm_count(index):
    """SM count of device `index` (an int): one dict lookup after the first call, for grids
    computed on the launch path."""
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = _props(index).multi_processor_count
    return n


def persistent_ctas(tiles, index, occupancy, per_cluster=1):
    """CTAs (or clusters of `per_cluster` CTAs) of a persistent grid on device `index`: one per
    tile, at most as many as the SMs hold at `occupancy`; each strides over the tiles. (On the
    launch path: comparisons instead of min/max calls.)"""
    n = _SM_COUNT.get(index) or sm_count(index)
    n = n * occupancy // per_cluster
    if tiles < n:
        n = tiles
    return n if n > 0 else 1


def gpu_name(device):
    return _props(_index(device)).name


@functools.lru_cache(maxsize=None)
def _uuid_of_index(index):
    try:
        p = _props(index)
    except Exception:           # (no CUDA, or a device torch cannot describe)
        return None
    text = str(getattr(p, "uuid", "") or "")
    if not text:
        bus = getattr(p, "pci_bus_id", None)
        if bus is None:
            return None
        text = f"{p.name}-{getattr(p, 'pci_domain_id', 0)}-{bus}-{getattr(p, 'pci_device_id', 0)}"
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def uuid(device):
    """The physical GPU's UUID as a file-name-safe string (the same whichever index
    CUDA_VISIBLE_DEVICES gives it), or None where torch cannot say."""
    return _uuid_of_index(_index(device))


def _raw_stream_fallback(device_index):
    return torch.cuda.current_stream(device_index).cuda_stream


# torch.cuda.current_stream() builds a Stream object (3.4 us on H200); the raw handle is 0.2 us.
# ct.launch takes either. Both follow torch's current stream, graph capture included.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream_fallback)


# torch's autograd engine runs a CUDA backward on a thread of its own per device. On device 0's
# thread no CUDA context is current (torch sets a device only where cudaGetDevice does not
# already name it, and it names 0 on a fresh thread) until a torch kernel launched there makes
# one current; until then every allocation and launch pays for finding one (H200 host: an
# allocation 9.7-11.1 us against 2.6-4.0 us, a launch 3.4 us more, RMSNorm's backward body 57
# against 34 us; references/hardware-constraints.md). Our launches go through the driver API,
# which does not make it current.
_thread = threading.local()


def bind_context():
    """Make the current device's primary context current on this thread where none is: once
    per thread, then an attribute read. (Called where a backward starts.)"""
    try:
        _thread.bound
    except AttributeError:
        _thread.bound = True
        _bind_primary_context()


def _bind_primary_context():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or ctx.value:
        return                  # a context is current (or the driver cannot say): leave it
    dev = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) != 0:
        return
    # the retained reference is this thread's for the process's life (torch holds its own)
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
        cuda.cuCtxSetCurrent(ctx)
