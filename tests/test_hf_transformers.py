"""A shardsafe checkpoint of a real ``transformers`` model, exported by the ``shardsafe export``
console script as a sharded Hugging Face folder, loads with ``transformers``' own
``from_pretrained``; and the same folder loads back through ``shardsafe.load_hf_safetensors``.
A tiny random-init Llama built from a config: no download."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import shardsafe

from .helpers import run_process

transformers = pytest.importorskip("transformers", reason="transformers is not installed (it is in the 'test' extra)")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def _config():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )


def _llama(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


def test_export_loads_with_transformers_from_pretrained(tmp_path):
    model = _llama(0)
    sd = model.state_dict()
    ck = tmp_path / "ck"
    shardsafe.Checkpointer().save(ck, {**{"model." + k: v for k, v in sd.items()}, "step": 7})
    out = tmp_path / "hf"
    r = run_process(
        [sys.executable, "-m", "shardsafe", "export", str(ck), str(out), "--prefix", "model.", "--max-shard-size", "40KB", "--json"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    total = sum(v.numel() * v.element_size() for v in sd.values())
    nfiles = json.loads(r.stdout)["files"]
    assert nfiles >= 3  # ~107 KB of weights in files of at most 40 KB
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": total}
    assert set(index["weight_map"]) == set(sd)  # "step" is not under the prefix: not exported
    assert sorted(set(index["weight_map"].values())) == [f"model-{i:05d}-of-{nfiles:05d}.safetensors" for i in range(1, nfiles + 1)]
    _config().save_pretrained(out)  # config.json, written by us: the export holds weights only

    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    got = loaded.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    other = _llama(1)  # different random weights, overwritten in place
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert shardsafe.load_hf_safetensors(out, other) == total
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd[k]), k
