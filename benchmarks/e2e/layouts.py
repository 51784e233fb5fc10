"""Layout names (``eager``, ``compile[-layers[-liger]][-ao|-aorow]``, ``native-tpN``, ``fx-...``; see
benchmarks/end_to_end.py's docstring) parsed into ``Layout`` records and checked against the
world size, the model (``e2e.models.ModelSpec``) and the device."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

@dataclass
class Layout:
    name: str
    kind: str                   # eager, compile, native, fx
    dp: int = 1
    pp: int = 1
    tp: int = 1
    v: int = 1
    m: int = 1
    schedule: Optional[str] = None
    sp: bool = True
    fuse: bool = False
    compile: object = False     # False, True or a torch.compile mode
    recompute: str = "none"
    fadam: bool = False         # -fadam: accepted, a no-op (the optimizer is --optimizer's, every row)
    fp32_accum: bool = False    # parallelize(grad_accum_dtype=torch.float32)
    overlap: int = 0
    transport: str = "auto"
    async_tp: bool = False      # native -async: torch's async TP (symmetric memory + inductor's micro-pipeline)
    fp8: str = ""               # fx -fp8 / -fp8row: parallelize(precision="fp8", fp8_recipe=tensorwise / rowwise);
                                # compile -ao / -aorow: torchao float8 training, the same recipes
    fp8_head: bool = False      # fx -fp8head: FP8 tensorwise with the LM head in FP8 too (FP8Policy(lm_head=True))
    per_layer: bool = False     # compile -layers: each decoder layer compiled, the rest eager (torchtitan's habit)
    liger: bool = False         # compile -layers-liger: and Liger's RMSNorm, SwiGLU and fused linear cross-entropy
    zero1: bool = False         # fx -zero1: parallelize(dp_shard="optimizer"), the optimizer built by pm.adamw
    zero3: bool = False         # fx -zero3: parallelize(dp_shard="full")
    rep: int = 1                # -repN (fx -zero1/-zero3, fsdp2): hybrid sharding, N replica groups of dp / N shards
    ep: int = 1                 # fx -epN: parallelize(ep=N), experts over N of the dp ranks

    @property
    def world(self):
        return self.dp * self.pp * self.tp

    @property
    def label(self) -> str:
        """What the row runs, in words: ``fx-fuse`` is "fxmegatron fuse=True + compile",
        ``compile-ao`` "the plain model, torchao float8 tensorwise + torch.compile"."""
        if self.kind == "compile":
            mode = f" ({self.compile})" if isinstance(self.compile, str) else ""
            what = "each decoder layer compiled" if self.per_layer else f"torch.compile{mode}"
            liger = ", Liger RMSNorm, SwiGLU and fused linear cross-entropy" if self.liger else ""
            fp8 = f"torchao float8 {self.fp8} + " if self.fp8 else ""
            return f"the plain model, {fp8}{what}{liger}"
        if self.kind == "fsdp2":
            over = f"dp {self.dp}" if self.rep == 1 else f"dp {self.dp} (HSDP: {self.rep} replicas of {self.dp // self.rep} shards)"
            return (f"PyTorch FSDP2 over {over}, each decoder layer fully_shard-ed"
                    + (" and compiled" if self.compile else "") + (", recomputed" if self.recompute == "full" else "")
                    + ", fp32 parameters, compute in --dtype, fp32 gradient reduction")
        if self.kind != "fx":
            return {"eager": "the plain model, eager", "compile": "the plain model, torch.compile",
                    "native": f"PyTorch-native DTensor TP, tp {self.tp}"
                              + (", async TP" if self.async_tp else "")}[self.kind]
        what = "fxmegatron" + (f" ep={self.ep}" if self.ep > 1 else "") + (" dp_shard=optimizer" if self.zero1 else "") + (" dp_shard=full" if self.zero3 else "") + (f" dp_replicate={self.rep}" if self.rep > 1 else "") + (" fuse=True" if self.fuse else "") + (f" fp8 {self.fp8}" if self.fp8 else "") + (" (LM head in FP8 too)" if self.fp8_head else "")
        if self.compile:
            return what + " + compile" + (f" ({self.compile})" if isinstance(self.compile, str) else "")
        return what + (", the rest eager" if self.fuse else ", eager")


def parse_layout(name: str, pp_microbatches: int) -> Layout:
    """``eager``, ``compile[-ao|-aorow]``, ``native-tpN``, ``fx-...`` (see end_to_end.py's
    docstring), each with an optional ``-mN``. Raises ValueError with the reason."""
    head, *tokens = name.split("-")
    if head not in ("eager", "compile", "native", "fx", "fsdp2"):
        raise ValueError(f"layout {name!r}: starts with {head!r}; expected eager, compile, native-tpN, fsdp2-dpN "
                         "or fx[-...]")
    lay = Layout(name, head)
    m, rest_eager = None, False
    for tok in tokens:
        if re.fullmatch(r"a\d+", tok):   # -aN: another copy of the same row (an A/A pair shows the noise floor)
            continue
        num = re.fullmatch(r"(tp|pp|dp|v|m|ov|rep|ep)(\d+)", tok)
        if num and (head == "fx" or num.group(1) in ("tp", "m") and (head == "native" or num.group(1) == "m")
                    or head == "fsdp2" and num.group(1) in ("dp", "m", "rep")):
            key, val = num.group(1), int(num.group(2))
            if val < 1:
                raise ValueError(f"layout {name!r}: {tok} must be >= 1")
            if key == "m":
                m = val
            elif key == "ov":
                lay.overlap = val
            else:
                setattr(lay, key, val)
        elif head == "fx" and tok in ("1f1b", "gpipe", "interleaved"):
            lay.schedule = tok
        elif head == "fx" and tok == "fuse":
            lay.fuse = True
        elif head == "fx" and tok == "eager":
            rest_eager = True
        elif head == "fx" and tok == "compile":
            lay.compile = lay.compile or True
        elif head in ("fx", "compile") and tok in ("cgraphs", "autotune"):
            lay.compile = {"cgraphs": "reduce-overhead", "autotune": "max-autotune-no-cudagraphs"}[tok]
        elif head == "fx" and tok == "nosp":
            lay.sp = False
        elif head == "fx" and tok == "fadam":
            lay.fadam = True
        elif head == "fx" and tok in ("fp8", "fp8row"):
            lay.fp8 = {"fp8": "tensorwise", "fp8row": "rowwise"}[tok]
        elif head == "fx" and tok == "fp8head":
            lay.fp8, lay.fp8_head = "tensorwise", True
        elif head == "compile" and tok in ("ao", "aorow"):
            lay.fp8 = {"ao": "tensorwise", "aorow": "rowwise"}[tok]
        elif head == "compile" and tok == "layers":
            lay.per_layer = True
        elif head == "compile" and tok == "liger":
            lay.liger = True
        elif head == "fx" and tok == "acc32":
            lay.fp32_accum = True
        elif head == "fx" and tok == "zero1":
            lay.zero1 = True
        elif head == "fx" and tok == "zero3":
            lay.zero3 = True
        elif head == "fsdp2" and tok == "compile":
            lay.compile = True
        elif head == "fsdp2" and tok == "rfull":
            lay.recompute = "full"
        elif head == "native" and tok == "async":
            lay.async_tp = True
        elif head == "fx" and tok in ("nccl", "ce"):
            lay.transport = {"nccl": "nccl", "ce": "copy_engine"}[tok]
        elif head == "fx" and tok in ("rsel", "rfull"):
            lay.recompute = {"rsel": "selective", "rfull": "full"}[tok]
        else:
            raise ValueError(f"layout {name!r}: unknown part {tok!r} for a {head} layout")
    # -fuse: the generated kernels inside the compiled graph (parallelize(fuse=True, compile=True));
    # -fuse-eager: the generated kernels, the rest of the graph eager
    if rest_eager and (not lay.fuse or lay.compile):
        raise ValueError(f"layout {name!r}: -eager (the graph eager around the fused kernels) goes with -fuse, "
                         f"and not with -compile, -cgraphs or -autotune")
    if lay.fuse and not rest_eager:
        lay.compile = lay.compile or True
    if lay.liger and not lay.per_layer:
        raise ValueError(f"layout {name!r}: -liger goes with -layers (compile-layers-liger: Liger's kernels in "
                         "eager code beside compiled layers, as its users run them)")
    if lay.per_layer and isinstance(lay.compile, str):
        raise ValueError(f"layout {name!r}: -layers compiles each layer with the default mode: drop -cgraphs / "
                         "-autotune")
    if head == "native" and not any(t.startswith("tp") for t in tokens):
        raise ValueError(f"layout {name!r}: native needs its tensor-parallel size, e.g. native-tp4")
    lay.m = m if m is not None else (pp_microbatches if lay.pp > 1 else 1)
    lay.sp = lay.sp and lay.tp > 1
    return lay


def check_layout(lay: Layout, world: int, spec, optimizer: str = "fused", device: str = "auto") -> Optional[str]:
    """Why ``lay`` cannot run here with the model ``spec`` (``e2e.models.ModelSpec``) on
    ``device`` (--device: "auto", "cuda" or "cpu"), or None."""
    if (lay.zero1 or lay.zero3) and optimizer != "fused":
        return f"{lay.name}: -zero1/-zero3 shard FusedAdamW's state (pm.adamw); --optimizer is {optimizer!r}"
    if lay.zero1 and lay.zero3:
        return f"{lay.name}: -zero1 or -zero3, not both"
    if lay.rep > 1 and (lay.kind == "fx" and not (lay.zero1 or lay.zero3) or lay.dp % lay.rep):
        return (f"{lay.name}: -rep{lay.rep} (hybrid sharding) splits dp {lay.dp} into {lay.rep} equal replica groups "
                "that shard (fx: with -zero1 or -zero3)")
    if lay.ep > 1 and lay.dp % lay.ep:
        return f"{lay.name}: -ep{lay.ep} folds experts onto the dp ranks: it must divide dp {lay.dp}"
    if lay.kind == "fsdp2" and optimizer != "fused":
        return f"{lay.name}: the FSDP2 row runs torch's fused AdamW on its fp32 shards; --optimizer is {optimizer!r}"
    if lay.fadam and optimizer != "fused":
        return (f"{lay.name}: -fadam asks for FusedAdamW, but --optimizer is {optimizer!r}; the optimizer is "
                f"run-wide now (every row uses --optimizer's): drop -fadam")
    if lay.kind in ("eager", "compile") and world != 1:
        return (f"{lay.name} runs the whole model in one process; world size is {world}: run it in a separate "
                f"one-process job (python benchmarks/end_to_end.py --layouts {lay.name})")
    if lay.world != world:
        return (f"{lay.name} needs dp·pp·tp = {lay.dp}·{lay.pp}·{lay.tp} = {lay.world} processes, but the world "
                f"size is {world} (torchrun --nproc-per-node)")
    if spec.batch % (lay.dp * lay.m):
        return f"{lay.name}: global batch {spec.batch} is not divisible by dp·microbatches = {lay.dp}·{lay.m}"
    if lay.kind == "native":
        if any(n % lay.tp for n in (spec.heads, spec.kv_heads, spec.vocab, spec.seq)):
            return (f"{lay.name}: tp {lay.tp} must divide the heads ({spec.heads}), kv heads ({spec.kv_heads}), "
                    f"vocabulary ({spec.vocab}) and sequence length ({spec.seq})")
        why = spec.native_unfit()
        if why:
            return f"{lay.name}: {why}"
    if lay.kind == "compile" and lay.fp8:
        why = _torchao_unfit(lay, device)
        if why:
            return why
    if lay.liger:
        why = _liger_unfit(lay, spec, device)
        if why:
            return why
    if lay.kind == "fx" and lay.pp * lay.v > spec.layers:
        return f"{lay.name}: pp·v = {lay.pp * lay.v} chunks but only {spec.layers} layers"
    return None


def _torchao_unfit(lay: Layout, device: str) -> Optional[str]:
    """Why torchao's float8 training cannot run ``lay`` here, or None. torchao is imported here,
    not at module import: CI has neither torchao nor a GPU, and only these rows need it."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:    # not installed, or built against another torch (its import then raises)
        return (f"{lay.name} needs torchao (pip install torchao==0.17.0): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    import torch
    # torchao's float8 training targets CUDA's torch._scaled_mm (sm_89+) and, unlike fxmegatron's
    # fp8 rows, has no CPU path; "auto" picks cuda when a GPU is visible, so no GPU means the CPU
    if device == "cpu" or not torch.cuda.is_available():
        return f"{lay.name}: torchao float8 training needs a CUDA GPU (sm_89+); this run is on the CPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"{lay.name}: torchao float8 training needs an sm_89+ GPU (Ada, Hopper or later); "
                f"this one is sm_{major}{minor}")
    return None


LIGER_TYPES = ("llama", "qwen2", "mistral")     # liger_kernel.transformers.apply_liger_kernel_to_<type>


def _liger_unfit(lay: Layout, spec, device: str) -> Optional[str]:
    """Why Liger's kernels cannot run ``lay`` here, or None (imported here: CI has neither
    liger-kernel nor a GPU)."""
    if spec.model_type not in LIGER_TYPES:
        return (f"{lay.name}: Liger patches HF models of type {', '.join(LIGER_TYPES)}; this model is "
                f"{spec.model_type!r} (use compile-layers)")
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:
        return (f"{lay.name} needs liger-kernel (pip install liger-kernel==0.8.5): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    import torch
    if device == "cpu" or not torch.cuda.is_available():
        return f"{lay.name}: Liger's kernels are Triton kernels for a CUDA GPU; this run is on the CPU"
    return None
