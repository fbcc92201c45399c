"""Tuning a transformers model's keys ahead of training: `python -m tiletune tune`.

A model's op keys depend on its layer shapes, the batch and sequence length and the dtype, never
on its number of layers or its vocabulary (the embedding and the LM head are not tiletune ops).
So `tune` builds the family's model with one decoder layer and a small vocabulary on the GPU,
patched with tiletune (the transformers suite's builder, which a registered case module
provides: `registry.models()`), and runs one forward (and backward) at each (batch, seq): every
key a training run of that shape meets is searched once and saved to the user's store, and the
run itself starts with zero searches; with `generate`, so is every key of generating that many
tokens after the prompt (decode keys change with the cache length's power of two). `export`
writes the winners in the shipped-file format (tiletune/store.py) that the package can carry as
read-only defaults. Under torchrun the ranks share the (model, batch, sequence length) steps
out (start_job, shares), each stepping its own with tiletune.distributed's process group set.
"""
import dataclasses
import datetime
import re
import time
from typing import Optional

import torch

from tiletune import autotune, env, precompile, registry, store

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The layer shapes that decide a model's op keys."""
    family: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    _: dataclasses.KW_ONLY          # the MoE sizes and the name by keyword only
    experts: Optional[int] = None
    top_k: Optional[int] = None
    moe_intermediate: Optional[int] = None
    name: str = "custom"

    def problems(self):
        """What makes this spec unusable, as messages (empty when it is fine)."""
        out = []
        if self.family not in FAMILIES:
            out.append(f"model {self.family!r} is not supported; supported: "
                       f"{', '.join(FAMILIES)}")
        if self.heads % self.kv_heads:
            out.append(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.head_dim % 2:       # (transformers refuses the config when the model is built)
            out.append(f"head dim {self.head_dim} is odd: rotary position embeddings rotate "
                       "pairs of dims (give an even --head-dim)")
        moe = (self.experts, self.top_k, self.moe_intermediate)
        if self.family == "qwen3_moe":
            missing = [flag for flag, v in zip(("--experts", "--top-k", "--moe-intermediate"), moe)
                       if v is None]
            if missing:
                out.append(f"a qwen3_moe model needs {', '.join(missing)}")
            elif self.top_k > self.experts:
                out.append(f"--top-k {self.top_k} is more than --experts {self.experts}")
        elif any(v is not None for v in moe):
            out.append("--experts, --top-k and --moe-intermediate are for qwen3_moe models "
                       f"(this one is {self.family})")
        return out

    def describe(self):
        text = (f"{self.family}: hidden {self.hidden}, intermediate {self.intermediate}, "
                f"heads {self.heads}/{self.kv_heads} of {self.head_dim}")
        if self.family == "qwen3_moe":
            text += (f", {self.experts} experts of {self.moe_intermediate}, "
                     f"top-{self.top_k}")
        return text if self.name == "custom" else f"{self.name} [{text}]"


# From the models' public config.json files (vocabulary and layer count left out: no key
# depends on them). mistral-7b is v0.3 (no sliding window).
PRESETS = {
    "llama3-8b": ModelSpec("llama", 4096, 14336, 32, 8, 128, name="llama3-8b"),
    "llama3.2-1b": ModelSpec("llama", 2048, 8192, 32, 8, 64, name="llama3.2-1b"),
    "qwen3-8b": ModelSpec("qwen3", 4096, 12288, 32, 8, 128, name="qwen3-8b"),
    "qwen3-30b-a3b": ModelSpec("qwen3_moe", 2048, 6144, 32, 4, 128, experts=128, top_k=8,
                               moe_intermediate=768, name="qwen3-30b-a3b"),
    "mistral-7b": ModelSpec("mistral", 4096, 14336, 32, 8, 128, name="mistral-7b"),
}

SHAPE_FLAGS = {"model": "--model", "hidden": "--hidden", "intermediate": "--intermediate",
               "heads": "--heads", "kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "experts": "--experts", "top_k": "--top-k",
               "moe_intermediate": "--moe-intermediate"}


def family(name):
    """A family name as the CLI takes it: llama, mistral, qwen2, qwen3, qwen3_moe (also
    qwen3-moe), any case."""
    return name.strip().lower().replace("-", "_")


def specs(presets=None, **shape):
    """The ModelSpecs the CLI's flags describe: `presets` (names), or a model given by its
    family and shape (`model`, `hidden`, ... as in SHAPE_FLAGS). With one preset, the shape
    flags given override its values. Raises ValueError with a message naming the flags."""
    given = {k: v for k, v in shape.items() if v is not None}
    unknown = set(given) - set(SHAPE_FLAGS)
    if unknown:
        raise TypeError(f"unknown shape arguments {sorted(unknown)}")
    if presets:
        presets = list(dict.fromkeys(presets))
        bad = [p for p in presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown preset {', '.join(bad)}; presets: {', '.join(PRESETS)}")
        if len(presets) > 1 and given:
            raise ValueError(f"{', '.join(SHAPE_FLAGS[k] for k in given)} cannot change "
                             "several presets at once: give one --preset to change it")
        if len(presets) > 1:
            return [PRESETS[p] for p in presets]
        base = PRESETS[presets[0]]
        if given:
            fields = {("family" if k == "model" else k): v for k, v in given.items()}
            if fields.get("family", base.family) != "qwen3_moe":
                fields.update({k: fields.get(k) for k in ("experts", "top_k",
                                                          "moe_intermediate")})
            base = dataclasses.replace(base, name=f"{base.name} (modified)", **fields)
        spec = base
    else:
        if "model" not in given:
            raise ValueError("give --preset NAME (" + ", ".join(PRESETS) + ") or --model "
                             "FAMILY with --hidden, --intermediate and --heads (--kv-heads, "
                             "--head-dim optional)")
        missing = [SHAPE_FLAGS[k] for k in ("hidden", "intermediate", "heads") if k not in given]
        if missing:
            raise ValueError(f"--model {given['model']} needs {', '.join(missing)}")
        heads = given["heads"]
        head_dim = given.get("head_dim")
        if head_dim is None:
            if given["hidden"] % heads:
                raise ValueError(f"--hidden {given['hidden']} is not a multiple of --heads "
                                 f"{heads}: give --head-dim")
            head_dim = given["hidden"] // heads
        spec = ModelSpec(given["model"], given["hidden"], given["intermediate"], heads,
                         given.get("kv_heads", heads), head_dim, experts=given.get("experts"),
                         top_k=given.get("top_k"), moe_intermediate=given.get("moe_intermediate"))
    problems = spec.problems()
    if problems:
        raise ValueError("; ".join(problems))
    return [spec]


def _resolved():
    return {(op, key) for op, recs in autotune.records().items() for key in recs}


def record_line(rec):
    """One line for a key resolved during `tune`: op, key, seconds and the winner."""
    key = "(" + ", ".join(map(str, rec.key)) + ")"
    if rec.source == "search":
        us = f" {rec.best_us:.2f} us" if rec.best_us is not None else ""
        return (f"tuned   {rec.op} {key} in {rec.search_s:.1f}s: {rec.config}{us} "
                f"({len(rec.timings)} configs, {len(rec.failures)} failed)")
    where = {"store": "in the store", store.SHIPPED: "a shipped winner"}.get(rec.source,
                                                                             rec.source)
    return f"{rec.source:7} {rec.op} {key}: {rec.config} ({where})"


@dataclasses.dataclass
class Report:
    records: list = dataclasses.field(default_factory=list)   # TuningRecords, in order
    wall_s: float = 0.0

    def count(self, source):
        """Keys resolved from `source`; for "search", those this rank decided (in a job, the
        ranks that helped time a key record it too)."""
        return sum(1 for r in self.records if r.source == source and _mine(r))

    def search_s(self):
        return sum(r.search_s for r in self.records if r.source == "search" and _mine(r))


def _mine(record):
    """False for a key another rank of the job decided (its record carries that rank's
    search)."""
    return not record.agreement or record.agreement.get("by") == record.agreement.get("rank")


def shares(n_steps, world):
    """[indices of the (model, batch, sequence length) steps] per rank of a job of `world`: step
    0 on every rank, then step i on rank (i - 1) mod world. Most of a cold run is the first
    step's compiles (later shapes reuse them): stepping it together, the ranks meet its keys at
    once and split each key's configs (tiletune.distributed); ranks that each stepped a
    different first step compiled the same kernels twice."""
    return [[i for i in range(n_steps) if i == 0 or (i - 1) % world == r] for r in range(world)]


def decode_lengths(seq, new_tokens):
    """The cache lengths at which generating `new_tokens` after a `seq`-token prompt meets a
    new decode key: decode attention keys bucket the cache length by the next power of two, so
    the first new token, then the first length of each later bucket."""
    last = seq + new_tokens
    lengths = [seq + 1] if new_tokens > 0 else []
    p = autotune.bucket(seq + 1)
    while p < last:
        lengths.append(p + 1)
        p *= 2
    return lengths


def run(model_specs, seqs, batches, dtype, backward, out=print, share=(0, 1), generate=0):
    """Build each spec's model and step it at each batch and sequence length; print a line per key
    resolved (searched, or found in the store or the shipped winners) and one per step.
    generate > 0: after each step, also what generating that many tokens after the sequence
    meets (the prompt with a KV cache, then a decoding step at each decode_lengths length).
    share (rank, world size): in a job of several ranks this rank steps its steps of
    shares(); a key that several ranks meet is decided once (tiletune.distributed). Returns
    a Report."""
    rank, world = share
    steps = [(spec, batch, seq) for spec in model_specs for batch in batches for seq in seqs]
    mine = [steps[i] for i in shares(len(steps), world)[rank]]
    report = Report()
    t0 = time.perf_counter()
    if mine:
        precompile.warm()    # the compile workers start while the first model builds
    models = registry.models()
    if generate and not hasattr(models, "model_generate"):
        raise RuntimeError("tiletune: the registered model runner has no model_generate: "
                           "it cannot tune generation (--generate)")
    _step(models, mine, dtype, backward, out, report, generate)
    report.wall_s = time.perf_counter() - t0
    return report


def _step(models, steps, dtype, backward, out, report, generate=0):
    """Run each (spec, batch, seq) step, one model per spec, recording the keys each resolved."""
    def recorded(label, step, *args):
        before = _resolved()
        t = time.perf_counter()
        step(*args)
        recs = autotune.records()
        new = [recs[op][key] for op, key in sorted(_resolved() - before, key=str)]
        for rec in new:
            out(record_line(rec))
        report.records += new
        out(f"{label}: {len(new)} new key{'' if len(new) == 1 else 's'} in "
            f"{time.perf_counter() - t:.1f}s")

    for spec in dict.fromkeys(p[0] for p in steps):
        shapes = [(batch, seq) for s, batch, seq in steps if s is spec]
        model = models.build_model(spec, max(seq for _, seq in shapes) + generate, dtype)
        try:
            for batch, seq in shapes:
                name = f"{spec.name} batch {batch} x seq {seq}"
                recorded(name, models.model_step, model, batch, seq, backward)
                if generate:
                    lengths = decode_lengths(seq, generate)
                    recorded(f"{name}, generating {generate} tokens (decoding at cache lengths "
                             f"{', '.join(map(str, lengths))})",
                             models.model_generate, model, batch, seq, lengths)
        finally:
            del model
            torch.cuda.empty_cache()


# The job's one collective, the gather at its end, waits for the slowest rank's whole share of
# tuning: far past torch's 10-minute default on large lists.
JOB_GATHER_TIMEOUT = datetime.timedelta(hours=6)


# a torchrun variable set to anything but an int >= 0 (left over from another launcher) stops
# the command, naming the variable
_TORCHRUN = "torchrun sets it; outside torchrun, unset it"


def start_job(backend="nccl"):
    """(rank, world size) of the job `python -m tiletune tune` runs in: under torchrun
    (WORLD_SIZE > 1 in the environment) the process group is started here, on this rank's
    GPU (LOCAL_RANK), and set as tiletune's (tiletune.distributed), so the ranks share the
    (spec, batch, sequence length) steps out and decide every key once; (0, 1) otherwise."""
    world = env.integer("WORLD_SIZE", 1, minimum=0, refuse=_TORCHRUN)
    if world <= 1:
        return 0, 1
    import torch.distributed as dist
    from tiletune import distributed
    if backend == "nccl":
        torch.cuda.set_device(env.integer("LOCAL_RANK", 0, minimum=0, refuse=_TORCHRUN))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=JOB_GATHER_TIMEOUT)
    distributed.set_process_group()
    return dist.get_rank(), dist.get_world_size()


def end_job(world):
    """Close the process group start_job started (NCCL asks for it before exit)."""
    if world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def gather(obj, world):
    """Every rank's `obj`, in rank order (this rank's alone outside a job)."""
    if world <= 1:
        return [obj]
    import torch.distributed as dist
    objs = [None] * world
    dist.all_gather_object(objs, obj)
    return objs


def _slim(entry):
    """An entry as it ships: failure messages cut to their first words (compiler logs are
    long)."""
    entry = dict(entry)
    failures = entry.get("failures")
    if isinstance(failures, list):
        entry["failures"] = [{**f, "message": _first_words(f.get("message"))}
                             if isinstance(f, dict) else f for f in failures]
    return entry


def _first_words(message):
    """A failure message's first line, at most 300 characters; where that line is only a
    compiler's "Return code N", the next line follows it (what tileiras said)."""
    lines = autotune.message_lines(message or "")
    text = lines[0].strip() if lines else ""
    if len(lines) > 1 and re.fullmatch(r"Return code -?\d+", text):
        text = f"{text}: {lines[1].strip()}"
    return text[:300]


def used_rows():
    """[(op, full key, entry)] of every winner this process resolved through the store: the
    rows it searched and saved, found in the user's store, or took from the shipped files."""
    rows = []
    for (op, key), source in store.used().items():
        entry = store.shipped(op, key) if source == store.SHIPPED else store.load_own(op, key)
        if isinstance(entry, dict):
            rows.append((op, key, _slim(dict(entry))))
    return rows


def gpu_rows(gpu, arch, cuda_tile, tileiras):
    """[(op, full key, entry)] of the user's store rows for this GPU and software."""
    rows = []
    for op, entries in store.entries().items():
        for key, entry in entries.items():
            if isinstance(entry, dict) and store.key_facts(key) == (gpu, arch, cuda_tile,
                                                                    tileiras):
                rows.append((op, key, _slim(entry)))
    return rows


def export(path, rows):
    """Write `rows` to the shipped file `path` (merged with the rows it has). Returns what
    store.write_shipped returns."""
    import tiletune
    header = {"tiletune": tiletune.__version__, "torch": torch.__version__,
              "created": time.strftime("%Y-%m-%d")}
    return store.write_shipped(path, rows, header)
