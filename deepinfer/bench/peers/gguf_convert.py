"""Convert a checkpoint to GGUF for the llama.cpp peer, with llama.cpp's own converter.

    .venv/bin/python -m deepinfer.bench.peers.gguf_convert LLAMA_CPP_DIR MODEL_DIR OUT.gguf [OUTTYPE]

``LLAMA_CPP_DIR`` is llama.cpp's source tree (e.g. the ``vendor/llama.cpp`` of the llama-cpp-python
sdist). The converter reads DeepSeek's per-expert layout only and does not take MTP layers for this
architecture, so the model is first rewritten into a temporary folder in that layout without its MTP
layer (the peer runs the main model only). It identifies a BPE pre-tokenizer by hashing how it splits a
probe string and refuses hashes it does not know; deepinfer-tiny-coder's byte-level pre-tokenizer is
GPT-2's, so an unknown hash is mapped to "gpt-2" (the workaround research/peers.md used). ``OUTTYPE``
is the converter's ``--outtype``: f32 by default, as deepinfer runs it on the CPU; q8_0 (8-bit values,
one f16 scale per 32) to compare with an FP8 model at equal bits per weight (bench/fp8_decode.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from deepinfer.model.layouts import to_published_layout


def main_model_only(model_dir: Path, out_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    tensors = {}
    for shard in sorted(model_dir.glob("model*.safetensors")):
        tensors.update({k: v for k, v in load_file(shard).items() if not k.startswith(mtp_prefix)})
    save_file(to_published_layout(tensors), out_dir / "model.safetensors")
    config["num_nextn_predict_layers"] = 0
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)


def main(llama_cpp_dir: str, model_dir: str, out: str, outtype: str = "f32") -> None:
    root = Path(llama_cpp_dir)
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        # The converter knows pre-tokenizers by a hash of known models' outputs and raises on any other;
        # ours is a byte-level BPE with GPT-2's pre-tokenizer regex, which llama.cpp calls "gpt-2".
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    with tempfile.TemporaryDirectory() as tmp:
        main_model_only(Path(model_dir), Path(tmp))
        sys.argv = ["convert_hf_to_gguf.py", tmp, "--outtype", outtype, "--outfile", out]
        convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(*sys.argv[1:5])
