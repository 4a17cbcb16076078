"""One-time conversion of a GGUF checkpoint into a plain Hugging Face folder.

transformers reads the GGUF (dequantizing it, ~16 s for the default model); we then write
safetensors weights, config.json, generation_config.json, the tokenizer files and a record of the
source GGUF (`SOURCE_RECORD`, read by quantized loads). The folder is
assembled under a temporary name beside `dest` and renamed into place, so a crash mid-way leaves
no half-written model behind (only a temp folder that the next conversion sweeps away).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

TEMP_PREFIX = ".converting-"
SOURCE_RECORD = "tollway-source.json"
"""{"gguf": absolute path}: the file a folder was converted from, so an int4/int8 load can read its
quantized blocks as stored (workers/models/gguf_blocks.py) instead of quantizing the floats afresh."""


def convert_gguf(gguf_path: Path, dest: Path) -> Path:
    """Convert `gguf_path` into the folder `dest` (atomically); returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_temp_folders(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{dest.name}-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        write_converted_folder(gguf_path, tmp)
        write_source_record(tmp, gguf_path)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_converted_folder(gguf_path: Path, out: Path) -> None:
    # Heavy imports stay here: only the first load of a GGUF model pays for them.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the reader re-ties it to the embeddings
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out / "model.safetensors"))

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.to_json_file(str(out / "generation_config.json"))

    tokenizer.save_pretrained(str(out))
    # Keep the chat template inside tokenizer_config.json too, for readers that only look there.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    if tokenizer.chat_template and "chat_template" not in tok_config:
        tok_config["chat_template"] = tokenizer.chat_template
        config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    for path in out.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _sweep_stale_temp_folders(parent: Path, max_age_s: float = 3600.0) -> None:
    for path in parent.glob(f"{TEMP_PREFIX}*"):
        try:
            if time.time() - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def write_source_record(folder: Path, gguf_path: Path) -> None:
    record = folder / SOURCE_RECORD
    record.write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
    with open(record, "rb") as f:
        os.fsync(f.fileno())
