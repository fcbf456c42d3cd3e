"""Hugging Face import and export: time and peak host memory for a ~1B Llama on 8 fake devices.

    python scripts/bench_hf.py                 # Llama-3.2-1B's shape (1.24B, tied), bf16 files
    python scripts/bench_hf.py --size small    # a 50M shape, for a quick look

1. A random ``LlamaForCausalLM`` of that shape is written with ``save_pretrained`` (bf16, in a
   child process whose memory is then given back).
2. Another child with 8 fake CPU devices imports it (``load_hf_weights``, mesh d=4 x t=2, f32
   master weights) and exports it again (``export_weights``, bf16), sampling its resident
   memory every 5 ms: the peak of each phase is printed beside the weights' own size (on fake
   CPU devices the sharded weights live in host memory too) and the model's size times the
   device count (what gathering whole tensors per device, or the whole model per process,
   would cost). The re-exported tensors are compared with the originals (bf16 -> f32 -> bf16
   is exact).

Needs transformers and torch (``pip install -e '.[hf]'``). Timings on a shared 2-core machine
are noisy; the memory figures are not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SHAPES = {
    "1b": dict(  # Llama-3.2-1B
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "small": dict(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    ),
}

WRITE = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
shape = json.loads(sys.argv[1])
torch.manual_seed(0)
config = LlamaConfig(rms_norm_eps=1e-5, max_position_embeddings=8192, **shape)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[2], max_shard_size="1GB")
print(sum(p.numel() for p in model.parameters()))
"""

MEASURE = """
import json, os, sys, threading, time
from pathlib import Path

class Peak:  # resident set size, sampled
    def __init__(self):
        self.peak, self.stop = 0, False
        threading.Thread(target=self.run, daemon=True).start()
    def now(self):
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    def run(self):
        while not self.stop:
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)
    def phase(self):
        self.peak = self.now()

peak = Peak()
import jax, numpy as np
from safetensors import safe_open
from seqshard.hf.export import export_weights
from seqshard.hf.hf_config import read_hf_config
from seqshard.hf.load import load_hf_weights
from seqshard.hf.table import hf_tensor_names
from seqshard.mesh import training_mesh
from seqshard.model import ModelConfig

src, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = read_hf_config(src).model_config(ModelConfig(compute_dtype="bfloat16"))
mesh = training_mesh({"d": 4, "t": 2})
jax.block_until_ready(jax.numpy.zeros(8))
before = peak.now(); peak.phase(); t = time.perf_counter()
weights = jax.block_until_ready(load_hf_weights(src, cfg, mesh, log=lambda m: None))
import_s, import_peak = time.perf_counter() - t, peak.peak
resident = peak.now(); peak.phase(); t = time.perf_counter()
out.mkdir()
files, total = export_weights(weights, cfg, out, "bfloat16", 2**30)
export_s, export_peak = time.perf_counter() - t, peak.peak
weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
largest = 4 * max(int(np.prod(row.hf_shape(cfg))) for row, _, _ in hf_tensor_names(cfg))
def file_of(directory, name):
    # The file of tensor `name`: per the index of a split model, or the one file (a model
    # below the shard size is saved whole, without an index).
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return directory / "model.safetensors"
    return directory / json.loads(index.read_text())["weight_map"][name]

checked = 0
for name in ["model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight",
             "model.layers.7.mlp.down_proj.weight", "model.norm.weight"]:
    with safe_open(str(file_of(src, name)), "np") as a:
        with safe_open(str(file_of(out, name)), "np") as b:
            assert np.array_equal(a.get_tensor(name).view(np.uint16), b.get_tensor(name).view(np.uint16)), name
            checked += 1
print(json.dumps(dict(import_s=import_s, export_s=export_s, before=before, import_peak=import_peak,
    resident=resident, export_peak=export_peak, weight_bytes=weight_bytes, largest=largest,
    files=len(files), total=total, checked=checked, devices=len(mesh.devices.flat))))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="1b")
    args = p.parse_args()
    gib = 2**30
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        src, out = Path(tmp) / "hf", Path(tmp) / "exported"
        shape = json.dumps(SHAPES[args.size])
        made = subprocess.run(
            [sys.executable, "-c", WRITE, shape, str(src)], capture_output=True, text=True
        )
        if made.returncode:
            sys.exit(f"writing the model failed:\n{made.stderr[-3000:]}")
        n_params = int(made.stdout.split()[-1])
        file_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
        ran = subprocess.run(
            [sys.executable, "-c", MEASURE, str(src), str(out)],
            capture_output=True,
            text=True,
            env=env,
        )
        if ran.returncode:
            sys.exit(f"import/export failed:\n{ran.stderr[-3000:]}")
        r = json.loads(ran.stdout.strip().splitlines()[-1])
    f32 = r["weight_bytes"]
    print(
        textwrap.dedent(f"""\
        model: {args.size}, {n_params / 1e9:.2f}B parameters; files {file_bytes / gib:.2f} GiB bf16
        on {r["devices"]} fake CPU devices, mesh d=4 x t=2; f32 weights {f32 / gib:.2f} GiB in all,
        largest tensor {r["largest"] / gib:.2f} GiB f32; model x devices = {f32 * r["devices"] / gib:.1f} GiB

        RSS before importing: {r["before"] / gib:.2f} GiB; after: {r["resident"] / gib:.2f} GiB
        phase    seconds  peak RSS    above start-up + weights   above the phase's start
        import   {r["import_s"]:7.1f}  {r["import_peak"] / gib:6.2f} GiB  {(r["import_peak"] - r["before"] - f32) / gib:6.2f} GiB                 {(r["import_peak"] - r["before"]) / gib:6.2f} GiB
        export   {r["export_s"]:7.1f}  {r["export_peak"] / gib:6.2f} GiB  {(r["export_peak"] - r["before"] - f32) / gib:6.2f} GiB                 {(r["export_peak"] - r["resident"]) / gib:6.2f} GiB  ({r["files"]} files, {r["total"] / gib:.2f} GiB bf16)
        re-exported tensors bit-identical to the originals: {r["checked"]} checked""")
    )


if __name__ == "__main__":
    main()
