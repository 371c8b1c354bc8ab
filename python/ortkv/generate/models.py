"""Build-once cache of the three decoders of the default model (large files stay outside git):

    <cache>/models/smollm2-135m-f32-v2/{ortkv,genai,copy}/model.onnx (+ model.onnx.data)
    <cache>/models/smollm2-135m-f32-v2/genai/genai_config.json, tokenizer.json, tokenizer_config.json
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx

from .assets import cache_dir, smollm2_gguf
from .builder import VARIANTS, build
from .config import GenAIConfig, to_dict
from .weights import load, load_tokenizer

BUILD_TAG = "smollm2-135m-{weights}-v2"  # bump when the graphs change; + "-bsnh" for that layout
MAX_POSITIONS = 16384  # rotary table rows: the arena test generates at max_length 16384


def gguf_path(cfg: GenAIConfig, log=print) -> Path:
    return Path(cfg.ortkv.gguf) if cfg.ortkv.gguf else smollm2_gguf(log=log)


def model_dir(cfg: GenAIConfig) -> Path:
    tag = BUILD_TAG.format(weights="f32" if cfg.ortkv.weights == "float32" else cfg.ortkv.weights)
    if cfg.ortkv.cache_layout != "BNSH":
        tag += "-" + cfg.ortkv.cache_layout.lower()
    if cfg.ortkv.gguf:
        tag += "-" + Path(cfg.ortkv.gguf).stem
    return cache_dir() / "models" / tag


def model_path(cfg: GenAIConfig, variant: str, log=print) -> Path:
    """Path of the variant's model.onnx, building every missing variant on first use."""
    if variant not in VARIANTS:
        raise ValueError(variant)
    root = model_dir(cfg)
    target = root / variant / "model.onnx"
    if target.exists():
        return target
    src = gguf_path(cfg, log)
    weights, tokenizer = load(src, log=log, fmt=cfg.ortkv.weights)
    for v in VARIANTS:
        out = root / v / "model.onnx"
        if out.exists():
            continue
        log(f"ortkv: building the {v} decoder ...")
        model = build(weights, v, max_positions=MAX_POSITIONS, cache_layout=cfg.ortkv.cache_layout)
        tmp = root / f".{v}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        onnx.save_model(model, str(tmp / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        del model
        if v == "genai":
            write_genai_folder(tmp, cfg, tokenizer)
        shutil.rmtree(root / v, ignore_errors=True)
        os.replace(tmp, root / v)
    return target


def write_genai_folder(folder: Path, cfg: GenAIConfig, tokenizer) -> None:
    """genai_config.json (onnxruntime-genai's schema only) and tokenizer files beside the model."""
    data = to_dict(cfg)
    data.pop("ortkv")
    (folder / "genai_config.json").write_text(json.dumps(data, indent=2) + "\n")
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "add_bos_token": False}, indent=2) + "\n")


def tokenizer_for(cfg: GenAIConfig, log=print):
    return load_tokenizer(gguf_path(cfg, log))
