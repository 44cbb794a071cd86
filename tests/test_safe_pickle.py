"""``shardsafe.format.safe_pickle``: the one restricted unpickler for what other libraries pickle
into checkpoints.

- ``torch.save`` files with what megatron-core and Megatron-LM store in ``common.pt`` and
  ShardedObjects (an ``argparse.Namespace`` of args with Megatron's enums and a torch dtype,
  numpy RNG state arrays, Python's random state, tensors, parameters) load equal, bit-exact, with
  Megatron's own enum classes, or with stand-ins of the same ``.name``/``.value`` where
  megatron-core is not importable;
- a pickle written under numpy 2 (``numpy._core.multiarray``) loads under numpy 1.x and back;
- ``os.system``, ``exec``, ``numpy.testing``'s ``runstring`` and legacy (non-zip) pickles are
  refused with the global named, and nothing of them runs (the marker file they would create is
  absent).
"""

from __future__ import annotations

import argparse
import builtins
import collections
import io
import os
import pickle
import random
import re
import sys
import types
import zipfile

import numpy as np
import pytest
import torch

from shardsafe.errors import CorruptCheckpointError, PickleNotAllowedError, UnsafePickleError
from shardsafe.format import safe_pickle


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _megatron_lm_common(enums) -> dict:
    """What Megatron-LM's ``save_checkpoint`` puts in the common state and the rng ShardedObject."""
    model_type, attn_backend, rerun_mode, rerun_state, rerun_diag = enums
    random.seed(3)
    np.random.seed(5)
    torch.manual_seed(7)
    args = argparse.Namespace(
        model_type=model_type.encoder_or_decoder,
        attention_backend=attn_backend.auto,
        params_dtype=torch.bfloat16,
        lr=3e-4,
        seq_length=4096,
        data_path=["/data/a", "/data/b"],
        tensorboard_dir=None,
    )
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 1200,
        "num_floating_point_operations_so_far": 12345678901234,
        "rerun_state_machine": {"mode": rerun_mode.DISABLED, "state": rerun_state.NOT_RUNNING_YET, "diag": rerun_diag.CORRECT_RESULT},
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.arange(16, dtype=torch.uint8)},
        }],
        "optimizer": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0, 1]}]},
        "weight": torch.nn.Parameter(torch.randn(3, 5)),
        "bias": torch.randn(4).bfloat16(),
        "view": torch.arange(10.0)[3:7],  # a view: its storage, offset and stride
        "odict": collections.OrderedDict(b=1, a=2),
        "set": {1, 2},
        "bytes": b"\x00\xff",
        "path": __import__("pathlib").PosixPath("/ckpt/iter_0001200"),
        "ns": types.SimpleNamespace(x=1),
        "np_scalar": np.float32(0.5),
    }


def _megatron_enums():
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend

    return ModelType, AttnBackend, RerunMode, RerunState, RerunDiagnostic


def _assert_same(got, want) -> None:
    """Equal, tensors and arrays bit-exact and of the same dtype."""
    assert type(got) is type(want) or isinstance(want, torch.Tensor), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))
        assert got.requires_grad == want.requires_grad
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    elif isinstance(want, (argparse.Namespace, types.SimpleNamespace)):
        _assert_same(vars(got), vars(want))
    else:
        assert got == want


def test_megatron_lm_common_state_loads_bit_exact_with_megatrons_own_enums():
    pytest.importorskip("megatron.core")
    enums = _megatron_enums()
    want = _megatron_lm_common(enums)
    got = safe_pickle.load_archive(_saved(want), where="common.pt")
    _assert_same(got, want)
    assert got["args"].model_type is enums[0].encoder_or_decoder  # the very member, not a copy
    assert got["args"].attention_backend is enums[1].auto
    assert got["rng_state"][0]["np_rng_state"][1].dtype == np.uint32
    assert got["view"].storage_offset() == 3 and got["view"].stride() == (1,)


def test_without_megatron_its_enums_come_back_as_stand_ins_with_the_same_names_and_values(monkeypatch):
    pytest.importorskip("megatron.core")
    enums = _megatron_enums()
    raw = _saved(_megatron_lm_common(enums))
    for module in ("megatron.core.enums", "megatron.core.transformer.enums", "megatron.core.rerun_state_machine"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError: megatron-core is not importable
    got = safe_pickle.load_archive(raw, where="common.pt")
    for member, real in (
        (got["args"].model_type, enums[0].encoder_or_decoder),
        (got["args"].attention_backend, enums[1].auto),
        (got["rerun_state_machine"]["mode"], enums[2].DISABLED),
        (got["rerun_state_machine"]["state"], enums[3].NOT_RUNNING_YET),
        (got["rerun_state_machine"]["diag"], enums[4].CORRECT_RESULT),
    ):
        assert type(member) is not type(real) and type(member).__module__ == "shardsafe.format.safe_pickle"
        assert type(member).__name__ == type(real).__name__
        assert (member.name, member.value) == (real.name, real.value)
    # a stand-in is pickled by its own name and read back as itself
    again = safe_pickle.load_archive(_saved(got["args"]), where="again.pt")
    assert again.model_type is got["args"].model_type


def test_every_stand_in_has_the_members_of_megatrons_enum():
    pytest.importorskip("megatron.core")
    for real in _megatron_enums():
        stand_in = getattr(safe_pickle, real.__name__)
        assert [(m.name, m.value) for m in stand_in] == [(m.name, m.value) for m in real]


def _renamed(raw: bytes, old: bytes, new: bytes) -> bytes:
    """The archive with ``old`` replaced by ``new`` in its pickle (what another numpy writes)."""
    src = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert old in data
                data = data.replace(old, new)
            dst.writestr(info.filename, data)
    return out.getvalue()


def test_numpy_globals_match_by_the_name_the_pickle_carries_numpy_1_and_numpy_2():
    np.random.seed(11)
    want = {"np_rng_state": np.random.get_state(), "scalar": np.int64(-3), "matrix": np.arange(6, dtype=np.float16).reshape(2, 3)}
    raw = _saved(want)
    numpy1 = b"numpy.core.multiarray" in raw
    old, new = (b"numpy.core.multiarray", b"numpy._core.multiarray") if numpy1 else (b"numpy._core.multiarray", b"numpy.core.multiarray")
    for variant in (raw, _renamed(raw, old, new)):
        _assert_same(safe_pickle.load_archive(variant, where="rng.pt"), want)


class _Reduce:
    """Unpickles as ``fn(*args)``."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _attacks(marker: str) -> dict[str, object]:
    from numpy.testing._private.utils import runstring

    touch = f"open({marker!r}, 'w').close()"
    return {
        "posix.system": _Reduce(os.system, f"touch {marker}"),
        "__builtin__.exec": _Reduce(builtins.exec, touch),  # torch.save's pickle protocol 2 names builtins so
        "numpy.testing._private.utils.runstring": _Reduce(runstring, touch, {}),
    }


@pytest.mark.parametrize("name", ["posix.system", "__builtin__.exec", "numpy.testing._private.utils.runstring"])
def test_a_pickle_that_names_any_other_global_is_refused_naming_it_and_nothing_runs(tmp_path, name):
    marker = str(tmp_path / "pwned")
    raw = _saved({"args": argparse.Namespace(lr=0.1), "x": _attacks(marker)[name]})
    named = re.escape(name)
    with pytest.raises(UnsafePickleError, match=rf"common\.pt: the pickle names {named}, which is not one of the globals .* \(nothing of it was run\)"):
        safe_pickle.load_archive(raw, where="common.pt")
    with pytest.raises(PickleNotAllowedError, match=rf"the pickle names {named}, .*Pass allow_pickle=True only if you trust it"):
        safe_pickle.load_value_file(raw, where="common.pt", allow_pickle=False, opt_in="Pass allow_pickle=True only if you trust it")
    assert not os.path.exists(marker)


@pytest.mark.parametrize("legacy", ["pickle", "torch.save"])
def test_a_legacy_non_zip_pickle_is_refused_naming_its_globals_and_nothing_runs(tmp_path, legacy):
    marker = str(tmp_path / "pwned")
    value = {"x": _attacks(marker)["posix.system"]}
    if legacy == "pickle":
        raw = pickle.dumps(value, protocol=2)
    else:
        buf = io.BytesIO()
        torch.save(value, buf, _use_new_zipfile_serialization=False)
        raw = buf.getvalue()
    with pytest.raises(UnsafePickleError, match=r"old\.pt: not a torch\.save zip archive but a legacy torch\.save file or a bare pickle; it names posix\.system; .*refused it \(nothing of it was run\)"):
        safe_pickle.load_archive(raw, where="old.pt")
    assert not os.path.exists(marker)


def test_the_full_unpickler_runs_only_with_the_callers_opt_in():
    from fractions import Fraction

    raw = _saved({"ratio": Fraction(1, 3)})
    with pytest.raises(PickleNotAllowedError, match=r"names fractions\.Fraction"):
        safe_pickle.load_value_file(raw, where="v.pt", allow_pickle=False, opt_in="opt in")
    assert safe_pickle.load_value_file(raw, where="v.pt", allow_pickle=True, opt_in="opt in") == {"ratio": Fraction(1, 3)}


def test_a_damaged_archive_is_corrupt_not_unsafe():
    raw = bytearray(_saved({"t": torch.arange(1000, dtype=torch.int32)}))
    start = raw.index(b"archive/data/0") + len(b"archive/data/0")
    raw[start + 200] ^= 0xFF  # inside the tensor's bytes: the record's CRC-32 no longer matches
    with pytest.raises(CorruptCheckpointError, match=r"t\.pt: record data/0 cannot be read: BadZipFile: Bad CRC-32"):
        safe_pickle.load_archive(bytes(raw), where="t.pt")
    with pytest.raises(CorruptCheckpointError, match=r"t\.pt: not a readable torch\.save archive"):
        safe_pickle.load_archive(b"PK\x03\x04 truncated", where="t.pt")


def test_a_bare_pickle_reaches_only_the_allowlist_it_is_given():
    raw = pickle.dumps({"size": torch.Size([2, 3]), "ns": argparse.Namespace(a=1)})
    allowed = {"torch.Size": safe_pickle.TENSORS["torch.Size"]}
    with pytest.raises(UnsafePickleError, match=r"meta: the pickle names argparse\.Namespace, which is not one of the globals a test file holds"):
        safe_pickle.load_pickle(raw, where="meta", allowed=allowed, what="a test file")
    got = safe_pickle.load_pickle(raw, where="meta", allowed={**allowed, "argparse.Namespace": safe_pickle.VALUES["argparse.Namespace"]}, what="a test file")
    assert got == {"size": torch.Size([2, 3]), "ns": argparse.Namespace(a=1)}


def test_damage_inside_an_archive_record_is_a_corrupt_checkpoint_error_naming_the_record():
    """A byte flipped in ``data.pkl`` (its CRC-32 no longer matches) or in the UTF-8 name of its
    local header: zipfile raises BadZipFile or UnicodeDecodeError from the read, outside the
    hierarchy before (the importer campaign found both through DCP's object items)."""
    raw = _saved({"epoch": 4, "names": ["a", "b"], "lr": 0.5})
    name = next(n for n in zipfile.ZipFile(io.BytesIO(raw)).namelist() if n.endswith("/data.pkl")).encode()
    local = raw.index(name)  # the local header's copy of the name comes first (the directory's is at the end)
    assert zipfile.ZipFile(io.BytesIO(raw)).getinfo(name.decode()).flag_bits & 0x800  # names are flagged UTF-8

    body = raw.index(b"epoch")  # inside data.pkl's bytes (stored, not compressed)
    flipped = raw[:body] + bytes([raw[body] ^ 0x20]) + raw[body + 1:]
    with pytest.raises(CorruptCheckpointError, match=rf"^item: record {re.escape(name.decode())} cannot be read: BadZipFile: Bad CRC-32"):
        safe_pickle.load_archive(flipped, where="item")

    bad_name = raw[:local + 2] + b"\xf0" + raw[local + 3:]
    with pytest.raises(CorruptCheckpointError, match=rf"^item: record {re.escape(name.decode())} cannot be read: UnicodeDecodeError: "):
        safe_pickle.load_archive(bad_name, where="item")
    assert safe_pickle.load_archive(raw, where="item") == {"epoch": 4, "names": ["a", "b"], "lr": 0.5}
