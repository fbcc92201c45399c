"""The ops that `python -m tiletune bench` and `compile` know, as registered by the layer above
the engine (the `tiletune.cases` entry-point group; tiletune's own ops register
`tiletune.cases:REGISTRY`, a package of yours can add its own). The engine names no op."""
import functools
from collections.abc import Mapping
from importlib.metadata import entry_points

GROUP = "tiletune.cases"


@functools.lru_cache(maxsize=None)
def ops():
    """{op name: its case module}, in registration order. A case module has
    `bench_cases(full=False)` -> [bench.BenchCase] (the headline rows unless `full`),
    `compile_cases()` -> [aot.CompileCase], and optionally `bench_host()` -> {label: value}."""
    found = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name != "tiletune", e.name)):
        cases = ep.load()
        if not isinstance(cases, Mapping):      # (a module named without its ":REGISTRY")
            raise TypeError(f"tiletune: the {GROUP!r} entry point {ep.name} = {ep.value} is "
                            f"a {type(cases).__name__}, not a dict of op name -> case module")
        found.update(cases)
    if not found:
        raise RuntimeError("tiletune: no ops are registered (entry-point group "
                           f"{GROUP!r}); install the package: pip install -e .")
    return found


def models():
    """The registered case module that builds and steps a tiletune-patched transformers model of
    a `pretune.ModelSpec` (`build_model(spec, max_seq, dtype)`, `model_step(model, batch, seq,
    backward)`, and for `--generate` `model_generate(model, batch, seq, cache_lengths)`): what
    `python -m tiletune tune` runs."""
    for module in ops().values():
        if hasattr(module, "build_model") and hasattr(module, "model_step"):
            return module
    raise RuntimeError("tiletune: no registered case module builds models (build_model and "
                       "model_step); install the package: pip install -e .")
