"""A shardsafe checkpoint of a real ``transformers`` model, exported by the ``shardsafe export``
console script as a sharded Hugging Face folder, loads with ``transformers``' own
``from_pretrained``; and the same folder loads back through ``shardsafe.load_hf_safetensors``.
A tiny random-init Llama built from a config: no download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardsafe

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
    _config().save_pretrained(tmp_path / "cfg")  # the model's config.json, as a user has it
    r = subprocess.run(
        [sys.executable, "-m", "shardsafe", "export", str(ck), str(out), "--prefix", "model.", "--max-shard-size", "40KB", "--json",
         "--config", str(tmp_path / "cfg" / "config.json")],
        capture_output=True, text=True, env=ENV, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and json.loads(r.stdout)["config"] == 1
    assert (out / "config.json").read_bytes() == (tmp_path / "cfg" / "config.json").read_bytes()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    nfiles = json.loads(r.stdout)["files"]
    assert nfiles >= 3  # ~107 KB of weights in files of at most 40 KB
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": total}
    assert set(index["weight_map"]) == set(sd)  # "step" is not under the prefix: not exported
    assert sorted(set(index["weight_map"].values())) == [f"model-{i:05d}-of-{nfiles:05d}.safetensors" for i in range(1, nfiles + 1)]

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


def test_export_writes_config_json_from_a_pretrained_config_or_warns_without_one(tmp_path):
    from shardsafe.engine.consolidate import unshard_to_safetensors

    model = _llama(0)
    sd = model.state_dict()
    ck = tmp_path / "ck"
    shardsafe.save_model_and_optim_state(str(ck), model)
    out = tmp_path / "hf"
    counts = unshard_to_safetensors(ck, out, prefix="model.", max_shard_size=40_000, config=model.config)
    assert counts["config"] == 1
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert loaded.config.hidden_size == 32 and loaded.config.num_hidden_layers == 2  # not transformers' default Llama
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k

    bare = tmp_path / "bare"
    with pytest.warns(UserWarning, match=r"the folder holds the weights only, no config.json: transformers' from_pretrained needs"):
        assert unshard_to_safetensors(ck, bare, prefix="model.", max_shard_size=40_000)["config"] == 0
    assert not (bare / "config.json").exists()
    with pytest.raises(shardsafe.CheckpointError, match="config= writes config.json beside the weights, in a folder: pass max_shard_size"):
        unshard_to_safetensors(ck, tmp_path / "one.safetensors", prefix="model.", config=model.config)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(shardsafe.CheckpointError, match=r"bad.json: holds a JSON list, a config.json holds an object"):
        unshard_to_safetensors(ck, tmp_path / "other", prefix="model.", max_shard_size=40_000, config=tmp_path / "bad.json")
    assert not (tmp_path / "other").exists()  # refused before anything was written
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(shardsafe.CheckpointExistsError, match="a config.json is already there; pass overwrite=True"):
        unshard_to_safetensors(ck, mine, prefix="model.", max_shard_size=40_000, config=model.config)
    assert (mine / "config.json").read_text() == "{}"

    r = subprocess.run(
        [sys.executable, "-m", "shardsafe", "export", str(ck), str(tmp_path / "cli"), "--max-shard-size", "40KB"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        f"shardsafe export: warning: {tmp_path / 'cli'} holds the weights only, no config.json: transformers' from_pretrained "
        "needs it (without it, it builds a default model of its own); pass --config PATH (the model's config.json), or copy it "
        "into the folder\n"
    )
