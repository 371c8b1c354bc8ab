"""Build-once cache of the three decoders of the default model (large files stay outside git):

    <cache>/models/smollm2-135m-f32ln-v6/{ortkv,genai,copy}/model.onnx (+ model.onnx.data)
    <cache>/models/smollm2-135m-f32ln-v6/genai/genai_config.json, tokenizer.json, tokenizer_config.json
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx

from .assets import cache_dir, smollm2_gguf
from .builder import VARIANTS, build
from .config import MAX_POSITIONS, GenAIConfig, to_dict
from .weights import load, load_tokenizer

BUILD_TAG = "smollm2-135m-{weights}-v6"  # bump when the graphs change; + "-bsnh" / "-sbnh" for those layouts;
# v6: the copy decoder's mask hides a key with -1e4, not -inf (Note [Copy mask is finite] in builder.py)
# v5: the ortkv and copy decoders take logits_start (Note [Logits from logits_start] in builder.py); the runners feed
# it only to a model that has it, so a v4 model given by path still runs, computing every position's logits
# v4: RotaryCacheUpdate and SwiGLU in the ortkv decoder (Note [Fused ortkv layer] in builder.py)
# v3: SkipSimplifiedLayerNormalization and fused float projections (Note [Fused decoder layer] in builder.py);
# {weights}: f32, q4mlas, or f16 (float16 models of the dequantized GGUF, Note [Float16 models] in builder.py)
# the q4 graphs changed form (Note [Fast 4-bit path] in weights.py): their own tag, so that a cache built
# by an older ortkv is not reused, and the float32 decoders are not rebuilt
WEIGHTS_TAG = {"float32": "f32ln", "q4": "q4op", "q8": "q8from41"}  # q8: Note [8-bit from Q4_1] in weights.py;
# f32ln: the float32 ortkv / copy projections and LM head are ortkv.Linear on the CPU (linear_projections), each
# residual add + RMSNorm in the Linear that reads it (Note [Norm in the projection] in builder.py; "f32lin": before
# that, SkipSimplifiedLayerNormalization nodes); "f32":
# ORT's MatMul (float32 on CUDA, and every float32 build before Linear's CPU tile kernel)
# q4op: the projections are ortkv.MatMulQ4 (Note [Fast 4-bit path]; "q4mlas" was MatMulNBits + the minimum term)


def gguf_path(cfg: GenAIConfig, log=print) -> Path:
    return Path(cfg.ortkv.gguf) if cfg.ortkv.gguf else smollm2_gguf(log=log)


def model_dir(cfg: GenAIConfig) -> Path:
    # f16g: the float16 ortkv decoder picks its greedy token itself (Note [Greedy in the decoder] in builder.py);
    # f16lin: the float16 ortkv / copy projections are ortkv.Linear (Note [Linear projections] in builder.py)
    weights = "f16lin" if cfg.dtype == "float16" else WEIGHTS_TAG.get(cfg.ortkv.weights, cfg.ortkv.weights)
    if weights == "f32ln" and not linear_projections(cfg, "ortkv"):
        weights = "f32"  # float32 on CUDA: ORT's MatMul (the graphs of the "f32" tag)
    tag = BUILD_TAG.format(weights=weights)
    if cfg.cache_layout != "BNSH":
        # "-bsnh2": the BSNH graphs take K / V flat since Note [CacheUpdate flat values]; an older "-bsnh" build
        # (with a Reshape per K / V) is not reused for them
        tag += "-" + {"BSNH": "bsnh2"}.get(cfg.cache_layout, cfg.cache_layout.lower())
    if cfg.ortkv.gguf:
        tag += "-" + Path(cfg.ortkv.gguf).stem
    return cache_dir() / "models" / tag


def linear_projections(cfg: GenAIConfig, variant: str) -> bool | None:
    """build(linear=...) for a variant of cfg: True for the float32 ortkv / copy decoders on the CPU (ortkv.Linear's
    CPU tile kernel, Note [Linear CPU GEMV] in custom_ops/kernels/cpu/linear.cc; Note [Linear projections] in
    builder.py), else None (the builder's default: Linear for float16 ortkv / copy, MatMul otherwise)."""
    if cfg.ortkv.weights == "float32" and cfg.dtype == "float32" and cfg.device == "cpu" and variant != "genai":
        return True
    return None


def model_path(cfg: GenAIConfig, variant: str, log=print) -> Path:
    """Path of the variant's model.onnx, building it (and only it) on first use."""
    if variant not in VARIANTS:
        raise ValueError(variant)
    target = model_dir(cfg) / variant / "model.onnx"
    if not target.exists():
        build_models(cfg, [variant], log)
    return target


def save_decoder(model, root: Path, name: str, extra=None) -> Path:
    """Write ``model`` as root/name/model.onnx (+ model.onnx.data) atomically: into a hidden temporary folder
    (``extra(tmp)`` may add files), then renamed over any old one, so an interrupted build never leaves a
    half-written decoder where the next run would load it."""
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    onnx.save_model(model, str(tmp / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    if extra is not None:
        extra(tmp)
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    return root / name / "model.onnx"


def build_models(cfg: GenAIConfig, variants, log=print) -> None:
    """Build the missing ones of ``variants`` from one read of the GGUF. A run builds only the variant it
    runs (`--weights q4` used to build all three: 3 x the time and the disk)."""
    root = model_dir(cfg)
    missing = [v for v in variants if not (root / v / "model.onnx").exists()]
    if not missing:
        return
    src = gguf_path(cfg, log)
    weights, tokenizer = load(src, log=log, fmt=cfg.ortkv.weights)
    for v in missing:
        log(f"ortkv: building the {v} decoder ({cfg.ortkv.weights} weights) ...")
        model = build(weights, v, max_positions=MAX_POSITIONS, cache_layout=cfg.cache_layout, dtype=cfg.dtype,
                      linear=linear_projections(cfg, v))
        save_decoder(model, root, v, (lambda tmp: write_genai_folder(tmp, cfg, tokenizer)) if v == "genai" else None)
        del model
        log(f"ortkv: cached the {v} decoder in {root / v} ({human_size(tree_size(root / v))}); "
            f"`ortkv cache list` shows the cache, `ortkv cache rm {root.name}` frees it")


def tree_size(path: Path) -> int:
    """Bytes of the files under path (a file: its size)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def write_genai_folder(folder: Path, cfg: GenAIConfig, tokenizer) -> None:
    """genai_config.json (onnxruntime-genai's schema only) and tokenizer files beside the model."""
    data = to_dict(cfg)
    data.pop("ortkv")
    data["model"]["decoder"]["session_options"]["provider_options"] = []  # runners set the device
    (folder / "genai_config.json").write_text(json.dumps(data, indent=2) + "\n")
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "add_bos_token": False}, indent=2) + "\n")


def tokenizer_for(cfg: GenAIConfig, log=print):
    return load_tokenizer(gguf_path(cfg, log))
