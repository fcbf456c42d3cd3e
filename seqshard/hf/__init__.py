"""Hugging Face interop: Llama, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints in, runs
out (:mod:`seqshard.hf.hf_config` lists what each maps to).

    init: {from_hf: path/to/Llama-3.2-1B}          # a config key: start a run from its weights
    seqshard export runs/NAME hf/NAME                # a run's checkpoint as a HF Llama directory

:mod:`seqshard.hf.table` is the one table of names and layouts (with the head order and RoPE
pairing); :mod:`seqshard.hf.hf_config` reads and writes ``config.json``;
:mod:`seqshard.hf.safetensors_io` reads and streams safetensors files; :mod:`seqshard.hf.load`
places a directory's tensors into the sharded layout; :mod:`seqshard.hf.export` writes one.
"""
