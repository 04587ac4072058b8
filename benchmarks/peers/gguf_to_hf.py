"""Convert a GGUF file once to a Hugging Face folder for ``transformers serve``.

Run with the transformers venv's Python (``setup_generate.sh`` installs it):

    $GPUSERVE_GEN_PEERS/transformers/bin/python benchmarks/peers/gguf_to_hf.py MODEL.gguf OUT/

transformers dequantises the GGUF's blocks (Q4_1, Q8_0) to float32 on load; converting once
keeps that out of every server start. The folder carries the GGUF's chat template in its
tokenizer config.
"""

import os
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = sys.argv[1], sys.argv[2]
folder, name = os.path.split(path)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
# Without the `kernels` package (weights kept in GGUF blocks) transformers dequantises into
# plain float32 Linear layers, yet keeps the GGUF quantizer, which refuses save_pretrained:
# drop it, after checking that nothing quantized is left.
assert all(p.dtype.is_floating_point for p in model.parameters())
assert {type(m).__name__ for m in model.modules()} & {"GgufLinear", "GgufEmbedding"} == set()
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(
    f"  {type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
    f"parameters, eos {tokenizer.eos_token!r}, "
    f"chat template {'yes' if tokenizer.chat_template else 'NO'}"
)
